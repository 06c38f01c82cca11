"""Cost placement: the colours of the free vertices that minimise the bytes the model moves.

TF's rule paints infer/clear ops low only *between* two allow ops: a heuristic for few casts.
An infer or clear op that no deny op reaches is safe in either precision, so its colour is a
free binary choice with
- a unary cost: the bytes its type group reads and writes (elements x 4 in float32, x 2 low);
- a cost per tensor for each cast it needs: one Cast per (tensor, type) reads the tensor in the
  producer's type and writes it in the readers' (elements x 6), shared by all readers of that
  type (an auxiliary vertex per tensor and direction models the sharing exactly).
Every term is submodular, so one minimum s-t cut (networkx, Boykov-Kolmogorov) over the free
vertices only (allow, deny-reached and blocked vertices are folded into s and t) is the exact
optimum of this cost model. Sizes come from known shapes (a symbolic or unknown dim counts 1, an
unknown shape 1 element: then tensors are counted). Constants cost no cast (they are converted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from amp_rewrite.analysis.graph import FLOAT, ColouringGraph
from amp_rewrite.analysis.mincut import INF, Network, add_edge, min_cut
from amp_rewrite.analysis.mincut import regions as cut_regions
from amp_rewrite.plan import Reason, Step

LOW_BYTES, FP32_BYTES = 2, 4
CAST_BYTES = LOW_BYTES + FP32_BYTES  # a Cast reads one type and writes the other


def sizes(cg: ColouringGraph) -> dict:
    """The graph's cache of tensor elements, first filled with the initializers' (their dims are
    always known; graph.build fills it); every cut and estimate of one rewrite shares it."""
    if cg.elements is None:
        cg.elements = {
            name: math.prod(t.dims[:]) for scope in cg.scopes for name, t in scope.initializers.items()
        }
    return cg.elements


def elements(cg: ColouringGraph, name: str, cache: dict) -> int:
    """Elements of tensor `name` from its known shape (symbolic dims count 1; unknown: 1)."""
    size = cache.get(name)
    if size is None:
        shape = cg.shapes.get(name)
        size = 1 if shape is None else math.prod(d.dim_value if d.dim_value > 0 else 1 for d in shape.dim)
        cache[name] = size
    return size


def vertex_elements(cg: ColouringGraph) -> list:
    """Per vertex: the elements of its group's tensors, as graph.build counted them (else here)."""
    if cg.vertex_elements is not None and len(cg.vertex_elements) == len(cg.vertices):
        return cg.vertex_elements
    cache, found = sizes(cg), []
    for vertex in cg.vertices:
        inputs, outputs = cg.scopes[vertex.scope].io[vertex.node]
        names = [inputs[i] for i in vertex.group.inputs] + [outputs[i] for i in vertex.group.outputs]
        found.append(sum(elements(cg, x, cache) for x in names if x))
    cg.vertex_elements = found
    return found


def estimate(cg: ColouringGraph, low, low_io: frozenset = frozenset()) -> int:
    """Bytes moved under a colouring (`low`: the set of low-precision vertices; `low_io`: the main
    graph's inputs and outputs in the target type): every group's reads and writes plus every cast."""
    return estimates(cg, (low,), low_io)[0]


