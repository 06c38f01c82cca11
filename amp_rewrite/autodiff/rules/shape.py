"""Data movement: reshapes, transposes, concatenation, slicing and gathers.

Gathers scatter-add their gradient into zeros (ScatterND/ScatterElements with reduction='add',
opset 16+), which is right when an index repeats (a token used twice in one batch).
"""

from __future__ import annotations

from onnx import TensorProto

from amp_rewrite.autodiff.rules._common import normalize_axis, unbroadcast

SCATTER_ADD_SINCE = 16


def back_to_input_shape(ctx):
    """dY reshaped to the input's shape (Reshape, Flatten, Squeeze, Unsqueeze)."""
    return [ctx.emit.reshape_like(ctx.dy(), ctx.x(0))]


def transpose_grad(ctx):
    """Transpose by the inverse permutation (the default permutation reverses the axes)."""
    perm = ctx.attr("perm") or list(reversed(range(ctx.rank(ctx.x(0)))))
    inverse = [0] * len(perm)
    for i, p in enumerate(perm):
        inverse[p] = i
    return [ctx.emit.op("Transpose", [ctx.dy()], perm=inverse)]


def expand_grad(ctx):
    """Sum over the broadcast axes."""
    return [unbroadcast(ctx, ctx.dy(), ctx.x(0), ctx.dims(ctx.y()))]


def tile_grad(ctx):
    """View dY as [r0, x0, r1, x1, ...] and sum the repeat axes."""
    e, x = ctx.emit, ctx.x(0)
    rank = ctx.rank(x)
    pairs = e.op("Concat", [e.unsqueeze(ctx.x(1), [1]), e.unsqueeze(e.shape(x), [1])], axis=1)
    blocks = e.op("Reshape", [ctx.dy(), e.op("Reshape", [pairs, e.ints([-1])])])
    return [e.reduce_sum(blocks, [2 * k for k in range(rank)], keepdims=False)]


def concat_grad(ctx):
    """Split dY along the axis into pieces sized like the inputs (sizes read at run time)."""
    e = ctx.emit
    inputs = list(ctx.node.input)
    axis = normalize_axis(ctx.attr("axis"), ctx.rank(ctx.y()))
    sizes = e.op("Concat", [e.dim(x, axis) for x in inputs], axis=0)
    parts = e.op("Split", [ctx.dy(), sizes], outputs=len(inputs), axis=axis)
    parts = parts if isinstance(parts, list) else [parts]
    return [part if ctx.needs(i) else None for i, part in enumerate(parts)]


def split_grad(ctx):
    """Concatenate the output gradients (zeros for outputs that reach no loss)."""
    axis = ctx.attr("axis", 0)
    grads = [ctx.dy_or_zeros(i) for i in range(len(ctx.node.output))]
    return [ctx.emit.op("Concat", grads, axis=axis)]


def _flat_positions(ctx, x):
    """Each element's position in x flattened, shaped like x (int64)."""
    e = ctx.emit
    size = e.op("Size", [x])
    return e.op(
        "Reshape",
        [e.op("Range", [e.const(0, TensorProto.INT64), size, e.const(1, TensorProto.INT64)]), e.shape(x)],
    )


def _scatter_flat(ctx, x, positions, g, reduction=None):
    """zeros(Shape(x)) with g scattered (added when `reduction`) at flat `positions`."""
    e = ctx.emit
    flat = lambda t: e.op("Reshape", [t, e.ints([-1])])  # noqa: E731
    zeros = e.op(
        "ConstantOfShape", [e.op("Reshape", [e.op("Size", [x]), e.ints([1])])], value=_zero(ctx.dtype(x))
    )
    scattered = e.op("ScatterElements", [zeros, flat(positions), flat(g)], axis=0, reduction=reduction)
    return e.reshape_like(scattered, x)


def _zero(elem):
    from onnx import helper

    return helper.make_tensor("value", elem, [1], [0])


def slice_grad(ctx):
    """Slice the flat positions of x like the forward did, then scatter dY there (dynamic-safe)."""
    x = ctx.x(0)
    positions = ctx.emit.op("Slice", [_flat_positions(ctx, x), *ctx.node.input[1:]])
    return [_scatter_flat(ctx, x, positions, ctx.dy())]


def _needs_scatter_add(ctx):
    if ctx.opset < SCATTER_ADD_SINCE:
        raise ctx.error(
            f"its gradient scatter-adds, which needs opset {SCATTER_ADD_SINCE}+; the model has {ctx.opset}"
        )


def _dim_scalar(ctx, x, axis):
    return ctx.emit.op("Gather", [ctx.emit.shape(x), ctx.emit.const(axis, TensorProto.INT64)])


def _positive_indices(ctx, indices, dim):
    """Indices as int64 with negative values wrapped (ScatterND does not wrap them)."""
    e = ctx.emit
    if ctx.dtype(indices) != TensorProto.INT64:
        indices = e.cast(indices, TensorProto.INT64)
    negative = e.op("Less", [indices, e.const(0, TensorProto.INT64)])
    return e.op("Where", [negative, e.op("Add", [indices, dim]), indices])


