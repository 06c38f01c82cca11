"""A batch checked against the step graph before the step, so a wrong feed is one line naming the
input, what it got and what it needs, never ONNX Runtime's raw error from inside the step.

Checked: every input the step needs is fed and nothing else; the element kind (a float feed for a
float input, converted to its width; an integer feed for an integer input; bool for bool); the
rank; every fixed dim; a symbolic dim (`batch`) the same size across the feeds that share it; and
cross-entropy labels (`losses.check_labels`). A step that still fails in ONNX Runtime is a
TrainingError too (`run_failure`).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import onnx
from onnx import helper

from amp_rewrite.errors import TrainingError
from amp_rewrite.training import losses

UNNAMED = frozenset({"?", "-1", "unk"})  # dim_params exporters write for "unknown", not a shared symbol
KINDS = {"f": "float", "i": "integer", "u": "integer", "b": "bool"}


@dataclasses.dataclass(frozen=True)
class Spec:
    """What one input needs: its numpy dtype and dims (an int when fixed, a name or None when not)."""

    dtype: np.dtype
    dims: tuple | None  # None: the rank is not declared


@dataclasses.dataclass(frozen=True)
class FeedCheck:
    """Checks and converts a batch for the step graph (`check(feeds)` -> arrays to bind)."""

    specs: dict[str, Spec]
    loss: object = None  # a losses.CrossEntropy when the step reads labels
    classes: int | None = None

    @classmethod
    def of(cls, step_model: onnx.ModelProto, batch_inputs, loss, forward: onnx.ModelProto) -> FeedCheck:
        declared = {i.name: i for i in step_model.graph.input}
        specs = {name: _spec(declared[name]) for name in batch_inputs}
        loss = losses.resolve_loss(loss)
        if isinstance(loss, losses.CrossEntropy) and losses.LABELS_INPUT in specs:
            return cls(specs, loss, losses.classes_of(forward))
        return cls(specs)

    def check(self, feeds: dict) -> dict[str, np.ndarray]:
        if not isinstance(feeds, dict):
            raise TrainingError(f"a batch is a dict of input name -> array, got {type(feeds).__name__}")
        needed = ", ".join(self.specs)
        for name in feeds:
            if name not in self.specs:
                raise TrainingError(f"feed {name!r} is not an input of the step (it needs: {needed})")
        arrays, sizes = {}, {}
        for name, spec in self.specs.items():
            if name not in feeds:
                raise TrainingError(f"missing feed {name!r} (the step needs: {needed})")
            arrays[name] = _checked(name, feeds[name], spec, sizes)
        if self.loss is not None:
            losses.check_labels(arrays[losses.LABELS_INPUT], self.classes, self.loss)
        return arrays


def ort_message(text: str) -> str:
    """ONNX Runtime's message on one line, without its "[ONNXRuntimeError] : 1 : FAIL : " code."""
    lines = text.strip().splitlines() or [""]
    return re.sub(r"\[ONNXRuntimeError\] : \d+ : \w+ : ", "", lines[0])


def run_failure(error: Exception, precision: str) -> TrainingError:
    """ONNX Runtime's failure of a step as one TrainingError line (advice for a refused kernel)."""
    line = ort_message(str(error)) or type(error).__name__
    if any(
        refusal in str(error)
        for refusal in ("NOT_IMPLEMENTED", "Could not find an implementation", "data type is not supported")
    ):
        advice = (
            "use precision='float16', or a CUDA machine"
            if precision == "bfloat16"
            else "use precision='float32', or a CUDA machine"
        )
        return TrainingError(
            f"ONNX Runtime has no kernel for a node of the {precision} step graph ({line}): {advice}"
        )
    return TrainingError(f"ONNX Runtime failed the step: {line}")


def _spec(value: onnx.ValueInfoProto) -> Spec:
    tensor = value.type.tensor_type
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.elem_type))
    if not tensor.HasField("shape"):
        return Spec(dtype, None)
    dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim)
    return Spec(dtype, dims)


def _checked(name: str, feed, spec: Spec, sizes: dict) -> np.ndarray:
    """The feed as a contiguous array of the input's dtype, or a TrainingError naming the mismatch."""
    try:
        array = np.asarray(feed)
    except (TypeError, ValueError) as error:
        raise TrainingError(f"feed {name!r} is not an array: {error}") from None
    got, needs = KINDS.get(array.dtype.kind, str(array.dtype)), KINDS.get(spec.dtype.kind)
    if got != needs:
        raise TrainingError(
            f"feed {name!r}: got {_describe(array.dtype, array.shape)}, needs "
            f"{_describe(spec.dtype, spec.dims)} ({needs} values)"
        )
    if spec.dims is not None:
        if array.ndim != len(spec.dims):
            raise TrainingError(
                f"feed {name!r}: got {_describe(array.dtype, array.shape)}, needs "
                f"{_describe(spec.dtype, spec.dims)} (rank {len(spec.dims)})"
            )
        for axis, (size, dim) in enumerate(zip(array.shape, spec.dims)):
            if isinstance(dim, int) and dim > 0 and size != dim:
                raise TrainingError(
                    f"feed {name!r}: got {_describe(array.dtype, array.shape)}, needs "
                    f"{_describe(spec.dtype, spec.dims)} (dim {axis} is fixed at {dim})"
                )
            if isinstance(dim, str) and dim not in UNNAMED:
                first = sizes.setdefault(dim, (size, name))
                if first[0] != size and first[1] != name:
                    raise TrainingError(
                        f"feed {name!r}: dim {axis} ({dim!r}) is {size}, but feed {first[1]!r} "
                        f"gave {dim!r} = {first[0]}"
                    )
    return np.ascontiguousarray(array, dtype=spec.dtype)


def _describe(dtype, dims) -> str:
    shown = "?" if dims is None else ", ".join("?" if d is None else str(d) for d in dims)
    return f"{np.dtype(dtype).name}[{shown}]"
