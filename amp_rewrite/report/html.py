"""A self-contained HTML page of a rewrite: summary, checks, per-op-type table, and the graph.

No network: inline CSS and one small inline script. The graph picture (`picture.py`) is a
layered top-to-bottom drawing, Netron-like, coloured by precision; big graphs are collapsed into
regions that open in place.
"""

from __future__ import annotations

import html

import onnx

from amp_rewrite.report import picture

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
.graph{overflow:hidden;border:1px solid #ddd;border-radius:8px;height:600px;background:#fff;cursor:grab;touch-action:none}
#amp-svg{width:100%;height:100%;display:block} .toolbar{margin:6px 0;font-size:13px} .toolbar button{margin-right:4px}
#amp-info{margin-left:10px;color:#333} .node,.rbox,.head{cursor:pointer}
.edge{fill:none;stroke:#999;stroke-width:1.2}
.island-edge{fill:none;stroke:#e66100;stroke-opacity:.22;stroke-width:16;stroke-linecap:round}
.halo{fill:#e66100;fill-opacity:.14;stroke:#b34700;stroke-dasharray:4 3;stroke-width:1.2} .halo.hl{fill-opacity:.4;stroke-width:2.5}
.cast rect{fill:#fff;stroke:#222;stroke-width:1.6} .rbox{fill:#f7f7f7;stroke:#555;stroke-width:.8}
.region:hover>.rbox{stroke:#000;stroke-width:1.8} .frame{fill:#fbfbfb;stroke:#777;stroke-dasharray:5 3}
.sw.island{background:#fbe3cf;border:1px dashed #b34700} .sw.cast{background:#fff;border:2px solid #222;
width:7px;height:7px;transform:rotate(45deg)} .sw.measured{border:3px solid #7a0000;width:8px;height:8px}
.measured>rect:first-child{stroke:#7a0000;stroke-width:3}
details{margin:8px 0} code{font-size:12px} body.only-graph>:not(.picture){display:none}
"""


def _e(x) -> str:
    return html.escape(str(x), quote=True)


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
        *(
            [_card(s["casts_removed"], "model's casts removed (converting nothing)")]
            if s.get("casts_removed")
            else []
        ),
        _card(
            f"{100 * s['allow_share']:.0f}%",
            f"compute-heavy ops in {report.target} ({s['allow_ops_low']}/{s['allow_ops']})",
        ),
        _card(f"{s['deny_ops']} / {s['deny_blocked']}", "deny ops / nodes they kept float32"),
    ]
    if s.get("flops_total"):
        cards.append(
            _card(f"{100 * s['flops_share']:.0f}%", f"FLOPs in {report.target} (of {s['flops_total']:.3g})")
        )
    if "weight_bytes_before" in s:
        cards.append(
            _card(f"{_mb(s['weight_bytes_before'])} → {_mb(s['weight_bytes_after'])}", "float weights")
        )
    by_list = ", ".join(f"{k} {v}" for k, v in s.get("low_by_list", {}).items()) or "none"
    return f'<div class="cards">{"".join(cards)}</div><p>Low-precision nodes by list: {_e(by_list)}.</p>'


def _op_table(report) -> str:
    t = report.target
    rows = "".join(
        f"<tr><td class=l>{_e(r['op_type'])}</td><td class=l>{_e(r['list'] or '-')}</td><td>{r['nodes']}</td>"
        f"<td>{r[t]}</td><td>{r['mixed']}</td><td>{r['float32']}</td></tr>"
        for r in report.op_table()
    )
    return (
        f"<table><tr><th class=l>op type</th><th class=l>list</th><th>nodes</th><th>{_e(t)}</th><th>mixed</th>"
        f"<th>float32</th></tr>{rows}</table>"
    )


def _checks(report) -> str:
    out = []
    cal = report.sections.get("calibration")
    if cal:
        rows = "".join(
            f"<tr><td class=l><code>{_e(c['tensor'])}</code></td><td class=l>{_e(c['op_type'])} "
            f"<code>{_e(c['producer'])}</code></td><td>{c['max_abs']:.4g}</td></tr>"
            for c in cal["culprits"]
        )
        out.append(
            f"<h2>Calibration</h2><p>{cal['samples']} sample(s) on {_e(cal['provider'])}, "
            f"{cal['tensors']} float tensors measured; limit {cal['threshold']:.6g} "
            f"(largest finite value / {cal['safety']:g}). {len(cal['forced'])} node(s) forced float32.</p>"
        )
        held = cal.get("sentinels", ())
        if held:
            names = ", ".join(f"<code>{_e(s['tensor'])}</code>" for s in held[:10]) + (
                ", ..." if len(held) > 10 else ""
            )
            out.append(
                f"<p>{len(held)} tensor(s) held ±finfo(float32).max sentinels (masks), not counted as "
                f"overflow: {names}.</p>"
            )
        if rows:
            out.append(
                "<table><tr><th class=l>tensor over the limit</th><th class=l>produced by</th><th>max |x|</th>"
                f"</tr>{rows}</table>"
            )
    v = report.sections.get("validation")
    if v:
        verdict = '<span class="ok">PASSED</span>' if v["passed"] else '<span class="bad">FAILED</span>'
        rows = []
        for run, stats in v["runs"].items():
            for s in stats:
                top1 = "-" if s.get("top1") is None else f"{s['top1']:.3f}"
                ok = '<span class="ok">yes</span>' if s["passed"] else '<span class="bad">no</span>'
                rows.append(
                    f"<tr><td class=l>{_e(run)}</td><td class=l>{_e(s['name'])}</td>"
                    f"<td>{s.get('rel_l2', 0.0):.3g}</td><td>{s['max_abs']:.3g}</td>"
                    f"<td>{s['max_rel']:.3g}</td><td>{s['cosine']:.6f}</td><td>{s['nan']}</td><td>{s['inf']}</td>"
                    f"<td>{top1}</td><td>{ok}</td></tr>"
                )
        notes = "".join(f"<li>{_e(n)}</li>" for n in v.get("notes", []))
        out.append(
            f"<h2>Validation</h2><p>{verdict} on {_e(v['provider'])}, {v['samples']} sample(s), "
            f"each output judged against its own scale: RMS error &le; atol + rtol &times; RMS(float32), every "
            f"error &le; atol + 10 &times; rtol &times; max|float32|, no new NaN/Inf, no clear top-1 lost "
            f"(atol {v['atol']:g}, rtol {v['rtol']:g}); max rel is shown, not judged.</p>"
            f"<table><tr><th class=l>run</th><th class=l>output</th>"
            f"<th>rel L2</th><th>max abs</th><th>max rel</th><th>cosine</th><th>NaN</th><th>Inf</th><th>top-1</th><th>ok</th></tr>"
            f"{''.join(rows)}</table>" + (f"<ul>{notes}</ul>" if notes else "")
        )
    fb = report.sections.get("fallback")
    if fb:
        pins = "".join(f"<li><code>{_e(k)}</code>: {_e(r)}</li>" for k, r in fb["reasons"].items())
        out.append(
            f"<h2>Accuracy fallback</h2><p>{'Passed' if fb['passed'] else 'Not passed'} after "
            f"{fb['validation_runs']} validation run(s); {len(fb['pinned'])} node(s) pinned float32.</p>"
            f"<ul>{pins}</ul>"
        )
    return "".join(out)


def _node_table(report) -> str:
    rows = "".join(
        f"<tr><td class=l><code>{_e(n['name'])}</code></td><td class=l>{_e(n['op_type'])}</td>"
        f"<td class=l>{_e(n['precision'])}</td><td class=l>{_e(n['because'])}</td></tr>"
        for n in report.nodes[:5000]
    )
    more = (
        f"<p>… and {len(report.nodes) - 5000} more in the JSON report.</p>"
        if len(report.nodes) > 5000
        else ""
    )
    return (
        f"<details><summary>Every float node and why ({len(report.nodes)})</summary><table><tr><th class=l>node</th>"
        f"<th class=l>op</th><th class=l>precision</th><th class=l>reason</th></tr>{rows}</table>{more}</details>"
    )


def render(report, model: onnx.ModelProto, title: str | None = None) -> str:
    """The page for `report` of a rewrite of `model` (the original ModelProto)."""
    title = title or (model.graph.name or "model")
    notes = "".join(f"<li>{_e(n)}</li>" for n in report.notes)
    return (
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8>"
        f"<title>amp-rewrite: {_e(title)}</title><style>{CSS}</style></head><body>"
        f"<h1>amp-rewrite report: {_e(title)}</h1>"
        f'<div class="sub">target {_e(report.target)} · {report.summary["nodes_float"]} float nodes · '
        f"{report.summary['seconds']:.3f} s</div>"
        f"{_summary(report)}{_checks(report)}"
        f"<h2>Graph coloured by precision</h2>{picture.section(report, model)}"
        f"<h2>Per op type</h2>{_op_table(report)}{_node_table(report)}"
        + (f"<h2>Notes</h2><ul>{notes}</ul>" if notes else "")
        + "</body></html>"
    )


def summary_card(report) -> str:
    """A notebook's view of a RewriteResult: the headline figures, the checks' verdicts and the
    five largest op types, in a few lines of inline-styled HTML."""
    s = report.summary
    cell = 'style="border:1px solid #ddd;padding:2px 8px;text-align:{}"'
    figures = [
        (
            "float nodes in " + report.target,
            f"{s['nodes_low']} of {s['nodes_float']} ({s['nodes_mixed']} mixed)",
        ),
        ("compute-heavy ops low", f"{s['allow_ops_low']}/{s['allow_ops']} ({100 * s['allow_share']:.0f}%)"),
        ("casts inserted", str(s["casts_inserted"])),
        ("model size", f"{s['bytes_before'] / 1e6:.2f} MB &rarr; {s['bytes_after'] / 1e6:.2f} MB"),
    ]
    validation = report.sections.get("validation")
    if validation:
        figures.append(("validation", "passed" if validation["passed"] else "<b>failed</b>"))
    fallback = report.sections.get("fallback")
    if fallback:
        figures.append(("pinned float32 by --tolerance", str(len(fallback["pinned"]))))
    rows = "".join(
        f"<tr><td {cell.format('left')}>{_e(k)}</td><td {cell.format('right')}>{v}</td></tr>"
        for k, v in figures
    )
    ops = "".join(
        f"<tr><td {cell.format('left')}>{_e(r['op_type'])}</td><td {cell.format('right')}>{r['nodes']}</td>"
        f"<td {cell.format('right')}>{r[report.target]}</td><td {cell.format('right')}>{r['float32']}</td></tr>"
        for r in report.op_table()[:5]
    )
    head = "".join(f"<th {cell.format('right')}>{h}</th>" for h in ("nodes", report.target, "float32"))
    return (
        f'<div><b>amp-rewrite</b> ({_e(report.target)})<table style="border-collapse:collapse">{rows}</table>'
        f'<table style="border-collapse:collapse;margin-top:4px"><tr><th {cell.format("left")}>op type</th>{head}'
        f"</tr>{ops}</table></div>"
    )
