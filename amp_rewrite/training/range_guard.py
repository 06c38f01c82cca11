"""Ops kept float32 for range, found by the Trainer itself on the batch that no loss scale could step.

A low-precision step is skipped when a gradient or the loss is not finite. The dynamic loss scale
fixes scaled gradients that overflow; it cannot fix a value that leaves the low type at every
scale: a forward sum of squares past 65504, a variance written out as E[x^2] - E[x]^2 that
cancels to a negative number in float16 and gives NaN under its square root (magika v3.3's
LayerNorm, as jax2tf writes it). When the scale reaches its floor without one finite step, the
Trainer runs the failing batch once more through the step with every tensor exposed, takes the
*origins* of what is not finite (low-precision tensors that are not finite although every input
of their node is), and keeps their nodes float32: the producer, or, where the producer is one of
the rewrite's Casts, the nodes that read it (`keep`). A few rounds at most; each is said in one
line and each node's reason names it (the report's "measured deny root").
"""

from __future__ import annotations

import numpy as np
import onnx

from amp_rewrite.errors import TrainingError
from amp_rewrite.runtime import open_session

MAX_ROUNDS = 4
LOW = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
CAST_PREFIX = "amp/"  # the rewrite's own Casts (transform/casts.py)
REASON = "not finite in {precision} at every loss scale on a training batch: kept float32 by the Trainer"


def keep(model: onnx.ModelProto, feeds: dict, device: str, precision: str) -> dict[str, str]:
    """{node name: reason} for the nodes whose low-precision outputs first turn non-finite on
    `feeds` (state, lr and batch); empty when no low tensor is an origin (nothing float32 fixes)."""
    types = _output_types(model)
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    declared = {o.name for o in probe.graph.output}
    exposed = [name for name, elem in types.items() if name not in declared]
    for name in exposed:
        probe.graph.output.add().CopyFrom(onnx.helper.make_tensor_value_info(name, types[name], None))
    session, _ = open_session(probe.SerializeToString(), device, error=TrainingError, what="the range probe")
    names = [i.name for i in session.get_inputs()]
    outputs = [o.name for o in session.get_outputs()]
    values = dict(zip(outputs, session.run(outputs, {n: feeds[n] for n in names})))
    bad = {name for name, value in values.items() if _not_finite(value)}
    reason = REASON.format(precision=precision)
    kept: dict[str, str] = {}
    readers = _readers(model)
    for node in model.graph.node:
        origins = [o for o in node.output if o in bad and types.get(o) in LOW]
        if not origins or any(x in bad for x in node.input):
            continue
        if node.op_type == "Cast" and node.name.startswith(CAST_PREFIX):
            kept.update((r.name, reason) for o in origins for r in readers.get(o, ()) if r.name)
        elif node.name:
            kept[node.name] = reason
    return kept


def _not_finite(value) -> bool:
    array = np.asarray(value)
    return array.dtype.kind == "f" and array.size > 0 and not np.isfinite(array.astype(np.float32)).all()


def _output_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every node output whose type shape inference knows, in node order."""
    inferred = onnx.shape_inference.infer_shapes(model)
    known = {
        v.name: v.type.tensor_type.elem_type
        for v in (*inferred.graph.value_info, *inferred.graph.output)
        if v.type.HasField("tensor_type")
    }
    return {o: known[o] for node in model.graph.node for o in node.output if o in known}


def _readers(model: onnx.ModelProto) -> dict[str, list]:
    found: dict[str, list] = {}
    for node in model.graph.node:
        for x in node.input:
            found.setdefault(x, []).append(node)
    return found


def said(kept: dict[str, str], precision: str) -> str:
    shown = ", ".join(repr(name) for name in list(kept)[:4]) + (", ..." if len(kept) > 4 else "")
    return (
        f"amp-rewrite: no loss scale made a {precision} step finite on this batch: {len(kept)} ops whose "
        f"{precision} values were not finite are kept float32 ({shown}), and the step is rebuilt"
    )


class RangeGuard:
    """The Trainer's, in one process: at most MAX_ROUNDS rebuilds, each keeping more float32."""

    def __init__(self, rebuild, precision: str, say):
        self.rebuild, self.precision, self.say = rebuild, precision, say
        self.kept: dict[str, str] = {}
        self.rounds = 0

    def attempt(self, model: onnx.ModelProto, feeds: dict, device: str) -> bool:
        """Probe `model` on `feeds`; rebuild with what it newly found kept float32. False when it
        found nothing new (nothing float32 fixes) or the rounds are spent."""
        if self.rounds >= MAX_ROUNDS:
            return False
        self.rounds += 1
        new = {
            name: why
            for name, why in keep(model, feeds, device, self.precision).items()
            if name not in self.kept
        }
        if not new:
            return False
        self.kept.update(new)
        self.say(said(new, self.precision))
        self.rebuild(dict(self.kept))
        return True
