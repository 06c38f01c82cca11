"""Calibration both ways: an elementwise range-deny op (op_lists/range_relax.yaml) measured far
inside float16's range becomes an infer op; one near the range, or a reduction, stays float32.
Numbers checked under ONNX Runtime and onnx.reference (float16 arithmetic).
"""

import numpy as np
import pytest

from amp_rewrite import rewrite
from amp_rewrite.checks import calibrate
from amp_rewrite.errors import UsageError
from helpers import assert_close, init, make_model, node, run_ort, run_reference, tensor


def exp_between_matmuls(scale, seed=0):
    """MatMul -> Exp -> MatMul -> Softmax: `scale` sets how large Exp's input gets."""
    rng = np.random.default_rng(seed)
    inits = [
        init("W1", (rng.standard_normal((16, 16)) * scale).astype(np.float32)),
        init("W2", (rng.standard_normal((16, 8)) * 0.01).astype(np.float32)),
    ]
    nodes = [
        node("MatMul", ["x", "W1"], ["h"], name="fc1"),
        node("Exp", ["h"], ["e"], name="exp"),
        node("MatMul", ["e", "W2"], ["z"], name="fc2"),
        node("Softmax", ["z"], ["y"], name="softmax", axis=-1),
    ]
    return make_model(nodes, [tensor("x", [8, 16])], [tensor("y", [8, 8])], inits)


def feeds(seed):
    return [
        {"x": np.random.default_rng(seed + i).standard_normal((8, 16)).astype(np.float32)} for i in range(2)
    ]


def precision(result, name):
    return result.report.node(name)["precision"]


def test_exp_far_inside_the_range_becomes_float16_and_matches():
    model = exp_between_matmuls(0.1)
    cal = calibrate.calibrate(model, feeds(1))
    result = rewrite(model, calibration=cal, deny=["Softmax"])
    assert precision(result, "exp") == "float16" and result.report.node("exp")["list"] == "infer"
    assert precision(result, "softmax") == "float32"  # a deny reduction: never relaxed, whatever its values
    section = cal.to_dict(relax_margin=16.0)
    [relaxed] = section["relaxed"]
    assert relaxed["node"] == "exp" and section["relax_margin"] == 16.0
    assert relaxed["maxima"]["output 'e'"] == pytest.approx(cal.ranges["e"].max_abs)
    assert relaxed["maxima"]["output 'e'"] <= 65504 / 16 and "relaxed from deny to infer" in relaxed["reason"]
    for f in feeds(1) + feeds(9):
        expected = run_ort(model, f)
        for got in (run_ort(result.model, f), run_reference(result.model, f)):
            assert np.isfinite(got[0]).all()
            assert_close(got, expected, rtol=1e-2, atol=1e-3)
    plain = rewrite(model)  # without calibration the lists decide: Exp is deny
    assert precision(plain, "exp") == "float32"
    off = rewrite(model, calibration=cal, relax_margin=0)
    assert precision(off, "exp") == "float32"


def test_exp_near_the_range_stays_float32():
    model = exp_between_matmuls(1.5)  # Exp's outputs reach thousands: within float16, not within 65504/16
    cal = calibrate.calibrate(model, feeds(1))
    assert 65504 / 16 < cal.ranges["e"].max_abs
    result = rewrite(model, calibration=cal, scale_activations=False)
    assert precision(result, "exp") == "float32"
    assert cal.relaxed(margin=16.0) == {}
    for f in feeds(1):  # softmax over logits in the tens: float16 MatMul rounding shows at 1e-3
        assert_close(run_reference(result.model, f), run_ort(model, f), rtol=1e-2, atol=1e-2)


def test_relax_margin_below_one_is_refused():
    with pytest.raises(UsageError, match="relax margin"):
        rewrite(exp_between_matmuls(0.1), relax_margin=0.5)