def gather_grad(ctx):
    """Scatter-add dY into zeros with the gathered axis moved to the front: ScatterND(reduction='add')
    from opset 16, a one-hot MatMul before (memory grows with indices x axis size)."""
    e, x = ctx.emit, ctx.x(0)
    rank, q = ctx.rank(x), ctx.rank(ctx.x(1))
    axis = normalize_axis(ctx.attr("axis", 0), rank)
    dim = _dim_scalar(ctx, x, axis)
    indices = _positive_indices(ctx, ctx.x(1), dim)
    front = [axis, *range(axis), *range(axis + 1, rank)]
    front_shape = e.op("Gather", [e.shape(x), e.ints(front)])
    dy = ctx.dy()
    if axis:  # index axes first, then the remaining data axes in order
        dy = e.op(
            "Transpose", [dy], perm=[*range(axis, axis + q), *range(axis), *range(axis + q, rank + q - 1)]
        )
    if ctx.opset >= SCATTER_ADD_SINCE:
        zeros = e.op("ConstantOfShape", [front_shape], value=_zero(ctx.dtype(x)))
        scattered = e.op("ScatterND", [zeros, e.unsqueeze(indices, [-1]), dy], reduction="add")
    else:
        flat = e.op("Reshape", [indices, e.ints([-1])])
        classes = e.op("Range", [e.const(0, TensorProto.INT64), dim, e.const(1, TensorProto.INT64)])
        one_hot = e.cast(e.op("Equal", [e.unsqueeze(flat, [1]), classes]), ctx.dtype(x))
        rows = e.op("Reshape", [dy, e.op("Concat", [e.shape(flat), e.ints([-1])], axis=0)])
        summed = e.op("MatMul", [e.op("Transpose", [one_hot], perm=[1, 0]), rows])
        scattered = e.op("Reshape", [summed, front_shape])
    if axis:
        back = [0] * rank
        for i, p in enumerate(front):
            back[p] = i
        scattered = e.op("Transpose", [scattered], perm=back)
    return [scattered]


def gather_elements_grad(ctx):
    """ScatterElements-add dY into zeros at the gathered positions. Before opset 16 (no add) only
    one index per line along the axis is differentiable (a cross-entropy's label): no two land on
    one element, so a plain scatter is the sum."""
    e, x = ctx.emit, ctx.x(0)
    axis = normalize_axis(ctx.attr("axis", 0), ctx.rank(x))
    one_per_line = (ctx.dims(ctx.x(1)) or [None] * (axis + 1))[axis] == 1
    if not one_per_line or ctx.opset >= SCATTER_ADD_SINCE:
        _needs_scatter_add(ctx)
    indices = _positive_indices(ctx, ctx.x(1), _dim_scalar(ctx, x, axis))
    zeros = ctx.emit.zeros_like(x, ctx.dtype(x))
    add = {"reduction": "add"} if ctx.opset >= SCATTER_ADD_SINCE else {}
    return [e.op("ScatterElements", [zeros, indices, ctx.dy()], axis=axis, **add)]


def gather_nd_grad(ctx):
    """ScatterND-add dY into zeros (batch_dims=0)."""
    _needs_scatter_add(ctx)
    if ctx.attr("batch_dims", 0):
        raise ctx.error("batch_dims > 0 is not supported")
    zeros = ctx.emit.zeros_like(ctx.x(0), ctx.dtype(ctx.x(0)))
    return [ctx.emit.op("ScatterND", [zeros, ctx.x(1), ctx.dy()], reduction="add")]


def pad_grad(ctx):
    """Constant padding: slice the padded border off dY (pads must be constant and non-negative)."""
    if ctx.attr("mode", "constant") != "constant":
        raise ctx.error(f"only mode='constant' is supported, not '{ctx.attr('mode')}'")
    e = ctx.emit
    pads = ctx.constant_ints(ctx.x(1), "pads") if ctx.opset >= 11 else ctx.attr("pads")
    if any(p < 0 for p in pads):
        raise ctx.error("negative pads (cropping) are not supported")
    half = len(pads) // 2
    axes = ctx.constant_ints(ctx.x(3), "axes") if ctx.x(3) else list(range(half))
    axes = [normalize_axis(a, ctx.rank(ctx.x(0))) for a in axes]
    ends = e.op("Sub", [e.op("Gather", [e.shape(ctx.dy()), e.ints(axes)]), e.ints(pads[half:])])
    return [e.op("Slice", [ctx.dy(), e.ints(pads[:half]), ends, e.ints(axes)])]


def scatter_elements_grad(ctx):
    """Data: dY, less the positions an unreduced scatter overwrote (written back as zeros); updates:
    dY gathered at their positions. reduction max/min (a graph network's max pooling): dY goes
    to each value equal to the result there (ties each get it, as a subgradient may)."""
    return _scatter_grads(ctx, "GatherElements", axis=ctx.attr("axis", 0))


def scatter_nd_grad(ctx):
    """As scatter_elements_grad, with GatherND reading the updates' gradient back."""
    return _scatter_grads(ctx, "GatherND")


def _scatter_grads(ctx, gather: str, **axis):
    reduction = ctx.attr("reduction", "none")
    if reduction not in ("none", "add", "max", "min"):
        raise ctx.error(f"reduction='{reduction}' is not supported")
    e, dy, data, indices, updates = ctx.emit, ctx.dy(), ctx.x(0), ctx.x(1), ctx.x(2)
    data_grad = updates_grad = None
    if ctx.needs(0):
        data_grad = dy
        if reduction == "none":  # overwritten elements did not reach the output
            zeros = e.zeros_like(updates, ctx.dtype(updates))
            data_grad = e.op(ctx.node.op_type, [dy, indices, zeros], **axis)
        elif reduction in ("max", "min"):
            data_grad = e.op("Mul", [dy, _equal(ctx, data, ctx.y())])
    if ctx.needs(2):
        updates_grad = e.op(gather, [dy, indices], **axis)
        if reduction in ("max", "min"):
            result = e.op(gather, [ctx.y(), indices], **axis)
            updates_grad = e.op("Mul", [updates_grad, _equal(ctx, updates, result)])
    return [data_grad, None, updates_grad]


def _equal(ctx, a, b):
    return ctx.emit.cast(ctx.emit.op("Equal", [a, b]), ctx.dtype(a))
