"""The colouring passes, in TensorFlow AutoMixedPrecision's order.

Each pass is a small function from the colouring graph and the paint so far to the vertices it
paints, each with a Reason naming the pass and the vertex it came from, so every decision can be
explained as a chain. Every pass is one breadth-first walk (or one sweep) over the graph: linear.

1. allow ops are low precision;
2. deny spreads forward through infer and clear ops (clear ones only when they lead to an infer or
   deny op);
3. infer and clear ops on a path between two allow ops become low precision;
4. (bfloat16) an infer op fed by an allow op and by no deny op becomes low precision;
5. allow spreads through clear ops in both directions;
6. an output group typed by an attribute (Cast's `to`) whose consumers are all low precision
   becomes low precision itself.
"""

from __future__ import annotations

from types import MappingProxyType

import numpy as np
from onnx import numpy_helper

from amp_rewrite.analysis import ties
from amp_rewrite.analysis.graph import ColouringGraph
from amp_rewrite.onnx_facts import FLOAT as FLOAT_ELEM
from amp_rewrite.plan import FP32, LOW, Plan, Reason, Step

FILL_LIMITS = {"float16": 65504.0, "bfloat16": float(np.finfo(np.float32).max)}
# Reasons made per vertex in the passes' comprehensions as tuple.__new__(Reason, (step, via, None)):
# the same NamedTuple without the Python-level __new__ a call of the class runs (a third the cost)
_new = tuple.__new__


def reach(adjacencies, roots, enter) -> dict:
    """Multi-source BFS over neighbour lists (`_Masks.succ`, `.pred`, or both): vertex ->
    the vertex it was reached from (None for roots). `enter[w]` says whether w may be entered."""
    parent = dict.fromkeys(roots)
    frontier = list(parent)
    while frontier:  # level by level, in order: a FIFO queue's order, without a call per pop
        found = []
        for v in frontier:
            for adjacency in adjacencies:
                for w in adjacency[v]:
                    if enter[w] and w not in parent:
                        parent[w] = v
                        found.append(w)
        frontier = found
    return parent


class _Masks:
    """Per-vertex facts the passes test millions of times, computed once as plain lists, and the
    graph's neighbour lists (a neighbour may repeat: every pass asks only what is next to what)."""

    def __init__(self, cg: ColouringGraph):
        self.lists = [vx.op_list for vx in cg.vertices]
        self.paintable = [vx.blocked is None and not vx.group.output_only for vx in cg.vertices]
        self.succ = cg.succ
        self.pred = cg.pred
        self.clusters = ties.clusters(cg)  # vertices a sequence joins: one colour each
        self.pinned = ties.pinned(cg, self.clusters)  # members of clusters that stay float32, with why
        for v in self.pinned:
            self.paintable[v] = False

    def inside(self, reached: dict, left_out: dict) -> list[bool]:
        """Per vertex: in `reached` and not in `left_out` (a comprehension, not a call per vertex)."""
        return [v in reached and v not in left_out for v in range(len(self.lists))]

    def passable(self, lists: tuple, painted: dict) -> list[bool]:
        """Per vertex: in one of `lists`, paintable, and not in `painted`."""
        return [
            name in lists and ok and v not in painted
            for v, (name, ok) in enumerate(zip(self.lists, self.paintable))
        ]


def paint_allow(cg: ColouringGraph, m: _Masks) -> dict:
    """Paintable allow vertices, all with one Reason (immutable: shared, not made per vertex)."""
    reason = Reason(Step.ALLOW_LIST)
    return {v: reason for v, name in enumerate(m.lists) if name == "allow" and m.paintable[v]}


def propagate_deny(cg: ColouringGraph, m: _Masks, allow: dict) -> dict:
    """Deny spreads forward into infer/clear vertices that lead back to a deny or infer op."""
    deny_roots = [v for v, name in enumerate(m.lists) if name == "deny"]
    if not deny_roots:  # nothing to spread: no walk up from every infer op
        return {}
    roots = [v for v, name in enumerate(m.lists) if name in ("deny", "infer")]
    upstream = reach([m.pred], roots, [name == "clear" for name in m.lists])
    parent = reach([m.succ], deny_roots, m.inside(upstream, allow))
    return {
        v: _deny_root(cg.vertices[v]) if p is None else Reason(Step.DOWNSTREAM_OF_DENY, p)
        for v, p in parent.items()
    }


