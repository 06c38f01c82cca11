"""Figures from the model itself: FLOPs of the compute-heavy ops (from inferred shapes) and the
bytes of float weights. Below both halves: the report counts them, autodiff's recompute planner
weighs segments by them."""

from __future__ import annotations

import math

import numpy as np
import onnx

from amp_rewrite.onnx_facts import ELEMENT_SIZE, FLOAT_TYPES

HEAVY = {"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "FusedMatMul", "FusedGemm", "FusedConv"}


def weight_bytes(graphs) -> int:
    """Bytes of float weights (initializers and Constant tensors) in `graphs`, from their shapes."""
    total = 0
    for graph in graphs:
        tensors = list(graph.initializer)
        tensors += [a.t for n in graph.node if n.op_type == "Constant" for a in n.attribute if a.name == "value"]
        for t in tensors:
            if t.data_type in FLOAT_TYPES:
                total += ELEMENT_SIZE[t.data_type] * math.prod(t.dims)
    return total


def _dims(shapes: dict, name: str):
    shape = shapes.get(name)
    if shape is None:
        return None
    dims = [d.dim_value if d.HasField("dim_value") else None for d in shape.dim]
    return None if any(d is None or d <= 0 for d in dims) else dims


def estimate_flops(node: onnx.NodeProto, shapes: dict | None = None, *, dims=None) -> int | None:
    """Multiply-adds x 2 of a MatMul / Gemm / Conv / ConvTranspose from known shapes, else None.
    `shapes`: name -> TensorShapeProto; or `dims`: name -> list of positive ints or None."""
    dims = dims or (lambda name: _dims(shapes, name))
    op = node.op_type
    if op in ("MatMul", "FusedMatMul", "Gemm", "FusedGemm"):
        a = dims(node.input[0]) if node.input else None
        y = dims(node.output[0]) if node.output else None
        b = dims(node.input[1]) if len(node.input) > 1 else None
        if y is None and op in ("MatMul", "FusedMatMul") and a and b and len(a) >= 2 and len(b) >= 2:
            y = a[:-1] + [b[-1]]  # batch dims of b broadcast against a's: a lower bound
        if a is None or y is None or not a:
            return None
        k = a[-1]
        if op in ("Gemm", "FusedGemm") and any(at.name == "transA" and at.i for at in node.attribute):
            k = a[0]
        return 2 * int(np.prod(y)) * k
    if op in ("Conv", "FusedConv", "ConvTranspose"):
        x = dims(node.input[0]) if node.input else None
        w = dims(node.input[1]) if len(node.input) > 1 else None
        y = dims(node.output[0]) if node.output else None
        if x is None or w is None or y is None:
            return None
        if op == "ConvTranspose":  # each input element meets Cout/g x kernel weights
            return 2 * int(np.prod(x)) * int(np.prod(w[1:]))
        return 2 * int(np.prod(y)) * int(np.prod(w[1:]))
    return None
