"""The report: reason sentences a user can follow, summary figures, explain, and the HTML page."""

import json
from html.parser import HTMLParser

import numpy as np
import onnx

from amp_rewrite.cli import main
from amp_rewrite import rewrite
from helpers import assert_close, init, make_model, node, random_feeds, run_ort, run_reference, tensor


def deny_chain_model():
    """m1 -> ln/ReduceMean -> r1 (Reshape) -> a (Add with m1's output) -> m2."""
    rng = np.random.default_rng(0)
    inits = [init("W1", rng.standard_normal((16, 32)).astype(np.float32) * 0.3),
             init("W2", rng.standard_normal((32, 8)).astype(np.float32) * 0.3),
             init("shape", np.array([4, 1], np.int64))]
    nodes = [
        node("MatMul", ["x", "W1"], ["h"], name="m1"),
        node("ReduceMean", ["h"], ["mu"], name="ln/ReduceMean", axes=[1], keepdims=1),
        node("Reshape", ["mu", "shape"], ["mu2"], name="r1"),
        node("Add", ["h", "mu2"], ["s"], name="a"),
        node("MatMul", ["s", "W2"], ["y"], name="m2"),
    ]
    return make_model(nodes, [tensor("x", [4, 16])], [tensor("y", [4, 8])], inits)


def test_reason_is_a_chain_a_user_can_follow_and_numbers_hold():
    model = deny_chain_model()
    result = rewrite(model)
    why = {n["name"]: n["because"] for n in result.report.nodes}
    assert why["a"] == ("Add 'a' kept float32: infer op downstream of deny op ReduceMean 'ln/ReduceMean' "
                        "through Reshape 'r1'")
    assert why["m1"].startswith("MatMul 'm1' in float16: allow list")
    assert "<- ReduceMean 'ln/ReduceMean': deny list" in result.report.node("a")["groups"]["T"]["reason"]
    feeds = random_feeds(model)
    expected = run_ort(model, feeds)
    assert_close(run_ort(result.model, feeds), expected)
    assert_close(run_reference(result.model, feeds), expected)


def test_summary_figures():
    model = deny_chain_model()
    s = rewrite(model).report.summary
    assert s["nodes_float"] == 5 and s["nodes_low"] == 2 and s["low_by_list"] == {"allow": 2}
    assert s["deny_ops"] == 1 and s["deny_blocked"] == 2  # r1 and a
    assert s["flops_total"] == 2 * 4 * 16 * 32 + 2 * 4 * 32 * 8 and s["flops_share"] == 1.0
    assert s["weight_bytes_before"] == (16 * 32 + 32 * 8) * 4 and s["weight_bytes_after"] == (16 * 32 + 32 * 8) * 2
    assert s["casts_inserted"] >= 2
    from amp_rewrite import io as model_io
    from amp_rewrite.report import flops

    assert model_io.load(model).float_bytes == flops.weight_bytes([model.graph])  # counted while validating
    feeds = random_feeds(model)
    assert_close(run_reference(rewrite(model).model, feeds), run_ort(model, feeds))


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
    assert page.rects >= 5  # one box per node (+ legend swatches are <i>)
    text = " ".join(page.text)
    assert "Validation" in text and "PASSED" in text and "downstream of deny op ReduceMean" in text
    written = onnx.load(tmp_path / "m.fp16.onnx")
    feeds = random_feeds(written)
    assert_close(run_reference(written, feeds), run_ort(deny_chain_model(), feeds))


def test_html_collapses_large_graphs_into_regions(tmp_path):
    rng = np.random.default_rng(1)
    nodes, inits, x = [], [], "x"
    for b in range(40):  # 40 blocks of MatMul -> Add -> Relu -> Mul: 160 nodes
        inits += [init(f"W{b}", (rng.standard_normal((8, 8)) * 0.3).astype(np.float32)),
                  init(f"c{b}", np.float32(0.5))]
        nodes += [node("MatMul", [x, f"W{b}"], [f"p{b}"], name=f"block{b}/mm"),
                  node("Add", [f"p{b}", x], [f"q{b}"], name=f"block{b}/add"),
                  node("Relu", [f"q{b}"], [f"r{b}"], name=f"block{b}/relu"),
                  node("Mul", [f"r{b}", f"c{b}"], [f"o{b}"], name=f"block{b}/scale")]
        x = f"o{b}"
    model = make_model(nodes, [tensor("x", [2, 8])], [tensor(x, [2, 8])], inits)
    path = tmp_path / "big.onnx"
    onnx.save(model, path)
    html_path = tmp_path / "big.html"
    assert main([str(path), "--dry-run", "--quiet", "--html", str(html_path)]) == 0
    page = _parse(html_path)
    text = " ".join(page.text)
    assert "160 nodes collapsed into 40 regions" in text and "block7" in text
    assert page.rects < 160
    feeds = random_feeds(model)
    assert_close(run_ort(rewrite(model).model, feeds), run_ort(model, feeds), rtol=2e-2, atol=2e-2)


def test_explain_prints_one_nodes_chain(tmp_path, capsys):
    path = tmp_path / "m.onnx"
    onnx.save(deny_chain_model(), path)
    assert main(["explain", str(path), "a"]) == 0
    out = capsys.readouterr().out
    assert "downstream of deny op ReduceMean 'ln/ReduceMean' through Reshape 'r1'" in out
    assert not (tmp_path / "m.fp16.onnx").exists()  # explaining writes nothing
    assert main([str(path), "--explain", "ln/ReduceMen"]) == 2
    assert "did you mean 'ln/ReduceMean'" in capsys.readouterr().err
    report = tmp_path / "r.json"
    assert main([str(path), "--dry-run", "--quiet", "--report", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["summary"]["low_by_list"] == {"allow": 2}
    feeds = random_feeds(deny_chain_model())
    result = rewrite(str(path))
    assert_close(run_ort(result.model, feeds), run_ort(deny_chain_model(), feeds))
