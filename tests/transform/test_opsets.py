"""Opsets 7..latest, ONNX Runtime's com.microsoft ops, unknown domains, schema probes.

A type group is coloured only if its schema at the model's opset admits the target type; ops
whose types are tied beyond their type parameters (BitCast's bit width, function bodies) are
checked with ONNX's own inference. Every rewritten model is run in ONNX Runtime against the
original.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from amp_rewrite import rewrite
from helpers import assert_close, init, make_model, node, run_ort, run_reference, tensor, weights

FLOAT, F16, BF16 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16


def _check(model, result, feeds, rtol=2e-2, atol=2e-2, full_check=True):
    onnx.checker.check_model(result.model, full_check=full_check)
    assert_close(run_ort(result.model, feeds), run_ort(model, feeds), rtol=rtol, atol=atol)


def _cnn(opset):
    """Conv -> Relu -> MaxPool -> Flatten -> Gemm -> LogSoftmax (a deny op), valid at every opset from 7."""
    rng = np.random.default_rng(0)
    return make_model(
        [
            node("Conv", ["x", "Wc", "bc"], ["c"], name="conv", pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
            node("Relu", ["c"], ["r"], name="relu"),
            node("MaxPool", ["r"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
            node("Flatten", ["p"], ["f"], name="flat"),
            node("Gemm", ["f", "Wg", "bg"], ["g"], name="gemm", transB=1),
            node("LogSoftmax", ["g"], ["y"], name="logsoftmax"),
        ],
        [tensor("x", [1, 2, 4, 4])],
        [tensor("y", [1, 3])],
        [
            init("Wc", weights(rng, 4, 2, 3, 3)),
            init("bc", weights(rng, 4)),
            init("Wg", weights(rng, 3, 16)),
            init("bg", weights(rng, 3)),
        ],
        opset=opset,
    )


@pytest.mark.parametrize("opset", [7, 9, 11, 13, 17, 19, 21])
def test_cnn_at_every_opset_float16(opset):
    rng = np.random.default_rng(0)
    model = _cnn(opset)
    result = rewrite(model, target="float16")
    assert result.report.node("conv")["precision"] == "float16"
    assert result.report.node("gemm")["precision"] == "float16"
    assert result.report.node("logsoftmax")["precision"] == "float32"
    _check(model, result, {"x": weights(rng, 1, 2, 4, 4, scale=1.0)})


@pytest.mark.parametrize("opset", [7, 11, 13, 21])
def test_cnn_bfloat16_follows_the_schema_at_each_opset(opset):
    """bfloat16 Conv/Gemm arrived in later opsets: before, the schema keeps them float32."""
    model = _cnn(opset)
    result = rewrite(model, target="bfloat16")
    conv_sig = onnx.defs.get_schema("Conv", opset)
    admits = (
        "tensor(bfloat16)"
        in next(c for c in conv_sig.type_constraints if c.type_param_str == "T").allowed_type_strs
    )
    conv = result.report.node("conv")
    assert (conv["precision"] == "bfloat16") == admits
    if not admits:
        assert "does not allow bfloat16" in conv["groups"]["T"]["reason"]
    onnx.checker.check_model(result.model, full_check=True)


@pytest.mark.even_if_worse
def test_bitcast_stays_float32_when_bit_width_would_change():
    """Regression: BitCast's T1 admits float16 but its output keeps 32 bits: invalid model."""
    rng = np.random.default_rng(0)
    model = helper.make_model(
        helper.make_graph(
            [
                node("MatMul", ["x", "W"], ["h"], name="mm"),
                node("BitCast", ["h"], ["y"], name="bits", to=TensorProto.INT32),
            ],
            "g",
            [tensor("x", [2, 2])],
            [tensor("y", [2, 2], TensorProto.INT32)],
            [init("W", weights(rng, 2, 2))],
        ),
        opset_imports=[helper.make_opsetid("", 26)],
        ir_version=10,
    )
    result = rewrite(
        model, target="float16", allow=["BitCast"], provider="any"
    )  # the schema's verdict, not CUDA's
    reason = result.report.node("bits")["groups"]["T1"]["reason"]
    assert "inference refuses float16" in reason and "bit" in reason
    assert result.report.node("mm")["precision"] == "float16"
    onnx.checker.check_model(result.model, full_check=True)


