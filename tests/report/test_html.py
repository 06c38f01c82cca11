"""The HTML report: one self-contained page that draws every node, large graphs folded into regions."""

import json
import re
from html.parser import HTMLParser

import numpy as np
import onnx

from amp_rewrite import rewrite
from amp_rewrite.cli import main
from helpers import (
    assert_close,
    deny_chain_model,
    init,
    make_model,
    node,
    random_feeds,
    run_ort,
    run_reference,
    tensor,
)


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.rects, self.text, self.urls = [], 0, [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.rects += tag == "rect"
        self.urls += [v for k, v in attrs if k in ("src", "href") and v]

    def handle_data(self, data):
        self.text.append(data)


def _parse(path):
    page = _Page()
    page.feed(path.read_text())
    page.close()
    return page


def test_html_page_is_self_contained_and_draws_every_node(tmp_path, capsys):
    path = tmp_path / "m.onnx"
    onnx.save(deny_chain_model(), path)
    html_path = tmp_path / "m.html"
    assert main([str(path), "--html", str(html_path), "--validate", "--quiet"]) == 0
    page = _parse(html_path)
    assert "svg" in page.tags and "table" in page.tags and not page.urls
    assert len(_picture_data(html_path)["op"]) == 5  # every node goes to the drawing script
    text = " ".join(page.text)
    assert "Validation" in text and "PASSED" in text and "downstream of deny op ReduceMean" in text
    written = onnx.load(tmp_path / "m.fp16.onnx")
    feeds = random_feeds(written)
    assert_close(run_reference(written, feeds), run_ort(deny_chain_model(), feeds))


def _picture_data(path) -> dict:
    found = re.search(r'<script type="application/json" id="amp-data">(.*?)</script>', path.read_text())
    return json.loads(found.group(1))


def test_html_collapses_large_graphs_into_regions(tmp_path):
    rng = np.random.default_rng(1)
    nodes, inits, x = [], [], "x"
    for b in range(100):  # 100 blocks of MatMul -> Add -> Relu -> Mul: 400 nodes
        inits += [
            init(f"W{b}", (rng.standard_normal((8, 8)) * 0.3).astype(np.float32)),
            init(f"c{b}", np.float32(0.5)),
        ]
        nodes += [
            node("MatMul", [x, f"W{b}"], [f"p{b}"], name=f"block{b}/mm"),
            node("Add", [f"p{b}", x], [f"q{b}"], name=f"block{b}/add"),
            node("Relu", [f"q{b}"], [f"r{b}"], name=f"block{b}/relu"),
            node("Mul", [f"r{b}", f"c{b}"], [f"o{b}"], name=f"block{b}/scale"),
        ]
        x = f"o{b}"
    model = make_model(nodes, [tensor("x", [2, 8])], [tensor(x, [2, 8])], inits)
    path = tmp_path / "big.onnx"
    onnx.save(model, path)
    html_path = tmp_path / "big.html"
    assert main([str(path), "--dry-run", "--quiet", "--html", str(html_path)]) == 0
    page = _parse(html_path)
    text = " ".join(page.text)
    assert "400 compute nodes" in text and "collapsed into 10 regions" in text
    groups = _picture_data(html_path)["groups"]
    assert sum(g["l"] == "/block7" and g["n"] == 4 for g in groups) == 1
    assert groups[0]["n"] == 400 and len(groups[0]["i"]) == 10
    feeds = random_feeds(model)
    assert_close(run_ort(rewrite(model).model, feeds), run_ort(model, feeds), rtol=2e-2, atol=2e-2)
