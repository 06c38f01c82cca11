"""What the rewrite decided and why: per node, per type group, and in summary figures.

The sentences come from `sentences.py`, the FLOPs and weight bytes from `node_flops.py`; this module
assembles them into the `Report` that `--report` writes and the HTML picture draws.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field

from amp_rewrite.analysis import kernels
from amp_rewrite.analysis.graph import ColouringGraph
from amp_rewrite.flops import HEAVY
from amp_rewrite.plan import LOW, Plan, Step
from amp_rewrite.report import picture_graph
from amp_rewrite.report.sentences import explain, removed, sentence

SHOWN_PINS = 10  # the text shows the fallback's first pins; the report and --report JSON keep them all


@dataclass(repr=False)
class Report:
    """Decisions and figures of one rewrite; `to_dict()` is what `--report` writes as JSON."""

    def __repr__(self) -> str:
        return f"<Report {self.target}: {len(self.nodes)} nodes, sections {sorted(self.sections) or 'none'}>"

    target: str
    make_summary: object  # builds the summary figures on first use
    make_nodes: object = list  # builds the per-node entries on first use: a caller that wants only the model never pays for sentences
    notes: list = field(default_factory=list)
    sections: dict = field(default_factory=dict)  # "calibration", "validation", "fallback" when run
    casts: list = field(default_factory=list)  # (scope, Cast node name, tensor, to, output) per inserted Cast
    picture_facts: object = None  # () -> report.picture_graph.Facts: the main graph as read, where casts sit
    make_precisions: object = dict  # (scope, node index) -> (name, precision): no sentences, no figures
    _summary: dict | None = field(default=None, repr=False)
    _nodes: list | None = field(default=None, repr=False)

    @property
    def summary(self) -> dict:
        """Counts, shares, FLOPs, bytes and seconds of the rewrite (see `build`)."""
        if self._summary is None:
            self._summary = self.make_summary()
        return self._summary

    @property
    def nodes(self) -> list:
        """Per node: name, op type, list, precision, FLOPs, the sentence and each group's chain."""
        if self._nodes is None:
            self._nodes = self.make_nodes()
        return self._nodes

    @property
    def precisions(self) -> dict:
        """(scope, node index) -> (name, precision) per float node, removed Casts included: what the
        accuracy fallback reads after every candidate, without building sentences or figures."""
        return self.make_precisions()

    def to_dict(self) -> dict:
        out = {"target": self.target, "summary": self.summary, "nodes": self.nodes, "notes": self.notes}
        out.update(self.sections)
        return out

    def op_table(self) -> list[dict]:
        """Per op type: node count and how many are low precision, mixed, float32 (nodes of the
        result: removed Casts left out)."""
        rows: dict = {}
        for n in self.nodes:
            if n.get("removed"):  # not in the result
                continue
            row = rows.setdefault(
                n["op_type"],
                {
                    "op_type": n["op_type"],
                    "list": n["list"],
                    "nodes": 0,
                    self.target: 0,
                    "mixed": 0,
                    "float32": 0,
                },
            )
            row["nodes"] += 1
            row[n["precision"]] += 1
            lists = set(str(row["list"]).split("/")) | {str(n["list"])}
            row["list"] = "/".join(sorted(x for x in lists if x != "None")) or None
        return sorted(rows.values(), key=lambda r: (-r["nodes"], r["op_type"]))

    def explain(self, name: str) -> list[str]:
        """The sentence and chain of every type group of node `name` (empty if unknown)."""
        node = self.node(name)
        if node is None:
            return []
        return [f"{g['because']}\n    chain: {g['reason']}" for g in node["groups"].values()]

    def table_text(self) -> str:
        rows = self.op_table()
        head = f"{'op type':<24}{'list':<12}{'nodes':>7}{self.target:>10}{'mixed':>7}{'float32':>9}"
        lines = [head, "-" * len(head)]
        for r in rows:
            lines.append(
                f"{r['op_type']:<24}{str(r['list'] or '-'):<12}{r['nodes']:>7}{r[self.target]:>10}"
                f"{r['mixed']:>7}{r['float32']:>9}"
            )
        return "\n".join(lines)

    def node(self, name: str) -> dict | None:
        return next((n for n in self.nodes if n["name"] == name), None)

    def to_text(self) -> str:
        s = self.summary
        lines = [
            f"target {self.target}: {s['nodes_low']} of {s['nodes_float']} float nodes in {self.target}"
            f" ({s['nodes_mixed']} mixed), {s['groups_low']} of {s['groups']} type groups",
            (
                f"coloured for ONNX Runtime's {s['coloured_for']} provider: ops its {self.target} "
                "kernels cannot run (by type or by attribute) stay float32"
                if s.get("coloured_for")
                else "coloured without a kernel check (provider any): it may need casts where it runs"
            ),
            f"casts inserted: {s['casts_inserted']}"
            + (
                f", the model's own removed (converting nothing): {s['casts_removed']}"
                if s.get("casts_removed")
                else ""
            )
            + f"; constants converted {s['constants_converted']}, duplicated {s['constants_duplicated']}",
            f"compute-heavy ops (allow list) in {self.target}: {s['allow_ops_low']}/{s['allow_ops']}"
            f" ({100 * s['allow_share']:.1f}%)",
            f"deny ops: {s['deny_ops']}, nodes they kept float32: {s['deny_blocked']}",
            *(
                [
                    f"nodes kept float32 for want of a {self.target} kernel on the provider: {s['kernel_blocked']}"
                ]
                if s.get("kernel_blocked")
                else []
            ),
            *(
                [
                    f"deny ops relaxed to infer (every float16 value checked, or calibrated): {s['deny_relaxed']}"
                ]
                if s.get("deny_relaxed")
                else []
            ),
            f"model size: {s['bytes_before'] / 1e6:.2f} MB -> {s['bytes_after'] / 1e6:.2f} MB",
        ]
        if "bytes_moved" in s:
            sized = "".join(f", {name}={size}" for name, size in s.get("dims", {}).items())
            lines.insert(
                -1,
                f"estimated bytes moved ({s['placement']} placement{sized}): "
                f"{s['bytes_moved_float32'] / 1e6:.3f} MB in float32 -> {s['bytes_moved'] / 1e6:.3f} MB",
            )
        if "low_by_list" in s:
            lines.insert(
                1,
                "low-precision nodes by list: "
                + (", ".join(f"{k} {v}" for k, v in s["low_by_list"].items()) or "none"),
            )
        if s.get("flops_total"):
            lines.insert(
                -1,
                f"compute-heavy FLOPs in {self.target}: {100 * s['flops_share']:.1f}% of "
                f"{s['flops_total']:.3g} (shapes known for {s['flops_ops_known']}/{s['allow_ops']} ops)",
            )
        if "weight_bytes_before" in s:
            lines.insert(
                -1,
                f"weights: {s['weight_bytes_before'] / 1e6:.3f} MB -> {s['weight_bytes_after'] / 1e6:.3f} MB",
            )
        cal = self.sections.get("calibration")
        if cal:
            lines.append(
                f"calibration: {cal['samples']} sample(s), {cal['tensors']} tensors measured, "
                f"{len(cal['forced'])} node(s) forced float32"
            )
            lines += [f"  {f['node']}: {f['reason']}" for f in cal["forced"]]
            held = [s["tensor"] for s in cal.get("sentinels", ())]
            if held:
                lines.append(
                    f"calibration: {len(held)} tensor(s) held +-finfo(float32).max sentinels, not counted as "
                    f"overflow: {', '.join(map(repr, held[:5]))}{', ...' if len(held) > 5 else ''}"
                )
            if cal.get("relaxed"):
                lines.append(
                    f"calibration relaxed {len(cal['relaxed'])} deny op(s) to infer "
                    f"(margin {cal['relax_margin']:g})"
                )
                lines += [f"  {r['node']}: {r['reason']}" for r in cal["relaxed"]]
        scaled = self.sections.get("scaling")
        if scaled:
            lines.append(
                f"power-of-two scaling: {len(scaled['regions'])} region(s) computed on scaled values "
                f"(limit {scaled['threshold']:.6g})"
            )
            lines += [
                f"  region {r['region']!r} ({len(r['nodes'])} nodes): x 2^-{r['k']}, calibrated max "
                f"{r['max_abs']:.4g} at {r['tensor']!r}"
                for r in scaled["regions"]
            ]
        fb = self.sections.get("fallback")
        if fb:
            pinned = fb["pinned"]
            lines.append(
                f"fallback: {'passed' if fb['passed'] else 'NOT passed'} after {fb['validation_runs']} "
                f"validation run(s); {len(pinned)} node(s) pinned float32"
                + (
                    f", the first {SHOWN_PINS} (largest error jumps; --report lists all):"
                    if len(pinned) > SHOWN_PINS
                    else ":"
                    if pinned
                    else ""
                )
            )
            lines += [f"  {key}: {fb['reasons'].get(key, '')}" for key in pinned[:SHOWN_PINS]]
        rc = self.sections.get("recompute")
        if rc:
            lines.append(
                f"recomputed segments ({len(rc['segments'])}): "
                + ", ".join(f"{s['name']} ({s['nodes']} nodes)" for s in rc["segments"])
            )
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _node_entry(cg: ColouringGraph, plan: Plan, key, vs, precision, flops, gone: str | None = None) -> dict:
    """`gone`: why the node was removed (a Cast of the model that converts nothing), else None."""
    first = cg.vertices[vs[0]]
    entry = {
        "name": first.name,
        "op_type": first.op_type,
        "scope": key[0],
        "index": key[1],
        "list": first.op_list,
        "precision": precision,
        "flops": flops,
        "because": sentence(cg, plan, vs[0]),
        "step": plan.reason[vs[0]].step.value,
        "groups": {
            cg.vertices[v].group.type_param.split("@")[0]: {
                "precision": cg.target if plan.colour[v] == LOW else "float32",
                "reason": explain(cg, plan, v),
                "because": sentence(cg, plan, v),
                "step": plan.reason[v].step.value,
            }
            for v in vs
        },
    }
    if first.relaxed:  # a deny op made an infer op: why
        entry["relaxed"] = first.relaxed
    if gone is not None:  # its groups keep their colours' reasons; the node says it is gone
        entry.update(removed=True, because=removed(cg, vs[0], gone), step=Step.REMOVED_NO_OP.value)
    return entry


