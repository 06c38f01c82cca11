"""Power-of-two scaling under calibration (transform/scaling.py): linear regions whose measured
values pass float16's range compute in float16 on inputs x 2^-k. Checked by numbers under ONNX
Runtime and onnx.reference (which keeps float16 arithmetic, so an overflow would show as inf).
"""

import json

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings

from amp_rewrite import rewrite
from amp_rewrite.checks import calibrate
from amp_rewrite.cli import main
from helpers import assert_close, init, load_tool, make_model, node, run_ort, run_reference, tensor

F16_MAX = 65504.0
COMPUTE = ("MatMul", "Conv", "Gemm", "ConvTranspose")


def conv_front_end(seed=0):
    """Three Convs of an audio front end: the first one's outputs reach about 2e5."""
    rng = np.random.default_rng(seed)
    f32 = np.float32
    w1 = np.clip(
        rng.standard_normal((8, 1, 5)) * 1.5e4, -6e4, 6e4
    )  # in float16's range: only activations pass it
    inits = [
        init("W1", w1.astype(f32)),
        init("b1", (rng.standard_normal(8) * 1e3).astype(f32)),
        init("W2", (rng.standard_normal((8, 8, 3)) * 0.05).astype(f32)),
        init("b2", (rng.standard_normal(8) * 10).astype(f32)),
        init("W3", (rng.standard_normal((4, 8, 3)) * 0.1).astype(f32)),
        init("b3", rng.standard_normal(4).astype(f32)),
    ]
    nodes = [
        node("Conv", ["x", "W1", "b1"], ["c1"], name="conv1", pads=[2, 2]),
        node("Relu", ["c1"], ["r1"], name="relu1"),
        node("Conv", ["r1", "W2", "b2"], ["c2"], name="conv2", pads=[1, 1]),
        node("Relu", ["c2"], ["r2"], name="relu2"),
        node("Conv", ["r2", "W3", "b3"], ["y"], name="conv3", pads=[1, 1]),
    ]
    return make_model(nodes, [tensor("x", [1, 1, 256])], [tensor("y", [1, 4, 256])], inits)


def ffn(seed=0):
    """A two-layer FFN (MatMul-Add-Relu-MatMul-Add) whose hidden feature 3 reaches about 1e5 (T5's outliers)."""
    rng = np.random.default_rng(seed)
    f32 = np.float32
    w1 = rng.standard_normal((16, 64)) * 0.3
    w1[:, 3] *= 3e4
    b1 = rng.standard_normal(64) * 0.1
    b1[3] = 6e4  # the outlier feature is mostly positive: Relu passes it on
    inits = [
        init("W1", w1.astype(f32)),
        init("b1", b1.astype(f32)),
        init("W2", (rng.standard_normal((64, 16)) * 0.1).astype(f32)),
        init("b2", (rng.standard_normal(16) * 0.1).astype(f32)),
    ]
    nodes = [
        node("MatMul", ["x", "W1"], ["h"], name="fc1"),
        node("Add", ["h", "b1"], ["hb"], name="fc1/bias"),
        node("Relu", ["hb"], ["a"], name="act"),
        node("MatMul", ["a", "W2"], ["o"], name="fc2"),
        node("Add", ["o", "b2"], ["y"], name="fc2/bias"),
    ]
    return make_model(nodes, [tensor("x", [8, 16])], [tensor("y", [8, 16])], inits)


def samples(model, count, seed):
    rng = np.random.default_rng(seed)
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    scale = 2.0 if len(shape) == 3 else 1.0  # the audio front end's input is louder
    return [{"x": (rng.standard_normal(shape) * scale).astype(np.float32)} for _ in range(count)]


@pytest.fixture(scope="module", params=["conv", "ffn"])
def case(request):
    model = {"conv": conv_front_end, "ffn": ffn}[request.param]()
    cal = calibrate.calibrate(model, samples(model, 2, seed=1))
    return request.param, model, cal


def precisions(result):
    return {n["name"]: n["precision"] for n in result.report.nodes if n["op_type"] in COMPUTE}


def test_calibration_sees_values_beyond_float16(case):
    _, model, cal = case
    assert cal.culprits() and cal.culprits()[0].max_abs > 1.5 * F16_MAX


