"""Recompute: gradients with recomputed segments equal gradients without, bit for bit in float32 on
ONNX Runtime's CPU provider; the copies survive ORT's optimisations; bad specs are one clear error."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from amp_rewrite.autodiff import build_gradient_graph
from amp_rewrite.autodiff.recompute import COPY_SUFFIX, copies, plan_of, report_section
from amp_rewrite.errors import GradientError
from amp_rewrite.training.step_graph import precision_options
from helpers import IR_VERSION

PER_LAYER = [r"layer\d+/.*"]


def mlp(layers=6, width=16, dropout=False, batch="batch", act="Relu", seed=0):
    """layers x (MatMul, Add, act[, Dropout with a fixed seed]), loss = sum of squares."""
    rng = np.random.default_rng(seed)
    nodes, inits, h = [], [], "x"
    for i in range(layers):
        p = f"layer{i}/"
        inits += [
            numpy_helper.from_array(
                (rng.standard_normal((width, width)) / math.sqrt(width)).astype(np.float32), p + "W"
            ),
            numpy_helper.from_array((rng.standard_normal(width) * 0.1).astype(np.float32), p + "B"),
        ]
        nodes += [
            helper.make_node("MatMul", [h, p + "W"], [p + "mm"], name=p + "MatMul"),
            helper.make_node("Add", [p + "mm", p + "B"], [p + "pre"], name=p + "Add"),
            helper.make_node(act, [p + "pre"], [p + "act"], name=p + "Act"),
        ]
        h = p + "act"
        if dropout:
            nodes.append(
                helper.make_node(
                    "Dropout", [h, "ratio", "training"], [p + "drop"], name=p + "Dropout", seed=11 + i
                )
            )
            h = p + "drop"
    inits += [
        numpy_helper.from_array(np.array(0.25, np.float32), "ratio"),
        numpy_helper.from_array(np.array(True), "training"),
    ]
    nodes += [
        helper.make_node("Mul", [h, h], ["sq"], name="loss/Mul"),
        helper.make_node("ReduceSum", ["sq"], ["loss"], name="loss/ReduceSum", keepdims=0),
        helper.make_node("Relu", ["x"], ["aux"], name="aux/Relu"),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, width])],
        [
            helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("aux", TensorProto.FLOAT, [batch, width]),
        ],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)


def transformer(layers=2, d=8, heads=2, seq=4, seed=1):
    """Pre-LayerNorm attention + erf-GELU layers (the autodiff transformer test's block), MSE loss."""
    rng = np.random.default_rng(seed)
    dh = d // heads
    w = {
        "heads_shape": np.array([0, 0, heads, dh], np.int64),
        "model_shape": np.array([0, 0, d], np.int64),
        "scale": np.array(math.sqrt(dh), np.float32),
        "half": np.array(0.5, np.float32),
        "one": np.array(1.0, np.float32),
        "inv_sqrt2": np.array(1 / math.sqrt(2), np.float32),
    }
    nodes, x = [], "x"

    def n(name, op, inputs, outputs, **attrs):
        nodes.append(helper.make_node(op, inputs, outputs, name=name, **attrs))

    for i in range(layers):
        p = f"layer{i}/"
        for k, shape in {
            "g1": (d,),
            "b1": (d,),
            "g2": (d,),
            "b2": (d,),
            "c1": (2 * d,),
            "c2": (d,),
            "wq": (d, d),
            "wk": (d, d),
            "wv": (d, d),
            "wo": (d, d),
            "w1": (d, 2 * d),
            "w2": (2 * d, d),
        }.items():
            w[p + k] = (rng.standard_normal(shape) * 0.5 + (k[0] == "g")).astype(np.float32)
        n(p + "ln1", "LayerNormalization", [x, p + "g1", p + "b1"], [p + "ln1"])
        for k in "qkv":
            n(p + k + "/MatMul", "MatMul", [p + "ln1", p + "w" + k], [p + k + "0"])
            n(p + k + "/Reshape", "Reshape", [p + k + "0", "heads_shape"], [p + k + "1"])
        n(p + "q/T", "Transpose", [p + "q1"], [p + "q"], perm=[0, 2, 1, 3])
        n(p + "k/T", "Transpose", [p + "k1"], [p + "kT"], perm=[0, 2, 3, 1])
        n(p + "v/T", "Transpose", [p + "v1"], [p + "v"], perm=[0, 2, 1, 3])
        n(p + "scores", "MatMul", [p + "q", p + "kT"], [p + "s0"])
        n(p + "scale", "Div", [p + "s0", "scale"], [p + "s"])
        n(p + "softmax", "Softmax", [p + "s"], [p + "a"], axis=-1)
        n(p + "context", "MatMul", [p + "a", p + "v"], [p + "o0"])
        n(p + "o/T", "Transpose", [p + "o0"], [p + "o1"], perm=[0, 2, 1, 3])
        n(p + "o/Reshape", "Reshape", [p + "o1", "model_shape"], [p + "o2"])
        n(p + "o/MatMul", "MatMul", [p + "o2", p + "wo"], [p + "o"])
        n(p + "res1", "Add", [x, p + "o"], [p + "x2"])
        n(p + "ln2", "LayerNormalization", [p + "x2", p + "g2", p + "b2"], [p + "ln2"])
        n(p + "fc1", "MatMul", [p + "ln2", p + "w1"], [p + "f0"])
        n(p + "fc1/Add", "Add", [p + "f0", p + "c1"], [p + "f1"])
        n(p + "gelu/Mul", "Mul", [p + "f1", "inv_sqrt2"], [p + "f2"])
        n(p + "gelu/Erf", "Erf", [p + "f2"], [p + "f3"])
        n(p + "gelu/Add", "Add", [p + "f3", "one"], [p + "f4"])
        n(p + "gelu/Mul2", "Mul", [p + "f1", p + "f4"], [p + "f5"])
        n(p + "gelu/Half", "Mul", [p + "f5", "half"], [p + "gelu"])
        n(p + "fc2", "MatMul", [p + "gelu", p + "w2"], [p + "f6"])
        n(p + "fc2/Add", "Add", [p + "f6", p + "c2"], [p + "f7"])
        n(p + "res2", "Add", [p + "x2", p + "f7"], [p + "out"])
        x = p + "out"
    n("loss/Sub", "Sub", [x, "target"], ["diff"])
    n("loss/Mul", "Mul", ["diff", "diff"], ["sq"])
    n("loss/ReduceMean", "ReduceMean", ["sq"], ["loss"], keepdims=0)
    inits = [numpy_helper.from_array(v, k) for k, v in w.items()]
    graph = helper.make_graph(
        nodes,
        "tf",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", seq, d]),
            helper.make_tensor_value_info("target", TensorProto.FLOAT, ["N", seq, d]),
        ],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)


