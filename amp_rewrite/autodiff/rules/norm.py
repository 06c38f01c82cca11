"""Normalisation: LayerNormalization, BatchNormalization (training and inference mode),
InstanceNormalization and GroupNormalization, in standard ops where ONNX Runtime calls its
LayerNormalizationGrad / BatchNormalizationGrad training kernels.
"""

from __future__ import annotations

from onnx import TensorProto

from amp_rewrite.autodiff.rules._common import normalize_axis, unbroadcast


def _normalized_input_grad(ctx, dxhat, xhat, inv_std, axes):
    """dX of (x - mean(x)) * inv_std given d xhat: inv_std * (dxhat - mean(dxhat) - xhat*mean(dxhat*xhat))."""
    e = ctx.emit
    centered = e.op("Sub", [dxhat, e.reduce_mean(dxhat, axes)])
    along = e.op("Mul", [xhat, e.reduce_mean(e.op("Mul", [dxhat, xhat]), axes)])
    return e.op("Mul", [inv_std, e.op("Sub", [centered, along])])


def layer_norm_grad(ctx):
    """Uses the node's Mean and InvStdDev outputs (added when missing) instead of recomputing them."""
    e, x, scale = ctx.emit, ctx.x(0), ctx.x(1)
    rank = ctx.rank(x)
    axes = list(range(normalize_axis(ctx.attr("axis", -1), rank), rank))
    mean, inv_std = ctx.ensure_output(1, "mean"), ctx.ensure_output(2, "inv_std_dev")
    stash = ctx.attr("stash_type", TensorProto.FLOAT)
    for stat in (mean, inv_std):
        ctx.info.elem[stat] = stash
    if stash != ctx.dtype(x):
        mean, inv_std = e.cast(mean, ctx.dtype(x)), e.cast(inv_std, ctx.dtype(x))
    xhat = e.op("Mul", [e.op("Sub", [x, mean]), inv_std])
    dy = ctx.dy()
    grads = [None, None, None]
    if ctx.needs(0):
        grads[0] = _normalized_input_grad(ctx, e.op("Mul", [dy, scale]), xhat, inv_std, axes)
    if ctx.needs(1):
        grads[1] = unbroadcast(ctx, e.op("Mul", [dy, xhat]), scale, ctx.dims(x))
    if ctx.needs(2):
        grads[2] = unbroadcast(ctx, dy, ctx.x(2), ctx.dims(x))
    return grads


def _channel_vector(ctx, v, rank):
    """A [C] vector as [C, 1, ...], broadcastable against [N, C, spatial...]."""
    return ctx.emit.unsqueeze(v, list(range(1, rank - 1))) if rank > 2 else v


def _is_training_batch_norm(ctx):
    if ctx.opset >= 14:
        return bool(ctx.attr("training_mode", 0))
    return len([o for o in ctx.node.output if o]) > 1


def batch_norm_grad(ctx):
    """Inference form: a per-channel affine map. Training form: batch statistics, as LayerNorm over N and spatial axes.

    The running mean and variance are statistics, not trained: they never get a gradient.
    """
    e, x, scale, dy = ctx.emit, ctx.x(0), ctx.x(1), ctx.dy()
    rank = ctx.rank(x)
    axes = [0, *range(2, rank)]
    eps = ctx.const(ctx.attr("epsilon", 1e-5), x)
    if _is_training_batch_norm(ctx):
        mean = e.reduce_mean(x, axes)
        centered = e.op("Sub", [x, mean])
        var = e.reduce_mean(e.op("Mul", [centered, centered]), axes)
        inv_std = e.op("Reciprocal", [e.op("Sqrt", [e.op("Add", [var, eps])])])
        xhat = e.op("Mul", [centered, inv_std])
    else:
        inv_std = _channel_vector(
            ctx, e.op("Reciprocal", [e.op("Sqrt", [e.op("Add", [ctx.x(4), eps])])]), rank
        )
        xhat = e.op("Mul", [e.op("Sub", [x, _channel_vector(ctx, ctx.x(3), rank)]), inv_std])
    grads = [None, None, None]
    if ctx.needs(0):
        dxhat = e.op("Mul", [dy, _channel_vector(ctx, scale, rank)])
        if _is_training_batch_norm(ctx):
            grads[0] = _normalized_input_grad(ctx, dxhat, xhat, inv_std, axes)
        else:
            grads[0] = e.op("Mul", [dxhat, inv_std])
    if ctx.needs(1):
        grads[1] = e.reduce_sum(e.op("Mul", [dy, xhat]), axes, keepdims=False)
    if ctx.needs(2):
        grads[2] = e.reduce_sum(dy, axes, keepdims=False)
    return grads


