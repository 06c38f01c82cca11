"""Elementwise arithmetic and activations: the local derivative times dY, un-broadcast."""

from __future__ import annotations

import math

from amp_rewrite.autodiff.context import GradContext
from amp_rewrite.autodiff.rules._common import unbroadcast


def _binary(ctx: GradContext, grad_a, grad_b):
    """Un-broadcast the gradients of a two-input broadcasting op; skip inputs that need none."""
    a, b = ctx.x(0), ctx.x(1)
    return [
        unbroadcast(ctx, grad_a(), a, ctx.dims(ctx.y())) if ctx.needs(0) else None,
        unbroadcast(ctx, grad_b(), b, ctx.dims(ctx.y())) if ctx.needs(1) else None,
    ]


def add_grad(ctx):
    """d(a+b) = dY for both, summed over broadcast axes."""
    return _binary(ctx, ctx.dy, ctx.dy)


def sub_grad(ctx):
    """d(a-b): dY and -dY."""
    return _binary(ctx, ctx.dy, lambda: ctx.emit.op("Neg", [ctx.dy()]))


def mul_grad(ctx):
    """d(a*b): dY*b and dY*a."""
    e = ctx.emit
    return _binary(ctx, lambda: e.op("Mul", [ctx.dy(), ctx.x(1)]), lambda: e.op("Mul", [ctx.dy(), ctx.x(0)]))


def div_grad(ctx):
    """d(a/b): dY/b and -dY*y/b."""
    e = ctx.emit
    return _binary(
        ctx,
        lambda: e.op("Div", [ctx.dy(), ctx.x(1)]),
        lambda: e.op("Neg", [e.op("Div", [e.op("Mul", [ctx.dy(), ctx.y()]), ctx.x(1)])]),
    )


def pow_grad(ctx):
    """d(a^b): dY*b*a^(b-1) and dY*y*log(a) (the latter only where a > 0)."""
    e = ctx.emit
    a, b, y = ctx.x(0), ctx.x(1), ctx.y()
    b_as_a = b if ctx.dtype(b) == ctx.dtype(a) else e.cast(b, ctx.dtype(a))

    def grad_a():
        power = e.op("Pow", [a, e.op("Sub", [b_as_a, ctx.const(1, a)])])
        return e.op("Mul", [ctx.dy(), e.op("Mul", [b_as_a, power])])

    return _binary(ctx, grad_a, lambda: e.op("Mul", [e.op("Mul", [ctx.dy(), y]), e.op("Log", [a])]))


def _unary(local):
    """The rule of a one-input op whose gradient is dY * local(ctx, emit, x, y)."""

    def rule(ctx):
        return [ctx.emit.op("Mul", [ctx.dy(), local(ctx, ctx.emit, ctx.x(0), ctx.y())])]

    rule.__doc__, rule.__name__ = local.__doc__, local.__name__
    return rule


def _derivative_of_x(op_type: str, name: str, doc: str):
    """The rule of a one-input op whose local derivative is another op (`op_type`) of x."""

    def local(ctx, e, x, y):
        return e.op(op_type, [x])

    local.__doc__, local.__name__ = doc, name
    return _unary(local)


log_grad = _derivative_of_x("Reciprocal", "log_grad", "dY/x.")
sin_grad = _derivative_of_x("Cos", "sin_grad", "dY*cos(x).")
sinh_grad = _derivative_of_x("Cosh", "sinh_grad", "dY*cosh(x).")
cosh_grad = _derivative_of_x("Sinh", "cosh_grad", "dY*sinh(x).")
abs_grad = _derivative_of_x("Sign", "abs_grad", "dY*sign(x).")
softplus_grad = _derivative_of_x("Sigmoid", "softplus_grad", "dY*sigmoid(x).")


@_unary
def exp_grad(ctx, e, x, y):
    """dY*y."""
    return y


@_unary
def sqrt_grad(ctx, e, x, y):
    """dY*0.5/y."""
    return e.op("Div", [ctx.const(0.5, x), y])


@_unary
def reciprocal_grad(ctx, e, x, y):
    """-dY*y^2."""
    return e.op("Neg", [e.op("Mul", [y, y])])


@_unary
def tanh_grad(ctx, e, x, y):
    """dY*(1-y^2)."""
    return e.op("Sub", [ctx.const(1, x), e.op("Mul", [y, y])])