def run(model, feeds):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def feeds_for(model, batch, seed=3):
    rng = np.random.default_rng(seed)
    out = {}
    for value in model.graph.input:
        dims = [d.dim_value or batch for d in value.type.tensor_type.shape.dim]
        out[value.name] = rng.standard_normal(dims).astype(np.float32)
    return out


def assert_bit_identical(model, spec, batch=5, stops=()):
    feeds = feeds_for(model, batch)
    plain = run(build_gradient_graph(model, "loss", stop_gradients=stops), feeds)
    recomputed_model = build_gradient_graph(model, "loss", stop_gradients=stops, recompute=spec)
    onnx.checker.check_model(recomputed_model, full_check=True)
    got = run(recomputed_model, feeds)
    assert set(got) == set(plain)
    for name, value in plain.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    return recomputed_model


def assert_forward_tensors_freed(model):
    """No backward node reads a recomputed forward tensor: each dies at its last forward reader."""
    plan = plan_of(model)
    recomputed = {t for s in plan.segments for t in s.recomputed}
    assert recomputed
    forward_names = {
        n.name
        for n in model.graph.node
        if not n.name.startswith(("grad/", "recompute/")) and not n.name.endswith(COPY_SUFFIX)
    }
    for node in model.graph.node:
        if node.name not in forward_names:
            assert not recomputed & set(node.input), node.name


@pytest.fixture(scope="module")
def small_mlp():
    return mlp(act="LeakyRelu")  # its gradient reads the pre-activation (Relu's reads only its output)