def estimates(cg: ColouringGraph, lows: tuple, low_io: frozenset = frozenset()) -> tuple:
    """`estimate` of each colouring in `lows`, in one pass over vertices and uses (the pass, not
    the colourings, is what costs: 0.3 s at 100k nodes): per tensor and colouring, a Cast when
    some reader reads the type its source is not (two flags per tensor, no set). Linear."""
    cache, scopes = sizes(cg), cg.scopes
    vertex_sizes = vertex_elements(cg)
    everything = sum(vertex_sizes) * FP32_BYTES
    totals = [everything - sum(vertex_sizes[v] for v in low) * (FP32_BYTES - LOW_BYTES) for low in lows]
    types_get, writes, reads = cg.types.get, cg.writes, cg.reads
    carried_in, carried_out, constant_nodes = cg.carried_in, cg.carried_out, cg.constant_nodes
    defs = [scope.defs for scope in scopes]
    # all float32 with every main-graph input and output float32 (never_worse's first, without
    # low_io): not a single Cast, so that colouring is not looked at per tensor
    costed = [(i, low) for i, low in enumerate(lows) if low or low_io]
    for key, tensor_uses in cg.uses.items() if costed else ():
        s, name = key
        if types_get(name) != FLOAT:
            continue
        kind, n, slot = defs[s][name]
        if kind == "initializer":
            continue
        producer = carried_in.get(key) if kind == "input" and s > 0 else None
        if kind == "node":
            row = writes[s][n]
            producer = row[slot] if row else None
            if producer is None and (s, n) in constant_nodes:
                continue
        readers, fp32_reader, low_reader = [], False, False
        for use_scope, node, use_slot in tensor_uses:
            if node < 0:
                carried = carried_out.get((use_scope, use_slot)) if use_scope > 0 else None
                if carried is not None:
                    readers.append(carried)
                elif use_scope == 0 and name in low_io:
                    low_reader = True
                else:
                    fp32_reader = True
                continue
            row = reads[use_scope][node]
            v = row[use_slot] if row else None
            if v is None:
                fp32_reader = True
            else:
                readers.append(v)
        low_source = kind == "input" and s == 0 and name in low_io
        cost = None
        for i, low in costed:
            source_low = low_source or (producer is not None and producer in low)
            some_low, some_fp32 = low_reader, fp32_reader
            if not low:  # all float32 (never_worse's first): every reader vertex reads float32
                some_fp32 = some_fp32 or bool(readers)
            else:
                for r in readers:
                    if r in low:
                        some_low = True
                    else:
                        some_fp32 = True
            casts = some_fp32 if source_low else some_low  # one Cast per type the source is not
            if casts:
                if cost is None:
                    cost = elements(cg, name, cache) * CAST_BYTES
                totals[i] += cost
    return tuple(totals)


@dataclass
class Placement:
    low: set  # free vertices the cut put in low precision
    free: list
    region: (
        dict  # free vertex -> its region (free vertices the cut joins) number; absent: fixed before the cut
    )
    regions: int


def place(cg: ColouringGraph, free: list, is_low, low_io: frozenset = frozenset(), tied=()) -> Placement:
    """Colour `free` vertices with one minimum cut; `is_low(v)` gives every other vertex's fixed colour,
    `low_io` the main graph's inputs and outputs in the target type (the rest are float32); `tied`:
    lists of free vertices that take one colour (ties.py), joined by infinite edges both ways."""
    if not free:
        return Placement(set(), [], {}, 0)
    net = Network(len(cg.vertices))
    cache = sizes(cg)
    free_set = set(free)
    _build(cg, free, free_set, cache, is_low, low_io, net)
    for members in tied:
        for a, b in zip(members, members[1:]):
            add_edge(net.out, net.into, a, b, INF)
            add_edge(net.out, net.into, b, a, INF)
    side, flow = min_cut(net)
    low = {v for v in free if side.get(v, True)}
    region, count = cut_regions(flow, free_set)
    return Placement(low, list(free), region, count)