def test_function_body_that_refuses_the_type_stays_float32():
    """Regression: MeanVarianceNormalization-13 admits float16 but its body adds a float epsilon."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [node("MeanVarianceNormalization", ["x"], ["y"], name="mvn")],
        "g",
        [tensor("x", [1, 2, 3, 3])],
        [tensor("y", [1, 2, 3, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    result = rewrite(
        model, target="float16", allow=["MeanVarianceNormalization"], provider="any"
    )  # schema, not CUDA
    assert result.report.node("mvn")["precision"] == "float32"
    assert "inference refuses float16" in result.report.node("mvn")["groups"]["T"]["reason"]
    # (the full checker trips on MVN-13's own body even in float32: an onnx bug, so ORT checks it)
    _check(model, result, {"x": weights(rng, 1, 2, 3, 3, scale=1.0)}, full_check=False)


@pytest.mark.even_if_worse
def test_attention23_groups_tied_by_its_body_are_coloured_together():
    """Regression: Attention-23 T1 (Q, K) and T2 (V) were coloured apart; its body multiplies them."""
    rng = np.random.default_rng(0)
    model = make_model(
        [node("Attention", ["q", "k", "v"], ["y"], name="att")],
        [tensor("q", [1, 2, 3, 4]), tensor("k", [1, 2, 5, 4]), tensor("v", [1, 2, 5, 4])],
        [tensor("y", [1, 2, 3, 4])],
        opset=23,
        ir_version=10,
    )
    result = rewrite(model, target="float16")
    groups = result.report.node("att")["groups"]
    assert list(groups) == ["T1+T2"] and groups["T1+T2"]["precision"] == "float16"
    feeds = {
        "q": weights(rng, 1, 2, 3, 4, scale=1),
        "k": weights(rng, 1, 2, 5, 4, scale=1),
        "v": weights(rng, 1, 2, 5, 4, scale=1),
    }
    _check(model, result, feeds)


def _microsoft_model():
    rng = np.random.default_rng(0)
    hidden, heads = 8, 2
    nodes = [
        node("FusedMatMul", ["x", "W1"], ["h"], name="fmm", domain="com.microsoft", alpha=1.0),
        node("BiasGelu", ["h", "b1"], ["g"], name="bgelu", domain="com.microsoft"),
        node("Attention", ["g", "Wqkv", "bqkv"], ["a"], name="attn", domain="com.microsoft", num_heads=heads),
        node(
            "SkipLayerNormalization",
            ["a", "x", "gamma", "beta"],
            ["y"],
            name="sln",
            domain="com.microsoft",
            epsilon=1e-5,
        ),
    ]
    inits = [
        init("W1", weights(rng, hidden, hidden)),
        init("b1", weights(rng, hidden)),
        init("Wqkv", weights(rng, hidden, 3 * hidden)),
        init("bqkv", weights(rng, 3 * hidden)),
        init("gamma", np.ones(hidden, np.float32)),
        init("beta", weights(rng, hidden)),
    ]
    return make_model(
        nodes,
        [tensor("x", [1, 4, hidden])],
        [tensor("y", [1, 4, hidden])],
        inits,
        extra_opsets=[("com.microsoft", 1)],
    )


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_com_microsoft_transformer_ops(target):
    rng = np.random.default_rng(0)
    model = _microsoft_model()
    result = rewrite(model, target=target)
    report = result.report
    for name in ("fmm", "attn"):
        assert report.node(name)["list"] == "allow" and report.node(name)["precision"] == target
    assert report.node("bgelu")["list"] == "infer"
    assert report.node("sln")["list"] == "infer"  # float16 too: CUDA's kernel overflows past an RMS of 256
    onnx.checker.check_model(result.model, full_check=True)
    feeds = {"x": weights(rng, 1, 4, 8, scale=1.0)}
    if target == "float16":  # ORT CPU runs these in float16 or inserts casts where it has no kernel
        _check(model, result, feeds)


@pytest.mark.even_if_worse
def test_unknown_domain_stays_float32_with_a_note():
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [
            node("MatMul", ["x", "W"], ["h"], name="mm"),
            node("Frobnicate", ["h"], ["y"], name="mystery", domain="example.custom"),
        ],
        "g",
        [tensor("x", [2, 2])],
        [tensor("y", [2, 2])],
        [init("W", weights(rng, 2, 2))],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("example.custom", 1)],
        ir_version=8,
    )
    result = rewrite(model, target="float16")
    assert any("Frobnicate" in note and "float32" in note for note in result.report.notes)
    out = result.model.graph
    # the custom op reads float32: the MatMul result is cast back before it
    mystery = next(n for n in out.node if n.op_type == "Frobnicate")
    cast = next(n for n in out.node if n.output and n.output[0] == mystery.input[0])
    assert cast.op_type == "Cast" and cast.attribute[0].i == FLOAT


@pytest.mark.parametrize("opset", [9, 13, 19])
def test_resize_roi_and_scales_stay_float32_between_low_convs(opset):
    """Resize's roi (T2 admits float16) is read as float32 by ONNX Runtime's kernels
    (op_lists/kernel_float32_inputs.yaml); scales are float by the schema, Upsample's too."""
    rng = np.random.default_rng(opset)
    if opset == 9:
        resize = node("Upsample", ["c", "scales"], ["r"], "resize", mode="nearest")
        extra = []
    else:
        resize = node(
            "Resize",
            ["c", "roi", "scales"],
            ["r"],
            "resize",
            mode="linear",
            coordinate_transformation_mode="tf_crop_and_resize",
        )
        extra = [init("roi", np.array([0, 0, 0.1, 0.1, 1, 1, 0.9, 0.9], np.float32))]
    model = make_model(
        [node("Conv", ["x", "W"], ["c"], "conv"), resize, node("Conv", ["r", "W"], ["y"], "conv2")],
        [tensor("x", [1, 2, 4, 4])],
        [tensor("y", [1, 2, 8, 8])],
        [init("W", weights(rng, 2, 2, 1, 1)), init("scales", np.array([1, 1, 2, 2], np.float32)), *extra],
        opset=opset,
    )
    result = rewrite(model, target="float16")
    kinds = {t.name: t.data_type for t in result.model.graph.initializer}
    assert kinds["scales"] == TensorProto.FLOAT and kinds.get("roi", TensorProto.FLOAT) == TensorProto.FLOAT
    groups = next(n for n in result.report.nodes if n["name"] == "resize")["groups"]
    data = "T1" if opset > 9 else "T"
    assert groups[data]["precision"] == "float16"
    if opset > 9:
        assert groups["T2"]["precision"] == "float32" and "ParseRoiData" in groups["T2"]["reason"]
    assert sum(n.op_type == "Cast" for n in result.model.graph.node) == 2
    feeds = {"x": weights(rng, 1, 2, 4, 4)}
    expected = run_ort(model, feeds)
    assert_close(run_ort(result.model, feeds), expected, rtol=2e-2, atol=2e-2)
    assert_close(run_reference(result.model, feeds), expected, rtol=2e-2, atol=2e-2)
