"""The step in two halves: a gradient session, then the update (on CPU numpy's host update, else an
apply session), each bound once to the one copy of the state.

The Trainer runs it on CPU, where the host update (host_update.py) is faster than ONNX Runtime's
whole-tensor optimizer ops; the data-parallel runner (`distributed.MpiRunner`) wraps it and sums
the gradients across ranks between the halves. The halves compute what the one-graph step
(`runner.SessionRunner`) computes, bit for bit (`split_step.py`, tests/training/test_host_update.py).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from amp_rewrite.training.host_update import HostUpdate
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
    """Gradient session, then update. `loss_share` pre-scales the backward seed (data parallel);
    `gradients` are the arrays the gradient session writes into (default: one per weight);
    `flag` is the skip flag the update reads (default: the one the gradient session writes);
    `host_update=False` keeps ONNX Runtime's apply session on CPU too."""

    def __init__(
        self,
        step: StepGraph,
        initial: dict[str, np.ndarray],
        lr: float,
        provider: str,
        precision: str,
        threads: int = 0,
        device_id: int = 0,
        loss_share: float = 1.0,
        gradients: dict[str, np.ndarray] | None = None,
        flag: np.ndarray | None = None,
        host_update: bool = True,
        tf32: bool = False,
    ):
        self.split = split = split_step_graph(step, loss_share)
        check_in_place(split.apply, step.next_state)
        options = {"device_id": device_id, "threads": threads, "tf32": tf32}
        self._grad_session, self.device = open_step_session(split.gradient, provider, precision, **options)
        self.feed_types = feed_dtypes(split.gradient)
        self.state = DeviceState(initial, lr, self.device, device_id)
        shapes = {split.grads[w]: initial[w].shape for w in step.weights}
        self.gradients = gradients or {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
        self.loss, self.skipped = np.zeros((), np.float32), np.zeros((), np.bool_)
        self.flag = self.skipped if flag is None else flag
        host = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in self.gradients.items()}
        host[step.loss_output] = ort.OrtValue.ortvalue_from_numpy(self.loss)
        host[SKIPPED_OUTPUT] = ort.OrtValue.ortvalue_from_numpy(self.skipped)
        self._grad_binding = self._grad_session.io_binding()
        self.state.bind(self._grad_binding, self.feed_types)
        for value in split.gradient.graph.output:
            self._grad_binding.bind_ortvalue_output(value.name, host[value.name])
        arrays = {**self.state.arrays, **self.gradients, SKIPPED_OUTPUT: self.flag}
        self.host_update = (
            HostUpdate.compile(split.apply, arrays, step.next_state)
            if host_update and self.device == "cpu"
            else None
        )
        if self.host_update is None:
            self._apply_session, _ = open_step_session(split.apply, provider, precision, **options)
            self._apply_binding = self._apply_session.io_binding()
            self.state.bind(self._apply_binding, feed_dtypes(split.apply), step.next_state)
            host[SKIPPED_OUTPUT] = ort.OrtValue.ortvalue_from_numpy(self.flag)  # the flag the update reads
            for name in feed_dtypes(split.apply):
                if name in host:
                    self._apply_binding.bind_ortvalue_input(name, host[name])
        self._host = host  # the OrtValues over the numpy buffers stay alive with the bindings

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
        self.compute_gradients(batch)
        self.apply()
        return float(self.loss), bool(self.flag)