def test_scaled_regions_compute_in_float16_and_match_float32(case):
    name, model, cal = case
    result = rewrite(model, calibration=cal)
    assert set(precisions(result).values()) == {"float16"}, precisions(result)
    section = result.report.sections["scaling"]
    [region] = section["regions"]
    top = cal.culprits()[0].max_abs
    assert region["max_abs"] == pytest.approx(top)
    k = region["k"]  # the smallest k that brings the maximum under the limit
    assert top * 2.0**-k <= cal.threshold < top * 2.0 ** -(k - 1)
    by_name = {n["name"]: n for n in result.report.nodes}
    assert all(by_name[key]["scaled"]["k"] == k for key in region["nodes"] if key in by_name)
    assert "power-of-two scaling" in by_name["conv1" if name == "conv" else "fc1"]["because"]
    onnx.checker.check_model(result.model, full_check=True)
    for feeds in samples(model, 2, seed=1) + samples(model, 1, seed=7):  # calibration data and new data
        expected = run_ort(model, feeds)
        scale = max(float(np.abs(e).max()) for e in expected)
        for got in (run_ort(result.model, feeds), run_reference(result.model, feeds)):
            assert all(np.isfinite(g).all() for g in got)
            assert_close(got, expected, rtol=1e-2, atol=2e-3 * scale)


def test_without_scaling_compute_goes_float32_or_overflows(case):
    _, model, cal = case
    kept = rewrite(model, calibration=cal, scale_activations=False)
    assert "float32" in precisions(kept).values()  # today's behaviour: calibration forces them float32
    assert "scaling" not in kept.report.sections
    forced = rewrite(model)  # every compute op float16 without scaling: float16 arithmetic overflows
    assert set(precisions(forced).values()) == {"float16"}
    wrong = 0
    for feeds in samples(model, 2, seed=1):  # the calibration samples: one holds the maximum
        with np.errstate(all="ignore"):
            got = run_reference(forced.model, feeds)
        expected = run_ort(model, feeds)
        scale = max(float(np.abs(e).max()) for e in expected)
        wrong += not all(
            np.isfinite(g).all() and np.allclose(g, e, rtol=1e-2, atol=2e-3 * scale)
            for g, e in zip(got, expected)
        )
    assert wrong


def test_a_product_of_two_activations_is_not_scaled():
    """x·xᵀ is of degree two in x: scaling x by 2^-k would scale it by 2^-2k. It stays float32."""
    rng = np.random.default_rng(3)
    inits = [init("W", (rng.standard_normal((8, 8)) * 300).astype(np.float32))]
    nodes = [
        node("MatMul", ["x", "W"], ["h"], name="proj"),
        node("Transpose", ["h"], ["ht"], name="t", perm=[1, 0]),
        node("MatMul", ["h", "ht"], ["s"], name="scores"),
        node("Relu", ["s"], ["y"], name="out"),
    ]
    model = make_model(nodes, [tensor("x", [4, 8])], [tensor("y", [4, 4])], inits)
    cal = calibrate.calibrate(model, samples(model, 1, seed=2))
    assert {r.name for r in cal.culprits()} >= {"s"}
    result = rewrite(model, calibration=cal)
    assert precisions(result)["scores"] == "float32"
    regions = result.report.sections.get("scaling", {}).get("regions", [])
    assert all("scores" not in r["nodes"] for r in regions)
    feeds = samples(model, 1, seed=2)[0]
    expected = run_ort(model, feeds)
    for got in (run_ort(result.model, feeds), run_reference(result.model, feeds)):
        assert_close(got, expected, rtol=1e-2, atol=1e-3 * float(np.abs(expected[0]).max()))


def test_cli_reports_the_scaled_regions(tmp_path, capsys):
    model = ffn()
    path, inputs, report = tmp_path / "m.onnx", tmp_path / "s.npz", tmp_path / "r.json"
    onnx.save(model, path)
    np.savez(inputs, **{f"{i}/x": s["x"] for i, s in enumerate(samples(model, 2, seed=1))})
    html = tmp_path / "r.html"
    assert (
        main(
            [
                str(path),
                "--calibrate",
                "--inputs",
                str(inputs),
                "-o",
                str(tmp_path / "o.onnx"),
                "--report",
                str(report),
                "--html",
                str(html),
            ]
        )
        == 0
    )
    assert "fc1" in html.read_text()  # the picture draws the original graph, matched by node name
    out = capsys.readouterr().out
    assert "power-of-two scaling: 1 region(s)" in out and "region 'fc1'" in out
    data = json.loads(report.read_text())
    assert data["scaling"]["regions"][0]["k"] >= 1
    assert not any(f["node"] in ("fc1", "fc2") for f in data["calibration"]["forced"])
    assert (
        main(
            [
                str(path),
                "--calibrate",
                "--no-scale-activations",
                "--inputs",
                str(inputs),
                "-o",
                str(tmp_path / "p.onnx"),
                "--report",
                str(report),
                "--force",
            ]
        )
        == 0
    )  # the report exists
    data = json.loads(report.read_text())
    assert "scaling" not in data and any(f["node"] == "fc1" for f in data["calibration"]["forced"])