@_unary
def sigmoid_grad(ctx, e, x, y):
    """dY*y*(1-y)."""
    return e.op("Mul", [y, e.op("Sub", [ctx.const(1, x), y])])


@_unary
def erf_grad(ctx, e, x, y):
    """dY*2/sqrt(pi)*exp(-x^2)."""
    return e.op(
        "Mul", [ctx.const(2 / math.sqrt(math.pi), x), e.op("Exp", [e.op("Neg", [e.op("Mul", [x, x])])])]
    )


@_unary
def cos_grad(ctx, e, x, y):
    """-dY*sin(x)."""
    return e.op("Neg", [e.op("Sin", [x])])


@_unary
def tan_grad(ctx, e, x, y):
    """dY*(1+y^2)."""
    return e.op("Add", [ctx.const(1, x), e.op("Mul", [y, y])])


@_unary
def atan_grad(ctx, e, x, y):
    """dY/(1+x^2)."""
    return e.op("Reciprocal", [e.op("Add", [ctx.const(1, x), e.op("Mul", [x, x])])])


@_unary
def softsign_grad(ctx, e, x, y):
    """dY/(1+|x|)^2."""
    d = e.op("Add", [ctx.const(1, x), e.op("Abs", [x])])
    return e.op("Reciprocal", [e.op("Mul", [d, d])])


@_unary
def mish_grad(ctx, e, x, y):
    """dY*(tanh(sp) + x*sigmoid(x)*(1-tanh(sp)^2)), sp = softplus(x)."""
    t = e.op("Tanh", [e.op("Softplus", [x])])
    one_minus_t2 = e.op("Sub", [ctx.const(1, x), e.op("Mul", [t, t])])
    return e.op("Add", [t, e.op("Mul", [e.op("Mul", [x, e.op("Sigmoid", [x])]), one_minus_t2])])


def _where_positive(ctx, x, if_pos: str, if_not: str) -> str:
    return ctx.emit.op("Where", [ctx.emit.op("Greater", [x, ctx.const(0, x)]), if_pos, if_not])


def relu_grad(ctx):
    """dY times (y > 0) as 1 or 0. y > 0 exactly where x > 0; reading y leaves x to the forward
    alone, so ONNX Runtime fuses the Gemm or Conv before it with the Relu, and x is not kept.
    Cast and Mul rather than Where: ONNX Runtime's CPU Where is slower (3.5 vs 2.4 ms on 1.6M
    floats at one thread); the same values, 0 as -0 where dY < 0."""
    y, e = ctx.y(), ctx.emit
    return [e.op("Mul", [ctx.dy(), e.cast(e.op("Greater", [y, ctx.const(0, y)]), ctx.dtype(y))])]


def leaky_relu_grad(ctx):
    """dY where x > 0, else alpha*dY."""
    x = ctx.x(0)
    alpha = ctx.const(ctx.attr("alpha", 0.01), x)
    return [_where_positive(ctx, x, ctx.dy(), ctx.emit.op("Mul", [ctx.dy(), alpha]))]


def elu_grad(ctx):
    """dY where x > 0, else dY*(y+alpha)."""
    x, e = ctx.x(0), ctx.emit
    slope = e.op("Add", [ctx.y(), ctx.const(ctx.attr("alpha", 1.0), x)])
    return [_where_positive(ctx, x, ctx.dy(), e.op("Mul", [ctx.dy(), slope]))]


def selu_grad(ctx):
    """dY*gamma where x > 0, else dY*(y+alpha*gamma)."""
    x, e = ctx.x(0), ctx.emit
    alpha, gamma = ctx.attr("alpha", 1.67326319217681884765625), ctx.attr("gamma", 1.05070102214813232421875)
    pos = e.op("Mul", [ctx.dy(), ctx.const(gamma, x)])
    neg = e.op("Mul", [ctx.dy(), e.op("Add", [ctx.y(), ctx.const(alpha * gamma, x)])])
    return [_where_positive(ctx, x, pos, neg)]


def celu_grad(ctx):
    """dY where x > 0, else dY*exp(x/alpha)."""
    x, e = ctx.x(0), ctx.emit
    neg = e.op("Mul", [ctx.dy(), e.op("Exp", [e.op("Div", [x, ctx.const(ctx.attr("alpha", 1.0), x)])])])
    return [_where_positive(ctx, x, ctx.dy(), neg)]


