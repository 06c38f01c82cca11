"""The step in two halves, the engine engine.py picks on CPU and for MPI: a gradient session, then the
update (numpy's host update on CPU, else an apply session), each bound once to the one copy of the
state; a `reduction` (distributed.MpiReduction) sums the gradients across ranks between them.

On CPU the host update (host_update.py) is faster than ONNX Runtime's whole-tensor optimizer ops.
The halves compute what the one-graph step (`runner.SessionRunner`) computes (`split_step.py`;
tests/training/test_host_update.py says within what).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from amp_rewrite.training.host_update import HostUpdate, Unsupported
from amp_rewrite.training.runner import (
    DeviceState,
    SingleProcess,
    check_in_place,
    feed_dtypes,
    open_step_session,
)
from amp_rewrite.training.split_step import split_step_graph
from amp_rewrite.training.step_graph import SKIPPED_OUTPUT, StepGraph


class SplitRunner(SingleProcess):
    """Gradient session, [reduction,] then update. `host_update=False` keeps ONNX Runtime's apply
    session on CPU too. `description`: what runs, and why the host update does not where it
    cannot, for the engine's line."""

    def __init__(
        self,
        step: StepGraph,
        initial: dict[str, np.ndarray],
        lr: float,
        device: str,
        precision: str,
        threads: int = 0,
        device_id: int = 0,
        reduction=None,
        host_update: bool = True,
        tf32: bool = False,
    ):
        self.reduction = reduction
        self.split = split = split_step_graph(step, reduction.loss_share if reduction else 1.0)
        check_in_place(split.apply, step.next_state)
        options = {"device_id": device_id, "threads": threads, "tf32": tf32}
        self._grad_session, self.device = open_step_session(split.gradient, device, precision, **options)
        self.feed_types = feed_dtypes(split.gradient)
        self.state = DeviceState(initial, lr, self.device, device_id)
        shapes = {split.grads[w]: initial[w].shape for w in step.weights}
        self.gradients = (
            reduction.gradient_arrays(shapes)
            if reduction
            else {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
        )
        self.loss, self.skipped = np.zeros((), np.float32), np.zeros((), np.bool_)
        self.flag = reduction.flag if reduction else self.skipped  # the flag the update reads
        host = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in self.gradients.items()}
        host[step.loss_output] = ort.OrtValue.ortvalue_from_numpy(self.loss)
        host[SKIPPED_OUTPUT] = ort.OrtValue.ortvalue_from_numpy(self.skipped)
        self._grad_binding = self._grad_session.io_binding()
        self.state.bind(self._grad_binding, self.feed_types)
        for value in split.gradient.graph.output:
            self._grad_binding.bind_ortvalue_output(value.name, host[value.name])
        self.host_update, why = self._host_update(split, step, host_update)
        if self.host_update is None:
            self._apply_session, _ = open_step_session(split.apply, device, precision, **options)
            self._apply_binding = self._apply_session.io_binding()
            self.state.bind(self._apply_binding, feed_dtypes(split.apply), step.next_state)
            host[SKIPPED_OUTPUT] = ort.OrtValue.ortvalue_from_numpy(self.flag)
            for name in feed_dtypes(split.apply):
                if name in host:
                    self._apply_binding.bind_ortvalue_input(name, host[name])
        self._host = host  # the OrtValues over the numpy buffers stay alive with the bindings
        update = (
            "the update on the host (numpy, in cache-sized blocks)"
            if self.host_update
            else f"the update in an apply session ({why})"
        )
        between = f", {reduction.description}," if reduction else ","
        self.description = f"a gradient session on {self.device.upper()}{between} then {update}"
        if reduction:
            reduction.attach(self)

    def _host_update(self, split, step: StepGraph, wanted: bool) -> tuple[HostUpdate | None, str]:
        """The compiled host update, or None and why not."""
        if not wanted:
            return None, "host_update=False"
        if self.device != "cpu":
            return None, f"the state lives on {self.device.upper()}"
        arrays = {**self.state.arrays, **self.gradients, SKIPPED_OUTPUT: self.flag}
        try:
            return HostUpdate.compile(split.apply, arrays, step.next_state), ""
        except Unsupported as error:
            return None, f"the host update does not run {error}"

    def compute_gradients(self, batch: dict[str, np.ndarray]) -> None:
        """Loss, gradients and skip flag of a batch (converted feeds), into their arrays. A feed the
        loss does not depend on is not an input of the gradient graph, and is not bound."""
        for name, array in batch.items():
            if name in self.feed_types:
                self._grad_binding.bind_cpu_input(name, array)
        self._grad_session.run_with_iobinding(self._grad_binding)

    def apply(self) -> None:
        """The update from the gradient arrays and `flag`, into the state, in place."""
        if self.host_update is not None:
            self.host_update.run()
        else:
            self._apply_session.run_with_iobinding(self._apply_binding)

    def run(self, batch: dict[str, np.ndarray]) -> tuple[float, bool]:
        """One step on a batch (converted feeds); returns (loss, skipped)."""
        if self.reduction is None:
            self.compute_gradients(batch)
            self.apply()
            return float(self.loss), bool(self.flag)
        timed = self.reduction.timed
        timed("gradient", self.compute_gradients, batch)
        loss, skipped = timed("allreduce", self.reduction.reduce, self.loss, self.skipped)
        timed("apply", self.apply)
        return loss, skipped

    # what a data-parallel job's hooks are: the reduction's, else one process's (SingleProcess)
    @property
    def primary(self) -> bool:
        return self.reduction.primary if self.reduction else True

    def on_primary(self, action) -> None:
        (self.reduction or SingleProcess()).on_primary(action)

    def share_state(self) -> None:
        if self.reduction:
            self.reduction.share_state(self.state)

    def check_batch_count(self, count: int) -> None:
        if self.reduction:
            self.reduction.check_batch_count(count)
