"""Say why steps keep being skipped: one diagnostic run of the step with every gradient exposed.

A step is skipped when any gradient (or the loss) is not finite. When that happens `PATIENCE`
times in a row, or at the loss scale's floor, the trainer runs the failing batch once more
through a copy of the step graph that also outputs one float32 sum per gradient, and warns once,
naming the tensors whose gradients are not finite (typically exporter constants: masks, -inf
fills), so the user can freeze them.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import TensorProto, helper

from amp_rewrite.errors import TrainingError
from amp_rewrite.runtime import open_session

PATIENCE = 10
SHOWN = 6
log = logging.getLogger("amp_rewrite.training")


def diagnostic_model(
    model: onnx.ModelProto, loss: str, gradients: dict[str, str]
) -> tuple[onnx.ModelProto, dict]:
    """The step model plus a float32 scalar output `diag/<i>` = sum of each gradient; {output: weight}."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    probes = {}
    for i, (weight, grad) in enumerate([("the loss", loss), *gradients.items()]):
        cast, total = f"diag/{i}/float", f"diag/{i}"
        graph.node.append(
            helper.make_node("Cast", [grad], [cast], name=f"diag/{i}/cast", to=TensorProto.FLOAT)
        )
        graph.node.append(helper.make_node("ReduceSum", [cast], [total], name=f"diag/{i}/sum", keepdims=0))
        graph.output.append(helper.make_tensor_value_info(total, TensorProto.FLOAT, []))
        probes[total] = weight
    return out, probes


def nonfinite_tensors(
    model: onnx.ModelProto, loss: str, gradients: dict[str, str], feeds: dict, device: str
) -> list[str]:
    """The weights (or 'the loss') whose gradient is not finite for `feeds` (state, lr and batch)."""
    diagnostic, probes = diagnostic_model(model, loss, gradients)
    session, _ = open_session(
        diagnostic.SerializeToString(), device, error=TrainingError, what="the diagnostic step"
    )
    names = [i.name for i in session.get_inputs()]
    values = session.run(list(probes), {n: feeds[n] for n in names})
    return [probes[out] for out, value in zip(probes, values) if not np.isfinite(value)]


def warning_text(skipped: int, bad: list[str]) -> str:
    if not bad:
        return (
            f"amp-rewrite: {skipped} steps in a row skipped, but a diagnostic run found every gradient "
            "finite (the overflow depends on the loss scale or the batch)"
        )
    shown = ", ".join(repr(b) if b != "the loss" else b for b in bad[:SHOWN])
    more = f" and {len(bad) - SHOWN} more" if len(bad) > SHOWN else ""
    hint = (
        "" if bad == ["the loss"] else " (freeze them with Trainer(frozen=[...]) if they are not parameters)"
    )
    return (
        f"amp-rewrite: {skipped} steps in a row skipped: the gradients of {shown}{more} are not finite{hint}"
    )


class Watch:
    """The Trainer's count of skips in a row, and its one warning: after PATIENCE skips in a row
    (or a skip at the scale's floor), one diagnostic run of the batch that failed (a skipped step
    left weights and slots as they were) names the tensors whose gradients are not finite."""

    def __init__(self, floor: float | None):
        self.floor, self.in_row, self.warned = floor, 0, False

    def due(self, skipped: bool, scale: float) -> bool:
        self.in_row = self.in_row + 1 if skipped else 0
        at_floor = skipped and self.floor is not None and scale <= self.floor and self.in_row > 1
        if self.warned or not (self.in_row >= PATIENCE or at_floor):
            return False
        self.warned = True
        return True

    def warn(self, step, feeds: dict, device: str) -> None:
        bad = nonfinite_tensors(step.model, step.loss_output, step.gradients, feeds, device)
        log.warning(warning_text(self.in_row, bad))
