"""Resident weight bytes: why cost placement keeps a low region that has no allow op.

TF drops a low-precision region without an allow op back to float32: only an allow op's faster
arithmetic pays for the casts around it. A region that reads a float32 weight pays in memory
instead: an embedding table read by a Gather is resident whole on the device and in the file,
however few rows a step reads, and low precision halves it. So under cost placement such a
region stays low when the bytes its weights shrink by outweigh the bytes its casts move (sizes as
the cut counts them, placement.elements). A weight also read by a float32 vertex is kept in both
types (transform.constants duplicates it): its low copy adds bytes instead.
"""

from __future__ import annotations

import math

from amp_rewrite.analysis.graph import FLOAT, ColouringGraph
from amp_rewrite.analysis.placement import CAST_BYTES, FP32_BYTES, LOW_BYTES, elements, sizes
from amp_rewrite.onnx_facts import constant_tensor


def payer(cg: ColouringGraph):
    """`pays(cg, members, low)` for paint.drop_regions_without_allow, sharing the graph's size
    cache (placement.sizes) over its regions (no pass over every initializer per region)."""
    cache = sizes(cg)
    return lambda cg, members, low: region_pays(cg, members, low, cache)


def region_pays(cg: ColouringGraph, members: list, low, cache: dict | None = None) -> bool:
    """Whether the low region `members` (its vertices; `low`: every low vertex) saves more weight
    bytes than its casts move. One visit of each member's tensors."""
    inside = set(members)
    cache = {} if cache is None else cache
    weights: dict = {}  # (def scope, name) -> elements
    crossing: dict = {}  # (def scope, name) -> elements of a tensor cast at the region's edge
    for v in members:
        vertex = cg.vertices[v]
        s = vertex.scope
        inputs, outputs = cg.scopes[s].io[vertex.node]
        for x in (inputs[i] for i in vertex.group.inputs):
            if not x or cg.types.get(x) != FLOAT:
                continue
            found = cg.resolve(s, x)
            if found is None:
                continue
            kind, n, slot = found.definition
            key = (found.scope, x)
            if kind == "initializer":
                weights[key] = math.prod(cg.scopes[found.scope].initializers[x].dims)
                continue
            if kind == "node" and (found.scope, n) in cg.constant_nodes:
                tensor = constant_tensor(cg.node(found.scope, n))
                weights[key] = math.prod(tensor.dims) if tensor is not None else 1
                continue
            row = cg.writes[found.scope][n] if kind == "node" else None
            if (row[slot] if row else None) not in inside:  # made outside: a cast up
                crossing[key] = elements(cg, x, cache)
        for x in (outputs[i] for i in vertex.group.outputs):
            if x and any(_reader(cg, use) not in inside for use in cg.uses.get((s, x), ())):
                crossing[(s, x)] = elements(cg, x, cache)  # read outside: a cast down
    saved = 0
    for key, size in weights.items():
        only_low = all((r := _reader(cg, use)) is not None and r in low for use in cg.uses.get(key, ()))
        saved += size * (FP32_BYTES - LOW_BYTES) if only_low else -size * LOW_BYTES
    return saved > CAST_BYTES * sum(crossing.values())


def _reader(cg: ColouringGraph, use) -> int | None:
    """The vertex reading a use (None: a graph output or a slot no vertex reads)."""
    scope, node, slot = use
    return cg.input_vertex(scope, node, slot)
