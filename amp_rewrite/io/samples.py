"""Samples synthesised from a model's declared inputs: the checks' default data, and the range
evidence of cost placement (analysis/evidence.py), which runs below the checks."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from amp_rewrite.errors import UsageError


def feed_inputs(model: onnx.ModelProto) -> list:
    """Graph inputs that must be fed (inputs that are also initializers are optional)."""
    initializers = {i.name for i in model.graph.initializer}
    return [v for v in model.graph.input if v.name not in initializers]


class Synthesised(list):
    """Samples made up here, not given: a model that refuses them needs --dim or --inputs.
    `guessed`: the inputs whose sizes or integer values were guessed (every input when none was)."""

    guessed: tuple = ()
    make = None  # scale -> the samples again, every guessed size that many times larger
    scale = 1

    def grow(self) -> bool:
        """Make the samples again with every guessed size 4x larger (up to 64x), in place, so
        every check holding this list runs on them; False when there is nothing left to try."""
        if self.make is None or not self.guessed or self.scale >= 64:
            return False
        self.scale *= 4
        self[:] = self.make(self.scale)
        return True

    def refused(self, error: Exception) -> UsageError:
        """The one line for a model ONNX Runtime would not run on these samples."""
        first = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
        names = list(self.guessed) or list(self[0] if self else ())
        shown = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
        return UsageError(
            f"the model does not run on synthesised inputs ({first[:200]}); give {shown} their sizes "
            "with --dim NAME=SIZE or real samples with --inputs"
        )


_WINDOWED = ("Conv", "ConvTranspose", "MaxPool", "AveragePool", "LpPool", "ConvInteger", "QLinearConv")


def _attribute(node, name, default=None):
    found = next((a for a in node.attribute if a.name == name), None)
    return helper.get_attribute_value(found) if found is not None else default


def _ints(initializers: dict, name: str):
    tensor = initializers.get(name)
    return [int(v) for v in numpy_helper.to_array(tensor).reshape(-1)] if tensor is not None else None


def needs(model: onnx.ModelProto) -> tuple[dict, dict]:
    """What the nodes reading a graph input directly ask of made-up values: ({(input, axis):
    smallest size}, {input: integer values below}). A window (Conv, pooling) needs each spatial
    dim at least its dilated kernel less the pads; a reflect Pad more than its pads; an integer
    input indexing a Gather table values below the table's rows."""
    initializers = {t.name: t for t in model.graph.initializer}
    sizes, below = {}, {}

    def at_least(name, axis, size):
        sizes[(name, axis)] = max(sizes.get((name, axis), 1), size)

    for node in model.graph.node:
        x = node.input[0] if node.input else ""
        if node.op_type in _WINDOWED:
            kernel = _attribute(node, "kernel_shape")
            if kernel is None and len(node.input) > 1 and node.input[1] in initializers:
                kernel = list(initializers[node.input[1]].dims[2:])
            dilations = _attribute(node, "dilations") or [1] * len(kernel or ())
            pads = _attribute(node, "pads") or [0] * (2 * len(kernel or ()))
            for i, k in enumerate(kernel or ()):
                at_least(x, 2 + i, (k - 1) * dilations[i] + 1 - pads[i] - pads[i + len(kernel)])
        elif node.op_type == "Pad" and _attribute(node, "mode", b"constant") in (b"reflect", "reflect"):
            pads = _attribute(node, "pads") or (
                _ints(initializers, node.input[1]) if len(node.input) > 1 else None
            )
            half = len(pads or ()) // 2
            for axis in range(half):
                at_least(x, axis, max(pads[axis], pads[axis + half]) + 1)
        elif node.op_type == "Gather" and len(node.input) > 1 and node.input[0] in initializers:
            table = initializers[node.input[0]].dims
            axis = _attribute(node, "axis", 0)
            if table and -len(table) <= axis < len(table):
                below[node.input[1]] = min(below.get(node.input[1], 3), max(int(table[axis]), 1))
    return sizes, below


def synthesise(
    model: onnx.ModelProto,
    *,
    dims=None,
    count: int = 1,
    seed: int = 0,
    scale: float = 1.0,
    default_dim: int = 1,
) -> Synthesised:
    """`count` random samples from the declared input types; symbolic dims from `dims`, else
    `default_dim` or the smallest size the nodes reading the input need (`needs`).

    Floats are standard normal x `scale`, integers in [0, 3) (safe as indices; below a Gather
    table's rows where one reads the input), bools random.
    """
    dims = dims or {}
    sizes, below = needs(model)

    def make(grown: int) -> list:
        rng = np.random.default_rng(seed)
        samples = []
        for _ in range(count):
            feeds = {}
            for value in feed_inputs(model):
                t = value.type.tensor_type
                if not value.type.HasField("tensor_type"):
                    raise UsageError(f"input {value.name!r} is not a tensor; pass samples with --inputs")
                shape = []
                for d in t.shape.dim:
                    if d.HasField("dim_value") and d.dim_value >= 0:  # -1: dynamic, as ONNX Runtime reads it
                        shape.append(d.dim_value)
                    else:
                        guess = max(default_dim, sizes.get((value.name, len(shape)), 1)) * grown
                        shape.append(dims.get(d.dim_param, guess))
                dtype = helper.tensor_dtype_to_np_dtype(t.elem_type)
                if np.issubdtype(dtype, np.floating):
                    feeds[value.name] = (rng.standard_normal(shape) * scale).astype(dtype)
                elif dtype == np.bool_:
                    feeds[value.name] = rng.integers(0, 2, shape).astype(bool)
                else:
                    feeds[value.name] = rng.integers(0, below.get(value.name, 3), shape).astype(dtype)
            samples.append(feeds)
        return samples

    samples = Synthesised(make(1))
    samples.make = make
    samples.guessed = tuple(
        v.name
        for v in feed_inputs(model)
        if any(
            (not d.HasField("dim_value") or d.dim_value < 0) and d.dim_param not in dims
            for d in v.type.tensor_type.shape.dim
        )
        or helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).kind in "iu"
    )
    return samples