def _deny_root(vertex) -> Reason:
    return Reason(Step.MEASURED, None, vertex.forced) if vertex.forced else Reason(Step.DENY_LIST)


def paint_between_allow(cg: ColouringGraph, m: _Masks, allow: dict, deny: dict) -> dict:
    """Infer/clear vertices on a path from an allow vertex to another allow vertex."""
    passable = m.passable(("infer", "clear"), deny)
    downstream = reach([m.succ], list(allow), passable)
    back = reach([m.pred], list(allow), m.inside(downstream, allow))
    step = Step.BETWEEN_ALLOW
    return {v: _new(Reason, (step, downstream[v], None)) for v, p in back.items() if p is not None}


def paint_infer_after_allow(cg: ColouringGraph, m: _Masks, low: dict, deny: dict) -> dict:
    """bfloat16 only: an infer vertex fed by low precision and by no deny vertex follows it."""
    painted = {}
    for v, name in enumerate(m.lists):  # vertices are in node order: chains follow
        if name != "infer" or v in low or v in deny or not m.paintable[v]:
            continue
        preds = list(m.pred[v])
        source = next((p for p in preds if p in low or p in painted), None)
        if source is not None and not any(p in deny for p in preds):
            painted[v] = Reason(Step.INFER_AFTER_ALLOW, source)
    return painted


def propagate_allow_through_clear(cg: ColouringGraph, m: _Masks, low: dict, deny: dict) -> dict:
    passable = m.passable(("clear",), deny)
    parent = reach([m.succ, m.pred], list(low), passable)
    step = Step.CLEAR_NEXT_TO_LOW
    return {v: _new(Reason, (step, p, None)) for v, p in parent.items() if p is not None}


def paint_attribute_typed_outputs(cg: ColouringGraph, low: dict, graph_outputs: set) -> dict:
    """Output groups typed by an attribute (Cast's `to`, ConstantOfShape's `value`, which it
    holds in float16 when it fits) whose every consumer is low precision."""
    painted = {}
    for v, vertex in enumerate(cg.vertices):
        if not vertex.group.output_only or vertex.blocked is not None or vertex.op_list is None:
            continue
        node = cg.node(vertex.scope, vertex.node)
        if not (any(a.name in ("to", "dtype") for a in node.attribute) or fill_fits(node, cg.target)):
            continue
        if any((vertex.scope, node.output[i]) in graph_outputs for i in vertex.group.outputs):
            continue
        consumers = cg.succ[v]
        if consumers and all(c in low for c in consumers) and _only_vertex_uses(cg, vertex, node):
            painted[v] = Reason(Step.ALL_CONSUMERS_LOW, consumers[0])
    return painted


def fill_fits(node, target: str) -> bool:
    """A ConstantOfShape whose fill (its `value`, 0.0 float32 when absent) is float32 and finite
    within the target's range: retyped, it fills the same value (transform.retype)."""
    if node.op_type != "ConstantOfShape":
        return False
    value = next((a.t for a in node.attribute if a.name == "value"), None)
    if value is None:
        return True
    if value.data_type != FLOAT_ELEM:
        return False
    fill = numpy_helper.to_array(value).reshape(-1)
    return fill.size == 1 and bool(np.isfinite(fill).all()) and abs(float(fill[0])) <= FILL_LIMITS[target]


def _only_vertex_uses(cg: ColouringGraph, vertex, node) -> bool:
    """Every reader of the group's outputs is a vertex (not a fixed-type or untyped slot)."""
    for i in vertex.group.outputs:
        for scope, n, slot in cg.uses.get((vertex.scope, node.output[i]), []):
            if cg.input_vertex(scope, n, slot) is None:
                return False
    return True


