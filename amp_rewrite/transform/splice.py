"""Splicing: the new Casts and Constants go into the node lists, right after their producers or at
the top of their graph, and the removed nodes (noop_casts.py) leave them, with one rebuild of each
changed graph.
"""

from __future__ import annotations

from amp_rewrite.transform.state import Materialisation


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