@pytest.mark.parametrize(
    "spec", [PER_LAYER, [r"(layer[0-2])/.*", r"(layer[3-5])/.*"], "auto"], ids=["per-layer", "groups", "auto"]
)
def test_mlp_gradients_bit_identical(small_mlp, spec):
    model = assert_bit_identical(small_mlp, spec)
    assert_forward_tensors_freed(model)
    plan = plan_of(model)
    if spec == PER_LAYER:
        assert [s.name for s in plan.segments] == [f"layer{i}/" for i in range(6)]
        assert plan.segments[1].recomputed == ("layer1/pre",)  # Relu's gradient reads its input
        assert plan.segments[1].checkpoints[0] == "layer0/act"
    if spec != "auto":
        assert len(plan.segments) in (2, 6)


def test_budget_bit_identical_and_below_reach(small_mlp):
    static = mlp(batch=5)
    with pytest.raises(
        GradientError,
        match=r"recompute budget 10 bytes is below reach: the smallest estimated "
        r"activation peak is \d+ bytes",
    ) as error:
        build_gradient_graph(static, "loss", recompute=10)
    smallest = int(str(error.value).split()[-2])
    tight = plan_of(assert_bit_identical(static, smallest)).segments
    assert tight
    roomy = plan_of(build_gradient_graph(static, "loss", recompute=10**9)).segments
    assert roomy == ()  # everything fits: the fewest recomputed FLOPs is none
    with pytest.raises(GradientError, match="needs static shapes"):
        build_gradient_graph(small_mlp, "loss", recompute=900)


def test_dropout_with_fixed_seed_reuses_the_mask():
    model = assert_bit_identical(mlp(dropout=True, act="Tanh"), PER_LAYER)
    plan = plan_of(model)
    assert "layer2/Dropout/mask" in plan.segments[2].kept
    assert "layer1/drop" in plan.segments[2].checkpoints
    assert not any(n.op_type == "Dropout" and n.name.endswith(COPY_SUFFIX) for n in model.graph.node)
    assert_bit_identical(mlp(dropout=True, act="Tanh"), "auto")


def test_transformer_dynamic_batch_bit_identical():
    model = transformer()
    for spec in (PER_LAYER, "auto"):
        out = assert_bit_identical(model, spec, batch=3)
        assert_forward_tensors_freed(out)
    segments = plan_of(out).segments
    assert segments and all(s.name.startswith("auto/") for s in segments)


def test_copies_survive_ort_enable_all(tmp_path, small_mlp):
    model = build_gradient_graph(transformer(), "loss", recompute=PER_LAYER)
    recomputed = {t for s in plan_of(model).segments for t in s.recomputed}
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(str(tmp_path / "optimized.onnx"))
    names = [n.name for n in optimized.graph.node]
    # the dependency chain of each segment and the copies (possibly fused, the name kept) are there
    for layer in ("layer0", "layer1"):
        assert any(n.startswith(f"recompute/{layer}/") and n.endswith("/Where") for n in names), layer
    copies = [n for n in names if COPY_SUFFIX in n]
    assert any("softmax" in n for n in copies) and any("gelu" in n for n in copies)
    # and no backward node reads a forward tensor that was to be recomputed (not merged by CSE)
    readers = {
        t
        for n in optimized.graph.node
        if not n.name.startswith(tuple(f"layer{i}/" for i in range(2))) or COPY_SUFFIX in n.name
        for t in n.input
    }
    forward_outputs = {
        t
        for n in optimized.graph.node
        if n.name.startswith(("layer0/", "layer1/")) and COPY_SUFFIX not in n.name
        for t in n.output
    }
    assert recomputed & forward_outputs  # the forward still computes them
    assert not recomputed & forward_outputs & readers


