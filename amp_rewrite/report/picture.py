"""The graph section of the HTML report: the picture's data, laid out, and the script that draws it.

Python does the graph work once (regions, layers, crossing-cutting order, where casts sit); the
inline script (`picture.js`, no network) turns it into SVG with the boxes' sizes, expands a
region in place on click, pans and zooms. Data over 256 KB is gzip-compressed and base64-encoded
(the page inflates it with the browser's DecompressionStream), so a 100k-node report stays small.
"""

from __future__ import annotations

import base64
import gzip
import html
import json
from importlib import resources

import onnx

from amp_rewrite.report import layout as report_layout
from amp_rewrite.report import picture_graph as report_graph
from amp_rewrite.report import regions as report_regions

COLOURS = {"low": "#26a269", "mixed": "#9141ac", "float32": "#e66100", "other": "#b8b8b8"}
COMPRESS_OVER = 256 * 1024


def _lift(groups, direct: list, depth: list, u: int, v: int):
    """The group where the edge u -> v is drawn (their lowest common region) and the items of that
    group holding u and v."""
    a, b = u, v
    pa, pb = direct[u], direct[v]
    while pa != pb:
        if depth[pa] >= depth[pb]:
            a, pa = ~pa, groups[pa].parent
        else:
            b, pb = ~pb, groups[pb].parent
    return pa, a, b


def _depths(groups) -> list[int]:
    depth = [0] * len(groups)
    pending = list(range(len(groups)))
    known = [False] * len(groups)
    known[0] = True
    while pending:  # parents may come after children (runs cut later): settle by walking up
        gid = pending.pop()
        chain = []
        while not known[gid]:
            chain.append(gid)
            gid = groups[gid].parent
        for c in reversed(chain):
            depth[c] = depth[groups[c].parent] + 1
            known[c] = True
    return depth


def _totals(groups, gid: int, kinds: list, own_casts: list, out: dict) -> tuple:
    """(node count, precision mix, casts) of group `gid` and everything under it."""
    count, mix, casts = 0, [0, 0, 0, 0], own_casts[gid]
    for item in groups[gid].items:
        if item >= 0:
            count += 1
            mix[kinds[item]] += 1
        else:
            c, m, k = _totals(groups, ~item, kinds, own_casts, out)
            count, casts = count + c, casts + k
            mix = [x + y for x, y in zip(mix, m)]
    out[gid] = (count, mix, casts)
    return out[gid]


def _place(groups, g) -> tuple:
    """Each edge in the region where it is drawn, each Cast on its edge (or as a stub on the node
    that reads a graph input / writes a graph output, or inside a node's subgraphs): per group the
    edges with their casts, the stubs, and the casts drawn there; and the casts drawn nowhere."""
    direct = [0] * len(g.op)
    for gid, group in enumerate(groups):
        for item in group.items:
            if item >= 0:
                direct[item] = gid
    depth = _depths(groups)
    edges: list = [{} for _ in groups]  # per group: (item a, item b) -> casts on it
    stubs: list = [{} for _ in groups]  # per group: node -> [casts from graph inputs, to outputs, inside]
    own_casts = [0] * len(groups)
    for u, vs in enumerate(g.succ):
        for v in vs:
            gid, a, b = _lift(groups, direct, depth, u, v)
            edges[gid].setdefault((a, b), 0)
    loose = 0
    for p, r, _ in g.casts:
        if p is not None and r is not None and r in g.succ[p]:
            gid, a, b = _lift(groups, direct, depth, p, r)
            edges[gid][(a, b)] += 1
        elif r is not None or p is not None:
            node, slot = (r, 0) if r is not None else (p, 1)
            gid = direct[node]
            stubs[gid].setdefault(node, [0, 0, 0])[slot] += 1
        else:
            loose += 1
            continue
        own_casts[gid] += 1
    for node, inside in g.inner_casts.items():
        stubs[direct[node]].setdefault(node, [0, 0, 0])[2] += inside
        own_casts[direct[node]] += inside
    return edges, stubs, own_casts, loose


