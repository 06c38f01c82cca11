"""Nodes that must compute in the colour of another node (`RewriteOptions.colour_as`).

A caller that copies nodes (training's recomputation copies forward nodes into the backward) needs
each copy to compute what its original computes. The colouring passes see a copy among other
neighbours than its original's, so left alone it can come out float32 where its original is
float16. After painting, each named node's type groups take the colour of the same groups of the
node it follows (the materialiser casts wherever colours meet, so any colouring is valid; a copy
has its original's op and groups, so a colour the original may have, the copy may have).
"""

from __future__ import annotations

from types import MappingProxyType

from amp_rewrite.analysis.graph import ColouringGraph
from amp_rewrite.plan import Plan, Reason, Step


def follow(cg: ColouringGraph, plan: Plan, colour_as) -> Plan:
    """The plan with each node of `colour_as` ({node: node it follows}, main graph) coloured as
    the node it follows; unchanged when empty."""
    if not colour_as:
        return plan
    main = {
        (vertex.name, vertex.op_type, vertex.group.type_param): v
        for v, vertex in enumerate(cg.vertices)
        if vertex.scope == 0 and vertex.name
    }
    colours, reasons = dict(plan.colour), dict(plan.reason)
    for (name, op_type, param), v in main.items():
        followed = colour_as.get(name)
        original = None if followed is None else main.get((followed, op_type, param))
        if original is not None and colours[v] != colours[original]:
            colours[v] = colours[original]
            reasons[v] = Reason(Step.COLOURED_AS, original)
    return Plan(MappingProxyType(colours), MappingProxyType(reasons))