def test_unnamed_nodes_graph_outputs_and_subgraph_readers_see_unscaled_values():
    """Region tensors that leave the region (a graph output, an If branch's outer reference) are
    restored under their own names; unnamed nodes are exempt from calibration by their old keys."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(5)
    w1 = rng.standard_normal((16, 32)).astype(np.float32)
    w1[:, 0] *= 3e4
    inits = [
        init("W1", w1),
        init("b1", np.full(32, 5e4, np.float32)),
        init("W2", (rng.standard_normal((32, 8)) * 0.1).astype(np.float32)),
    ]
    then_branch = helper.make_graph([node("Identity", ["h"], ["t"])], "then", [], [tensor("t", [4, 32])])
    else_branch = helper.make_graph([node("Identity", ["hb"], ["e"])], "else", [], [tensor("e", [4, 32])])
    unnamed = helper.make_node
    nodes = [
        unnamed("MatMul", ["x", "W1"], ["h"]),
        unnamed("Add", ["h", "b1"], ["hb"]),
        unnamed("Relu", ["hb"], ["a"]),
        unnamed("MatMul", ["a", "W2"], ["y"]),
        node("If", ["cond"], ["sel"], then_branch=then_branch, else_branch=else_branch),
    ]
    model = make_model(
        nodes,
        [tensor("x", [4, 16]), tensor("cond", [], TensorProto.BOOL)],
        [tensor("y", [4, 8]), tensor("hb", [4, 32]), tensor("sel", [4, 32])],
        inits,
    )
    rng_feeds = np.random.default_rng(6)
    feeds = [
        {"x": rng_feeds.standard_normal((4, 16)).astype(np.float32), "cond": np.array(c)}
        for c in (True, False)
    ]
    cal = calibrate.calibrate(model, feeds)
    result = rewrite(model, calibration=cal)
    [region] = result.report.sections["scaling"]["regions"]
    assert {"h", "hb", "y"} <= set(region["exits"]) and region["k"] >= 2
    assert {"h", "hb", "a"} <= set(result.report.sections["scaling"]["exempt"])
    low = {n["op_type"] for n in result.report.nodes if n["precision"] == "float16"}
    assert "MatMul" in low
    assert [o.name for o in result.model.graph.output] == ["y", "hb", "sel"]
    for f in feeds:
        expected = run_ort(model, f)
        for got in (run_ort(result.model, f), run_reference(result.model, f)):
            assert all(np.isfinite(g).all() for g in got)
            for g, e in zip(got, expected):
                assert_close([g], [e], rtol=1e-2, atol=2e-3 * float(np.abs(e).max()))


strategies = load_tool("strategies")


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(strategies.onnx_graphs())
def test_scaling_keeps_meaning_on_random_graphs(model):
    """A calibration limit of 0.5 (safety 131008) makes most tensors 'over the limit', so random
    graphs get regions (about 4 in 10 do) of k 2 to 7: the result must still be valid and compute
    the same numbers (ONNX Runtime, float16 tolerance as the fuzz test's)."""
    feeds = strategies.synthesise(model, seed=0)
    cal = calibrate.calibrate(model, feeds, safety=F16_MAX / 0.5)
    result = rewrite(model, calibration=cal)
    onnx.checker.check_model(result.model, full_check=True)
    expected, got = run_ort(model, feeds[0]), run_ort(result.model, feeds[0])
    for g, e in zip(got, expected):
        if e.dtype.kind in "biu":
            assert np.array_equal(g, e)
            continue
        scale = 1.0 + float(np.max(np.abs(e), initial=0.0))
        assert np.isfinite(g).all() == np.isfinite(e).all()
        assert float(np.max(np.abs(g.astype(np.float64) - e), initial=0.0)) <= 0.03 * scale


def test_fallback_compares_scaled_tensors_at_their_true_scale():
    """--tolerance after scaling: region tensors hold values x 2^-k under their own names, so the
    fallback multiplies them back before blaming a node (else every one looks 94% wrong), and the
    inserted scale Muls do not shift which node a report entry is."""
    from amp_rewrite import driver

    model = conv_front_end()
    feeds = samples(model, 2, seed=1)
    checked = driver.check(
        model, samples=feeds, calibrate=True, tolerance=True, rtol=1e-4, atol=1e-3, reference=True
    )
    assert checked.passed  # 1e-4 of the outputs' own scale: only float32 gets there, node by node
    reasons = checked.fallback.pinned
    assert "conv1" in reasons
    first = reasons[next(iter(reasons))]
    jump = float(first.rsplit("-> ", 1)[1])
    assert jump < 0.01, first  # float16 rounding, not the 1 - 2^-4 of comparing scaled values
    for f in feeds:
        assert_close(run_reference(checked.result.model, f), run_ort(model, f), rtol=1e-2, atol=1e-3)
