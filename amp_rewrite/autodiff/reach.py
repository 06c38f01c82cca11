"""Why a loss has no gradient path to its sources: the ops where the path is cut.

A loss can depend on a weight only through ops that pass no gradient: an op without a rule whose
output is an integer (ArgMax, Cast to int64), a slot its rule calls non-differentiable (Gather's
indices, Where's condition), or a stop-gradient. Walking the plain data path (every input) from
the loss back to the sources and keeping the nodes where the differentiable walk stops names them.
"""

from __future__ import annotations

import onnx

from amp_rewrite import ir
from amp_rewrite.autodiff.graphinfo import TypeInfo
from amp_rewrite.autodiff.registry import lookup


def cut_nodes(model: onnx.ModelProto, loss: str, sources, stops=()) -> list[str]:
    """'ArgMax (node 'am'): no gradient rule' for each node on a loss-to-source path that the
    gradient cannot cross, in graph order."""
    graph = model.graph
    producer = ir.producers(node.output for node in graph.node)
    ancestors, stack = set(), [loss]
    while stack:  # everything the loss depends on at all
        name = stack.pop()
        if name not in ancestors:
            ancestors.add(name)
            if name in producer:
                stack.extend(n for n in graph.node[producer[name]].input if n)
    sourced = set(sources) & ancestors
    for node in graph.node:  # what depends on a source and feeds the loss (topological order)
        if any(n in sourced for n in node.input):
            sourced.update(o for o in node.output if o in ancestors)
    info = TypeInfo.of(model)
    stops = set(stops)
    cuts = []
    for node in graph.node:
        slots = [s for s, n in enumerate(node.input) if n in sourced]
        if not slots or not any(o in sourced for o in node.output):
            continue
        rule = lookup(node)
        why = None
        if any(node.input[s] in stops for s in slots):
            why = "a stop-gradient input"
        elif rule is not None and not any(rule.carries(s) for s in slots):
            why = "its rule passes no gradient to that input"
        elif not any(info.is_float(o) for o in node.output if o in sourced):
            why = "no gradient rule (integer output)" if rule is None else "integer output"
        elif rule is None:
            why = "no gradient rule"
        if why:
            cuts.append(f"{node.op_type} (node {node.name!r}): {why}")
    return cuts