def colour(cg: ColouringGraph, *, low_io: frozenset = frozenset(), placement: str = "tf") -> Plan:
    """Run the passes in order and freeze the result. `placement="cost"`: the infer/clear vertices
    no deny op reaches are coloured by one minimum cut of bytes moved (placement.py), not TF's rule.
    `low_io`: names of the main graph's inputs and outputs that hold the target type (the rest
    keep float32; `RewriteOptions.low_io_names`)."""
    m = _Masks(cg)
    allow = paint_allow(cg, m)
    if not allow:  # as TF: without allow ops, casts cannot pay off
        return _freeze(cg, {}, dict(m.pinned))
    deny = propagate_deny(cg, m, allow)
    ties.spread_deny_and_allow(m.clusters, allow, deny)
    if placement == "cost":
        from amp_rewrite.analysis import placement as cost
        from amp_rewrite.analysis import resident

        low, kept = cost.colour_free(cg, m, allow, deny, low_io)
        kept.update(drop_regions_without_allow(cg, m, low, low_io, resident.payer(cg), cast_sharing=True))
        graph_outputs = _typed_output_keys(cg, low_io)
        low.update(paint_attribute_typed_outputs(cg, low, graph_outputs))
        return _freeze(cg, low, {**m.pinned, **deny, **kept, **low})
    low = dict(allow)
    low.update(paint_between_allow(cg, m, low, deny))
    if cg.target == "bfloat16":
        low.update(paint_infer_after_allow(cg, m, low, deny))
    low.update(propagate_allow_through_clear(cg, m, low, deny))
    low.update(ties.match_low(m.clusters, low))
    kept = drop_regions_without_allow(cg, m, low, low_io)
    low.update(paint_attribute_typed_outputs(cg, low, _typed_output_keys(cg, low_io)))
    reasons = {**m.pinned, **deny, **kept, **low}
    return _freeze(cg, low, reasons)


def drop_regions_without_allow(
    cg: ColouringGraph,
    m: _Masks,
    low: dict,
    low_io: frozenset = frozenset(),
    pays=None,
    cast_sharing: bool = False,
) -> dict:
    """Regions of low vertices (joined by edges, the groups of one node, ties) with no allow op in
    them go back to float32, in place: casts pay off only around an allow op (TF: no allow op,
    nothing to do), or, under cost placement, where `pays(cg, members, low)` says the weights the
    region holds shrink by more bytes than its casts move (analysis.resident). Returns their
    reasons. One walk over the low vertices, from the ones that keep their region (allow ops, and
    those touching the user's low-precision inputs and outputs), then one over each region left.
    `cast_sharing` (cost placement): low readers of one computed tensor are one region too, as the
    cut counted them: they share its one Cast (a Cast's input group, low beside the Add that reads
    the same input, costs nothing more; dropped alone, it left the cut's choice worse than TF's)."""
    of_node: dict = {}
    vertices, shared = cg.vertices, cg.siblings  # few: not a dict entry per low vertex
    for v in low:
        if v in shared:
            vertex = vertices[v]
            of_node.setdefault((vertex.scope, vertex.node), []).append(v)
    siblings = {v: group for group in of_node.values() if len(group) > 1 for v in group}
    tied = {v: c for c in m.clusters for v in c.members}  # a sequence's ops are one region too
    seeds = [v for v in low if m.lists[v] == "allow" or (low_io and _touches(cg, v, low_io))]
    joins = (siblings,)
    kept = _reached(seeds, low, m, joins, tied)
    if cast_sharing and len(kept) < len(low):  # rare: the readers' links only where some would drop
        joins = (siblings, _readers_of_one_tensor(cg, low))
        kept = _reached(seeds, low, m, joins, tied)
    dropped = {}
    reason = Reason(
        Step.NOT_PAINTED, None, "a low-precision region without an allow op: its casts cannot pay off"
    )
    for start in [v for v in low if v not in kept]:
        if start in kept or start in dropped:
            continue
        members = _reached([start], low, m, joins, tied)
        if pays and pays(cg, list(members), low):
            kept.update(members)
            continue
        for v in members:
            del low[v]
            dropped[v] = reason
    return dropped


def _reached(seeds: list, low: dict, m: _Masks, joins: tuple, tied: dict) -> set:
    """The low vertices joined to a seed by edges, by `joins` (dicts: vertex -> vertices of its
    region) and by ties (each cluster's members once): one walk, in that order. Each kind of
    neighbour in a loop of its own (no tuple or generator per vertex: it visits every low vertex)."""
    kept, queue, clusters_seen = set(seeds), list(seeds), set()
    succ, pred, add, push = m.succ, m.pred, kept.add, queue.append
    gets = [join.get for join in joins if join]  # empty ones (often): no call per vertex
    tied_get = tied.get if tied else None
    while queue:
        v = queue.pop()
        for w in succ[v]:
            if w not in kept and w in low:
                add(w)
                push(w)
        for w in pred[v]:
            if w not in kept and w in low:
                add(w)
                push(w)
        cluster = tied_get(v) if tied_get is not None else None
        if cluster is not None and id(cluster) not in clusters_seen:
            clusters_seen.add(id(cluster))
            for w in cluster.members:
                if w not in kept and w in low:
                    add(w)
                    push(w)
        for get in gets:
            for w in get(v, ()):
                if w not in kept and w in low:
                    add(w)
                    push(w)
    return kept


