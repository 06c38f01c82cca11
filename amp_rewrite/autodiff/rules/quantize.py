"""QuantizeLinear -> DequantizeLinear: the straight-through estimator (STE) of quantization-aware
training. Rounding has a zero gradient almost everywhere, so a QDQ model's float weights would get
none; QAT (torch's FakeQuantize) treats the pair as identity for x inside the representable range
and zero where it saturates. The DequantizeLinear carries the rule: the index gives it, from slot
3, the x, scale and zero point of the QuantizeLinear whose integer output it reads
(graphinfo._quantized_through). Scales and zero points are not differentiated (torch's default
QAT learns neither); a DequantizeLinear of integer weights passes nothing (they are not trained).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from amp_rewrite.autodiff.context import GradContext

STE_SLOT = 3  # the QuantizeLinear's x, past the DequantizeLinear's three own inputs
# representable range of each integer quantized type: the STE passes the gradient inside it
RANGES = {
    TensorProto.UINT8: (0, 255),
    TensorProto.INT8: (-128, 127),
    TensorProto.UINT16: (0, 65535),
    TensorProto.INT16: (-32768, 32767),
    TensorProto.INT32: (-(2**31), 2**31 - 1),
    TensorProto.UINT4: (0, 15),
    TensorProto.INT4: (-8, 7),
}


def dequantize_grad(ctx: GradContext):
    """dx = dY where qmin <= round(x / scale) + zero_point <= qmax, else 0, for the x of the
    QuantizeLinear this node dequantizes (the pair must share its scale and zero point)."""
    grads = [None] * 6
    if not ctx.needs(STE_SLOT) or ctx.dy() is None:
        return grads
    scale, zero = ctx.x(1), ctx.x(2)
    x, q_scale, q_zero = ctx.x(3), ctx.x(4), ctx.x(5)
    if not _same(ctx, scale, q_scale) or not _same(ctx, zero, q_zero):
        raise ctx.error(
            "the straight-through gradient needs its QuantizeLinear to share the scale and zero point"
        )
    if ctx.attr("block_size", 0):
        raise ctx.error("blocked quantization (block_size) is not supported")
    qtype = ctx.dtype(zero) if zero else ctx.dtype(ctx.x(0))
    if qtype not in RANGES:
        raise ctx.error(f"quantized type {TensorProto.DataType.Name(qtype)} has no integer range")
    e, elem = ctx.emit, ctx.dtype(x)
    ratio = e.op("Round", [e.op("Div", [x, _per_axis(ctx, scale, x)])])
    if zero:
        ratio = e.op("Add", [ratio, _per_axis(ctx, e.cast(zero, elem), x)])
    low, high = (ctx.const(bound, x) for bound in RANGES[qtype])
    inside = e.op("And", [e.op("GreaterOrEqual", [ratio, low]), e.op("LessOrEqual", [ratio, high])])
    grads[STE_SLOT] = e.op("Where", [inside, ctx.dy(), ctx.const(0, x)])
    return grads


def _same(ctx: GradContext, a: str, b: str) -> bool:
    """The same tensor, or constants of equal values (exporters may repeat an initializer)."""
    if a == b:
        return True
    va, vb = ctx.constant(a), ctx.constant(b)
    return va is not None and vb is not None and va.shape == vb.shape and bool(np.array_equal(va, vb))


def _per_axis(ctx: GradContext, value: str, x: str) -> str:
    """A per-axis (1-D) scale or zero point shaped to broadcast along `axis` of x."""
    dims = ctx.dims(value)
    if dims is not None and len(dims) == 0:
        return value
    rank = ctx.rank(x)
    axis = ctx.attr("axis", 1)
    axis = axis + rank if axis < 0 else axis
    if dims == [1] or axis == rank - 1:  # broadcasts as it is
        return value
    return ctx.emit.op("Reshape", [value, ctx.emit.ints([-1] + [1] * (rank - 1 - axis))])
