"""Loss ops: SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss (MSE is built from primitives)."""

from __future__ import annotations

from onnx import TensorProto


def _per_sample_factor(ctx, target, weight):
    """(one_hot(target), g) with loss = sum_i -g_i * input[i, target_i] locally, i.e. g_i = w_i * dY_i / norm.

    w_i is weight[target_i] (1 without weights) and 0 where target_i == ignore_index; `mean`
    divides by sum(w_i), as the ONNX definition does.
    """
    e = ctx.emit
    scores = ctx.x(0)
    elem = ctx.dtype(scores)
    rank = ctx.rank(scores)
    ignore = ctx.attr("ignore_index")
    safe_target, valid = target, None
    if ignore is not None:
        valid = e.op("Not", [e.op("Equal", [target, e.const(ignore, ctx.dtype(target))])])
        safe_target = e.op("Where", [valid, target, e.const(0, ctx.dtype(target))])
    if weight:
        w = e.op("Gather", [weight, safe_target])
    else:
        w = e.ones_of_shape(e.shape(target), elem)
    if valid is not None:
        w = e.op("Mul", [w, e.cast(valid, elem)])
    reduction = ctx.attr("reduction", "mean")
    dy = ctx.dy(0)
    g = e.op("Mul", [w, dy])  # dY is a scalar for sum/mean, per sample for none
    if reduction == "mean":
        g = e.op("Div", [g, e.op("ReduceSum", [w], keepdims=0)])
    classes = e.op(
        "Range",
        [
            e.const(0, TensorProto.INT64),
            e.op("Gather", [e.shape(scores), e.const(1, TensorProto.INT64)]),
            e.const(1, TensorProto.INT64),
        ],
    )
    classes = e.op("Reshape", [classes, e.ints([1, -1, *([1] * (rank - 2))])])
    target64 = (
        safe_target if ctx.dtype(target) == TensorProto.INT64 else e.cast(safe_target, TensorProto.INT64)
    )
    one_hot = e.cast(e.op("Equal", [e.unsqueeze(target64, [1]), classes]), elem)
    return one_hot, e.unsqueeze(g, [1])


def nll_loss_grad(ctx):
    """-one_hot(target) * w_i * dY (divided by sum(w) for mean)."""
    one_hot, g = _per_sample_factor(ctx, ctx.x(1), ctx.x(2))
    return [ctx.emit.op("Neg", [ctx.emit.op("Mul", [one_hot, g])])]


def softmax_cross_entropy_grad(ctx):
    """(softmax - one_hot) * w_i * dY, from the node's log_prob output (added when missing);
    plus the LogSoftmax gradient when log_prob itself is used downstream."""
    e = ctx.emit
    log_prob = ctx.ensure_output(1, "log_prob")
    ctx.info.copy_from(log_prob, ctx.x(0))
    prob = e.op("Exp", [log_prob])
    grad = None
    if ctx.dy(0):
        one_hot, g = _per_sample_factor(ctx, ctx.x(1), ctx.x(2))
        grad = e.op("Mul", [e.op("Sub", [prob, one_hot]), g])
    if ctx.dy(1):
        dlp = ctx.dy(1)
        through_log_prob = e.op("Sub", [dlp, e.op("Mul", [prob, e.reduce_sum(dlp, [1])])])
        grad = through_log_prob if grad is None else e.op("Add", [grad, through_log_prob])
    return [grad]
