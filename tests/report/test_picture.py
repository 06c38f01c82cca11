"""The graph picture of the HTML report, drawn by headless Chromium and read back from its DOM:
no Constant boxes, every compute node or region present, region counts adding up to the model's,
casts drawn equal to casts inserted, no horizontal scrolling at 1400 px. Also the layout and
region rules without a browser, and `--annotate`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

import browser
from amp_rewrite import rewrite
from amp_rewrite.cli import main
from amp_rewrite.report import annotate as notes
from amp_rewrite.report import html as html_report
from amp_rewrite.report import layout as report_layout
from amp_rewrite.report import picture as report_page
from amp_rewrite.report import regions as report_regions
from helpers import assert_close, init, load_tool, make_model, node, random_feeds, run_ort, tensor

exported, synthetic = load_tool("exported"), load_tool("synthetic")


def folded(model: onnx.ModelProto) -> set[str]:
    """Names of the main-graph nodes the picture folds: Constants, Identity nodes of a constant."""
    constants, names = {t.name for t in model.graph.initializer}, set()
    for n in model.graph.node:
        if n.op_type == "Constant" or (n.op_type == "Identity" and n.input[0] in constants):
            constants.update(n.output)
            names.add(n.name)
    return names


def nested(model: onnx.ModelProto) -> set[str]:
    """Names of the nodes inside subgraphs (a training step's update `If` holds the optimizer)."""
    names, pending = (
        set(),
        [a.g for n in model.graph.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH],
    )
    while pending:
        graph = pending.pop()
        for n in graph.node:
            names.add(n.name)
            pending.extend(a.g for a in n.attribute if a.type == onnx.AttributeProto.GRAPH)
    return names


def compute_nodes(model: onnx.ModelProto) -> int:
    return len(model.graph.node) - len(folded(model))


def check_drawing(dom: browser.Dom, model: onnx.ModelProto, report) -> None:
    assert not any(n["data-op"] == "Constant" for n in dom.nodes)
    assert len({n["data-i"] for n in dom.nodes}) == len(dom.nodes)
    assert len(dom.nodes) + sum(int(r["data-nodes"]) for r in dom.regions) == compute_nodes(model)
    kinds = {
        k: sum(n["data-kind"] == k for n in dom.nodes) + sum(int(r[f"data-{k}"]) for r in dom.regions)
        for k in ("low", "mixed", "float32")
    }
    s, skip = (
        report.summary,
        folded(model) | nested(model),
    )  # an Identity of a weight is a float node of the report's;
    # a branch's nodes are counted by the report and drawn inside their If
    off = {
        k: sum(1 for n in report.nodes if n["name"] in skip and n["precision"] == p)
        for k, p in (("low", report.target), ("mixed", "mixed"), ("float32", "float32"))
    }
    assert kinds == {
        "low": s["nodes_low"] - off["low"],
        "mixed": s["nodes_mixed"] - off["mixed"],
        "float32": s["nodes_float32"] - off["float32"],
    }
    assert sum(dom.casts) + sum(int(r["data-casts"]) for r in dom.regions) == s["casts_inserted"]
    assert dom.body["data-overflow-x"] == "false"  # no horizontal scrolling at 1400 px


def render(tmp: Path, model: onnx.ModelProto, name: str):
    result = rewrite(model)
    page = tmp / f"{name}.html"
    page.write_text(html_report.render(result.report, model, name))
    return result, page


@pytest.fixture(scope="session")
def pictures(tmp_path_factory):
    return tmp_path_factory.mktemp("pictures")


def test_cnn_export_draws_every_compute_node(pictures):
    pytest.importorskip("torch")
    path = exported.export_cnn(pictures / "cnn.onnx")
    page = pictures / "cnn.html"
    assert main([str(path), "--dry-run", "--quiet", "--html", str(page)]) == 0
    model = onnx.load(path)
    dom = browser.dom(page)
    assert not dom.regions and {int(n["data-i"]) for n in dom.nodes} == set(range(compute_nodes(model)))
    check_drawing(dom, model, rewrite(model).report)
    browser.screenshot(page, pictures / "cnn.png", "only")


def test_bert_export_collapses_by_module_names_and_expands_in_place(pictures):
    pytest.importorskip("torch")
    model = onnx.load(exported.export_bert(pictures / "bert.onnx", layers=8))
    assert compute_nodes(model) > report_regions.FLAT_MAX
    result, page = render(pictures, model, "bert")
    dom = browser.dom(page)
    labels = {r["data-label"]: r for r in dom.regions}
    assert {f"/layers.{i}" for i in range(8)} <= set(labels)
    check_drawing(dom, model, result.report)
    layer = labels["/layers.3"]
    opened = browser.dom(page, f"expand={layer['data-g']}")
    assert [r["data-label"] for r in opened.open_regions] == ["/layers.3"]
    assert len(opened.regions) + len(opened.nodes) > len(dom.regions) + len(dom.nodes)  # its insides drawn
    check_drawing(opened, model, result.report)
    browser.screenshot(page, pictures / "bert.png", f"only,expand={layer['data-g']}")
    feeds = {
        "input_ids": np.random.default_rng(0).integers(0, 1000, (2, 16)),
        "attention_mask": np.ones((2, 16), np.int64),
    }
    assert_close(run_ort(result.model, feeds), run_ort(model, feeds), rtol=2e-2, atol=2e-2)


@pytest.fixture(scope="session")
def stack_10k(pictures):
    model = synthetic.transformer_stack(10_000)
    return model, *render(pictures, model, "stack10k")


def test_10k_stack_collapsed_page_is_small_and_adds_up(stack_10k, pictures):
    model, result, page = stack_10k
    assert page.stat().st_size < 5e6
    dom = browser.dom(page)
    assert 2 <= len(dom.regions) <= report_regions.MAX_ITEMS and not dom.nodes
    check_drawing(dom, model, result.report)
    browser.screenshot(page, pictures / "stack10k.png", "only")


def test_names_without_hierarchy_cut_where_the_graph_narrows(pictures):
    model = synthetic.transformer_stack(1000)
    for k, n in enumerate(model.graph.node):
        n.name = f"n{k}"
    data = report_page.page_data(rewrite(model).report, model)
    root, groups = data["groups"][0], data["groups"]
    assert sum(item < 0 for item in root["i"]) >= 2

    def members(item):
        return [item] if item >= 0 else [m for i in groups[~item]["i"] for m in members(i)]

    region_of = {m: r for r, item in enumerate(root["i"]) for m in members(item)}
    succ = report_page.report_graph.build(rewrite(model).report, model).succ
    for r in range(1, len(root["i"]) - 1):  # one producer feeds everything after each cut
        feeding = {u for u, vs in enumerate(succ) for v in vs if region_of[u] < r <= region_of[v]}
        assert len(feeding) == 1, (r, feeding)
    path = pictures / "flat_names.onnx"
    onnx.save(model, path)
    page = pictures / "flat_names.html"
    assert main([str(path), "--dry-run", "--quiet", "--html", str(page)]) == 0
    check_drawing(browser.dom(page), model, rewrite(model).report)


def test_training_step_graph_shows_its_phases_apart(pictures):
    from amp_rewrite.training import Adam, Trainer
    from training_models import mlp

    trainer = Trainer(mlp(sizes=(16, 32, 32, 4)), optimizer=Adam(0.01), provider="cpu")
    page = pictures / "step.html"
    report = trainer.report(html=page)
    dom = browser.dom(page)
    phases = {r["data-label"]: int(r["data-nodes"]) for r in dom.open_regions}
    assert set(phases) == {"forward", "loss", "backward", "loss scale", "optimizer"}
    assert all(n > 0 for n in phases.values())
    step = trainer._float_step
    check_drawing(dom, step, report)
    assert sum(phases.values()) == compute_nodes(step)
    browser.screenshot(page, pictures / "step.png", "only")
    onnx.save(step, pictures / "step.onnx")  # the CLI on a saved step graph finds the phases by name
    assert (
        main([str(pictures / "step.onnx"), "--dry-run", "--quiet", "--html", str(pictures / "cli_step.html")])
        == 0
    )
    cli = browser.dom(pictures / "cli_step.html")
    assert {r["data-label"]: int(r["data-nodes"]) for r in cli.open_regions} == phases


def test_regions_are_the_parts_a_model_declares_not_name_prefixes():
    """The compiler knows no training prefix: nodes named like a step graph's are one region
    until the model declares its parts (report.regions.REGIONS_KEY, as training's step graph does)."""
    nodes = [
        node("MatMul", ["x", "w"], ["h"], name="grad/MatMul"),
        node("Relu", ["h"], ["r"], name="opt/Relu"),
        node("Relu", ["r"], ["y"], name="fw/Relu"),
    ]
    model = make_model(
        nodes, [tensor("x", [2, 2])], [tensor("y", [2, 2])], [init("w", np.ones((2, 2), np.float32))]
    )
    assert report_page.page_data(rewrite(model).report, model)["open"] == []
    report_regions.declare(model, [("grad/", "backward"), ("opt/", "optimizer")])
    data = report_page.page_data(rewrite(model).report, model)
    labels = [data["groups"][~item]["l"] for item in data["groups"][0]["i"]]
    assert labels == ["backward", "optimizer", report_regions.OTHER] and len(data["open"]) == 3


def crossings(layers: list[list[int]], edges) -> int:
    where = {e: (lay, k) for lay, row in enumerate(layers) for k, e in enumerate(row)}
    segments = [
        (where[a][1], where[b][1], where[a][0]) for a, b, _ in edges if where[b][0] == where[a][0] + 1
    ]
    return sum(
        1
        for i, (a, b, la) in enumerate(segments)
        for c, d, lc in segments[i + 1 :]
        if la == lc and (a - c) * (b - d) < 0
    )


def test_layout_layers_by_longest_path_and_orders_to_cut_crossings():
    # two chains whose second layer starts crossed: 0 -> 3 -> 5, 1 -> 2 -> 4
    edges = [(0, 3, 0), (1, 2, 0), (3, 5, 0), (2, 4, 0)]
    layer, rows = report_layout.layout(6, edges)
    assert layer == [0, 0, 1, 1, 2, 2]
    assert crossings([[0, 1], [2, 3], [4, 5]], edges) == 1 and crossings(rows, edges) == 0
    # an edge over two layers gets one dummy point in the layer between; a source sinks to its reader
    layer, rows = report_layout.layout(4, [(0, 1, 0), (1, 3, 0), (0, 3, 0), (2, 3, 0)])
    assert layer == [0, 1, 1, 2] and ~2 in rows[1]


@pytest.mark.even_if_worse
def test_picture_data_folds_constants_and_places_every_cast():
    nodes = [
        node("Constant", [], ["c"], name="const", value=onnx.numpy_helper.from_array(np.float32(2.0))),
        node("Mul", ["x", "c"], ["h"], name="scale"),
        node("MatMul", ["h", "W"], ["m"], name="mm"),
        node("LogSoftmax", ["m"], ["s"], name="sm", axis=-1),
        node("MatMul", ["s", "W"], ["y"], name="mm2"),
    ]
    model = make_model(
        nodes,
        [tensor("x", [2, 4])],
        [tensor("y", [2, 4])],
        [init("W", np.random.default_rng(3).standard_normal((4, 4)).astype(np.float32))],
    )
    result = rewrite(model)
    data = report_page.page_data(result.report, model)
    assert [data["ops"][o] for o in data["op"]] == ["Mul", "MatMul", "LogSoftmax", "MatMul"]
    assert data["weights"] == [1, 1, 0, 1]
    root = data["groups"][0]
    drawn = sum(e[2] for e in root["e"]) + sum(sum(s[1:]) for s in root["st"]) + data["loose"]
    assert drawn == data["casts"] == result.report.summary["casts_inserted"] > 0
    assert any("LogSoftmax 'sm' kept float32: deny list" in reason for _, reason in data["islands"])
    assert data["measured"] == []
    pinned = rewrite(model, force_fp32={"mm2": "measured overflow"})
    assert report_page.page_data(pinned.report, model)["measured"] == [3]  # drawn with a red frame
    assert_close(
        run_ort(result.model, random_feeds(model)), run_ort(model, random_feeds(model)), rtol=1e-2, atol=1e-2
    )


# --- --annotate -------------------------------------------------------------------------------------


def _stripped(model: onnx.ModelProto) -> bytes:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for n in copy.graph.node:
        n.doc_string = ""
        del n.metadata_props[:]
    return copy.SerializeToString()


def test_annotate_writes_reasons_and_changes_nothing_else(tmp_path):
    from test_html import deny_chain_model

    model = deny_chain_model()
    model.graph.node[0].doc_string = "exported from m1 = x @ W1"
    plain, annotated = rewrite(model), rewrite(model, annotate=True)
    assert plain.model.SerializeToString() == rewrite(model, annotate=False).model.SerializeToString()
    assert not any(n.doc_string.startswith("amp-rewrite") or n.metadata_props for n in plain.model.graph.node)
    assert _stripped(annotated.model) == _stripped(plain.model)
    onnx.checker.check_model(annotated.model, full_check=True)
    by_name = {n.name: n for n in annotated.model.graph.node}
    assert notes.read(by_name["a"]) == ("float32", annotated.report.node("a")["because"])
    assert (
        notes.read(by_name["m1"])[0] == "float16" and by_name["m1"].doc_string == "exported from m1 = x @ W1"
    )
    casts = [n for n in annotated.model.graph.node if n.op_type == "Cast"]
    assert casts and all("inserted by amp-rewrite" in notes.read(c)[1] for c in casts)
    feeds = random_feeds(model)
    assert_close(run_ort(annotated.model, feeds), run_ort(model, feeds))
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    assert main([str(path), "--annotate", "--quiet", "-o", str(tmp_path / "a.onnx")]) == 0
    assert main([str(path), "--quiet", "-o", str(tmp_path / "p.onnx")]) == 0
    written = onnx.load(tmp_path / "a.onnx")
    assert {n.name: notes.read(n) for n in written.graph.node}["a"][1].startswith("Add 'a' kept float32")
    assert _stripped(written) == _stripped(onnx.load(tmp_path / "p.onnx"))
    assert (tmp_path / "p.onnx").read_bytes() == plain.model.SerializeToString()


def test_casts_inside_a_branch_are_drawn_on_the_node_holding_it():
    def branch(name, op):  # x is read from the outer graph and cast inside each branch
        return onnx.helper.make_graph(
            [
                node("MatMul", ["x", "W"], [f"{name}_mm"], name=f"{name}_mm"),
                node(op, [f"{name}_mm"], [f"{name}_out"], name=f"{name}_act"),
            ],
            name,
            [],
            [tensor(f"{name}_out", [2, 3])],
        )

    rng = np.random.default_rng(5)
    model = make_model(
        [
            node("ReduceSum", ["x"], ["total"], name="total", keepdims=0),
            node("Greater", ["total", "zero"], ["c"], name="cond"),
            node(
                "If",
                ["c"],
                ["y"],
                name="if",
                then_branch=branch("then", "Relu"),
                else_branch=branch("else", "Sigmoid"),
            ),
        ],
        [tensor("x", [2, 4])],
        [tensor("y", [2, 3])],
        [init("W", rng.standard_normal((4, 3)).astype(np.float32)), init("zero", np.float32(0.0))],
    )
    result = rewrite(model)
    data = report_page.page_data(result.report, model)
    stubs = {data["name"][data["groups"][0]["i"][s[0]]]: s[1:] for s in data["groups"][0]["st"]}
    assert (
        stubs["if"][2] == result.report.summary["casts_inserted"] == data["casts"] == 4
    )  # x in, out back: per branch
    feeds = random_feeds(model)
    assert_close(run_ort(result.model, feeds), run_ort(model, feeds), rtol=2e-2, atol=2e-2)
