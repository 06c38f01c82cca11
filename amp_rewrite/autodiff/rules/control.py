"""If: the gradient flows through the branch taken, into everything the branches read from outside.

An If node's branches read their weights and activations from the enclosing graph (outer-scope
captures, which the builder counts as the node's inputs). The backward is a second If on the same
condition: each branch recomputes its forward and differentiates it with the builder itself,
seeded with the If outputs' gradients, and returns a gradient for every captured tensor that needs
one (zeros for tensors that branch does not read). Weights stored inside a branch are lifted to
the main graph first (`branches.lift_branch_weights`), so they are captures like any other.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from amp_rewrite import ir

SMALL_CONSTANT = 1024  # captured constants up to this size are visible to the branch's rules (axes, scales)


def _branch(ctx, name: str) -> onnx.GraphProto:
    return next(a.g for a in ctx.node.attribute if a.name == name)


def if_grad(ctx):
    """A second If on the same condition: each branch recomputes its forward and returns the gradients
    of everything the branches read from outside (zeros for what the other branch reads)."""
    first = len(ctx.node.input)
    wanted = [name for k, name in enumerate(ctx.inputs[first:]) if ctx.needs(first + k)]
    if not wanted:
        return []
    bodies = [_branch_backward(ctx, _branch(ctx, name), wanted) for name in ("then_branch", "else_branch")]
    outs = ctx.emit.op("If", [ctx.x(0)], len(wanted), then_branch=bodies[0], else_branch=bodies[1])
    by_name = dict(zip(wanted, outs if isinstance(outs, list) else [outs]))
    return [None] * first + [by_name.get(name) for name in ctx.inputs[first:]]


def _named(tensor: onnx.TensorProto, name: str) -> onnx.TensorProto:
    """A copy of `tensor` called `name`: a Constant node's value tensor has no name of its own."""
    copy = onnx.TensorProto()
    copy.CopyFrom(tensor)
    copy.name = name
    return copy


def _branch_backward(ctx, branch: onnx.GraphProto, wanted: list[str]) -> onnx.GraphProto:
    """The branch's forward plus its backward (builder run on the branch as a graph of its own),
    outputting d/d captured for every name in `wanted`, in order."""
    e = ctx.emit
    seeds = {out.name: ctx.dy(k) for k, out in enumerate(branch.output) if ctx.dy(k)}
    outer = list(dict.fromkeys([*ir.captures(branch), *wanted]))
    small = {
        n: _named(ctx.index.constants[n], n)
        for n in outer
        if n in ctx.index.constants
        and n not in wanted
        and np.prod(ctx.index.constants[n].dims) <= SMALL_CONSTANT
    }
    typed = lambda n: helper.make_tensor_value_info(n, ctx.dtype(n), ctx.dims(n))  # noqa: E731
    graph = helper.make_graph(
        list(branch.node),
        branch.name or "branch",
        [typed(n) for n in [*outer, *seeds.values()] if n not in small],
        list(branch.output),
        [*branch.initializer, *small.values()],
    )
    domains = {node.domain for node in branch.node if node.domain not in ("", "ai.onnx")}
    model = helper.make_model(
        graph,
        ir_version=8,
        opset_imports=[
            helper.make_opsetid("", ctx.opset),
            *(helper.make_opsetid(d, 1) for d in sorted(domains)),
        ],
    )
    names = {w: e.fresh(f"{e.scope}/{w}_grad_in_branch") for w in wanted}
    ctx.differentiate(model, wanted, seeds, names)
    body = model.graph
    kept = [t for t in body.initializer if t.name not in small]
    return helper.make_graph(
        list(body.node),
        e.fresh(f"{e.scope}/branch_backward"),
        [],
        [helper.make_tensor_value_info(names[w], ctx.dtype(w), ctx.dims(w)) for w in wanted],
        kept,
    )
