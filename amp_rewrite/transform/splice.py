"""Splicing: the new Casts and Constants go into the node lists, right after their producers or at
the top of their graph, and the removed nodes (noop_casts.py) leave them, with one rebuild of each
changed graph, or, for a few changes to a model without subgraphs, in place.
"""

from __future__ import annotations

from amp_rewrite.transform.state import Materialisation

# Up to this many nodes inserted or removed, a model of one graph is changed in place: each insert
# moves pointers (C), where a rebuild copies every node (0.1 s at 100k nodes). Bounded: linear.
IN_PLACE_LIMIT = 64


def emit_nodes(m: Materialisation) -> None:
    points: dict = {}  # scope -> indices of the nodes that get nodes right after them
    for s, n in m.after:
        points.setdefault(s, []).append(n)
    # Children first: re-adding a parent's nodes copies them, subgraphs included.
    for s in reversed(range(len(m.cg.scopes))):
        scope = m.cg.scopes[s]
        gone = m.removed.get(s)
        if s not in m.top and s not in points and not gone:
            continue
        if len(m.cg.scopes) == 1 and _changes(m, s, points.get(s, ()), gone) <= IN_PLACE_LIMIT:
            _splice_in_place(m, s, points.get(s, ()), gone or ())
            continue
        old = list(scope.graph.node)
        if gone:  # the indices stay those of the graph as read: a removed node leaves a hole
            old = [None if n in gone else node for n, node in enumerate(old)]
        nodes = list(m.top.get(s, []))
        start = 0
        for n in sorted(points.get(s, ())):  # spliced: one step per insertion point, not per node
            nodes.extend(old[start : n + 1])
            nodes.extend(m.after[(s, n)])
            start = n + 1
        nodes.extend(old[start:])
        if gone:
            nodes = [node for node in nodes if node is not None]
        del scope.graph.node[:]
        scope.graph.node.extend(nodes)


def _changes(m: Materialisation, s: int, points, gone) -> int:
    """Nodes graph `s` gains or loses."""
    return len(m.top.get(s, ())) + sum(len(m.after[(s, n)]) for n in points) + len(gone or ())


def _splice_in_place(m: Materialisation, s: int, points, gone) -> None:
    """`emit_nodes`' result, by inserts and deletes from the last index to the first, so the
    indices as read stay valid until used."""
    nodes = m.cg.scopes[s].graph.node
    for n in sorted({*points, *gone}, reverse=True):
        for k, node in enumerate(m.after.get((s, n), ())):
            nodes.insert(n + 1 + k, node)
        if n in gone:
            del nodes[n]
    for k, node in enumerate(m.top.get(s, ())):
        nodes.insert(k, node)