def _build(
    cg: ColouringGraph, free: list, free_set: set, cache: dict, is_low, low_io: frozenset, net: Network
) -> None:
    """The network, in one visit of each free vertex: its edge from s (the bytes it saves in low
    precision) and the edges charging the casts of every float tensor it writes or reads, each
    tensor once (a free vertex's outputs under it, the tensors it reads from other producers once).

    A tensor's casts: a cast up (some reader low, the producer float32) and a cast down (the
    reverse) are each paid once per tensor, whatever the number of readers: an auxiliary vertex
    per tensor and direction; the source side of the cut is low precision. This is `estimates`'s
    reading of the uses, with the edges added in place (a call per edge cost more than
    the edge): it runs once per tensor next to a free vertex, 100k times at 100k nodes."""
    saving = FP32_BYTES - LOW_BYTES
    vertices, scopes, writes, reads = cg.vertices, cg.scopes, cg.writes, cg.reads
    uses_get, cache_get, shapes_get = cg.uses.get, cache.get, cg.shapes.get
    constant_nodes = cg.constant_nodes
    to_s, to_t, out_edges, in_edges = net.to_s, net.to_t, net.out, net.into
    to_s.update(dict.fromkeys(free, 0))  # every free vertex has an edge from s, in `free`'s order
    inputs_seen: set = set()
    carried_made: dict = {}  # a Loop/Scan's carried vertex -> the body inputs it makes
    for key, v in cg.carried_in.items():
        carried_made.setdefault(v, []).append(key)
    carried_out = cg.carried_out
    for v in free:
        vertex = vertices[v]
        s = vertex.scope
        scope = scopes[s]
        inputs, outputs = scope.io[vertex.node]
        group = vertex.group
        total = 0
        made = []  # a loop, not a comprehension (a call per vertex in Python 3.11)
        for i in group.outputs:
            if outputs[i]:
                made.append((s, outputs[i]))
        if carried_made:
            made += carried_made.get(v, ())  # a carried value's body input: v makes it too
        for ms, x in made:  # made here: the producer is v, free
            size = cache_get(x)
            if size is None:  # elements(), inlined
                shape = shapes_get(x)
                size = cache[x] = (
                    1
                    if shape is None
                    else math.prod(d.dim_value if d.dim_value > 0 else 1 for d in shape.dim)
                )
            if ms == s:
                total += size
            key = (ms, x)
            tensor_uses = uses_get(key, ())
            c = size * CAST_BYTES
            if len(tensor_uses) == 1 and not carried_out:  # the common case: one reader (_readers, inlined)
                use_scope, node, use_slot = tensor_uses[0]
                if node < 0:
                    if use_scope > 0 or x not in low_io:
                        to_t[v] = to_t.get(v, 0) + c  # a cast down whenever v is low
                    else:
                        to_s[v] += c  # a low output: a cast up whenever v is float32
                    continue
                row = reads[use_scope][node]
                r = row[use_slot] if row else None
                if r is None:
                    to_t[v] = to_t.get(v, 0) + c
                elif r in free_set:  # a cast either way when r and v differ
                    add_edge(out_edges, in_edges, r, v, c)
                    add_edge(out_edges, in_edges, v, r, c)
                elif is_low(r):
                    to_s[v] += c
                else:
                    to_t[v] = to_t.get(v, 0) + c
                continue
            loose, fixed_low, fixed_fp32 = _readers(
                tensor_uses, reads, free_set, is_low, x in low_io, carried_out
            )
            if fixed_low:  # a cast up whenever v is float32
                to_s[v] += c
            elif len(loose) == 1:
                add_edge(out_edges, in_edges, loose[0], v, c)
            elif loose:
                aux = net.auxiliary(False)
                for r in loose:
                    add_edge(out_edges, in_edges, r, aux, INF)
                add_edge(out_edges, in_edges, aux, v, c)
            if fixed_fp32:  # a cast down whenever v is low
                to_t[v] = to_t.get(v, 0) + c
            elif len(loose) == 1:
                add_edge(out_edges, in_edges, v, loose[0], c)
            elif loose:
                aux = net.auxiliary(True)
                for r in loose:
                    add_edge(out_edges, in_edges, aux, r, INF)
                add_edge(out_edges, in_edges, v, aux, c)
        defs_get = scope.defs.get
        for i in group.inputs:
            x = inputs[i]
            if not x:
                continue
            size = cache_get(x)
            if size is None:
                size = elements(cg, x, cache)
            total += size
            found = defs_get(x)
            ds = s
            if found is None:  # captured from an enclosing graph
                resolved = cg.resolve(s, x)
                if resolved is None:
                    continue
                ds, found = resolved.scope, resolved.definition
            kind, n, slot = found
            if kind == "initializer":
                continue
            p = None
            if kind == "input" and ds > 0:
                p = cg.carried_in.get((ds, x))  # a loop-carried body input: its Loop's vertex makes it
                if p in free_set:  # charged with that vertex's tensors
                    continue
            if kind == "node":
                row = writes[ds][n]
                p = row[slot] if row else None
                if p in free_set:  # charged with the producer's outputs
                    continue
                if p is None and (ds, n) in constant_nodes:
                    continue
            key = (ds, x)
            if key in inputs_seen:
                continue
            inputs_seen.add(key)
            loose, fixed_low, fixed_fp32 = _readers(
                uses_get(key, ()), reads, free_set, is_low, x in low_io, carried_out
            )
            c = size * CAST_BYTES
            if (p is not None and is_low(p)) or (kind == "input" and ds == 0 and x in low_io):
                # a low source: a cast down, when some reader is float32
                if fixed_fp32:
                    pass
                elif len(loose) == 1:
                    to_s[loose[0]] += c
                elif loose:
                    aux = net.auxiliary(True)
                    for r in loose:
                        add_edge(out_edges, in_edges, aux, r, INF)
                    to_s[aux] = to_s.get(aux, 0) + c
            elif not fixed_low:  # a cast up from a float32 source, when some reader is low
                if len(loose) == 1:
                    to_t[loose[0]] = to_t.get(loose[0], 0) + c
                elif loose:
                    aux = net.auxiliary(False)
                    for r in loose:
                        add_edge(out_edges, in_edges, r, aux, INF)
                    to_t[aux] = to_t.get(aux, 0) + c
        to_s[v] += total * saving