def thresholded_relu_grad(ctx):
    """dY where x > alpha, else 0."""
    x, e = ctx.x(0), ctx.emit
    above = e.op("Greater", [x, ctx.const(ctx.attr("alpha", 1.0), x)])
    return [e.op("Where", [above, ctx.dy(), ctx.const(0, x)])]


def hard_sigmoid_grad(ctx):
    """dY*alpha inside the linear band 0 < alpha*x+beta < 1, else 0."""
    x, e = ctx.x(0), ctx.emit
    alpha, beta = ctx.attr("alpha", 0.2), ctx.attr("beta", 0.5)
    z = e.op("Add", [e.op("Mul", [x, ctx.const(alpha, x)]), ctx.const(beta, x)])
    band = e.op("And", [e.op("Greater", [z, ctx.const(0, x)]), e.op("Less", [z, ctx.const(1, x)])])
    return [e.op("Where", [band, e.op("Mul", [ctx.dy(), ctx.const(alpha, x)]), ctx.const(0, x)])]


def hard_swish_grad(ctx):
    """dY*(x/3 + 0.5) for -3 < x < 3, dY for x >= 3, else 0."""
    x, e = ctx.x(0), ctx.emit
    inner = e.op("Add", [e.op("Div", [x, ctx.const(3, x)]), ctx.const(0.5, x)])
    inside = e.op("And", [e.op("Greater", [x, ctx.const(-3, x)]), e.op("Less", [x, ctx.const(3, x)])])
    above = e.op("Where", [e.op("Less", [x, ctx.const(3, x)]), ctx.const(0, x), ctx.const(1, x)])
    return [e.op("Mul", [ctx.dy(), e.op("Where", [inside, inner, above])])]


def prelu_grad(ctx):
    """x: dY where x > 0 else slope*dY; slope: dY*x where x <= 0, un-broadcast to the slope's shape."""
    x, slope, e = ctx.x(0), ctx.x(1), ctx.emit
    zero = ctx.const(0, x)
    positive = e.op("Greater", [x, zero])
    grads = [None, None]
    if ctx.needs(0):
        grads[0] = unbroadcast(
            ctx, e.op("Where", [positive, ctx.dy(), e.op("Mul", [ctx.dy(), slope])]), x, ctx.dims(ctx.y())
        )
    if ctx.needs(1):
        grads[1] = unbroadcast(
            ctx, e.op("Where", [positive, zero, e.op("Mul", [ctx.dy(), x])]), slope, ctx.dims(ctx.y())
        )
    return grads


_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)


def gelu_grad(ctx):
    """Exact: Phi(x) + x*phi(x). Tanh form: 0.5(1+t) + 0.5x(1-t^2)*sqrt(2/pi)(1+3*0.044715x^2)."""
    return [_gelu_derivative(ctx, ctx.attr("approximate", "none") == "tanh")]


def fast_gelu_grad(ctx):
    """Gelu's tanh form (com.microsoft FastGelu without bias, as `gelu_fusion` writes it)."""
    if len(ctx.node.input) > 1 and ctx.node.input[1]:
        raise ctx.error("a bias input is not supported (decompose_contrib_ops writes it out)")
    return [_gelu_derivative(ctx, True)]


def _gelu_derivative(ctx, tanh: bool) -> str:
    """dY * d gelu(x)/dx, from x alone (no forward intermediate is kept for it)."""
    x, e = ctx.x(0), ctx.emit
    c = lambda v: ctx.const(v, x)  # noqa: E731 - a constant of x's type
    if tanh:
        x2 = e.op("Mul", [x, x])
        u = e.op(
            "Mul", [c(_SQRT_2_OVER_PI), e.op("Add", [x, e.op("Mul", [c(0.044715), e.op("Mul", [x2, x])])])]
        )
        t = e.op("Tanh", [u])
        du = e.op("Mul", [c(_SQRT_2_OVER_PI), e.op("Add", [c(1), e.op("Mul", [c(3 * 0.044715), x2])])])
        left = e.op("Mul", [c(0.5), e.op("Add", [c(1), t])])
        right = e.op(
            "Mul", [e.op("Mul", [c(0.5), x]), e.op("Mul", [e.op("Sub", [c(1), e.op("Mul", [t, t])]), du])]
        )
    else:
        cdf = e.op("Mul", [c(0.5), e.op("Add", [c(1), e.op("Erf", [e.op("Mul", [x, c(1 / math.sqrt(2))])])])])
        pdf = e.op(
            "Mul", [c(1 / math.sqrt(2 * math.pi)), e.op("Exp", [e.op("Mul", [e.op("Mul", [x, x]), c(-0.5)])])]
        )
        left, right = cdf, e.op("Mul", [x, pdf])
    return e.op("Mul", [ctx.dy(), e.op("Add", [left, right])])