def _readers_of_one_tensor(cg: ColouringGraph, low: dict) -> dict:
    """vertex -> low vertices it shares a computed float tensor's Cast with: each tensor's low
    readers joined to the first (a star, so linear however many read it)."""
    first: dict = {}
    joined: dict = {}
    for v in low:
        vertex = cg.vertices[v]
        scope = cg.scopes[vertex.scope]
        inputs = scope.io[vertex.node][0]
        for i in vertex.group.inputs:
            x = inputs[i]
            found = scope.defs.get(x) if x else None
            if found is None or found[0] == "initializer":
                continue
            u = first.setdefault(x, v)
            if u != v:
                joined.setdefault(u, []).append(v)
                joined.setdefault(v, []).append(u)
    return joined


def _touches(cg: ColouringGraph, v: int, low_io: frozenset) -> bool:
    """Whether vertex `v` reads or writes a main-graph input or output the user has in the target
    type: its region is theirs (a Shape of a float16 KV cache), not one the colouring made."""
    vertex = cg.vertices[v]
    if vertex.scope != 0:
        return False
    inputs, outputs = cg.scopes[0].io[vertex.node]
    return any(inputs[i] in low_io for i in vertex.group.inputs) or any(
        outputs[i] in low_io for i in vertex.group.outputs
    )


def _typed_output_keys(cg: ColouringGraph, low_io: frozenset) -> set:
    """Graph outputs whose declared type stays: every body's, and the main graph's not in `low_io`."""
    return {
        (s, o.name)
        for s, scope in enumerate(cg.scopes)
        for o in scope.graph.output
        if s > 0 or o.name not in low_io
    }


def never_worse(cg: ColouringGraph, plan, low_io: frozenset = frozenset()):
    """(plan, note, (bytes moved in float32, as the plan colours)): cost placement's promise, by its own estimate: never more bytes moved than in
    float32. The cut places the free ops; allow ops are low whatever they cost (TF's rule), and
    where their casts outweigh what they save (a QDQ model's small MatMuls between its
    DequantizeLinear nodes) the model stays float32, with the figures in the reasons and a note.
    The figures are the report's too (both from one pass over every use)."""
    from amp_rewrite.analysis.placement import estimates

    low = {v for v, c in plan.colour.items() if c == LOW}
    before, after = estimates(cg, (set(), low), low_io)
    if after <= before:
        return plan, None, (before, after)
    why = (
        f"cost placement: in {cg.target} the model would move {after / 1e6:.3f} MB by its estimate, "
        f"more than {before / 1e6:.3f} MB in float32, so it stays float32"
    )
    return all_float32(cg, plan, why), f"nothing pays: {why}", (before, before)


def all_float32(cg: ColouringGraph, plan: Plan, why: str) -> Plan:
    """`plan` with every vertex float32: the low ones for `why` (cost placement's estimate says
    the low-precision model would move more bytes), the rest with their own reasons."""
    reasons = {
        v: Reason(Step.COST_PLACEMENT, None, why) if c == LOW else plan.reason[v]
        for v, c in plan.colour.items()
    }
    return _freeze(cg, {}, reasons)


def _freeze(cg: ColouringGraph, low: dict, reasons: dict) -> Plan:
    colours = dict.fromkeys(range(len(cg.vertices)), FP32)  # in vertex order, set in C
    colours.update(dict.fromkeys(low, LOW))
    for v, vertex in enumerate(cg.vertices):
        if v not in reasons:
            reasons[v] = _unpainted(vertex)
    return Plan(MappingProxyType(colours), MappingProxyType(reasons))


def _unpainted(vertex) -> Reason:
    if vertex.blocked:
        return Reason(Step.BLOCKED, None, vertex.blocked)
    if vertex.op_list == "deny":
        return Reason(Step.DENY_LIST)
    if vertex.group.output_only:
        return Reason(
            Step.NOT_PAINTED,
            None,
            "output typed by an attribute: changed only when every reader is "
            "low precision and it is not a graph output",
        )
    if vertex.op_list in ("infer", "clear"):
        return Reason(Step.NOT_PAINTED, None, f"{vertex.op_list} op not between low-precision ops")
    return Reason(Step.NOT_PAINTED)
