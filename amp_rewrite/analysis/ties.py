"""Vertices that must share one colour: the producer and readers of a value no Cast can convert.

A sequence (SequenceInsert's S, SplitToSequence's output) cannot be cast: the ops that make and
read it take one element type, so they are coloured as one (TensorFlow does the same for the
TensorList ops that share a list handle: `ForceColorMatchBetweenTensorListOps`). A cluster is the
set of vertices joined by such values (union-find, linear). Its rules, TF's:
- a member that may never be low (blocked, or a value with a fixed end: a graph input or output,
  a node with no vertex) pins the whole cluster to float32;
- after deny propagation, a deny member makes every member deny; else an allow member makes every
  member allow (then TF's between-allow and clear passes see them);
- after the passes, a low member makes every member low (they are all paintable by then);
- cost placement joins the members by infinite edges, so the cut never separates them.
"""

from __future__ import annotations

from dataclasses import dataclass

from amp_rewrite.plan import Reason, Step


@dataclass
class Cluster:
    members: list  # vertices, in the order they were joined
    pinned: Reason | None  # why every member stays float32, or None


def clusters(cg) -> list[Cluster]:
    """The clusters of `cg.tied_tensors`, each with the reason it is pinned float32 (if it is)."""
    if not cg.tied_tensors:
        return []
    parent: dict = {}

    def find(v):
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    def join(a, b):
        parent.setdefault(a, a)
        parent.setdefault(b, b)
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[rb] = ra

    pins: dict = {}  # a member vertex -> the reason its cluster is pinned
    for s, name in dict.fromkeys(cg.tied_tensors):
        found = cg.resolve(s, name)
        if found is None:
            continue
        kind, n, slot = found.definition
        producer = None
        if kind == "node":
            row = cg.writes[found.scope][n]
            producer = row[slot] if row else None
        ends = []
        if producer is not None and not cg.vertices[producer].group.output_only:
            ends.append(
                producer
            )  # an output typed by an attribute follows its readers (SequenceEmpty's dtype)
        fixed = None
        if producer is None:
            fixed = f"sequence '{name}' comes from {'a graph input' if kind != 'node' else 'a node of fixed type'}"
        for use_scope, node, use_slot in cg.uses.get((found.scope, name), ()):
            reader = cg.input_vertex(use_scope, node, use_slot)
            if reader is None:
                fixed = fixed or (
                    f"sequence '{name}' is a graph output"
                    if node < 0
                    else f"sequence '{name}' is read by {cg.scopes[use_scope].op_types[node]}, "
                    "whose type is fixed"
                )
            else:
                ends.append(reader)
        for v in ends:
            join(ends[0], v)
        if fixed and ends:
            pins.setdefault(
                ends[0], Reason(Step.TIED, None, f"{fixed}: it and every op tied to it stay float32")
            )
    for v in parent:
        vertex = cg.vertices[v]
        if vertex.blocked is not None:
            pins.setdefault(
                v,
                Reason(
                    Step.TIED,
                    v,
                    f"tied by a sequence to {vertex.op_type} '{vertex.name}', "
                    f"which stays float32 ({vertex.blocked})",
                ),
            )
    grouped: dict = {}
    for v in parent:
        grouped.setdefault(find(v), []).append(v)
    out = []
    for members in grouped.values():
        pin = next((pins[v] for v in members if v in pins), None)
        out.append(Cluster(members, pin))
    return out


def pinned(cg, found: list) -> dict:
    """vertex -> reason, for every member of a pinned cluster (they leave the passes as float32)
    that is not blocked already (a blocked one keeps its own reason)."""
    return {
        v: c.pinned
        for c in found
        if c.pinned is not None
        for v in c.members
        if cg.vertices[v].blocked is None
    }


def spread_deny_and_allow(found: list, allow: dict, deny: dict) -> None:
    """TF's pass 2b, in place: a deny member makes its cluster deny; else an allow member, allow."""
    for c in found:
        if c.pinned is not None:
            continue
        source = next((v for v in c.members if v in deny), None)
        if source is not None:
            for v in c.members:
                if v not in deny:
                    deny[v] = Reason(Step.TIED, source, "tied by a sequence to a float32 op")
                allow.pop(v, None)
            continue
        source = next((v for v in c.members if v in allow), None)
        if source is not None:
            for v in c.members:
                allow.setdefault(v, Reason(Step.TIED, source, "tied by a sequence to a low-precision op"))


def match_low(found: list, low: dict) -> dict:
    """TF's pass 6b: the members of a cluster with a low member, all low (the unpinned ones)."""
    painted = {}
    for c in found:
        if c.pinned is not None:
            continue
        source = next((v for v in c.members if v in low), None)
        if source is not None:
            painted.update(
                (v, Reason(Step.TIED, source, "tied by a sequence to a low-precision op"))
                for v in c.members
                if v not in low
            )
    return painted
