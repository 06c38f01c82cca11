"""Layered (Sugiyama) layout of one region's items, as dot and dagre do it, in three cheap steps.

1. Layers: longest path from the sources, items in topological order (an edge against that order,
   possible between regions, is layered as if reversed); then items with no more inputs than
   outputs sink to just above their first reader, so a Shape chain sits beside the Reshape it
   feeds rather than at the top.
2. Edges spanning several layers get one dummy point per layer crossed.
3. Order within each layer: barycenter sweeps down and up, which cut most crossings.

Coordinates are left to the page, which knows the boxes' sizes (a region grows when it is
expanded). Each step is linear in items + dummies, up to the sort per layer.
"""

from __future__ import annotations

SWEEPS = 4


def _layers(count: int, edges: list) -> list[int]:
    preds: list = [[] for _ in range(count)]
    succs: list = [[] for _ in range(count)]
    for a, b, _ in edges:
        lo, hi = (a, b) if a < b else (b, a)
        preds[hi].append(lo)
        succs[lo].append(hi)
    layer = [0] * count
    for i in range(count):
        for p in preds[i]:
            if layer[p] + 1 > layer[i]:
                layer[i] = layer[p] + 1
    for _ in range(2):
        for i in reversed(range(count)):
            if succs[i] and len(preds[i]) <= len(succs[i]):
                below = min(layer[s] for s in succs[i]) - 1
                if below > layer[i]:
                    layer[i] = below
    return layer


def layout(count: int, edges: list) -> tuple[list[int], list[list[int]]]:
    """Items 0..count-1 in topological order, `edges` as (a, b, casts). Returns each item's layer
    and the layers' entries in drawing order: an item index, or ~e for a dummy point of edge e."""
    if len(edges) == count - 1 and all(b == a + 1 for a, b, _ in edges):  # a chain, as most small regions
        return list(range(count)), [[i] for i in range(count)]
    layer = _layers(count, edges)
    depth = max(layer, default=-1) + 1
    rows: list = [[] for _ in range(depth)]
    for i in range(count):
        rows[layer[i]].append(i)
    up: list = [[] for _ in range(count)]  # entry -> entries in the layer above joined to it
    down: list = [[] for _ in range(count)]
    dummy_edge = []  # entries count.. are dummy points; their edge
    for e, (a, b, _) in enumerate(edges):
        top, bottom = (a, b) if layer[a] < layer[b] else (b, a)
        previous = top
        for lay in range(layer[top] + 1, layer[bottom]):
            entry = count + len(dummy_edge)
            dummy_edge.append(e)
            rows[lay].append(entry)
            up.append([previous])
            down.append([])
            down[previous].append(entry)
            previous = entry
        down[previous].append(bottom)
        up[bottom].append(previous)
    position = [0] * len(up)
    for row in rows:
        for k, entry in enumerate(row):
            position[entry] = k
    for sweep in range(SWEEPS if depth > 1 else 0):
        neighbours = up if sweep % 2 == 0 else down
        for lay in range(1, depth) if sweep % 2 == 0 else range(depth - 2, -1, -1):
            row = rows[lay]
            if len(row) < 2:
                continue
            keys = [0.0] * len(row)
            for k, entry in enumerate(row):
                nb = neighbours[entry]
                if len(nb) == 1:
                    keys[k] = position[nb[0]]
                elif nb:
                    keys[k] = sum(position[x] for x in nb) / len(nb)
                else:
                    keys[k] = k
            row[:] = [row[k] for k in sorted(range(len(row)), key=keys.__getitem__)]
            for k, entry in enumerate(row):
                position[entry] = k
    return layer, [[x if x < count else ~dummy_edge[x - count] for x in row] for row in rows]
