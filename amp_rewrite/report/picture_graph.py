"""The graph the HTML picture draws: compute nodes of the main graph, the tensors between them,
each node's precision and reason, float32 islands, and where the inserted Casts sit.

Constant nodes, initializers and Identity nodes of them (exporters share weights that way) are
folded into their readers (a count of weights per node), as Netron shows them: never boxes. The
structure comes from the rewrite itself (`facts`: the node io it read once, and which uses each
inserted Cast feeds), so the page reads no tensor lists from the protobuf again; each Cast is drawn
on the edge (producer, first reader) it sits on. Linear in the graph size.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import onnx

from amp_rewrite import ir
from amp_rewrite.plan import Step

KINDS = ("low", "mixed", "float32", "other")  # index = the kind code used in the page data
LOW, MIXED, FLOAT32, OTHER = range(4)


@dataclass
class Facts:
    """The main graph as the rewrite read it (per node: inputs, outputs, name) and each inserted
    Cast as (producer node or None, first reader node or None, to), or ("inside", holder node, to)
    for a Cast in a subgraph: node indices of the graph before casts were spliced in."""

    io: list
    names: list
    casts: list


def facts(cg, materialised) -> Facts:
    """Facts of one rewrite; `report.Report.picture_facts` calls this when a page is drawn."""
    scopes, main = cg.scopes, cg.scopes[0]
    places = []
    for scope, _, source, elem, output in materialised.casts:
        if scope != 0:  # inside a body: counted on the main-graph node that holds it
            while scopes[scope].parent != 0:
                scope = scopes[scope].parent
            places.append(("inside", scopes[scope].owner[1], elem))
            continue
        d = main.defs.get(source)
        if d is None:  # a producer renamed for a graph output writes a new name; the Cast the old one
            d = main.defs.get(output)
        readers = [u.node for u in materialised.cast_uses.get(output, ()) if u.scope == 0 and u.node >= 0]
        places.append(
            (d.node if d is not None and d.kind == "node" else None, min(readers, default=None), elem)
        )
    return Facts(main.io, main.names, places)


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
    measured: list = field(
        default_factory=list
    )  # nodes made deny roots by calibration, the fallback or the user
    island: list = field(default_factory=list)  # float32 island id or -1
    islands: list = field(default_factory=list)  # per island: (size, reason)
    casts: list = field(default_factory=list)  # (producer or None, first reader or None, to elem type)
    inner_casts: Counter = field(default_factory=Counter)  # node -> casts inside its subgraphs


def _kind(entry, target: str) -> int:
    if entry is None or entry.get("removed"):  # a Cast removed as converting nothing computes nothing
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


def _read(report, model: onnx.ModelProto):
    """(inputs, outputs, names, cast places, whether the rewrite's node indices are the model's) per
    node of the main graph: from the rewrite's facts, else (functions inlined, or scale nodes
    inserted before colouring: the rewrite saw another graph) from the protobuf."""
    get = getattr(report, "picture_facts", None)
    if get is not None and not len(model.functions):
        f = get()
        if len(f.io) == len(model.graph.node):
            return [io[0] for io in f.io], [io[1] for io in f.io], f.names, f.casts, True
    nodes = model.graph.node  # the casts sit in the rewritten graph: drawn apart, not on an edge
    loose = [(None, None, cast[3]) for cast in getattr(report, "casts", ())]
    return (
        [tuple(n.input) for n in nodes],
        [tuple(n.output) for n in nodes],
        [n.name for n in nodes],
        loose,
        False,
    )


def build(report, model: onnx.ModelProto) -> PictureGraph:
    """The picture graph of `model` (the original, unrewritten) with `report`'s decisions."""
    inputs, outputs, names, places, by_index = _read(report, model)
    ops = [n.op_type for n in model.graph.node]
    producer = ir.producers(outputs)
    constants = {t.name for t in model.graph.initializer}
    order = []
    for i in ir.topological_order(inputs, producer):
        if ops[i] == "Constant" or (ops[i] == "Identity" and inputs[i] and inputs[i][0] in constants):
            constants.update(outputs[i])  # exporters share a weight through an Identity of it
        else:
            order.append(i)
    pos = {i: k for k, i in enumerate(order)}
    # by_index False: inlined functions or inserted scale nodes renumber the working copy: match names
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
        g.reason.append(
            entry["because"] if entry else f"{ops[i]} '{names[i]}': no float tensors, not coloured"
        )
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
    for p, r, elem in places:
        if p == "inside":
            if pos.get(r) is not None:
                g.inner_casts[pos[r]] += 1
        else:
            g.casts.append((pos.get(p), pos.get(r), elem))
    return g
