"""The s-t network of cost placement and its minimum cut: capacities as adjacency dicts,
persistency (vertices whose side no cut can improve on are fixed first, `reduce_terminal`), then
one networkx Boykov-Kolmogorov cut over what is left. placement.py builds the network.
"""

from __future__ import annotations

import networkx as nx
from networkx.algorithms.flow import boykov_kolmogorov

INF = float("inf")


def add_edge(out_edges: dict, in_edges: dict, a, b, c) -> None:
    """Capacity c more on the edge a -> b, between two non-terminal vertices."""
    outs = out_edges.get(a)
    if outs is None:
        out_edges[a] = {b: c}
    else:
        outs[b] = outs.get(b, 0) + c
    ins = in_edges.get(b)
    if ins is None:
        in_edges[b] = {a: c}
    else:
        ins[a] = ins.get(a, 0) + c


class Network:
    """The cut's capacities as adjacency dicts: edges from s and to t apart (the persistency rule
    of `reduce_terminal` reads them per vertex), the rest both ways. Auxiliary vertices are
    numbered on from the colouring graph's vertices (`first_aux`), in the order they are made:
    ints hash in no time and iterate in the same order in every process (tuples of names moved
    with the hash seed, and with them which of several equal cuts persistency found)."""

    __slots__ = ("down", "first_aux", "into", "next_aux", "out", "to_s", "to_t")

    def __init__(self, first_aux: int):
        self.to_s, self.to_t, self.out, self.into = {}, {}, {}, {}
        self.first_aux = self.next_aux = first_aux
        self.down = set()  # auxiliary vertices of casts down (the rest are of casts up)

    def auxiliary(self, down: bool) -> int:
        """A new auxiliary vertex: of one tensor's cast down (`down`) or up."""
        aux = self.next_aux
        self.next_aux += 1
        if down:
            self.down.add(aux)
        return aux


def reduce_terminal(net: Network) -> tuple[dict, dict]:
    """Fix the vertices whose side no cut can improve on, before the flow (persistency): a vertex
    whose edge from s outweighs all its outgoing edges is on the source side of some minimum cut
    (moving it there cannot cost more); one whose edge to t outweighs all its incoming edges, on
    the sink side. An infinite edge to a tensor's auxiliary vertex weighs what that vertex can cost
    (its own edges on the far side): moving the reader drags the auxiliary vertex along, no more.
    A fixed vertex merges into s or t, which may fix its neighbours: a worklist, each edge moved
    once. Returns (vertex -> source side?, the remaining capacities)."""
    to_s, to_t, out_edges, in_edges = net.to_s, net.to_t, net.out, net.into
    for a in to_t:
        both = min(to_t[a], to_s.get(a, 0))  # paid whichever side: a constant, not an edge
        if both:
            to_t[a] -= both
            to_s[a] -= both
    side: dict = {}
    work = list(to_s.keys() | to_t.keys() | out_edges.keys() | in_edges.keys())
    empty = _EMPTY
    first_aux, down = net.first_aux, net.down
    pop, s_get, t_get, out_get, in_get = work.pop, to_s.get, to_t.get, out_edges.get, in_edges.get
    while work:
        v = pop()
        if v in side:
            continue
        outs, ins = out_get(v, empty), in_get(v, empty)
        source, sink = s_get(v, 0), t_get(v, 0)
        if v >= first_aux:  # an auxiliary vertex whose edges changed: its readers may now be fixed
            work.extend(outs if v in down else ins)
        weight = sum(outs.values()) if outs else 0  # _weight's common case, inlined
        if weight == INF:
            weight = _weight(outs, out_edges, to_t)
        if source >= sink + weight:
            side[v] = True
            _merge(v, outs, in_edges, to_s, ins, out_edges, work)
        else:
            weight = sum(ins.values()) if ins else 0
            if weight == INF:
                weight = _weight(ins, in_edges, to_s)
            if sink >= source + weight:
                side[v] = False
                _merge(v, ins, out_edges, to_t, outs, in_edges, work)
            else:
                continue
        if outs:
            del out_edges[v]
        if ins:
            del in_edges[v]
    rest = {("s", b): c for b, c in to_s.items() if b not in side}
    rest.update(((a, "t"), c) for a, c in to_t.items() if a not in side)
    rest.update(((a, b), c) for a, outs in out_edges.items() if a not in side for b, c in outs.items())
    return side, rest


def _merge(
    v, toward: dict, toward_back: dict, terminal: dict, away: dict, away_back: dict, work: list
) -> None:
    """Merge fixed vertex `v` into its terminal: its edges `toward` the other side now leave the
    terminal (their capacities join `terminal`), its edges `away` from it are inside and vanish;
    `*_back` are the same edges seen from their other end. Every neighbour is looked at again."""
    for w, c in toward.items():
        del toward_back[w][v]
        terminal[w] = terminal.get(w, 0) + c
        work.append(w)
    for u in away:
        del away_back[u][v]
        work.append(u)


_EMPTY: dict = {}


def _weight(edges: dict, onward: dict, terminal: dict) -> float:
    """The most that putting a vertex on the far side of these edges costs: each finite edge, and
    for an infinite one (to an auxiliary vertex) that vertex's own edges onward."""
    total = sum(edges.values())
    if total != INF:
        return total
    total = 0
    for w, c in edges.items():
        if c == INF:
            c = terminal.get(w, 0) + sum(onward.get(w, _EMPTY).values())
        total += c
    return total


def min_cut(net: Network) -> tuple[dict, nx.DiGraph]:
    """(vertex -> on the source side?, the flow graph the cut was taken of): `reduce_terminal`
    fixes what it can, one minimum cut decides the rest."""
    side, rest = reduce_terminal(net)
    flow = nx.DiGraph()
    flow.add_nodes_from(("s", "t"))
    flow.add_edges_from(
        (a, b, {"capacity": c}) if c != INF else (a, b) for (a, b), c in rest.items() if c > 0
    )
    if flow.number_of_edges():  # an edge without capacity is infinite for networkx
        _, (source_side, _) = nx.minimum_cut(flow, "s", "t", flow_func=boykov_kolmogorov)
        side.update((n, n in source_side) for n in flow if n not in ("s", "t"))
    return side, flow


def regions(flow: nx.DiGraph, free: set) -> tuple[dict, int]:
    """Free vertex -> region number: the connected parts of the cut graph without s and t."""
    inner = flow.subgraph(n for n in flow if n not in ("s", "t"))
    region = {}
    count = 0
    for part in nx.weakly_connected_components(inner):
        members = [n for n in part if n in free]
        if members:
            count += 1
            region.update(dict.fromkeys(members, count))
    return region, count
