"""The graph the HTML picture draws: compute nodes of the main graph, the tensors between them,
each node's precision and reason, float32 islands, and where the inserted Casts sit.

Constant nodes, initializers and Identity nodes of them (exporters share weights that way) are
folded into their readers (a count of weights per node), as Netron shows them: never boxes. Casts are read from the rewritten model and attached to
the edge (producer, first reader) of the original graph they sit on. Linear in the graph size.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import onnx

from amp_rewrite.analysis.paint import Step

KINDS = ("low", "mixed", "float32", "other")  # index = the kind code used in the page data
LOW, MIXED, FLOAT32, OTHER = range(4)


@dataclass
class PictureGraph:
    """Compute nodes are numbered 0..n-1 in topological order; `index[i]` is the node's index in
    the original main graph."""

    index: list = field(default_factory=list)
    op: list = field(default_factory=list)
    name: list = field(default_factory=list)
    kind: list = field(default_factory=list)
    reason: list = field(default_factory=list)
    weights: list = field(default_factory=list)  # folded constants / initializers read
    succ: list = field(default_factory=list)  # distinct successors, per node
    measured: list = field(default_factory=list)  # nodes made deny roots by calibration, the fallback or the user
    island: list = field(default_factory=list)  # float32 island id or -1
    islands: list = field(default_factory=list)  # per island: (size, reason)
    casts: list = field(default_factory=list)  # (producer or None, first reader or None, to elem type)
    inner_casts: Counter = field(default_factory=Counter)  # node -> casts inside its subgraphs


def _topological(inputs: list, producer: dict) -> list[int]:
    """Node indices in topological order: the given order when it is one (the usual case)."""
    get = producer.get
    if all(get(x, -1) < i for i, ins in enumerate(inputs) for x in ins):
        return list(range(len(inputs)))
    deps = [[producer[x] for x in ins if x in producer] for ins in inputs]
    waiting = [len(set(ps)) for ps in deps]
    readers: list = [[] for _ in inputs]
    for i, ps in enumerate(deps):
        for p in set(ps):
            readers[p].append(i)
    ready = [i for i, w in enumerate(waiting) if w == 0]
    order = []
    while ready:
        i = ready.pop()
        order.append(i)
        for r in readers[i]:
            waiting[r] -= 1
            if waiting[r] == 0:
                ready.append(r)
    seen = set(order)  # a cycle cannot be sorted: its nodes follow in file order
    return order + [i for i in range(len(inputs)) if i not in seen]


def _kind(entry, target: str) -> int:
    if entry is None:
        return OTHER
    p = entry["precision"]
    return LOW if p == target else (MIXED if p == "mixed" else FLOAT32)


def _islands(g: PictureGraph) -> None:
    """Connected groups of float32 nodes (union-find over edges between two float32 nodes)."""
    n = len(g.kind)
    parent = list(range(n))

    def root(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a in range(n):
        if g.kind[a] == FLOAT32:
            for b in g.succ[a]:
                if g.kind[b] == FLOAT32:
                    ra, rb = root(a), root(b)
                    if ra != rb:
                        parent[max(ra, rb)] = min(ra, rb)
    ids: dict = {}
    members: dict = {}
    g.island = [-1] * n
    for a in range(n):
        if g.kind[a] == FLOAT32:
            r = root(a)
            g.island[a] = ids.setdefault(r, len(ids))
            members.setdefault(g.island[a], []).append(a)
    g.islands = [(len(m), _island_reason(g, m)) for _, m in sorted(members.items())]


def _island_reason(g: PictureGraph, members: list[int]) -> str:
    """The commonest causes among the members' reasons (the part before any ' through '), each
    with the first member it was given for."""
    causes: Counter = Counter()
    example = {}
    for m in members:
        cause = g.reason[m].split(": ", 1)[-1].split(" through ")[0]
        causes[cause] += 1
        example.setdefault(cause, g.reason[m].split(" through ")[0])
    top = "; ".join(example[c] + (f" (and {k - 1} more)" if k > 1 else "") for c, k in causes.most_common(3))
    more = f"; {len(causes) - 3} other cause(s)" if len(causes) > 3 else ""
    return f"float32 island of {len(members)} node(s): {top}{more}"


def _subgraph_names(graph: onnx.GraphProto, out: list) -> None:
    for node in graph.node:
        out.append(node.name)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                _subgraph_names(attr.g, out)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for body in attr.graphs:
                    _subgraph_names(body, out)


def _attach_casts(g: PictureGraph, rewritten: onnx.ModelProto, cast_list, orig_producer: dict, pos: dict,
                  orig_names: dict) -> None:
    """Each inserted Cast as (producer, first reader, type) in picture numbering."""
    main_casts = {name for scope, name, _, _ in cast_list if scope == 0}
    nested = {name for scope, name, _, _ in cast_list if scope != 0}

    def picture_node(node) -> int | None:
        for o in node.output:
            if o in orig_producer:
                return pos.get(orig_producer[o])
        return pos.get(orig_names.get(node.name)) if node.name else None

    casts = []
    for node in rewritten.graph.node:
        if node.op_type == "Cast" and node.name in main_casts:
            casts.append(node)
        elif nested and any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            names: list = []
            _subgraph_names(onnx.GraphProto(node=[node]), names)
            inside = sum(1 for nm in names if nm in nested)
            holder = picture_node(node)
            if inside and holder is not None:
                g.inner_casts[holder] += inside
    outputs = {c.output[0]: [] for c in casts}
    for node in rewritten.graph.node:  # the first reader of each Cast's output
        for x in node.input:
            if x in outputs:
                outputs[x].append(node)
    for node in casts:
        src, out = node.input[0], node.output[0]
        if src in orig_producer:
            p = pos.get(orig_producer[src])
        else:  # a producer renamed for a graph output writes a new name; the Cast writes the old one
            p = pos.get(orig_producer.get(out)) if out in orig_producer else None
        firsts = [r for r in (picture_node(n) for n in outputs[out]) if r is not None]
        g.casts.append((p, min(firsts) if firsts else None, node.attribute[0].i if node.attribute else 0))


def build(report, model: onnx.ModelProto, rewritten: onnx.ModelProto | None = None) -> PictureGraph:
    """The picture graph of `model` (the original) with `report`'s decisions and, when the
    rewritten model is given, the casts the report lists."""
    nodes = model.graph.node
    inputs = [list(n.input) for n in nodes]  # the protobuf is read once per field: each pass costs
    ops = [n.op_type for n in nodes]
    names = [n.name for n in nodes]
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    constants = {t.name for t in model.graph.initializer}
    order = []
    for i in _topological(inputs, producer):
        if ops[i] == "Constant" or (ops[i] == "Identity" and inputs[i] and inputs[i][0] in constants):
            constants.update(nodes[i].output)  # exporters share a weight through an Identity of it
        else:
            order.append(i)
    pos = {i: k for k, i in enumerate(order)}
    by_index = not len(model.functions)  # inlined functions renumber the working copy: match names then
    entries = {}
    for e in report.nodes:
        if e["scope"] == 0:
            entries[e["index"] if by_index else e["name"]] = e
    g = PictureGraph(index=order, op=[ops[i] for i in order], name=[names[i] for i in order])
    target = report.target
    for k, i in enumerate(order):
        entry = entries.get(i if by_index else names[i])
        g.kind.append(_kind(entry, target))
        if entry and entry["precision"] == "float32" and entry.get("step") == Step.MEASURED.value:
            g.measured.append(k)
        g.reason.append(entry["because"] if entry else f"{ops[i]} '{names[i]}': no float tensors, not coloured")
        folded = 0
        seen = set()
        for x in inputs[i]:
            if x in constants:
                folded += 1
            else:
                p = pos.get(producer.get(x))
                if p is not None and p not in seen:
                    seen.add(p)
        g.weights.append(folded)
        g.succ.append(seen)
    succ: list = [[] for _ in order]
    for k, preds in enumerate(g.succ):
        for p in preds:
            succ[p].append(k)
    g.succ = succ
    _islands(g)
    cast_list = getattr(report, "casts", None) or []
    if rewritten is not None and cast_list:
        names_at = {name: i for i, name in enumerate(names) if name}
        _attach_casts(g, rewritten, cast_list, producer, pos, names_at)
    return g
