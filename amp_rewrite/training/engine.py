"""The step engine: how the Trainer runs its step graph, decided in one place from one resolved
Deployment (`plan`), said in one line, opened by `open_engine`.

    one process on CUDA   one session (runner.SessionRunner): the update over flat buffers, gated
                          by Where (flat_update.py), nothing read by the host mid-step; with
                          `cuda_graph`, captured once and replayed where every node is on the
                          device and nothing branches (`cuda_graph_refusal` says why not)
    one process on CPU    a gradient session, then the update on the host: host_update.py's chains
                          in numpy over cache-sized blocks (split_runner.SplitRunner, the update
                          per tensor in one If)
    MPI, either device    the same two halves with the Allreduce between them
                          (distributed.MpiReduction)

An update the host cannot run (an op outside host_update's tables) runs in ONNX Runtime's apply
session; the line says so and why. Every engine has one surface, `StepEngine`. Every graph
rewrite happens while the step graph is built (`step_graph_for`), so the graph that runs is
`Trainer.step_graph.model` (the split engine cuts it in two, changing no node).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from amp_rewrite.deployment import Deployment
from amp_rewrite.errors import TrainingError
from amp_rewrite.training.log_sum_exp import log_sum_exp_by_log_softmax
from amp_rewrite.training.runner import DeviceState, SessionRunner
from amp_rewrite.training.split_runner import SplitRunner
from amp_rewrite.training.step_graph import StepGraph, apply_precision

_BRANCHING = ("If", "Loop", "Scan")  # ONNX Runtime cannot capture control flow in a CUDA graph


class StepEngine(Protocol):
    """What the Trainer drives. `run` steps a batch (converted feeds) and returns (loss, skipped);
    `state` is the one copy of the training state, updated in place; the rest are the
    data-parallel hooks, which one process answers trivially (runner.SingleProcess)."""

    device: str
    state: DeviceState
    description: str
    primary: bool

    def run(self, batch: dict[str, np.ndarray]) -> tuple[float, bool]: ...
    def on_primary(self, action) -> None: ...
    def share_state(self) -> None: ...
    def check_batch_count(self, count: int) -> None: ...


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    """`device`: where the step runs, resolved once; `flat`: the update over flat buffers (one
    session), else per tensor (split in two); `distributed`: None or "mpi"; `cuda_graph`: asked for."""

    device: str
    flat: bool
    distributed: str | None
    cuda_graph: bool


def plan(deployment: Deployment, distributed: str | None = None, cuda_graph: bool = False) -> EnginePlan:
    """The engine for a resolved Deployment; provider "cuda" where CUDA does not load is an error
    here, before anything is built."""
    device = deployment.device
    if deployment.provider == "cuda" and device != "cuda":
        raise TrainingError(
            "provider='cuda' was asked for but ONNX Runtime's CUDA provider does not load here"
        )
    return EnginePlan(device, device == "cuda" and distributed is None, distributed, cuda_graph)


def step_graph_for(
    step: StepGraph, precision: str, device: str, keep_float32: dict | None = None
) -> StepGraph:
    """The graph the engine runs: the precision rewrite for `device` (step_graph.apply_precision);
    on CPU also each cross-entropy's log-sum-exp by LogSoftmax (log_sum_exp.py)."""
    step = apply_precision(step, precision, device, keep_float32)
    if device == "cpu":
        step = dataclasses.replace(step, model=log_sum_exp_by_log_softmax(step.model))
    return step


def off_device(step: StepGraph) -> dict[str, str]:
    """{node: why} for the nodes of a CUDA step that would not run on the device (no CUDA kernel for
    their types) or would make the host wait for it (a host sync), read from the kernel table
    without a GPU (step_placement.py). Shape arithmetic on host tensors that ONNX Runtime runs on
    the CPU waits for nothing, copies nothing, and does not stop a CUDA graph (ONNX Runtime allows
    CPU nodes without Memcpy); under a CUDA graph the batch's shapes are fixed, so it folds away
    (runner.SessionRunner)."""
    from amp_rewrite.training.step_placement import place

    placement = place(step.model)
    return {**placement.no_kernel, **placement.host_syncs}


def cuda_graph_refusal(step: StepGraph, device: str, leaving: dict | None = None) -> str | None:
    """Why the step cannot be captured as a CUDA graph, None when it can: only on CUDA, over one
    session, without control flow, and with every node on the device (`leaving`: `off_device`'s)."""
    if device != "cuda":
        return f"the step runs on {device.upper()}"
    if not step.flat:
        return "the step is split in two (data parallel)"
    branching = next((n for n in step.model.graph.node if n.op_type in _BRANCHING), None)
    if branching is not None:
        return f"the step holds control flow ({branching.op_type} {branching.name!r})"
    leaving = off_device(step) if leaving is None else leaving
    if leaving:
        return f"{len(leaving)} node(s) would leave the device ({_first(leaving)})"
    return None


def _first(found: dict) -> str:
    name, why = next(iter(found.items()))
    return f"{name!r}: {why}"


def open_engine(
    chosen: EnginePlan,
    step: StepGraph,
    initial: dict[str, np.ndarray],
    lr: float,
    precision: str,
    loss,
    threads: int = 0,
    tf32: bool = False,
    say=lambda line: None,
    **distributed_options,
) -> StepEngine:
    """The engine `chosen` over `step` and its initial state; its line said through `say`, and for
    CUDA's one session a second line when nodes of the step would leave the device (the split
    engine reads its flag on the host by design)."""
    leaving = off_device(step) if chosen.device == "cuda" and chosen.flat else {}
    if leaving:
        say(
            f"amp-rewrite: {len(leaving)} node(s) of the CUDA step would leave the device ({_first(leaving)})"
        )
    refusal = cuda_graph_refusal(step, chosen.device, leaving) if chosen.cuda_graph else None
    if chosen.distributed == "mpi":
        from amp_rewrite.training.distributed import MpiReduction

        reduction = MpiReduction(loss, threads, **distributed_options)
        engine = SplitRunner(
            step,
            initial,
            lr,
            chosen.device,
            precision,
            threads=reduction.threads,
            device_id=reduction.device_id,
            reduction=reduction,
            tf32=tf32,
        )
    elif not chosen.flat:
        engine = SplitRunner(step, initial, lr, chosen.device, precision, threads=threads, tf32=tf32)
    else:
        graph = chosen.cuda_graph and refusal is None
        engine = SessionRunner(step, initial, lr, chosen.device, precision, threads, tf32, graph, say)
    if refusal:
        engine.description += f"; no CUDA graph: {refusal}"
    say(f"amp-rewrite: step engine: {engine.description}")
    return engine
