"""Range evidence for cost placement's extra low ops (`analysis/evidence.py`): an op cost
placement makes low that TF's rule keeps float32 stays low only with a data-free bound or values
measured on synthesised inputs within AutoCast's limit. Every rewrite runs in onnx.reference (it
keeps float16 as float16, so overflow shows) and ONNX Runtime against float32."""

import numpy as np
import pytest

from amp_rewrite import rewrite
from amp_rewrite.transform import range_run
from helpers import assert_close, init, make_model, node, run_ort, run_reference, tensor, weights


def x1000():
    """onnxconverter-common's own auto-mixed-precision test model: 274,000 in the middle."""
    return make_model(
        [
            node("Transpose", ["x"], ["a"], "transpose_x", perm=[0, 1, 3, 2]),
            node("Transpose", ["b"], ["c"], "transpose_b", perm=[1, 0]),
            node("MatMul", ["a", "c"], ["m"], "matmul"),
            node("Mul", ["m", "hundred"], ["m_large"], "times_100"),
            node("Mul", ["m_large", "ten"], ["m_xlarge"], "times_10"),
            node("Reshape", ["m_xlarge", "shape"], ["mr"], "reshape1"),
            node("Reshape", ["mr", "shape"], ["mr2"], "reshape2"),
            node("Div", ["mr2", "k999"], ["z"], "div"),
        ],
        [tensor("x", [1, 1, 6, 1])],
        [tensor("z", [2])],
        [
            init("b", np.arange(1, 13, dtype=np.float32).reshape(2, 6)),
            init("hundred", np.array(100, np.float32)),
            init("ten", np.array(10, np.float32)),
            init("shape", np.array([2], np.int64)),
            init("k999", np.array(999, np.float32)),
        ],
        opset=13,
    )


FEEDS = {"x": np.arange(2, 8, dtype=np.float32).reshape(1, 1, 6, 1)}  # the test's own input


def _precision(result, name):
    return result.report.node(name)["precision"]


def test_x1000_is_finite_by_default_and_the_measured_ops_say_why():
    model = x1000()
    result = rewrite(model)
    expected = run_ort(model, FEEDS)
    np.testing.assert_allclose(expected[0], [112.112, 274.274], rtol=1e-4)
    got = run_reference(result.model, FEEDS)[0]
    assert np.isfinite(got).all()
    assert_close([got], expected, rtol=1e-2, atol=1e-2)
    assert_close(run_ort(result.model, FEEDS), expected, rtol=1e-2, atol=1e-2)
    assert _precision(result, "matmul") == "float16"
    for name in ("times_10", "reshape1", "reshape2", "div"):
        entry = result.report.node(name)
        assert entry["precision"] == "float32", name
        assert "TF's rule keeps it float32 and synthesised inputs reach" in entry["because"], name
    note = next(n for n in result.report.notes if n.startswith("range check:"))
    assert "measured on synthesised inputs in" in note and "stay float32" in note
    # TF's rule keeps every op after the MatMul float32 (no allow op follows): no check runs
    tf = rewrite(model, placement="tf")
    assert not any(n.startswith("range check") for n in tf.report.notes)
    assert [_precision(tf, n) for n in ("times_100", "times_10", "div")] == ["float32"] * 3


def test_above_the_work_budget_nothing_is_measured_and_unproven_ops_stay_float32(monkeypatch):
    monkeypatch.setattr(range_run, "RANGE_CHECK_NODES", 3)
    result = rewrite(x1000())
    assert all(_precision(result, n) == "float32" for n in ("times_100", "times_10", "div"))
    assert (
        "no range evidence could be had (over the work budget of 3 nodes"
        in result.report.node("times_100")["because"]
    )
    note = next(n for n in result.report.notes if n.startswith("range check:"))
    assert "were not measured (over the work budget" in note
    assert np.isfinite(run_reference(result.model, FEEDS)[0]).all()


def test_a_data_free_bound_needs_no_measurement():
    """Sigmoid's values are within 1 and x 0.5 keeps them there: low without a run, no note."""
    rng = np.random.default_rng(0)
    model = make_model(
        [
            node("MatMul", ["x", "W"], ["h"], "mm"),
            node("Sigmoid", ["h"], ["s"], "sigmoid"),
            node("Mul", ["s", "half"], ["y"], "half"),
        ],
        [tensor("x", [4, 16])],
        [tensor("y", [4, 16])],
        [init("W", weights(rng, 16, 16)), init("half", np.array(0.5, np.float32))],
    )
    result = rewrite(model, keep_io_types=False)
    assert _precision(result, "sigmoid") == "float16" and _precision(result, "half") == "float16"
    assert rewrite(model, placement="tf", keep_io_types=False).report.node("half")["precision"] == "float32"
    assert not any(n.startswith("range check") for n in result.report.notes)
    feeds = {"x": rng.standard_normal((4, 16)).astype(np.float16)}
    expected = run_ort(model, {"x": feeds["x"].astype(np.float32)})
    assert_close([run_reference(result.model, feeds)[0].astype(np.float32)], expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("placement", ["cost", "tf"])
def test_a_low_region_needs_an_allow_op_or_the_users_low_io(placement):
    """A Relu between a float16 input and a float16 output (keep_io_types=False) is the user's own
    float16 region: it stays float16 (no cast); the same Relu beside a float32 input and output,
    where only a made-up region could make it low, is float32."""
    rng = np.random.default_rng(1)
    model = make_model(
        [node("MatMul", ["x", "W"], ["y"], "mm"), node("Relu", ["z"], ["r"], "relu")],
        [tensor("x", [2, 8]), tensor("z", [2, 8])],
        [tensor("y", [2, 8]), tensor("r", [2, 8])],
        [init("W", weights(rng, 8, 8))],
    )
    result = rewrite(model, keep_io_types=False, placement=placement)
    assert _precision(result, "mm") == "float16"
    assert _precision(result, "relu") == ("float16" if placement == "cost" else "float32")
    assert _precision(rewrite(model, placement=placement), "relu") == "float32"
    feeds = {
        "x": rng.standard_normal((2, 8)).astype(np.float16),
        "z": rng.standard_normal((2, 8)).astype(np.float16),
    }
    expected = run_ort(model, {k: v.astype(np.float32) for k, v in feeds.items()})
    assert_close([a.astype(np.float32) for a in run_ort(result.model, feeds)], expected, rtol=1e-2, atol=1e-2)
