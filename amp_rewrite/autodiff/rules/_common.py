"""Helpers shared by the rules: un-broadcasting and axis normalisation."""

from __future__ import annotations

from onnx import TensorProto

from amp_rewrite.autodiff.context import GradContext


def normalize_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def unbroadcast(
    ctx: GradContext, g: str, x: str, g_dims: list | None = None, x_dims: list | None = None
) -> str:
    """Sum g (shaped like a broadcast result) back to the shape of x.

    Leading extra axes are summed away; an axis where x has size 1 is summed with keepdims. Where
    x's size on an axis is not known to differ from 1 (a dynamic batch dim), the axes are found at
    run time from Shape(x), so the graph is right for any batch size.
    """
    g_dims = ctx.dims(g) if g_dims is None else g_dims
    x_dims = ctx.dims(x) if x_dims is None else x_dims
    if g_dims is None or x_dims is None:
        return unbroadcast_at_runtime(ctx, g, x)
    lead = len(g_dims) - len(x_dims)
    if lead > 0:
        g = ctx.emit.reduce_sum(g, list(range(lead)), keepdims=False)
    g_tail = g_dims[lead:] if lead >= 0 else g_dims
    static_axes, unsure = [], False
    for axis, (xd, gd) in enumerate(zip(x_dims, g_tail)):
        if xd == 1 and gd != 1:
            static_axes.append(axis)
        elif xd != gd and not (isinstance(xd, int) and xd > 1):
            unsure = True
    if unsure:
        return _sum_where_x_is_one(ctx, g, x, x_dims)
    if static_axes:
        g = ctx.emit.reduce_sum(g, static_axes, keepdims=True)
    return g


def _sum_where_x_is_one(ctx: GradContext, g: str, x: str, x_dims: list | None = None) -> str:
    """ReduceSum over the axes where x is 1 (g has x's rank), with no data-dependent shape. An axis
    where x's size is written is summed (1) or kept (another size) as it stands; every other axis k
    is split by one Reshape into (g_k / x_k, x_k) and summed over its first part: of size 1 (a
    no-op) where x's size is g's, g's size where x is 1. The shapes follow from shapes alone
    (Shape, Gather, Div: host values), so no NonZero waits for the device (a host sync on CUDA)."""
    e = ctx.emit
    dims = ctx.dims(x) if x_dims is None else x_dims
    if dims is None:
        return _sum_where_x_is_one_at_any_rank(ctx, g, x)
    ones = [k for k, d in enumerate(dims) if d == 1]
    if ones:  # an ordinary sum over the axes known to be broadcast, the big one of a loss's [rows, C]
        g = e.reduce_sum(g, ones, keepdims=True)
    unsure = [k for k, d in enumerate(dims) if not isinstance(d, int)]
    if not unsure:
        return g
    x_sizes = e.op("Gather", [e.shape(x), e.ints(unsure)], axis=0)
    g_sizes = e.op("Gather", [e.shape(g), e.ints(unsure)], axis=0)
    ratio = e.op("Div", [g_sizes, e.op("Max", [x_sizes, e.ints([1])])])  # x's 0-sized axes: g's 0
    source = e.op("Concat", [e.shape(g), ratio, x_sizes], axis=0)
    picks, axes = [], []
    for k in range(len(dims)):
        if k in unsure:
            j = unsure.index(k)
            axes.append(len(picks))
            picks += [len(dims) + j, len(dims) + len(unsure) + j]
        else:
            picks.append(k)
    target = e.op("Gather", [source, e.ints(picks)], axis=0)
    return e.reduce_sum(e.op("Reshape", [g, target]), axes, keepdims=False)


def _sum_where_x_is_one_at_any_rank(ctx: GradContext, g: str, x: str) -> str:
    """The same where x's rank is unknown: every axis split, [g0/x0, x0, g1/x1, x1, ...], summed
    over the even axes (a Range over twice x's rank)."""
    e = ctx.emit
    x_shape = e.shape(x)
    ratio = e.op("Div", [e.shape(g), e.op("Max", [x_shape, e.ints([1])])])
    pairs = e.op("Concat", [e.unsqueeze(ratio, [1]), e.unsqueeze(x_shape, [1])], axis=1)
    split = e.op("Reshape", [g, e.op("Reshape", [pairs, e.ints([-1])])])
    twice = e.op("Mul", [e.op("Size", [x_shape]), e.const(2, TensorProto.INT64)])
    axes = e.op("Range", [e.const(0, TensorProto.INT64), twice, e.const(2, TensorProto.INT64)])
    return e.reduce_sum(split, axes, keepdims=False)


def unbroadcast_at_runtime(ctx: GradContext, g: str, x: str) -> str:
    """Rank-agnostic form: leading axes from Size(Shape(g)) - Size(Shape(x)), then the size-1 axes."""
    e = ctx.emit
    lead = e.op("Sub", [e.op("Size", [e.shape(g)]), e.op("Size", [e.shape(x)])])
    axes = e.op("Range", [e.const(0, 7), lead, e.const(1, 7)])
    g = e.reduce_sum(g, axes, keepdims=False)
    return _sum_where_x_is_one(ctx, g, x)


def reduce_axes(ctx: GradContext) -> list[int] | None:
    """Axes of a Reduce* node as written (may be negative); None means 'all axes'.

    No rank is needed: Unsqueeze reads negative axes against its output rank, the input's rank.
    """
    if ctx.opset >= _axes_input_since(ctx.node.op_type):
        name = ctx.x(1)
        axes = ctx.constant_ints(name, "axes") if name else []
    else:
        axes = ctx.attr("axes") or []
    if not axes:
        return [] if ctx.attr("noop_with_empty_axes", 0) else None
    return list(axes)


def _axes_input_since(op_type: str) -> int:
    from amp_rewrite.autodiff.emitter import AXES_INPUT_SINCE

    return AXES_INPUT_SINCE.get(op_type, 1)


def expand_reduced(ctx: GradContext, g: str, x: str) -> str:
    """Broadcast the gradient of a Reduce* output back to the shape of its input."""
    axes = reduce_axes(ctx)
    if axes == []:
        return g
    if axes is not None and not ctx.attr("keepdims", 1):
        g = ctx.emit.unsqueeze(g, axes)
    return ctx.emit.op("Expand", [g, ctx.emit.shape(x)])


def reduced_with_keepdims(ctx: GradContext, y: str, x: str) -> str:
    """The Reduce* output reshaped so it broadcasts against the input (keepdims=1 form)."""
    axes = reduce_axes(ctx)
    if axes == [] or axes is None or ctx.attr("keepdims", 1):
        return y  # a full reduction broadcasts as it is, with or without kept dims
    return ctx.emit.unsqueeze(y, axes)
