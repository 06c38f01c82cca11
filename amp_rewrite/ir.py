"""The package's IR: the graphs of a model as scopes, where each tensor is defined, who reads
it, and a topological order. Every stage that asks for a producer or a tensor's readers asks here.

A scope is one graph: the main graph (index 0) or a subgraph held by a node of its parent scope.
`read_scopes` reads every scope once (definitions, and per node its inputs, outputs, name, op type
and domain); `record_uses` lists the readers of every tensor across scopes (a tensor captured from
an outer scope is read by the inner node). For one plain graph, `producers` and `readers` index
rows of names (`node.output` / `node.input`, or `Scope.io`), `producer_nodes` maps to NodeProtos. Lookups are dicts; all is linear.
Nothing here imports the rest of the package but `errors`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import networkx as nx
import onnx

from amp_rewrite.errors import ModelError


class Def(NamedTuple):
    """Where a tensor is defined in its graph."""

    kind: str  # "input" | "initializer" | "node"
    node: int  # the node's index, -1 for inputs and initializers
    slot: int  # the output slot, -1 for inputs and initializers


class Use(NamedTuple):
    """One reading of a tensor: an input slot of a node, or a graph output (node -1)."""

    scope: int
    node: int
    slot: int


class Found(NamedTuple):
    """A tensor visible from a scope: the scope that defines it and the definition."""

    scope: int
    definition: Def


INPUT, INITIALIZER = Def("input", -1, -1), Def("initializer", -1, -1)
# Def/Use made in the hot loops as tuple.__new__(Def, (...)): the same NamedTuple, without the
# Python-level __new__ a call of the class runs (half the cost, 300k of them at 100k nodes).
_new = tuple.__new__


@dataclass
class Scope:
    """One graph: the main graph (index 0) or a subgraph held by a node of its parent scope."""

    graph: onnx.GraphProto
    parent: int | None
    owner: tuple[int, int] | None  # (scope, node index) of the If/Loop/Scan holding it
    defs: dict = field(default_factory=dict)  # tensor name -> Def
    io: list = field(
        default_factory=list
    )  # per node: (inputs, outputs) as tuples (cheaper than lists from upb), read once
    names: list = field(default_factory=list)  # per node: its name, read once
    op_types: list = field(default_factory=list)  # per node: its op type, read once
    domains: list = field(default_factory=list)  # per node: its domain, read once
    initializers: dict = field(default_factory=dict)  # name -> its TensorProto in this graph, read once


def collect_scopes(graph: onnx.GraphProto) -> list[Scope]:
    """The main graph and every subgraph, parents before children."""
    scopes = [Scope(graph, None, None)]
    i = 0
    while i < len(scopes):
        for n, node in enumerate(scopes[i].graph.node):
            for attr in node.attribute:
                subgraphs = [attr.g] if attr.HasField("g") else list(attr.graphs)
                for sub in subgraphs:
                    scopes.append(Scope(sub, i, (i, n)))
        i += 1
    return scopes


def read_scopes(graph: onnx.GraphProto, nested: bool = True) -> list[Scope]:
    """`collect_scopes` with every scope's defs and node io read: one walk that type propagation
    and the colouring graph share. `nested=False`: the caller knows no node holds a subgraph
    (validation walked the attributes already), so they are not walked again."""
    scopes = collect_scopes(graph) if nested else [Scope(graph, None, None)]
    for scope in scopes:
        _record_defs(scope)
    return scopes


def _record_defs(scope: Scope) -> None:
    scope.initializers = {tensor.name: tensor for tensor in scope.graph.initializer}
    defs = scope.defs
    defs.update(dict.fromkeys(scope.initializers, INITIALIZER))
    for value in scope.graph.input:  # an input that is also an initializer can be fed: an input
        defs[value.name] = INPUT
    # one visit a node; a slice of a upb container is read in one call, tuple() iterates it (0.06 s at 100k nodes)
    rows = [
        (tuple(node.input[:]), tuple(node.output[:]), node.name, node.op_type, node.domain)
        for node in scope.graph.node
    ]
    columns = list(zip(*rows)) or [(), (), (), (), ()]  # split in C, not four comprehensions
    scope.io = list(zip(columns[0], columns[1]))
    scope.names, scope.op_types, scope.domains = list(columns[2]), list(columns[3]), list(columns[4])
    for n, (_, outputs) in enumerate(scope.io):
        for slot, name in enumerate(outputs):
            if name:
                defs[name] = _new(Def, ("node", n, slot))


def resolve(scopes: list[Scope], scope: int, name: str) -> Found | None:
    """Where a tensor visible from `scope` is defined (its own graph, else the nearest enclosing
    one), or None if undefined."""
    s = scope
    while s is not None:
        found = scopes[s].defs.get(name)
        if found is not None:
            return Found(s, found)
        s = scopes[s].parent
    return None


def record_uses(scopes: list[Scope]) -> tuple[dict, bool]:
    """(def scope, name) -> its readers as Uses (graph outputs as node -1), and whether some node
    reads a tensor made after it in its graph (then the graph is not sorted)."""
    uses: dict = {}
    unsorted = False
    for s, scope in enumerate(scopes):
        defs = scope.defs
        for n, (inputs, _) in enumerate(scope.io):
            for slot, name in enumerate(inputs):
                if not name:
                    continue
                found = defs.get(name)
                if found is not None:  # the common case: defined in the same graph
                    key = (s, name)
                    if found.node >= n:
                        unsorted = True
                else:
                    found = resolve(scopes, s, name)
                    if found is None:
                        continue
                    key = (found.scope, name)
                readers = uses.get(key)  # not setdefault: no empty list made per use
                if readers is None:
                    uses[key] = [_new(Use, (s, n, slot))]
                else:
                    readers.append(_new(Use, (s, n, slot)))
        for slot, value in enumerate(scope.graph.output):
            found = resolve(scopes, s, value.name)
            if found is not None:
                uses.setdefault((found.scope, value.name), []).append(Use(s, -1, slot))
    return uses, unsorted


# --- one graph: rows of names per node ----------------------------------------------------------


def producers(outputs: Iterable[Sequence[str]]) -> dict[str, int]:
    """Tensor name -> the index of the row (node) that writes it; `outputs` holds one row of
    output names per node (`node.output for node in nodes`, or the second half of `Scope.io`)."""
    return {name: i for i, row in enumerate(outputs) for name in row if name}


def producer_nodes(nodes: Iterable[onnx.NodeProto]) -> dict[str, onnx.NodeProto]:
    """Tensor name -> the node that writes it, for walks that follow nodes rather than indices."""
    return {name: node for node in nodes for name in node.output if name}


def readers(inputs: Iterable[Sequence[str]]) -> dict[str, list[int]]:
    """Tensor name -> the indices of the rows (nodes) that read it, in order, once per slot."""
    found: dict = {}
    for i, row in enumerate(inputs):
        for name in row:
            if name:
                rows = found.get(name)
                if rows is None:
                    found[name] = [i]
                else:
                    rows.append(i)
    return found


def captures(graph: onnx.GraphProto) -> list[str]:
    """Names a graph (and the graphs nested in it) reads but does not define: what it takes from
    outer scopes, in reading order (a node's inputs, then its bodies' captures; outputs last)."""
    defined = {value.name for value in graph.input} | {tensor.name for tensor in graph.initializer}
    defined.update(producers(node.output for node in graph.node))
    read: dict[str, None] = {}
    for node in graph.node:
        read.update((name, None) for name in node.input if name and name not in defined)
        for attr in node.attribute:
            for body in [attr.g] if attr.HasField("g") else attr.graphs:
                read.update((name, None) for name in captures(body) if name not in defined)
    read.update((value.name, None) for value in graph.output if value.name not in defined)
    return list(read)


def topological_order(inputs: Sequence[Sequence[str]], producer: dict, what: str = "graph") -> list[int]:
    """Node indices in an order where each node reads only what earlier ones made: the given order
    when it is one (the usual case), else the file order wherever the data allows (the smallest
    ready index first). `producer`: `producers(...)` of the same nodes. A cycle is a ModelError."""
    get = producer.get
    if all(get(x, -1) < i for i, row in enumerate(inputs) for x in row):
        return list(range(len(inputs)))
    deps = nx.DiGraph()
    deps.add_nodes_from(range(len(inputs)))
    deps.add_edges_from((producer[x], i) for i, row in enumerate(inputs) for x in row if x in producer)
    try:
        return list(nx.lexicographical_topological_sort(deps))
    except nx.NetworkXUnfeasible:
        raise ModelError(f"{what} has a cycle") from None


def sort_graphs(model: onnx.ModelProto) -> None:
    """Topologically sort every graph that is not sorted, keeping the original order otherwise."""
    for scope in reversed(
        collect_scopes(model.graph)
    ):  # children first: re-adding a parent's nodes copies them
        g = scope.graph
        inputs = [node.input for node in g.node]
        order = topological_order(
            inputs, producers(node.output for node in g.node), f"graph {g.name or '(main)'}"
        )
        if order == list(range(len(order))):
            continue
        nodes = [g.node[i] for i in order]
        del g.node[:]
        g.node.extend(nodes)
