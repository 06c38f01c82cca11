"""Samples synthesised from a model's declared inputs: the checks' default data, and the range
evidence of cost placement (analysis/evidence.py), which runs below the checks."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from amp_rewrite.errors import UsageError


def feed_inputs(model: onnx.ModelProto) -> list:
    """Graph inputs that must be fed (inputs that are also initializers are optional)."""
    initializers = {i.name for i in model.graph.initializer}
    return [v for v in model.graph.input if v.name not in initializers]


def synthesise(
    model: onnx.ModelProto,
    *,
    dims=None,
    count: int = 1,
    seed: int = 0,
    scale: float = 1.0,
    default_dim: int = 1,
) -> list:
    """`count` random samples from the declared input types; symbolic dims from `dims`, else `default_dim`.

    Floats are standard normal x `scale`, integers in [0, 3) (safe as indices), bools random.
    """
    dims = dims or {}
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
                    shape.append(dims.get(d.dim_param, default_dim))
            dtype = helper.tensor_dtype_to_np_dtype(t.elem_type)
            if np.issubdtype(dtype, np.floating):
                feeds[value.name] = (rng.standard_normal(shape) * scale).astype(dtype)
            elif dtype == np.bool_:
                feeds[value.name] = rng.integers(0, 2, shape).astype(bool)
            else:
                feeds[value.name] = rng.integers(0, 3, shape).astype(dtype)
        samples.append(feeds)
    return samples
