"""FLOPs per compute-heavy node of the colouring graph, for the report (the estimate itself is
amp_rewrite/flops.py)."""

from __future__ import annotations

from amp_rewrite.analysis.graph import ColouringGraph
from amp_rewrite.flops import HEAVY, estimate_flops


def flops_by_node(cg: ColouringGraph) -> dict:
    """(scope, node index) -> FLOPs of compute-heavy nodes; call before materialising moves nodes."""
    out = {}
    for vertex in cg.vertices:
        key = (vertex.scope, vertex.node)
        if vertex.op_type in HEAVY and key not in out:
            inputs = cg.scopes[vertex.scope].io[vertex.node][0]
            # without the first input's shape every estimate is None: then the node is not read
            known = inputs and inputs[0] in cg.shapes
            out[key] = estimate_flops(cg.node(*key), cg.shapes) if known else None
    return out