def _readers(tensor_uses, reads, free: set, is_low, low_output: bool, carried_out=None) -> tuple:
    """(free readers in first-use order, some reader fixed low, some reader fixed float32);
    `low_output`: the tensor, where it is a main-graph output, is one in the target type;
    `carried_out`: a body output a Loop/Scan carries is read by that node's carried vertex."""
    loose = []
    fixed_low = fixed_fp32 = False
    for use_scope, node, use_slot in tensor_uses:
        if node < 0:
            r = carried_out.get((use_scope, use_slot)) if carried_out and use_scope > 0 else None
            if r is None:
                if use_scope == 0 and low_output:
                    fixed_low = True
                else:
                    fixed_fp32 = True
                continue
        else:
            row = reads[use_scope][node]
            r = row[use_slot] if row else None
        if r is None:
            fixed_fp32 = True
        elif r in free:
            if r not in loose:
                loose.append(r)
        elif is_low(r):
            fixed_low = True
        else:
            fixed_fp32 = True
    return loose, fixed_low, fixed_fp32


def free_vertices(lists: list, paintable: list, allow: dict, deny: dict) -> list:
    """Infer and clear vertices that may be low and that no deny vertex reaches."""
    return [
        v
        for v, name in enumerate(lists)
        if name in ("infer", "clear") and paintable[v] and v not in deny and v not in allow
    ]


def colour_free(cg: ColouringGraph, m, allow: dict, deny: dict, low_io: frozenset = frozenset()):
    """(low: allow + the free vertices the cut put low, with reasons; reasons of the free ones it
    kept float32). `m` is paint's masks (lists, paintable)."""
    free = free_vertices(m.lists, m.paintable, allow, deny)
    free_set = set(free)
    tied = [[v for v in c.members if v in free_set] for c in m.clusters if c.pinned is None]
    done = place(cg, free, allow.__contains__, low_io, [t for t in tied if len(t) > 1])
    low = dict(allow)
    kept = {}
    fixed = "cost placement: its own bytes outweigh every cast it can cause (fixed before the cut)"
    # most vertices are fixed before the cut: their two reasons are made once and shared (immutable)
    fixed_low = Reason(Step.COST_PLACEMENT, None, f"{fixed} (fewer bytes moved in {cg.target})")
    fixed_fp32 = Reason(Step.COST_PLACEMENT, None, f"{fixed} (fewer bytes moved in float32)")
    regions, chosen = done.region, done.low
    for v in free:
        region = regions.get(v)
        if region is None:
            if v in chosen:
                low[v] = fixed_low
            else:
                kept[v] = fixed_fp32
            continue
        where = f"cost placement: min cut of region {region} of {done.regions}"
        if v in chosen:
            low[v] = Reason(Step.COST_PLACEMENT, None, f"{where} (fewer bytes moved in {cg.target})")
        else:
            kept[v] = Reason(Step.COST_PLACEMENT, None, f"{where} (fewer bytes moved in float32)")
    return low, kept
