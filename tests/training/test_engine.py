"""The step engine (engine.py): picked in one place, said in one line, running the step graph the
Trainer holds; the CUDA graph's bookkeeping (the batch in buffers bound once, the state written
back around ONNX Runtime's capturing first run, another shape in a plain session) and its refusals."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from amp_rewrite import runtime
from amp_rewrite.deployment import Deployment
from amp_rewrite.errors import TrainingError
from amp_rewrite.training import SGD, AdamW, DynamicLossScale, Trainer, build_step_graph, engine
from amp_rewrite.training import runner as engine_runner
from amp_rewrite.training.runner import SessionRunner
from amp_rewrite.training.step_graph import apply_precision
from training_models import classification_batches, mlp

SIZES = (8, 16, 3)


def _engine_line(capsys, **options) -> str:
    Trainer(mlp(SIZES), optimizer=AdamW(0.01), provider="cpu", threads=1, **options)
    lines = [line for line in capsys.readouterr().err.splitlines() if "step engine:" in line]
    assert len(lines) == 1
    return lines[0]


def test_the_engine_says_in_one_line_what_runs_the_step(capsys):
    assert _engine_line(capsys) == (
        "amp-rewrite: step engine: a gradient session on CPU, then the update on the host "
        "(numpy, in cache-sized blocks)"
    )


class TanhSGD(SGD):
    """A user's optimizer with an op the host update has no kernel for."""

    def emit_update(self, e, weight, grad, slots, lr, step):
        return e.op(
            "Sub", [weight, e.op("Mul", [e.op("Tanh", [grad], "squashed"), lr], "delta")], "weight"
        ), {}


def test_an_update_the_host_cannot_run_says_which_op_and_where_it_runs(capsys):
    Trainer(mlp(SIZES), optimizer=TanhSGD(0.1), provider="cpu", threads=1, precision="float32")
    line = next(line for line in capsys.readouterr().err.splitlines() if "step engine:" in line)
    assert "then the update in an apply session (the host update does not run op Tanh" in line


@pytest.mark.skipif(runtime.cuda_loads(), reason="CUDA loads here")
def test_provider_cuda_where_it_does_not_load_is_one_line_before_anything_is_built():
    with pytest.raises(TrainingError, match="provider='cuda' was asked for but .* does not load here"):
        engine.plan(Deployment(provider="cuda"))


def test_the_graph_that_runs_is_the_trainers_step_graph():
    """No rewrite when a session opens: the CPU's log-sum-exp by LogSoftmax is in `step_graph`, and
    the engine's two halves are cut from it without a node more or less."""
    trainer = Trainer(mlp(SIZES), optimizer=AdamW(0.01), provider="cpu", verbose=False, threads=1)
    ops = {n.op_type for n in trainer.step_graph.model.graph.node}
    assert "LogSoftmax" in ops and "ReduceLogSumExp" not in ops
    split = trainer.engine.split
    halves = [n.name for part in (split.gradient, split.apply) for n in part.graph.node]
    assert len(halves) == len(set(halves))
    assert set(halves) <= {n.name for n in trainer.step_graph.model.graph.node}


def _flat_step(device: str = "cuda", precision: str = "float16"):
    step = build_step_graph(mlp(SIZES), "cross_entropy", AdamW(0.01), DynamicLossScale(), flat_update=True)
    return apply_precision(step, precision, device)


def test_cuda_graph_refusals_name_the_reason():
    assert engine.cuda_graph_refusal(_flat_step(), "cpu") == "the step runs on CPU"
    assert engine.cuda_graph_refusal(_flat_step(), "cuda") is None  # every node has a CUDA kernel
    branching = _flat_step()
    branch = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "b", [], [])
    branching.model.graph.node.append(
        helper.make_node("If", ["c"], ["z"], name="user_if", then_branch=branch, else_branch=branch)
    )
    assert engine.cuda_graph_refusal(branching, "cuda") == "the step holds control flow (If 'user_if')"
    per_tensor = build_step_graph(mlp(SIZES), "cross_entropy", AdamW(0.01), DynamicLossScale())
    assert engine.cuda_graph_refusal(per_tensor, "cuda") == "the step is split in two (data parallel)"