def build(
    cg: ColouringGraph,
    plan: Plan,
    materialised,
    *,
    bytes_before: int,
    bytes_after: int,
    seconds: float = 0.0,
    weights_before: int | None = None,
    weights_after: int | None = None,
    node_flops: dict | None = None,
    moved=None,
    coloured_for: str | None = None,
) -> Report:
    """The report of one rewrite. Its figures and per-node entries are worked out on first use:
    a caller that wants only the model (an export pipeline) does not pay for them. `coloured_for`:
    the provider whose kernels the colouring respected ("cuda", "cpu"; None: no kernel check)."""

    @functools.cache
    def grouped():
        """{(scope, node index): [vertex]}, {(scope, node index): precision}."""
        vertices, colour = cg.vertices, plan.colour
        by_node: dict = {}
        for v, vertex in enumerate(vertices):
            key = (vertex.scope, vertex.node)
            if key in by_node:
                by_node[key].append(v)
            else:
                by_node[key] = [v]
        precisions = {}
        for key, vs in by_node.items():
            lows = [colour[v] == LOW for v in vs if colour[v] == LOW or not vertices[v].group.output_only]
            precisions[key] = cg.target if lows and all(lows) else ("mixed" if any(lows) else "float32")
        return by_node, precisions

    @functools.cache
    def figures():
        vertices = cg.vertices
        by_node, precisions = grouped()
        flops_of = {}
        gone = {(s, n) for s, n, *_ in materialised.removed_casts}  # not in the result: not counted
        precision_counts = Counter()
        allow_ops = allow_low = 0
        low_by_list = Counter()
        flops_total = flops_low = 0
        flops_known = 0
        for key, vs in by_node.items():
            first = vertices[vs[0]]
            precision = precisions[key]
            if gone and key in gone:
                continue
            precision_counts[precision] += 1
            if precision != "float32":
                low_by_list[first.op_list or "none"] += 1
            if first.op_list == "allow" or (first.forced and first.op_type in HEAVY):
                allow_ops += 1
                allow_low += precision != "float32"
                flops = flops_of[key] = (node_flops or {}).get(key)
                if flops is not None:
                    flops_known += 1
                    flops_total += flops
                    flops_low += flops if precision != "float32" else 0
        no_kernel = sum(
            1 for vs in by_node.values() if any(kernels.is_kernel_reason(vertices[v].blocked) for v in vs)
        )
        deny_roots = sum(1 for vs in by_node.values() if cg.vertices[vs[0]].op_list == "deny")
        deny_blocked = len(
            {
                (cg.vertices[v].scope, cg.vertices[v].node)
                for v, r in plan.reason.items()
                if r.step is Step.DOWNSTREAM_OF_DENY
            }
        )
        summary = {
            "coloured_for": kernels.provider_name(coloured_for),
            "groups": len(cg.vertices),
            "groups_low": sum(1 for c in plan.colour.values() if c == LOW),
            "nodes_float": len(by_node) - len(gone),
            "nodes_low": precision_counts[cg.target],
            "nodes_mixed": precision_counts["mixed"],
            "nodes_float32": precision_counts["float32"],
            "casts_inserted": len(materialised.casts),
            "casts_removed": len(materialised.removed_casts),  # the model's own, converting nothing
            "constants_converted": materialised.converted_constants,
            "constants_duplicated": materialised.duplicated_constants,
            "values_clamped": materialised.clamped_values,
            "allow_ops": allow_ops,
            "allow_ops_low": allow_low,
            "allow_share": allow_low / allow_ops if allow_ops else 0.0,
            "low_by_list": dict(sorted(low_by_list.items())),
            "flops_total": flops_total,
            "flops_low": flops_low,
            "flops_share": flops_low / flops_total if flops_total else 0.0,
            "flops_ops_known": flops_known,
            "deny_ops": deny_roots,
            "deny_blocked": deny_blocked,
            "kernel_blocked": no_kernel,
            "deny_relaxed": sum(1 for vs in by_node.values() if cg.vertices[vs[0]].relaxed),
            "bytes_before": bytes_before,
            "bytes_after": bytes_after,
            "seconds": round(seconds, 4),
        }
        if moved is not None:  # estimated bytes moved (placement.estimate): a pass of its own, on first use
            summary.update(moved())
        if weights_before is not None:
            summary["weight_bytes_before"] = weights_before
            summary["weight_bytes_after"] = weights_after

        return summary, by_node, precisions, flops_of

    def make_nodes():
        _, by_node, precisions, flops_of = figures()
        gone = {(s, n): why for s, n, _, _, _, why in materialised.removed_casts}
        return [
            _node_entry(cg, plan, key, vs, precisions[key], flops_of.get(key), gone.get(key))
            for key, vs in by_node.items()
        ]

    def make_precisions():
        by_node, precisions = grouped()
        return {key: (cg.vertices[vs[0]].name, precisions[key]) for key, vs in by_node.items()}

    return Report(
        cg.target,
        lambda: figures()[0],
        make_nodes,
        [f"{label}: {text}" for label, text in cg.notes],
        casts=materialised.casts,
        picture_facts=functools.partial(picture_graph.facts, cg, materialised),
        make_precisions=make_precisions,
    )
