"""What the rewrite decided and why: per node, per type group, and in summary figures.

Every vertex carries a Reason (step + the neighbour it came through); following `via` links gives
the chain a user reads, e.g. "Add 'a1' float32: downstream of deny through Reshape 'r1' from
Softmax 'sm' (deny list)".
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from amp_rewrite.graph import ColouringGraph
from amp_rewrite.paint import LOW, Plan

MAX_CHAIN = 32


def _label(cg: ColouringGraph, v: int) -> str:
    vertex = cg.vertices[v]
    return f"{vertex.op_type} '{vertex.name}'" if vertex.name else f"{vertex.op_type} (unnamed, scope {vertex.scope} #{vertex.node})"


def chain(cg: ColouringGraph, plan: Plan, v: int) -> list[str]:
    """The reason of `v`, then of the vertex it came through, and so on to the root."""
    steps = []
    seen = set()
    while v is not None and v not in seen and len(steps) < MAX_CHAIN:
        seen.add(v)
        reason = plan.reason[v]
        steps.append(f"{_label(cg, v)}: {reason.step}")
        v = reason.via
    return steps


def explain(cg: ColouringGraph, plan: Plan, v: int) -> str:
    vertex = cg.vertices[v]
    colour = cg.target if plan.colour[v] == LOW else "float32"
    parts = chain(cg, plan, v)
    head = f"{_label(cg, v)} [{vertex.group.type_param.split('@')[0]}] {colour}: {plan.reason[v].step}"
    if len(parts) > 1:
        head += " <- " + " <- ".join(parts[1:])
    return head


@dataclass
class Report:
    """Decisions and figures of one rewrite; `to_dict()` is what `--report` writes as JSON."""

    target: str
    summary: dict
    nodes: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"target": self.target, "summary": self.summary, "nodes": self.nodes, "notes": self.notes}

    def node(self, name: str) -> dict | None:
        return next((n for n in self.nodes if n["name"] == name), None)

    def to_text(self) -> str:
        s = self.summary
        lines = [
            f"target {self.target}: {s['nodes_low']} of {s['nodes_float']} float nodes in {self.target}"
            f" ({s['nodes_mixed']} mixed), {s['groups_low']} of {s['groups']} type groups",
            f"casts inserted: {s['casts_inserted']}; constants converted {s['constants_converted']},"
            f" duplicated {s['constants_duplicated']}",
            f"compute-heavy ops (allow list) in {self.target}: {s['allow_ops_low']}/{s['allow_ops']}"
            f" ({100 * s['allow_share']:.1f}%)",
            f"deny ops: {s['deny_ops']}, nodes they kept float32: {s['deny_blocked']}",
            f"model size: {s['bytes_before'] / 1e6:.2f} MB -> {s['bytes_after'] / 1e6:.2f} MB",
        ]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def build(cg: ColouringGraph, plan: Plan, materialised, *, bytes_before: int, bytes_after: int,
          seconds: float = 0.0) -> Report:
    by_node: dict = {}
    for v, vertex in enumerate(cg.vertices):
        by_node.setdefault((vertex.scope, vertex.node), []).append(v)
    nodes = []
    precision_counts = Counter()
    allow_ops = allow_low = 0
    for (scope, _), vs in by_node.items():
        first = cg.vertices[vs[0]]
        lows = [plan.colour[v] == LOW for v in vs if not cg.vertices[v].group.output_only or plan.colour[v] == LOW]
        precision = cg.target if lows and all(lows) else ("mixed" if any(lows) else "float32")
        precision_counts[precision] += 1
        if first.op_list == "allow":
            allow_ops += 1
            allow_low += precision != "float32"
        nodes.append({
            "name": first.name, "op_type": first.op_type, "scope": scope, "list": first.op_list,
            "precision": precision,
            "groups": {cg.vertices[v].group.type_param.split("@")[0]: {
                "precision": cg.target if plan.colour[v] == LOW else "float32",
                "reason": explain(cg, plan, v)} for v in vs},
        })
    deny_roots = sum(1 for (s, n), vs in by_node.items() if cg.vertices[vs[0]].op_list == "deny")
    deny_blocked = len({(cg.vertices[v].scope, cg.vertices[v].node) for v, r in plan.reason.items()
                        if r.step == "downstream of deny"})
    summary = {
        "groups": len(cg.vertices),
        "groups_low": sum(1 for c in plan.colour.values() if c == LOW),
        "nodes_float": len(by_node),
        "nodes_low": precision_counts[cg.target],
        "nodes_mixed": precision_counts["mixed"],
        "nodes_float32": precision_counts["float32"],
        "casts_inserted": len(materialised.casts),
        "constants_converted": materialised.converted_constants,
        "constants_duplicated": materialised.duplicated_constants,
        "values_clamped": materialised.clamped_values,
        "allow_ops": allow_ops,
        "allow_ops_low": allow_low,
        "allow_share": allow_low / allow_ops if allow_ops else 0.0,
        "deny_ops": deny_roots,
        "deny_blocked": deny_blocked,
        "bytes_before": bytes_before,
        "bytes_after": bytes_after,
        "seconds": round(seconds, 4),
    }
    notes = [f"{_node_label(cg, s, n)}: {text}" for s, n, text in cg.notes]
    return Report(cg.target, summary, nodes, notes)


def _node_label(cg: ColouringGraph, s: int, n: int) -> str:
    node = cg.node(s, n)
    return f"{node.op_type} '{node.name}'" if node.name else f"{node.op_type} (scope {s} #{n})"