def instance_norm_grad(ctx):
    """Normalisation over the spatial axes of each (sample, channel), then a per-channel affine map."""
    e, x, scale, dy = ctx.emit, ctx.x(0), ctx.x(1), ctx.dy()
    rank = ctx.rank(x)
    axes = list(range(2, rank))
    mean = e.reduce_mean(x, axes)
    centered = e.op("Sub", [x, mean])
    var = e.reduce_mean(e.op("Mul", [centered, centered]), axes)
    inv_std = e.op(
        "Reciprocal", [e.op("Sqrt", [e.op("Add", [var, ctx.const(ctx.attr("epsilon", 1e-5), x)])])]
    )
    xhat = e.op("Mul", [centered, inv_std])
    grads = [None, None, None]
    if ctx.needs(0):
        dxhat = e.op("Mul", [dy, _channel_vector(ctx, scale, rank)])
        grads[0] = _normalized_input_grad(ctx, dxhat, xhat, inv_std, axes)
    if ctx.needs(1):
        grads[1] = e.reduce_sum(e.op("Mul", [dy, xhat]), [0, *axes], keepdims=False)
    if ctx.needs(2):
        grads[2] = e.reduce_sum(dy, [0, *axes], keepdims=False)
    return grads


def group_norm_grad(ctx):
    """Normalise x viewed as [N, G, -1]; scale and bias are per group at opset 18, per channel from 21."""
    e, x, scale, dy = ctx.emit, ctx.x(0), ctx.x(1), ctx.dy()
    rank, groups = ctx.rank(x), ctx.attr("num_groups")
    grouped = e.ints([0, groups, -1])
    xg = e.op("Reshape", [x, grouped])
    mean = e.reduce_mean(xg, [2])
    centered = e.op("Sub", [xg, mean])
    var = e.reduce_mean(e.op("Mul", [centered, centered]), [2])
    inv_std = e.op(
        "Reciprocal", [e.op("Sqrt", [e.op("Add", [var, ctx.const(ctx.attr("epsilon", 1e-5), x)])])]
    )
    xhat = e.op("Mul", [centered, inv_std])
    dyg = e.op("Reshape", [dy, grouped])
    per_channel = ctx.opset >= 21
    grads = [None, None, None]
    if ctx.needs(0):
        if per_channel:
            dxhat = e.op("Reshape", [e.op("Mul", [dy, _channel_vector(ctx, scale, rank)]), grouped])
        else:
            dxhat = e.op("Mul", [dyg, e.unsqueeze(scale, [1])])
        grads[0] = e.reshape_like(_normalized_input_grad(ctx, dxhat, xhat, inv_std, [2]), x)
    if per_channel:
        axes = [0, *range(2, rank)]
        if ctx.needs(1):
            grads[1] = e.reduce_sum(e.op("Mul", [dy, e.reshape_like(xhat, x)]), axes, keepdims=False)
        if ctx.needs(2):
            grads[2] = e.reduce_sum(dy, axes, keepdims=False)
    else:
        if ctx.needs(1):
            grads[1] = e.reduce_sum(e.op("Mul", [dyg, xhat]), [0, 2], keepdims=False)
        if ctx.needs(2):
            grads[2] = e.reduce_sum(dyg, [0, 2], keepdims=False)
    return grads
