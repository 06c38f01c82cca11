// amp-rewrite report: draws the graph picture from #amp-data (layers and order come laid out by
// Python; coordinates are worked out here, since an expanded region changes the boxes' sizes).
(function () {
  "use strict";
  var NS = "http://www.w3.org/2000/svg";
  var NW = 128, NH = 36, RW = 190, RH = 58, GAP = 16, LGAP = 36, PAD = 10, HEAD = 22, DW = 4;
  var D, measured = {}, open = {}, view = {s: 1, x: 0, y: 0}, fitted = false;
  var svg = document.getElementById("amp-svg"), vp = document.getElementById("amp-vp");
  var box = document.getElementById("amp-graph"), info = document.getElementById("amp-info");

  function load() {
    var el = document.getElementById("amp-data");
    if (el.dataset.encoding !== "gzip-base64") return Promise.resolve(JSON.parse(el.textContent));
    var raw = atob(el.textContent.trim()), bytes = new Uint8Array(raw.length);
    for (var i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
    var stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
    return new Response(stream).text().then(JSON.parse);
  }

  function el(tag, attrs, parent, text) {
    var e = document.createElementNS(NS, tag);
    for (var k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }

  function cut(s, n) { return s.length <= n ? s : "\u2026" + s.slice(s.length - n + 1); }

  // --- layout: sizes, then per layer y, then x by barycenter with order and spacing kept (PAV) ---
  function place(row, want) {
    var off = [0], blocks = [];
    for (var i = 1; i < row.length; i++) off.push(off[i - 1] + (row[i - 1].w + row[i].w) / 2 + GAP);
    for (i = 0; i < row.length; i++) {
      var b = {sum: want[i] - off[i], n: 1, start: i};
      while (blocks.length && blocks[blocks.length - 1].sum / blocks[blocks.length - 1].n > b.sum / b.n) {
        var p = blocks.pop(); b = {sum: p.sum + b.sum, n: p.n + b.n, start: p.start};
      }
      blocks.push(b);
    }
    blocks.forEach(function (b) { for (var j = b.start; j < b.start + b.n; j++) row[j].cx = b.sum / b.n + off[j]; });
  }

  function lay(gid) {
    var G = D.groups[gid], ents = {}, rows = [], edges = [];
    G.r.forEach(function (r, l) {
      rows.push(r.map(function (code) {
        var key = code >= 0 ? "i" + code : "d" + (~code) + "_" + l, e = {key: key, l: l, code: code, up: [], dn: []};
        if (code >= 0) {
          var item = G.i[code], sz = item >= 0 ? [NW, NH] : (open[~item] ? lay(~item) : [RW, RH]);
          e.item = item; e.w = sz[0]; e.h = sz[1]; e.sub = item < 0 && open[~item] ? sz : null;
        } else { e.w = DW; e.h = 0; }
        ents[key] = e; return e;
      }));
    });
    G.e.forEach(function (ed, k) {
      var a = ents["i" + ed[0]], b = ents["i" + ed[1]], top = a.l <= b.l ? a : b, bot = top === a ? b : a, chain = [top];
      for (var l = top.l + 1; l < bot.l; l++) chain.push(ents["d" + k + "_" + l]);
      chain.push(bot);
      for (var j = 1; j < chain.length; j++) { chain[j].up.push(chain[j - 1]); chain[j - 1].dn.push(chain[j]); }
      edges.push({from: a, to: b, chain: top === a ? chain : chain.slice().reverse(), casts: ed[2]});
    });
    var y = 0;
    rows.forEach(function (row) {
      var h = 0, x = 0;
      row.forEach(function (e) { h = Math.max(h, e.h); e.cx = x + e.w / 2; x += e.w + GAP; });
      row.forEach(function (e) { e.y = y; e.rowh = h; });
      y += h + LGAP;
    });
    function pass(order, nb) {
      order.forEach(function (l) {
        var row = rows[l];
        place(row, row.map(function (e) {
          var n = e[nb]; if (!n.length) return e.cx;
          return n.reduce(function (s, o) { return s + o.cx; }, 0) / n.length;
        }));
      });
    }
    var down = [], up = [];
    for (var l = 1; l < rows.length; l++) down.push(l);
    for (l = rows.length - 2; l >= 0; l--) up.push(l);
    pass(down, "up"); pass(up, "dn"); pass(down, "up");
    var lo = Infinity, hi = -Infinity;
    rows.forEach(function (row) { row.forEach(function (e) { lo = Math.min(lo, e.cx - e.w / 2); hi = Math.max(hi, e.cx + e.w / 2); }); });
    if (!isFinite(lo)) { lo = 0; hi = 0; }
    rows.forEach(function (row) { row.forEach(function (e) { e.cx -= lo; }); });
    var L = {rows: rows, edges: edges, ents: ents, w: hi - lo, h: Math.max(0, y - LGAP)};
    layouts[gid] = L;
    return G === D.groups[0] ? [L.w, L.h] : [Math.max(L.w + 2 * PAD, 160), L.h + 2 * PAD + HEAD];
  }
  var layouts = {};

  // --- drawing ---
  function bezier(p, q, t) {
    var m = (p[1] + q[1]) / 2, u = 1 - t;
    return [u * u * u * p[0] + 3 * u * u * t * p[0] + 3 * u * t * t * q[0] + t * t * t * q[0],
            u * u * u * p[1] + 3 * u * u * t * m + 3 * u * t * t * m + t * t * t * q[1]];
  }

  function castMark(parent, x, y, n, where) {
    var g = el("g", {"class": "cast", "data-n": n}, parent);
    el("rect", {x: x - 5, y: y - 5, width: 10, height: 10, transform: "rotate(45 " + x + " " + y + ")"}, g);
    if (n > 1) el("text", {x: x + 8, y: y + 4, "font-size": 10}, g, "\u00d7" + n);
    el("title", {}, g, n + " Cast node(s) inserted " + where);
  }

  function drawNode(parent, k, x, y, within) {
    var kind = +D.kind[k], isl = D.island[k], name = D.name[k], op = D.ops[D.op[k]];
    if (within && name.indexOf(within + "/") === 0) name = name.slice(within.length + 1);  // the region says the rest
    if (isl >= 0) el("rect", {"class": "halo", "data-island": isl, x: x - 6, y: y - 6, width: NW + 12, height: NH + 12, rx: 10}, parent);
    var g = el("g", {"class": "node" + (isl >= 0 ? " in-island" : "") + (measured[k] ? " measured" : ""), "data-i": k, "data-op": op, "data-kind": D.kinds[kind]}, parent);
    el("rect", {x: x, y: y, width: NW, height: NH, rx: 6, fill: D.colours[D.kinds[kind]]}, g);
    el("text", {x: x + NW / 2, y: y + 15, "text-anchor": "middle", "font-size": 11, "font-weight": 600, fill: "#fff"}, g, cut(op, 20));
    el("text", {x: x + NW / 2, y: y + 28, "text-anchor": "middle", "font-size": 9, fill: "#fff"}, g, cut(name, 22));
    var tip = D.reasons[D.why[k]] + (D.weights[k] ? " (reads " + D.weights[k] + " constant(s))" : "");
    el("title", {}, g, tip + (isl >= 0 ? "\n" + D.islands[isl][1] : ""));
  }

  function drawRegion(parent, gid, x, y) {
    var G = D.groups[gid], g = el("g", {"class": "region", "data-g": gid, "data-label": G.l, "data-nodes": G.n, "data-casts": G.c,
      "data-low": G.m[0], "data-mixed": G.m[1], "data-float32": G.m[2], "data-other": G.m[3]}, parent);
    el("rect", {x: x, y: y, width: RW, height: RH, rx: 7, "class": "rbox"}, g);
    el("text", {x: x + 8, y: y + 16, "font-size": 11, "font-weight": 600}, g, cut(G.s || G.l, 28));
    el("text", {x: x + 8, y: y + 30, "font-size": 10, fill: "#444"}, g,
       G.n + " nodes, " + G.m[0] + " " + D.target + (G.c ? ", " + G.c + " casts" : ""));
    var bx = x + 8, bw = RW - 16;
    G.m.forEach(function (c, kind) {
      if (!c) return;
      el("rect", {x: bx, y: y + 38, width: bw * c / G.n, height: 11, fill: D.colours[D.kinds[kind]]}, g);
      bx += bw * c / G.n;
    });
    el("title", {}, g, (G.l || "graph") + ": " + G.n + " nodes (" + G.m[0] + " " + D.target + ", " + G.m[1] +
       " mixed, " + G.m[2] + " float32, " + G.m[3] + " without float tensors); " + G.c + " casts inside. Click to open.");
  }

  function drawGroup(parent, gid, ox, oy) {
    var L = layouts[gid], G = D.groups[gid], edgeLayer = el("g", {"class": "edges"}, parent), top = el("g", {}, parent);
    L.edges.forEach(function (ed) {
      var pts = ed.chain.map(function (e, j) {
        var last = j === ed.chain.length - 1, first = j === 0;
        var y = e.code < 0 ? e.y + e.rowh / 2 : (first ? e.y + e.h : (last ? e.y : e.y + e.h / 2));
        if (ed.from.l > ed.to.l && e.code >= 0) y = first ? e.y : e.y + e.h;
        return [ox + e.cx, oy + y];
      });
      var d = "M" + pts[0][0] + "," + pts[0][1];
      for (var j = 1; j < pts.length; j++) {
        var p = pts[j - 1], q = pts[j], m = (p[1] + q[1]) / 2;
        d += " C" + p[0] + "," + m + " " + q[0] + "," + m + " " + q[0] + "," + q[1];
      }
      var same = ed.from.item >= 0 && ed.to.item >= 0 && D.island[ed.from.item] >= 0 &&
                 D.island[ed.from.item] === D.island[ed.to.item];
      if (same) el("path", {d: d, "class": "island-edge"}, edgeLayer);
      el("path", {d: d, "class": "edge", "marker-end": "url(#amp-arrow)"}, edgeLayer);
      if (ed.casts) { var c = bezier(pts[0], pts[1], 0.45); castMark(top, c[0], c[1], ed.casts, "on this edge"); }
    });
    L.rows.forEach(function (row) {
      row.forEach(function (e) {
        if (e.code < 0) return;
        var x = ox + e.cx - e.w / 2, y = oy + e.y;
        if (e.item >= 0) drawNode(top, e.item, x, y, G.l);
        else if (!open[~e.item]) drawRegion(top, ~e.item, x, y);
        else {
          var S = D.groups[~e.item], g = el("g", {"class": "region open", "data-g": ~e.item, "data-label": S.l, "data-nodes": S.n}, top);
          el("rect", {x: x, y: y, width: e.w, height: e.h, rx: 8, "class": "frame"}, g);
          el("text", {x: x + 8, y: y + 15, "font-size": 11, "font-weight": 600, "class": "head", "data-g": ~e.item}, g,
             "\u25be " + cut(S.l || S.s, 60) + " (" + S.n + " nodes)");
          drawGroup(g, ~e.item, x + e.w / 2 - layouts[~e.item].w / 2, y + PAD + HEAD);
        }
      });
    });
    G.st.forEach(function (st) {
      var e = L.ents["i" + st[0]], x = ox + e.cx, y = oy + e.y;
      if (st[1]) { el("path", {d: "M" + x + "," + (y - 18) + " V" + y, "class": "edge"}, edgeLayer); castMark(top, x, y - 11, st[1], "on a graph input read here"); }
      if (st[2]) { el("path", {d: "M" + x + "," + (y + e.h) + " V" + (y + e.h + 18), "class": "edge"}, edgeLayer); castMark(top, x, y + e.h + 11, st[2], "on a graph output written here"); }
      if (st[3]) castMark(top, x + e.w / 2, y + e.h / 2, st[3], "inside this node's subgraphs");
    });
  }

  function render() {
    layouts = {};
    while (vp.firstChild) vp.removeChild(vp.firstChild);
    var size = lay(0), defs = el("defs", {}, vp), m = el("marker", {id: "amp-arrow", viewBox: "0 0 10 10", refX: 9, refY: 5,
      markerWidth: 6, markerHeight: 6, orient: "auto-start-reverse"}, defs);
    el("path", {d: "M0,0 L10,5 L0,10 z", fill: "#888"}, m);
    drawGroup(vp, 0, 0, 0);
    if (D.loose) castMark(vp, -14, 0, D.loose, "that sit on no edge of this drawing (between graph inputs and outputs, or in inlined functions)");
    view.w = size[0]; view.h = size[1];
    if (!fitted) fit();
    apply();
  }

  function apply() { vp.setAttribute("transform", "translate(" + view.x + "," + view.y + ") scale(" + view.s + ")"); }

  function fit() {
    var s = Math.max(0.45, Math.min(1, (box.clientWidth - 24) / Math.max(view.w, 1)));  // readable: pan for the rest
    box.style.height = Math.max(320, Math.min(window.innerHeight * 0.8, view.h * s + 60)) + "px";
    view.s = s; view.x = Math.max(12, (box.clientWidth - view.w * s) / 2); view.y = 30; fitted = true;  // room for input stubs
  }

  function zoom(f, cx, cy) { view.x = cx - (cx - view.x) * f; view.y = cy - (cy - view.y) * f; view.s *= f; apply(); }

  function setupInput() {
    var drag = null, moved = 0;
    svg.addEventListener("wheel", function (ev) {
      ev.preventDefault();
      var r = svg.getBoundingClientRect();
      zoom(ev.deltaY < 0 ? 1.15 : 1 / 1.15, ev.clientX - r.left, ev.clientY - r.top);
    }, {passive: false});
    svg.addEventListener("pointerdown", function (ev) { drag = [ev.clientX, ev.clientY]; moved = 0; });
    window.addEventListener("pointermove", function (ev) {
      if (!drag) return;
      moved += Math.abs(ev.clientX - drag[0]) + Math.abs(ev.clientY - drag[1]);
      view.x += ev.clientX - drag[0]; view.y += ev.clientY - drag[1]; drag = [ev.clientX, ev.clientY]; apply();
    });
    window.addEventListener("pointerup", function () { drag = null; });
    svg.addEventListener("click", function (ev) {
      if (moved > 4) return;
      var t = ev.target.closest("[data-g],.node");
      highlight(-1);
      if (!t) return;
      if (t.classList.contains("node")) {
        var k = +t.dataset.i, isl = D.island[k];
        info.textContent = D.reasons[D.why[k]] + (isl >= 0 ? " \u2014 " + D.islands[isl][1] : "");
        highlight(isl);
      } else if (t.classList.contains("region") && !t.classList.contains("open")) {
        open[+t.dataset.g] = true; info.textContent = D.groups[+t.dataset.g].l; render();
      } else if (t.classList.contains("head")) { delete open[+t.dataset.g]; render(); }
    });
    document.querySelectorAll(".toolbar button").forEach(function (b) {
      b.addEventListener("click", function () {
        var a = b.dataset.act, r = svg.getBoundingClientRect();
        if (a === "fit") { fitted = false; render(); }
        if (a === "in") zoom(1.25, r.width / 2, r.height / 2);
        if (a === "out") zoom(0.8, r.width / 2, r.height / 2);
        if (a === "collapse") { open = {}; fitted = false; render(); }
      });
    });
  }

  function highlight(isl) {
    vp.querySelectorAll(".halo").forEach(function (h) { h.classList.toggle("hl", isl >= 0 && +h.dataset.island === isl); });
  }

  function fromHash() {
    var m = /expand=([\w,]+)/.exec(location.hash);
    if (!m) return;
    m[1].split(",").forEach(function (v) {
      if (v === "all") D.groups.forEach(function (g, i) { if (i) open[i] = true; });
      else if (D.groups[+v]) open[+v] = true;
    });
  }

  load().then(function (data) {
    D = data; D.measured.forEach(function (k) { measured[k] = true; }); D.open.forEach(function (g) { open[g] = true; }); fromHash(); render(); setupInput();
    if (/only/.test(location.hash)) { document.body.classList.add("only-graph"); fitted = false; render(); }
    var first = /expand=(\d+)/.exec(location.hash), frame = first && vp.querySelector('.region.open[data-g="' + first[1] + '"] > rect');
    if (frame) { view.y = 12 - frame.getAttribute("y") * view.s; apply(); }  // the opened region at the top
    var de = document.documentElement;
    document.body.dataset.overflowX = String(de.scrollWidth > de.clientWidth);
    document.body.dataset.ampReady = "1";
  }).catch(function (err) {
    info.textContent = "The picture could not be drawn: " + err;
    document.body.dataset.ampReady = "error";
  });
})();
