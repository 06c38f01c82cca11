"""Recomputed copies take the colour of their forward originals.

`autodiff.recompute` names each copy `<original>/recompute` and records its plan in the model's
metadata. The colouring passes see a copy among backward nodes rather than forward ones (a residual
Add between two MatMuls in the forward may lead only to a LayerNorm gradient in the backward), so
left alone a copy can come out float32 where its original is float16: it would then compute other
values than the forward did. After painting, each copy's type groups take their original's colour
(the materialiser casts wherever colours meet, so any colouring is valid; the copy's op and groups
are the original's, so a colour the original may have, the copy may have).
"""

from __future__ import annotations

from types import MappingProxyType

from amp_rewrite.analysis.graph import ColouringGraph
from amp_rewrite.plan import Plan, Reason, Step

PLAN_KEY = "amp_rewrite.recompute"  # autodiff.recompute.PLAN_KEY (no import: a lower layer)
COPY_SUFFIX = "/recompute"


def follow_originals(model, cg: ColouringGraph, plan: Plan) -> Plan:
    """The plan with every copy's groups coloured as its original's; unchanged without recompute."""
    if not any(p.key == PLAN_KEY for p in model.metadata_props):
        return plan
    main = {(vertex.name, vertex.op_type, vertex.group.type_param): v
            for v, vertex in enumerate(cg.vertices) if vertex.scope == 0 and vertex.name}
    colours, reasons = dict(plan.colour), dict(plan.reason)
    for (name, op_type, param), v in main.items():
        if not name.endswith(COPY_SUFFIX):
            continue
        original = main.get((name[: -len(COPY_SUFFIX)], op_type, param))
        if original is not None and colours[v] != colours[original]:
            colours[v] = colours[original]
            reasons[v] = Reason(Step.RECOMPUTED_COPY, original)
    return Plan(MappingProxyType(colours), MappingProxyType(reasons))


def report_section(model) -> dict | None:
    """The recomputed segments for the rewrite report (names, nodes, recomputed tensors), or None."""
    import json

    for prop in model.metadata_props:
        if prop.key == PLAN_KEY:
            segments = json.loads(prop.value)
            return {"segments": [{"name": s["name"], "nodes": len(s["nodes"]), "recomputed": s["recomputed"],
                                  "checkpoints": s["checkpoints"]} for s in segments]}
    return None