@pytest.mark.parametrize(
    "spec, message",
    [
        (["nothing/.*"], "recompute pattern 'nothing/.*' matches no node of the main graph"),
        ([r"layer5/.*", r"loss/.*"], "recompute segment 'loss/' contains the loss node 'loss/ReduceSum'"),
        ([r"aux/.*"], "recompute segment 'aux/' has no differentiable path from a weight to the loss"),
        (["("], "recompute pattern '(' is not a valid regular expression"),
        ("everything", "recompute must be 'auto', a byte budget or a list of node-name patterns"),
        (-5, "recompute budget must be a positive number of bytes"),
    ],
)
def test_bad_specs_are_one_clear_error(small_mlp, spec, message):
    with pytest.raises(GradientError) as error:
        build_gradient_graph(small_mlp, "loss", recompute=spec)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_mixed_precision_copies_coloured_like_originals_and_close():
    import amp_rewrite

    model = transformer()
    feeds = feeds_for(model, 3)
    options = precision_options("float16")  # a gradient graph: the training lists, as the Trainer uses them
    plain = amp_rewrite.rewrite(build_gradient_graph(model, "loss"), options).model
    recomputing = build_gradient_graph(model, "loss", recompute=PER_LAYER)
    result = amp_rewrite.rewrite(recomputing, options.replace(colour_as=copies(recomputing)))
    result.report.sections["recompute"] = report_section(recomputing)  # what the Trainer's rewrite adds
    precision = {n["name"]: n["precision"] for n in result.report.nodes}
    copied = [name for name in precision if name.endswith(COPY_SUFFIX)]
    assert len(copied) > 20 and "float16" in {precision[c] for c in copied}
    assert all(precision[c] == precision[c[: -len(COPY_SUFFIX)]] for c in copied)
    assert [s["name"] for s in result.report.sections["recompute"]["segments"]] == ["layer0/", "layer1/"]
    assert "recomputed segments (2): layer0/" in result.report.to_text()
    expected, got = run(plain, feeds), run(result.model, feeds)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-2, atol=1e-3, err_msg=name)


def test_trainer_recompute_same_weights_and_checkpoints():
    from amp_rewrite.training import SGD, Trainer

    model = transformer()
    batches = [feeds_for(model, 3, seed=s) for s in range(3)]

    def train(recompute, precision="float32"):
        trainer = Trainer(
            model,
            loss="loss",
            optimizer=SGD(lr=0.05, momentum=0.9),
            precision=precision,
            provider="cpu",
            recompute=recompute,
        )
        for feeds in batches:
            trainer.step(feeds)
        return trainer

    plain, auto = train(None), train("auto")
    assert plain.checkpointed == () and auto.checkpointed
    assert set(auto.checkpointed) <= {v for n in auto.step_graph.model.graph.node for v in n.output} | {"x"}
    for name, value in plain.weights().items():
        np.testing.assert_array_equal(auto.weights()[name], value, err_msg=name)
    half, half_recomputed = train(None, "float16"), train(PER_LAYER, "float16")
    for name, value in half.weights().items():
        np.testing.assert_allclose(half_recomputed.weights()[name], value, rtol=1e-2, atol=1e-3, err_msg=name)


def test_bench_smoke(tmp_path):
    """The benchmark runs end to end (tiny sizes) and prints one row per configuration."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "tools" / "bench_recompute.py"
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            "--models",
            "mlp",
            "--mlp-layers",
            "4",
            "--mlp-width",
            "32",
            "--mlp-batch",
            "16",
            "--steps",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    rows = [
        r for r in (line.split() for line in done.stdout.splitlines()) if r[:1] == ["mlp"] and len(r) == 8
    ]
    assert [r[1] for r in rows] == ["off", "per-layer", "auto"] and rows[0][7] == "1.00"


def test_random_op_values_read_from_the_forward():
    """RandomUniformLike inside a segment is never drawn again: the copies read its forward output."""
    rng = np.random.default_rng(4)
    weights = [
        numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), f"W{i}") for i in range(2)
    ]
    weights.append(numpy_helper.from_array(np.array(0.1, np.float32), "noise_scale"))
    nodes = [
        helper.make_node("MatMul", ["x", "W0"], ["h0"], name="block/MatMul0"),
        helper.make_node("RandomUniformLike", ["h0"], ["r"], name="block/Noise", seed=5.0),
        helper.make_node("Mul", ["r", "noise_scale"], ["rs"], name="block/Scale"),
        helper.make_node("Add", ["h0", "rs"], ["h1"], name="block/Add"),
        helper.make_node("Tanh", ["h1"], ["h2"], name="block/Tanh"),
        helper.make_node("MatMul", ["h2", "W1"], ["h3"], name="block/MatMul1"),
        helper.make_node("Tanh", ["h3"], ["h4"], name="block/Tanh1"),
        helper.make_node("Mul", ["h4", "h4"], ["sq"], name="loss/Mul"),
        helper.make_node("ReduceSum", ["sq"], ["loss"], name="loss/ReduceSum", keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "noisy",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)
    out = assert_bit_identical(model, [r"block/.*"], stops=["r"])
    segment = plan_of(out).segments[0]
    assert "h2" in segment.recomputed and "block/Noise" in segment.nodes
    assert not any(n.op_type == "RandomUniformLike" and COPY_SUFFIX in n.name for n in out.graph.node)
