"""Matrix products: MatMul (numpy semantics, batch broadcasting), Gemm and Einsum."""

from __future__ import annotations

import re

from onnx import TensorProto

from amp_rewrite.autodiff.rules._common import unbroadcast, unbroadcast_at_runtime


def matmul_grad(ctx):
    """dA = dY @ B^T and dB = A^T @ dY, with 1-D operands promoted and batch axes un-broadcast."""
    e = ctx.emit
    a, b, dy = ctx.x(0), ctx.x(1), ctx.dy()
    a_dims, b_dims, y_dims = ctx.dims(a), ctx.dims(b), ctx.dims(ctx.y())
    if (
        (a_dims is None or y_dims is None or len(a_dims) > 2)
        and b_dims is not None
        and len(b_dims) == 2
        and all(isinstance(d, int) for d in b_dims)
    ):
        return _matmul_by_matrix_grad(ctx, a, b, dy, b_dims)
    if a_dims is None or b_dims is None or y_dims is None:
        raise ctx.error("the ranks of both operands must be known")
    if len(a_dims) == 1 and len(b_dims) == 1:  # a dot product
        return [
            e.op("Mul", [dy, b]) if ctx.needs(0) else None,
            e.op("Mul", [dy, a]) if ctx.needs(1) else None,
        ]
    # promote 1-D operands to matrices, as numpy does, and give dY the matching unit axes
    if len(a_dims) == 1:
        a, a_dims, dy, y_dims = (
            e.unsqueeze(a, [0]),
            [1, *a_dims],
            e.unsqueeze(dy, [-2]),
            [*y_dims[:-1], 1, *y_dims[-1:]],
        )
    if len(b_dims) == 1:
        b, b_dims, dy, y_dims = e.unsqueeze(b, [1]), [*b_dims, 1], e.unsqueeze(dy, [-1]), [*y_dims, 1]
    grads = [None, None]
    if ctx.needs(0):
        da = e.op("MatMul", [dy, e.transpose_last_two(b, len(b_dims))])
        da_dims = [*y_dims[:-1], b_dims[-2]]
        da = unbroadcast(ctx, da, a, da_dims, a_dims)
        grads[0] = da if a == ctx.x(0) else e.reshape_like(da, ctx.x(0))
    if ctx.needs(1):
        db = e.op("MatMul", [e.transpose_last_two(a, len(a_dims)), dy])
        db_dims = [*y_dims[:-2], a_dims[-1], y_dims[-1]]
        db = unbroadcast(ctx, db, b, db_dims, b_dims)
        grads[1] = db if b == ctx.x(1) else e.reshape_like(db, ctx.x(1))
    return grads


def _matmul_by_matrix_grad(ctx, a, b, dy, b_dims):
    """A of rank >= 2 (known or not) times a [K, N] matrix, as a Linear layer: dA = dY @ B^T; dB
    over every row of A flattened, A[-1, K]^T @ dY[-1, N]: one matrix product, no rank needed, and
    no [batch, K, N] stack of per-batch products to sum (500 MB for a BERT's decoder at batch 16)."""
    e = ctx.emit
    k, n = b_dims
    grads = [None, None]
    if ctx.needs(0):
        grads[0] = e.op("MatMul", [dy, e.op("Transpose", [b], perm=[1, 0])])
    if ctx.needs(1):
        rows = e.op("Reshape", [a, e.const([-1, k], TensorProto.INT64)])
        grads[1] = e.op(
            "MatMul",
            [
                e.op("Transpose", [rows], perm=[1, 0]),
                e.op("Reshape", [dy, e.const([-1, n], TensorProto.INT64)]),
            ],
        )
    return grads


def gemm_grad(ctx):
    """Y = alpha*op(A)@op(B) + beta*C: each operand's gradient is one Gemm with the right transposes."""
    e = ctx.emit
    a, b, c, dy = ctx.x(0), ctx.x(1), ctx.x(2), ctx.dy()
    alpha, beta = ctx.attr("alpha", 1.0), ctx.attr("beta", 1.0)
    ta, tb = ctx.attr("transA", 0), ctx.attr("transB", 0)
    grads = [None, None, None]
    if ctx.needs(0):  # dA = alpha * dY @ op(B)^T, transposed back when A was
        grads[0] = (
            e.op("Gemm", [b, dy], alpha=alpha, transA=tb, transB=1)
            if ta
            else e.op("Gemm", [dy, b], alpha=alpha, transA=0, transB=1 - tb)
        )
    if ctx.needs(1):  # dB = alpha * op(A)^T @ dY, transposed back when B was
        grads[1] = (
            e.op("Gemm", [dy, a], alpha=alpha, transA=1, transB=ta)
            if tb
            else e.op("Gemm", [a, dy], alpha=alpha, transA=1 - ta, transB=0)
        )
    if ctx.needs(2):
        scaled = dy if beta == 1.0 else e.op("Mul", [dy, ctx.const(beta, c)])
        grads[2] = unbroadcast(ctx, scaled, c, ctx.dims(ctx.y()))
    return grads


_TERM = re.compile(r"\.\.\.|[A-Za-z]")


def _parse_einsum(equation: str) -> tuple[list[list[str]], list[str]]:
    """Terms as lists of letters ('...' kept as one token); an implicit output is made explicit."""
    equation = equation.replace(" ", "")
    lhs, _, rhs = equation.partition("->")
    inputs = [_TERM.findall(term) for term in lhs.split(",")]
    if "->" not in equation:
        letters = [t for term in inputs for t in term if t != "..."]
        once = sorted(t for t in set(letters) if letters.count(t) == 1)
        rhs_terms = (["..."] if any("..." in term for term in inputs) else []) + once
    else:
        rhs_terms = _TERM.findall(rhs)
    return inputs, rhs_terms


def einsum_grad(ctx):
    """d input_i = einsum(dY, other inputs -> term_i); letters summed only in term_i are broadcast back."""
    e = ctx.emit
    terms, out = _parse_einsum(ctx.attr("equation"))
    grads = []
    for i, term in enumerate(terms):
        if not ctx.needs(i):
            grads.append(None)
            continue
        if len(set(term)) != len(term):
            raise ctx.error(f"repeated subscript in '{''.join(term)}' (a diagonal) is not supported")
        others = [t for j, t in enumerate(terms) if j != i]
        available = set(out).union(*others) if others else set(out)
        kept = [t for t in term if t in available]
        equation = ",".join("".join(t) for t in [out, *others]) + "->" + "".join(kept)
        g = e.op(
            "Einsum", [ctx.dy(), *[x for j, x in enumerate(ctx.node.input) if j != i]], equation=equation
        )
        if len(kept) != len(term):  # letters summed away inside this operand alone: broadcast back
            g = e.unsqueeze(g, [k for k, t in enumerate(term) if t not in available])
            g = e.op("Expand", [g, e.shape(ctx.x(i))])
        if "..." in term:  # the ellipsis may have been broadcast against other operands
            g = unbroadcast_at_runtime(ctx, g, ctx.x(i))
        grads.append(g)
    return grads
