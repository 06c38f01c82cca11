"""Reductions and scans: the output gradient is broadcast back over the reduced axes."""

from __future__ import annotations

from amp_rewrite.autodiff.rules._common import expand_reduced, reduce_axes, reduced_with_keepdims


def _expanded(ctx):
    return expand_reduced(ctx, ctx.dy(), ctx.x(0))


def reduce_sum_grad(ctx):
    """dY broadcast over the reduced axes."""
    return [_expanded(ctx)]


def reduce_mean_grad(ctx):
    """dY broadcast over the reduced axes, divided by the count (Size(x)/Size(y), dynamic-safe)."""
    e, x = ctx.emit, ctx.x(0)
    count = e.cast(e.op("Div", [e.op("Size", [x]), e.op("Size", [ctx.y()])]), ctx.dtype(x))
    return [e.op("Div", [_expanded(ctx), count])]


def _times_expanded(local):
    def rule(ctx):
        return [
            ctx.emit.op(
                "Mul",
                [
                    _expanded(ctx),
                    local(ctx, ctx.emit, ctx.x(0), reduced_with_keepdims(ctx, ctx.y(), ctx.x(0))),
                ],
            )
        ]

    rule.__doc__, rule.__name__ = local.__doc__, local.__name__
    return rule


def _times_broadcast(local):
    """For a `local` factor of the input's shape: dY multiplies it by broadcasting, with no
    input-sized Expand of dY (the same values: one input-sized tensor less, e.g. 250 MB for a
    ReduceLogSumExp over a BERT's 16x128x30522 logits)."""

    def rule(ctx):
        x = ctx.x(0)
        return [
            ctx.emit.op(
                "Mul",
                [
                    reduced_with_keepdims(ctx, ctx.dy(), x),
                    local(ctx, ctx.emit, x, reduced_with_keepdims(ctx, ctx.y(), x)),
                ],
            )
        ]

    rule.__doc__, rule.__name__ = local.__doc__, local.__name__
    return rule


@_times_broadcast
def reduce_sum_square_grad(ctx, e, x, y):
    """dY*2x."""
    return e.op("Mul", [x, ctx.const(2, x)])


@_times_broadcast
def reduce_l1_grad(ctx, e, x, y):
    """dY*sign(x)."""
    return e.op("Sign", [x])


@_times_broadcast
def reduce_l2_grad(ctx, e, x, y):
    """dY*x/y."""
    return e.op("Div", [x, y])


@_times_broadcast
def reduce_log_sum_exp_grad(ctx, e, x, y):
    """dY*exp(x-y)."""
    return e.op("Exp", [e.op("Sub", [x, y])])


@_times_expanded
def reduce_log_sum_grad(ctx, e, x, y):
    """dY*exp(-y) (= dY/sum)."""
    return e.op("Exp", [e.op("Neg", [y])])


@_times_broadcast
def reduce_prod_grad(ctx, e, x, y):
    """dY*y/x (inputs must be non-zero)."""
    return e.op("Div", [y, x])


def select_reduce_grad(ctx):
    """dY to the elements equal to the extreme, split evenly between ties (at least 1: see
    elementwise.select_grads)."""
    e, x = ctx.emit, ctx.x(0)
    hit = e.cast(e.op("Equal", [x, reduced_with_keepdims(ctx, ctx.y(), x)]), ctx.dtype(x))
    axes = reduce_axes(ctx)
    count = e.op("ReduceSum", [hit], keepdims=1) if axes is None else e.reduce_sum(hit, axes, keepdims=True)
    count = e.op("Max", [count, ctx.const(1, x)])
    return [e.op("Mul", [_expanded(ctx), e.op("Div", [hit, count])])]


def cumsum_grad(ctx):
    """A cumulative sum in the other direction, with the same exclusive flag."""
    reverse = 1 - ctx.attr("reverse", 0)
    return [ctx.emit.op("CumSum", [ctx.dy(), ctx.x(1)], exclusive=ctx.attr("exclusive", 0), reverse=reverse)]