def neg_grad(ctx):
    """-dY."""
    return [ctx.emit.op("Neg", [ctx.dy()])]


def identity_grad(ctx):
    """dY."""
    return [ctx.dy()]


def cast_grad(ctx):
    """dY cast back to the input's type (only float-to-float casts carry a gradient)."""
    x = ctx.x(0)
    return [ctx.dy() if ctx.dtype(x) == ctx.dtype(ctx.y()) else ctx.emit.cast(ctx.dy(), ctx.dtype(x))]


def zero_grad(ctx):
    """Zero (piecewise constant: Floor, Ceil, Round, Sign)."""
    return [None]


def clip_grad(ctx):
    """dY where min <= x <= max, else 0 (bounds are constants, not trained)."""
    x, e = ctx.x(0), ctx.emit
    inside = None
    for bound, op in ((ctx.x(1), "GreaterOrEqual"), (ctx.x(2), "LessOrEqual")):
        if bound:
            test = e.op(op, [x, bound])
            inside = test if inside is None else e.op("And", [inside, test])
    return [ctx.dy() if inside is None else e.op("Where", [inside, ctx.dy(), ctx.const(0, x)])]


def select_grads(ctx: GradContext):
    """Min/Max: each input gets dY where it is the extreme, split evenly between ties. The inputs
    are compared with each other, not with the result: a mixed-precision step compares a float32
    input with the result its float16 op rounded, which matches almost nothing (openwakeword's
    embedding clamps with Max after every conv: the gradient below nearly vanished in float16). The
    count is at least 1 (a NaN input wins no comparison)."""
    e, y, inputs = ctx.emit, ctx.y(), list(ctx.node.input)
    if len(inputs) == 1:
        return [ctx.dy()]
    compare = "GreaterOrEqual" if ctx.node.op_type == "Max" else "LessOrEqual"
    hits = []
    for i, x in enumerate(inputs):
        wins = [e.op(compare, [x, other]) for j, other in enumerate(inputs) if j != i]
        for other in wins[1:]:
            wins[0] = e.op("And", [wins[0], other])
        hits.append(e.op("Cast", [wins[0]], to=ctx.dtype(y)))
    count = e.op("Max", [e.op("Sum", hits), ctx.const(1, y)])
    share = e.op("Div", [ctx.dy(), count])
    return [
        unbroadcast(ctx, e.op("Mul", [share, hit]), x, ctx.dims(y)) if ctx.needs(i) else None
        for i, (x, hit) in enumerate(zip(inputs, hits))
    ]


def sum_grad(ctx):
    """dY to every input, un-broadcast."""
    return [
        unbroadcast(ctx, ctx.dy(), x, ctx.dims(ctx.y())) if ctx.needs(i) else None
        for i, x in enumerate(ctx.node.input)
    ]


def mean_grad(ctx):
    """dY/n to every input, un-broadcast."""
    share = ctx.emit.op("Div", [ctx.dy(), ctx.const(len(ctx.node.input), ctx.y())])
    return [
        unbroadcast(ctx, share, x, ctx.dims(ctx.y())) if ctx.needs(i) else None
        for i, x in enumerate(ctx.node.input)
    ]


def where_grad(ctx):
    """dY where the condition holds to X, elsewhere to Y, each un-broadcast."""
    e, cond, y = ctx.emit, ctx.x(0), ctx.y()
    zero = ctx.const(0, y)
    grads = [None, None, None]
    if ctx.needs(1):
        grads[1] = unbroadcast(ctx, e.op("Where", [cond, ctx.dy(), zero]), ctx.x(1), ctx.dims(y))
    if ctx.needs(2):
        grads[2] = unbroadcast(ctx, e.op("Where", [cond, zero, ctx.dy()]), ctx.x(2), ctx.dims(y))
    return grads
