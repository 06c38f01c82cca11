"""QuantizeLinear -> DequantizeLinear: the straight-through estimator (rules/quantize.py). The
gradient graph's dx is checked against an independent numpy STE (torch's FakeQuantize: dY where
qmin <= round(x/s) + zp <= qmax); a QDQ model's float weights fine-tune with falling loss, and the
exported model is the QDQ model with the trained weights."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from amp_rewrite.autodiff import build_gradient_graph
from amp_rewrite.errors import GradientError
from amp_rewrite.training import Trainer
from helpers import IR_VERSION, run_ort

F = TensorProto.FLOAT


def _pair_model(scale, zero, axis=1, dq_scale="s"):
    """x -> Q -> DQ -> * g -> ReduceSum: d loss / dx is g where the STE passes, else 0."""
    rng = np.random.default_rng(0)
    zp = ["zp"] if zero is not None else []
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", *zp], ["q"], axis=axis),
        helper.make_node("DequantizeLinear", ["q", dq_scale, *zp], ["d"], axis=axis),
        helper.make_node("Mul", ["d", "g"], ["y"]),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
    ]
    inits = [numpy_helper.from_array(np.asarray(scale, np.float32), "s")]
    inits += [numpy_helper.from_array(np.asarray(scale, np.float32) * 2, "s2")]
    inits += [numpy_helper.from_array(zero, "zp")] if zero is not None else []
    inits.append(numpy_helper.from_array(rng.standard_normal((2, 3, 4)).astype(np.float32), "g"))
    graph = helper.make_graph(
        nodes,
        "qdq",
        [helper.make_tensor_value_info("x", F, [2, 3, 4])],
        [helper.make_tensor_value_info("loss", F, [])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=IR_VERSION)


def _numpy_ste(x, g, scale, zero, qmin, qmax, axis=1):
    shape = [1] * x.ndim
    shape[axis] = -1
    s = np.asarray(scale, np.float32).reshape(shape if np.ndim(scale) else ())
    zp = 0.0 if zero is None else np.asarray(zero, np.float32).reshape(shape if np.ndim(zero) else ())
    r = np.round(x / s) + zp  # numpy rounds half to even, as QuantizeLinear does
    return np.where((r >= qmin) & (r <= qmax), g, 0)


CASES = {
    "int8-per-channel": ([0.02, 0.05, 0.1], np.array([0, 10, -5], np.int8), -128, 127),
    "uint8-per-tensor": (0.03, np.array(128, np.uint8), 0, 255),
    "uint8-no-zero-point": (0.03, None, 0, 255),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_gradient_is_the_straight_through_estimator(case):
    scale, zero, qmin, qmax = CASES[case]
    model = build_gradient_graph(_pair_model(scale, zero), "loss", ["x"])
    x = (np.random.default_rng(1).standard_normal((2, 3, 4)) * 6).astype(np.float32)
    dx = dict(zip([o.name for o in model.graph.output], run_ort(model, {"x": x})))["x_grad"]
    g = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "g"))
    expected = _numpy_ste(x, g, scale, zero, qmin, qmax)
    assert 0 < (expected == 0).sum() < expected.size  # some values saturate, some pass
    np.testing.assert_array_equal(dx, expected)


def test_a_pair_with_different_scales_is_refused_in_one_line():
    with pytest.raises(GradientError, match="share the scale and zero point"):
        build_gradient_graph(_pair_model(0.03, np.array(128, np.uint8), dq_scale="s2"), "loss", ["x"])


def _qdq_regressor():
    """x @ W + b, its activation through an int8 Q/DQ pair, then @ V: W, b, V float, trainable."""
    rng = np.random.default_rng(2)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["hb"]),
        helper.make_node("QuantizeLinear", ["hb", "s", "zp"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["d"]),
        helper.make_node("MatMul", ["d", "V"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32) * 0.3, "W"),
        numpy_helper.from_array(rng.standard_normal(16).astype(np.float32) * 0.1, "b"),
        numpy_helper.from_array(np.array(0.02, np.float32), "s"),
        numpy_helper.from_array(np.array(0, np.int8), "zp"),
        numpy_helper.from_array(rng.standard_normal((16, 2)).astype(np.float32) * 0.3, "V"),
    ]
    graph = helper.make_graph(
        nodes,
        "qdq",
        [helper.make_tensor_value_info("x", F, [4, 8])],
        [helper.make_tensor_value_info("y", F, [4, 2])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=IR_VERSION)


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_a_qdq_model_fine_tunes_and_exports_its_qdq_graph(precision):
    model = _qdq_regressor()
    rng = np.random.default_rng(3)
    feeds = {
        "x": rng.standard_normal((4, 8)).astype(np.float32),
        "targets": rng.standard_normal((4, 2)).astype(np.float32),
    }
    trainer = Trainer(model, loss="mse", precision=precision, provider="cpu", verbose=False)
    assert set(trainer.step_graph.weights) == {"W", "b", "V"}  # never the scale or zero point
    losses = [trainer.step(feeds).loss for _ in range(8)]
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses
    exported = trainer.inference_model()
    assert [n.op_type for n in exported.graph.node] == [n.op_type for n in model.graph.node]
    trained = {t.name: numpy_helper.to_array(t) for t in exported.graph.initializer}
    first = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert not np.array_equal(trained["b"], first["b"])  # reached only through the Q/DQ pair's STE
    assert np.array_equal(trained["s"], first["s"])
    onnx.checker.check_model(exported)