def page_data(report, model: onnx.ModelProto) -> dict:
    """What the script draws: nodes, reasons, islands, and per region its items, layers and edges."""
    g = report_graph.build(report, model)
    phases = report_regions.declared(model)
    groups = report_regions.build(g.name, g.op, g.succ, parts=phases)
    edges, stubs, own_casts, loose = _place(groups, g)
    totals: dict = {}
    _totals(groups, 0, g.kind, own_casts, totals)
    out_groups = []
    for gid, group in enumerate(groups):
        index = {item: k for k, item in enumerate(group.items)}
        elist = [(index[a], index[b], c) for (a, b), c in edges[gid].items()]
        _, rows = report_layout.layout(len(group.items), elist)
        count, mix, casts = totals[gid]
        out_groups.append(
            {
                "l": group.label,
                "s": group.short,
                "i": group.items,
                "r": rows,
                "e": [list(e) for e in elist],
                "st": [[index[k], *v] for k, v in stubs[gid].items()],
                "n": count,
                "m": mix,
                "c": casts,
            }
        )
    reasons: dict = {}
    ops: dict = {}
    op_ids = [ops.setdefault(o, len(ops)) for o in g.op]
    return {
        "target": report.target,
        "kinds": list(report_graph.KINDS),
        "colours": COLOURS,
        "ops": list(ops),
        "op": op_ids,
        "name": g.name,
        "kind": "".join(map(str, g.kind)),
        "why": [reasons.setdefault(r, len(reasons)) for r in g.reason],
        "reasons": list(reasons),
        "island": g.island,
        "islands": [list(i) for i in g.islands],
        "weights": g.weights,
        "measured": g.measured,
        "groups": out_groups,
        "casts": len(g.casts) + sum(g.inner_casts.values()),
        "loose": loose,
        "open": [~i for i in groups[0].items if i < 0 and groups[~i].flat]
        if phases
        else [],  # phases drawn open
    }


def _script_json(data: dict) -> str:
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    if len(text) > COMPRESS_OVER:
        packed = base64.b64encode(gzip.compress(text.encode(), 6, mtime=0)).decode()
        return f'<script type="text/plain" id="amp-data" data-encoding="gzip-base64">{packed}</script>'
    text = text.replace("<", "\\u003c")  # "<" only occurs in strings: no name can end the script
    return f'<script type="application/json" id="amp-data">{text}</script>'


def section(report, model: onnx.ModelProto) -> str:
    """The legend, caption, toolbar, drawing area, data and script of the graph picture."""
    data = page_data(report, model)
    n, root = len(data["op"]), data["groups"][0]
    regions = sum(1 for item in root["i"] if item < 0)
    folded = len(model.graph.node) - n + len(model.graph.initializer)
    caption = (
        f"{n} compute nodes ({folded} constants and initializers folded into their readers)"
        + (f", collapsed into {regions} regions: click a region to open it in place" if regions else "")
        + f"; {data['casts']} casts inserted. Drag to pan, wheel to zoom, click a box for its reason."
    )
    e = html.escape
    legend = "".join(
        f'<span><i class="sw" style="background:{COLOURS[k]}"></i>{e(label)}</span>'
        for k, label in (
            ("low", report.target),
            ("float32", "float32"),
            ("mixed", "mixed"),
            ("other", "no float tensors"),
        )
    )
    legend += (
        '<span><i class="sw island"></i>float32 island (click for why)</span>'
        '<span><i class="sw cast"></i>inserted Cast</span>'
        '<span><i class="sw measured"></i>kept float32 by calibration / fallback / pin</span>'
    )
    script = resources.files("amp_rewrite.report").joinpath("picture.js").read_text()
    return (
        f'<div class="picture"><p class="legend">{legend}</p><p class="sub" id="amp-caption">{e(caption)}</p>'
        '<div class="toolbar"><button data-act="fit">Fit</button><button data-act="in">+</button>'
        '<button data-act="out">&minus;</button><button data-act="collapse">Collapse all</button>'
        '<span id="amp-info">Click a node or region.</span></div>'
        '<div class="graph" id="amp-graph"><svg id="amp-svg" xmlns="http://www.w3.org/2000/svg" '
        'font-family="system-ui,sans-serif"><g id="amp-vp"></g></svg></div>'
        f"{_script_json(data)}<script>{script}</script></div>"
    )
