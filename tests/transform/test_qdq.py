"""Quantized (QDQ) models: from opset 19 DequantizeLinear writes the target type itself and
QuantizeLinear reads it, so no Cast sits next to a Q/DQ pair; before 19 the schema keeps them float32."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

from amp_rewrite import rewrite
from helpers import assert_close, init, make_model, node, run_ort, run_reference, tensor


def run_ort_unfused(model, feeds):
    """The float32 original as ORT runs it without graph optimisations: fused, ORT runs an int8 QDQ
    MatMul with its u8s8 kernel, which saturates on x86 CPUs without VNNI (AVX2's vpmaddubsw) and
    so depends on the machine (on an AMD EPYC without AVX-512, 3 of 8 outputs off by up to 11)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        None, feeds
    )


INT = {"int8": (np.int8, -127, 127), "uint8": (np.uint8, 0, 255)}


def qdq_model(opset: int, int_type: str, per_channel: bool) -> onnx.ModelProto:
    """x -> MatMul(DQ(w_q)) -> Relu -> Q -> DQ -> MatMul(DQ(w2_q)) -> y: quantized weights (per tensor
    or per output channel) and one quantized activation, as a QDQ exporter writes them."""
    rng = np.random.default_rng(opset + per_channel)
    dtype, lo, hi = INT[int_type]
    zero = 0 if int_type == "int8" else 128

    def weight(name, shape):
        axis_scale = (rng.uniform(0.01, 0.03, shape[1]) if per_channel else np.array(0.02)).astype(np.float32)
        q = rng.integers(lo, hi, shape).astype(dtype)
        zp = np.full(axis_scale.shape, zero, dtype)
        attrs = {"axis": 1} if per_channel else {}
        inits = [init(f"{name}_q", q), init(f"{name}_scale", axis_scale), init(f"{name}_zp", zp)]
        return node(
            "DequantizeLinear",
            [f"{name}_q", f"{name}_scale", f"{name}_zp"],
            [name],
            name=f"dq_{name}",
            **attrs,
        ), inits

    dq1, i1 = weight("w1", (16, 16))
    dq2, i2 = weight("w2", (16, 8))
    act = [init("a_scale", np.array(0.05, np.float32)), init("a_zp", np.array(zero, dtype))]
    nodes = [
        dq1,
        node("MatMul", ["x", "w1"], ["h"], name="mm1"),
        node("Relu", ["h"], ["r"], name="relu"),
        node("QuantizeLinear", ["r", "a_scale", "a_zp"], ["rq"], name="q_act"),
        node("DequantizeLinear", ["rq", "a_scale", "a_zp"], ["rd"], name="dq_act"),
        dq2,
        node("MatMul", ["rd", "w2"], ["y"], name="mm2"),
    ]
    return make_model(nodes, [tensor("x", [4, 16])], [tensor("y", [4, 8])], i1 + i2 + act, opset=opset)


def _casts_after_dq(model):
    made_by_dq = {o for n in model.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    return [n.name for n in model.graph.node if n.op_type == "Cast" and n.input[0] in made_by_dq]


CASES = [(opset, t, pc) for opset in (13, 19, 21) for t in INT for pc in (False, True)]


@pytest.mark.parametrize(
    "opset,int_type,per_channel",
    CASES,
    ids=[f"opset{o}-{t}-{'channel' if pc else 'tensor'}" for o, t, pc in CASES],
)
def test_qdq_model(opset, int_type, per_channel):
    model = qdq_model(opset, int_type, per_channel)
    result = rewrite(model)
    onnx.checker.check_model(result.model, full_check=True)
    feeds = {"x": np.random.default_rng(1).uniform(-1, 1, (4, 16)).astype(np.float32)}
    expected = run_ort_unfused(model, feeds)[0]
    scale = float(np.max(np.abs(expected)))
    runs = [run_ort(result.model, feeds)[0]]
    if opset >= 19:  # onnx.reference implements DequantizeLinear from 19 only
        runs.append(run_reference(result.model, feeds)[0])
    for got in runs:
        # an activation on a quantization step boundary may round one step apart: tolerance of a step
        assert_close(got, expected, rtol=2e-2, atol=0.02 * scale)
    dq_nodes = [n for n in result.report.nodes if n["op_type"] == "DequantizeLinear"]
    if opset >= 19:
        assert _casts_after_dq(result.model) == []
        assert all(n["precision"] == "float16" for n in dq_nodes), dq_nodes
        assert result.report.node("q_act")["precision"] == "float16"
        types = {
            v.name: v.type.tensor_type.elem_type
            for v in onnx.shape_inference.infer_shapes(result.model, strict_mode=True).graph.value_info
        }
        assert types["w1"] == types["rd"] == TensorProto.FLOAT16
        assert result.report.summary["casts_inserted"] == 2  # x in, y out: nothing next to Q/DQ
    else:  # DequantizeLinear-13 writes float only: the schema keeps it, with a Cast after it
        assert all(n["precision"] == "float32" for n in dq_nodes)
        assert "does not allow float16" in result.report.node("dq_w1")["because"]


def test_scale_shared_with_a_float32_reader_is_duplicated():
    """The activation scale is read by the low Q/DQ pair and by a float32 Mul: it is duplicated, not cast."""
    model = qdq_model(19, "int8", False)
    model.graph.node.append(node("Mul", ["y", "a_scale"], ["z"], name="mul_scale"))
    model.graph.output.append(onnx.helper.make_tensor_value_info("z", TensorProto.FLOAT, [4, 8]))
    result = rewrite(model, keep_fp32_nodes=["mul_scale"])
    assert result.report.summary["constants_duplicated"] >= 1
    assert _casts_after_dq(result.model) == []
    feeds = {"x": np.random.default_rng(2).uniform(-1, 1, (4, 16)).astype(np.float32)}
    for got, expected in zip(run_ort(result.model, feeds), run_ort_unfused(model, feeds)):
        assert_close(got, expected, rtol=2e-2, atol=0.02 * float(np.max(np.abs(expected))))
