"""A self-contained HTML page of a rewrite: summary, checks, per-op-type table, and the graph.

No network, no scripts: inline CSS and an inline SVG. The main graph is drawn top to bottom, one
row per topological depth, each node coloured by precision (hover for its reason). Graphs over
`MAX_NODES` nodes are collapsed into regions (by node-name prefix when names have a usable one,
else by consecutive topological chunks); a region is a box with a bar of its precision shares,
and region edges follow the tensors between them.
"""

from __future__ import annotations

import html
import math
from collections import Counter, defaultdict

import networkx as nx
import onnx

from amp_rewrite.analysis.paint import Step

MAX_NODES = 120
MAX_REGIONS = 48
COLOURS = {"low": "#26a269", "float32": "#e66100", "mixed": "#9141ac", "other": "#b8b8b8"}

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1300px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
.sub{color:#666;margin-bottom:16px}
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{border:1px solid #ddd;border-radius:8px;padding:8px 12px;min-width:150px;background:#fafafa}
.card b{display:block;font-size:20px} .card span{color:#666;font-size:12px}
table{border-collapse:collapse;font-size:13px;margin:6px 0} th,td{border:1px solid #ddd;padding:3px 8px;text-align:right}
th{background:#f2f2f2} td.l,th.l{text-align:left} .bad{color:#b00020;font-weight:600} .ok{color:#1a7f37;font-weight:600}
.legend span{display:inline-block;margin-right:14px;font-size:13px} .sw{display:inline-block;width:12px;height:12px;
border-radius:2px;margin-right:4px;vertical-align:-1px}
.graph{overflow:auto;border:1px solid #ddd;border-radius:8px;max-height:900px;background:#fff}
details{margin:8px 0} code{font-size:12px}
"""


def _e(x) -> str:
    return html.escape(str(x), quote=True)


def _kind(precision: str | None, target: str) -> str:
    if precision is None:
        return "other"
    return "low" if precision == target else precision


def _card(value, label) -> str:
    return f'<div class="card"><b>{_e(value)}</b><span>{_e(label)}</span></div>'


def _mb(n) -> str:
    return f"{n / 1e6:.3f} MB" if n >= 1e4 else f"{n} B"


def _summary(report) -> str:
    s = report.summary
    cards = [
        _card(f"{s['nodes_low']}/{s['nodes_float']}", f"float nodes in {report.target}"),
        _card(s["nodes_float32"], "float nodes kept float32"),
        _card(s["casts_inserted"], "casts inserted"),
        _card(f"{100 * s['allow_share']:.0f}%", f"compute-heavy ops in {report.target} ({s['allow_ops_low']}/{s['allow_ops']})"),
        _card(f"{s['deny_ops']} / {s['deny_blocked']}", "deny ops / nodes they kept float32"),
    ]
    if s.get("flops_total"):
        cards.append(_card(f"{100 * s['flops_share']:.0f}%", f"FLOPs in {report.target} (of {s['flops_total']:.3g})"))
    if "weight_bytes_before" in s:
        cards.append(_card(f"{_mb(s['weight_bytes_before'])} → {_mb(s['weight_bytes_after'])}", "float weights"))
    by_list = ", ".join(f"{k} {v}" for k, v in s.get("low_by_list", {}).items()) or "none"
    return (f'<div class="cards">{"".join(cards)}</div>'
            f'<p>Low-precision nodes by list: {_e(by_list)}.</p>')


def _op_table(report) -> str:
    t = report.target
    rows = "".join(
        f"<tr><td class=l>{_e(r['op_type'])}</td><td class=l>{_e(r['list'] or '-')}</td><td>{r['nodes']}</td>"
        f"<td>{r[t]}</td><td>{r['mixed']}</td><td>{r['float32']}</td></tr>" for r in report.op_table())
    return (f"<table><tr><th class=l>op type</th><th class=l>list</th><th>nodes</th><th>{_e(t)}</th><th>mixed</th>"
            f"<th>float32</th></tr>{rows}</table>")


def _checks(report) -> str:
    out = []
    cal = report.sections.get("calibration")
    if cal:
        rows = "".join(f"<tr><td class=l><code>{_e(c['tensor'])}</code></td><td class=l>{_e(c['op_type'])} "
                       f"<code>{_e(c['producer'])}</code></td><td>{c['max_abs']:.4g}</td></tr>" for c in cal["culprits"])
        out.append(f"<h2>Calibration</h2><p>{cal['samples']} sample(s) on {_e(cal['provider'])}, "
                   f"{cal['tensors']} float tensors measured; limit {cal['threshold']:.6g} "
                   f"(largest finite value / {cal['safety']:g}). {len(cal['forced'])} node(s) forced float32.</p>")
        if rows:
            out.append("<table><tr><th class=l>tensor over the limit</th><th class=l>produced by</th><th>max |x|</th>"
                       f"</tr>{rows}</table>")
    v = report.sections.get("validation")
    if v:
        verdict = '<span class="ok">PASSED</span>' if v["passed"] else '<span class="bad">FAILED</span>'
        rows = []
        for run, stats in v["runs"].items():
            for s in stats:
                top1 = "-" if s.get("top1") is None else f"{s['top1']:.3f}"
                ok = '<span class="ok">yes</span>' if s["passed"] else '<span class="bad">no</span>'
                rows.append(f"<tr><td class=l>{_e(run)}</td><td class=l>{_e(s['name'])}</td><td>{s['max_abs']:.3g}</td>"
                            f"<td>{s['max_rel']:.3g}</td><td>{s['cosine']:.6f}</td><td>{s['nan']}</td><td>{s['inf']}</td>"
                            f"<td>{top1}</td><td>{ok}</td></tr>")
        notes = "".join(f"<li>{_e(n)}</li>" for n in v.get("notes", []))
        out.append(f"<h2>Validation</h2><p>{verdict} on {_e(v['provider'])}, {v['samples']} sample(s), "
                   f"rtol {v['rtol']:g}, atol {v['atol']:g}.</p><table><tr><th class=l>run</th><th class=l>output</th>"
                   f"<th>max abs</th><th>max rel</th><th>cosine</th><th>NaN</th><th>Inf</th><th>top-1</th><th>ok</th></tr>"
                   f"{''.join(rows)}</table>" + (f"<ul>{notes}</ul>" if notes else ""))
    fb = report.sections.get("fallback")
    if fb:
        pins = "".join(f"<li><code>{_e(k)}</code>: {_e(r)}</li>" for k, r in fb["reasons"].items())
        out.append(f"<h2>Accuracy fallback</h2><p>{'Passed' if fb['passed'] else 'Not passed'} after "
                   f"{fb['validation_runs']} validation run(s); {len(fb['pinned'])} node(s) pinned float32.</p>"
                   f"<ul>{pins}</ul>")
    return "".join(out)


# --- the picture -----------------------------------------------------------------------------------

def _main_graph(model: onnx.ModelProto) -> nx.DiGraph:
    g = nx.DiGraph()
    nodes = model.graph.node
    g.add_nodes_from(range(len(nodes)))
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    for i, n in enumerate(nodes):
        for x in n.input:
            if x in producer and producer[x] != i:
                g.add_edge(producer[x], i)
    return g


def _depths(g: nx.DiGraph) -> dict:
    depth = {}
    order = list(nx.topological_sort(g)) if nx.is_directed_acyclic_graph(g) else list(g.nodes)
    for v in order:
        depth[v] = max((depth.get(p, 0) + 1 for p in g.predecessors(v) if p in depth), default=0)
    return depth


def _regions(model: onnx.ModelProto, order: list) -> list[list[int]]:
    """Group node indices by the longest name prefix that gives few enough regions, else by chunks."""
    names = [n.name for n in model.graph.node]
    parts = [[p for p in name.replace(".", "/").split("/") if p][:-1] if name else [] for name in names]
    best = None
    for depth in range(1, 6):
        keys = ["/".join(p[:depth]) if p else "" for p in parts]
        distinct = len(set(keys))
        if "" in set(keys) and keys.count("") > len(keys) // 4:
            break
        if 2 <= distinct <= MAX_REGIONS:
            best = keys
        elif distinct > MAX_REGIONS:
            break
    if best is not None:
        groups: dict = defaultdict(list)
        for i in order:
            groups[best[i] or "(unnamed)"].append(i)
        return list(groups.values())
    size = math.ceil(len(order) / min(MAX_REGIONS, 40))
    return [order[i:i + size] for i in range(0, len(order), size)]


def _layer_positions(dag: nx.DiGraph, width: int, box_w: int, box_h: int, gap_x: int, gap_y: int):
    depth = _depths(dag)
    rows: dict = defaultdict(list)
    for v in sorted(dag.nodes, key=lambda v: (depth[v], v)):
        rows[depth[v]].append(v)
    pos = {}
    widest = max((len(r) for r in rows.values()), default=1)
    total_w = max(width, widest * (box_w + gap_x) + gap_x)
    for d, members in rows.items():
        row_w = len(members) * (box_w + gap_x) - gap_x
        x0 = (total_w - row_w) / 2
        for j, v in enumerate(members):
            pos[v] = (x0 + j * (box_w + gap_x), 20 + d * (box_h + gap_y))
    height = 40 + (max(rows) + 1 if rows else 1) * (box_h + gap_y)
    return pos, total_w, height


def _edge(x1, y1, x2, y2) -> str:
    my = (y1 + y2) / 2
    return f'<path d="M{x1:.1f},{y1:.1f} C{x1:.1f},{my:.1f} {x2:.1f},{my:.1f} {x2:.1f},{y2:.1f}" />'


def _picture(report, model: onnx.ModelProto) -> str:
    g = _main_graph(model)
    info = {n["index"]: n for n in report.nodes if n.get("scope") == 0 and n.get("index") is not None}
    nodes = model.graph.node
    if not len(nodes):
        return "<p>(empty graph)</p>"

    def flagged(i):
        n = info.get(i)
        if not n or n["precision"] != "float32":
            return False
        return n.get("step") == Step.MEASURED.value  # a deny root by calibration or the fallback

    if len(nodes) <= MAX_NODES:
        box_w, box_h = 128, 34
        pos, w, h = _layer_positions(g, 900, box_w, box_h, 14, 26)
        parts = ['<g stroke="#999" fill="none" stroke-width="1.2" marker-end="url(#arrow)">']
        parts += [_edge(pos[a][0] + box_w / 2, pos[a][1] + box_h, pos[b][0] + box_w / 2, pos[b][1]) for a, b in g.edges]
        parts.append("</g>")
        for i, node in enumerate(nodes):
            x, y = pos[i]
            n = info.get(i)
            kind = _kind(n["precision"] if n else None, report.target)
            tip = (n["because"] if n else f"{node.op_type} '{node.name}': no float32 tensors")
            stroke = ' stroke="#7a0000" stroke-width="3"' if flagged(i) else ' stroke="#333" stroke-width="0.6"'
            label = node.name if len(node.name) <= 18 else "…" + node.name[-17:]
            parts.append(f'<g><title>{_e(tip)}</title><rect x="{x:.1f}" y="{y:.1f}" width="{box_w}" height="{box_h}" '
                         f'rx="6" fill="{COLOURS[kind]}"{stroke}/><text x="{x + box_w / 2:.1f}" y="{y + 14:.1f}" '
                         f'text-anchor="middle" font-size="11" font-weight="600" fill="#fff">{_e(node.op_type)}</text>'
                         f'<text x="{x + box_w / 2:.1f}" y="{y + 27:.1f}" text-anchor="middle" font-size="9" '
                         f'fill="#fff">{_e(label)}</text></g>')
        caption = f"{len(nodes)} nodes, one per box; hover a box for its reason."
    else:
        depth = _depths(g)
        order = sorted(g.nodes, key=lambda v: (depth[v], v))
        regions = _regions(model, order)
        region_of = {i: r for r, members in enumerate(regions) for i in members}
        rg = nx.DiGraph()
        rg.add_nodes_from(range(len(regions)))
        rg.add_edges_from({(region_of[a], region_of[b]) for a, b in g.edges if region_of[a] != region_of[b]})
        cond = nx.condensation(rg)  # a prefix can be entered twice: lay out strongly connected parts together
        box_w, box_h = 170, 52
        cpos, w, h = _layer_positions(cond, 900, box_w, box_h, 18, 30)
        pos = {}
        for c, (x, y) in cpos.items():
            for k, r in enumerate(sorted(cond.nodes[c]["members"])):
                pos[r] = (x + 6 * k, y + 6 * k)
        parts = ['<g stroke="#999" fill="none" stroke-width="1.2" marker-end="url(#arrow)">']
        parts += [_edge(pos[a][0] + box_w / 2, pos[a][1] + box_h, pos[b][0] + box_w / 2, pos[b][1])
                  for a, b in rg.edges if pos[a][1] < pos[b][1]]
        parts.append("</g>")
        for r, members in enumerate(regions):
            x, y = pos[r]
            counts = Counter(_kind(info[i]["precision"] if i in info else None, report.target) for i in members)
            names = [nodes[i].name for i in members if nodes[i].name]
            title = _common_prefix(names) or f"nodes {min(members)}…{max(members)}"
            flags = sum(flagged(i) for i in members)
            ops = Counter(nodes[i].op_type for i in members).most_common(3)
            tip = (f"{title}: {len(members)} nodes; " + ", ".join(f"{k} {v}" for k, v in counts.items())
                   + "; top ops " + ", ".join(f"{o}×{c}" for o, c in ops)
                   + (f"; {flags} kept float32 by calibration/fallback" if flags else ""))
            stroke = ' stroke="#7a0000" stroke-width="3"' if flags else ' stroke="#333" stroke-width="0.6"'
            bar, bx = [], x + 8
            for kind in ("low", "mixed", "float32", "other"):
                share = counts.get(kind, 0) / len(members)
                if share:
                    bar.append(f'<rect x="{bx:.1f}" y="{y + 32:.1f}" width="{share * (box_w - 16):.1f}" height="12" '
                               f'fill="{COLOURS[kind]}"/>')
                    bx += share * (box_w - 16)
            label = title if len(title) <= 24 else "…" + title[-23:]
            parts.append(f'<g><title>{_e(tip)}</title><rect x="{x:.1f}" y="{y:.1f}" width="{box_w}" height="{box_h}" '
                         f'rx="6" fill="#f7f7f7"{stroke}/><text x="{x + 8:.1f}" y="{y + 15:.1f}" font-size="11" '
                         f'font-weight="600">{_e(label)}</text><text x="{x + 8:.1f}" y="{y + 27:.1f}" font-size="10" '
                         f'fill="#555">{len(members)} nodes, {counts.get("low", 0)} in {_e(report.target)}</text>'
                         f'{"".join(bar)}</g>')
        caption = (f"{len(nodes)} nodes collapsed into {len(regions)} regions; each bar shows the region's shares. "
                   "Hover a region for details.")
    defs = ('<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="6" markerHeight="6" '
            'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#999"/></marker></defs>')
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{w:.0f}" height="{h:.0f}" '
           f'viewBox="0 0 {w:.0f} {h:.0f}" font-family="system-ui,sans-serif">{defs}{"".join(parts)}</svg>')
    legend = "".join(f'<span><i class="sw" style="background:{COLOURS[k]}"></i>{_e(label)}</span>' for k, label in
                     (("low", report.target), ("float32", "float32"), ("mixed", "mixed"), ("other", "no float tensors")))
    legend += '<span><i class="sw" style="border:3px solid #7a0000;width:8px;height:8px"></i>kept float32 by calibration / fallback</span>'
    return f'<p class="legend">{legend}</p><p class="sub">{_e(caption)}</p><div class="graph">{svg}</div>'


def _common_prefix(names: list[str]) -> str:
    if not names:
        return ""
    first, last = min(names), max(names)
    k = 0
    while k < min(len(first), len(last)) and first[k] == last[k]:
        k += 1
    prefix = first[:k]
    return prefix.rstrip("/._") if "/" in prefix or "." in prefix or len(names) == 1 else prefix


def _node_table(report) -> str:
    rows = "".join(f"<tr><td class=l><code>{_e(n['name'])}</code></td><td class=l>{_e(n['op_type'])}</td>"
                   f"<td class=l>{_e(n['precision'])}</td><td class=l>{_e(n['because'])}</td></tr>"
                   for n in report.nodes[:5000])
    more = f"<p>… and {len(report.nodes) - 5000} more in the JSON report.</p>" if len(report.nodes) > 5000 else ""
    return (f"<details><summary>Every float node and why ({len(report.nodes)})</summary><table><tr><th class=l>node</th>"
            f"<th class=l>op</th><th class=l>precision</th><th class=l>reason</th></tr>{rows}</table>{more}</details>")


def render(report, model: onnx.ModelProto, title: str | None = None) -> str:
    """The page for `report` of a rewrite of `model` (the original ModelProto)."""
    title = title or (model.graph.name or "model")
    notes = "".join(f"<li>{_e(n)}</li>" for n in report.notes)
    return (
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8>"
        f"<title>amp-rewrite: {_e(title)}</title><style>{CSS}</style></head><body>"
        f"<h1>amp-rewrite report: {_e(title)}</h1>"
        f'<div class="sub">target {_e(report.target)} · {report.summary["nodes_float"]} float nodes · '
        f'{report.summary["seconds"]:.3f} s</div>'
        f"{_summary(report)}{_checks(report)}"
        f"<h2>Graph coloured by precision</h2>{_picture(report, model)}"
        f"<h2>Per op type</h2>{_op_table(report)}{_node_table(report)}"
        + (f"<h2>Notes</h2><ul>{notes}</ul>" if notes else "")
        + "</body></html>"
    )