def test_a_cuda_graph_asked_for_on_cpu_is_said_and_the_step_runs(capsys):
    assert _engine_line(capsys, cuda_graph=True).endswith("; no CUDA graph: the step runs on CPU")


class _CapturingFirstRun:
    """ONNX Runtime's graph session: its first Run runs the step three times (two runs to allocate,
    the capture's replay), each updating the state in place."""

    def __init__(self, session):
        self._session, self.runs = session, 0

    def __getattr__(self, name):
        return getattr(self._session, name)

    def run_with_iobinding(self, binding):
        for _ in range(3 if self.runs == 0 else 1):
            self._session.run_with_iobinding(binding)
        self.runs += 1


def _runner(cuda_graph: bool, say=lambda line: None) -> SessionRunner:
    step = _flat_step("cpu", "float32")
    return SessionRunner(step, step.initial_state, 0.01, "cpu", "float32", 1, cuda_graph=cuda_graph, say=say)


def test_a_captured_step_steps_each_batch_once_and_another_shape_runs_plain(monkeypatch):
    opened, real = {}, engine_runner.open_step_session

    def open_step_session(model, *args, cuda_graph=False, **options):
        session, device = real(model, *args, **options)
        if cuda_graph:
            opened["graph"] = session = _CapturingFirstRun(session)
            opened["inputs"] = {
                i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input
            }
        return session, device

    monkeypatch.setattr(engine_runner, "open_step_session", open_step_session)
    said = []
    plain, graph = _runner(False), _runner(True, said.append)
    batches = classification_batches(features=SIZES[0], classes=SIZES[-1], count=4)
    batches.append({k: v[:5] for k, v in batches[0].items()})  # a short last batch
    for batch in batches:
        assert graph.run(batch) == plain.run(batch)
        for name in plain.state.values:
            assert graph.state.read(name).tobytes() == plain.state.read(name).tobytes(), name
    assert opened["graph"].runs == 1 + 4  # the capture, then a replay per batch of the captured shape
    assert opened["inputs"]["x"] == [8, 8] and opened["inputs"]["labels"] == [8]  # static: shapes fold
    assert said == ["amp-rewrite: a batch of other shapes than the CUDA graph's {'x': [8, 8], 'labels': [8]}: "
                    "run without it"]  # fmt: skip
    assert np.asarray(graph.state.read("opt/step")) == 5


def test_cuda_graph_must_be_a_flag():
    with pytest.raises(TrainingError, match="cuda_graph must be True or False"):
        Trainer(mlp(SIZES), provider="cpu", verbose=False, cuda_graph="yes")


def test_a_node_that_would_leave_the_cuda_device_is_named():
    step = _flat_step()
    reads = step.model.graph.node[0].output[0]
    step.model.graph.node.append(helper.make_node("NonZero", [reads], ["where"], name="user_nonzero"))
    assert "user_nonzero" in engine.off_device(step)
    assert engine.cuda_graph_refusal(step, "cuda").startswith(
        "1 node(s) would leave the device ('user_nonzero'"
    )


def test_a_capture_onnx_runtime_refuses_is_said_and_the_plain_session_steps(monkeypatch):
    real = engine_runner.open_step_session

    def open_step_session(model, *args, cuda_graph=False, **options):
        if cuda_graph:
            raise TrainingError("ONNX Runtime refused the step graph: graph capture is not supported")
        return real(model, *args, **options)

    monkeypatch.setattr(engine_runner, "open_step_session", open_step_session)
    said = []
    plain, graph = _runner(False), _runner(True, said.append)
    for batch in classification_batches(features=SIZES[0], classes=SIZES[-1], count=2):
        assert graph.run(batch) == plain.run(batch)
    assert said == ["amp-rewrite: no CUDA graph: ONNX Runtime could not capture the step "
                    "(ONNX Runtime refused the step graph: graph capture is not supported)"]  # fmt: skip
    assert graph.state.read("w0").tobytes() == plain.state.read("w0").tobytes()
