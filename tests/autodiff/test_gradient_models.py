"""Whole small models (MLP, ResNet-style CNN block, transformer block) against torch autograd.

Both sides run in float32 with the same weights and inputs; the gradient graph runs in ONNX
Runtime CPU. Tolerance: max |onnx - torch| <= 1e-4 * max(1, max |torch|) per gradient. The
worst relative error per model is printed (pytest -s) and recorded in the autodiff note. Each
gradient graph then goes through the float16 AMP rewrite and must stay within 5e-3 of float32.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from amp_rewrite.autodiff import build_gradient_graph
from helpers import IR_VERSION, session

torch = pytest.importorskip("torch")
F = torch.nn.functional
TOLERANCE = 1e-4


def make(nodes, inputs, weights, opset=17, outputs=("loss",)):
    graph = helper.make_graph(
        nodes,
        "m",
        inputs,
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None if o != "loss" else []) for o in outputs],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION)
    onnx.checker.check_model(model, full_check=True)
    return model


def n(op, inputs, outputs, **attrs):
    return helper.make_node(op, inputs, outputs, name=f"{op}_{outputs[0]}", **attrs)


def f32(rng, *shape, scale=0.5):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def compare(model, feeds, weights, torch_loss, trainable):
    """Run the gradient graph in ORT and torch autograd; return the worst relative error."""
    grad_model = build_gradient_graph(model, "loss")
    onnx.checker.check_model(grad_model, full_check=True)
    assert {o.name for o in grad_model.graph.output} >= {f"{w}_grad" for w in trainable}
    outputs = [o.name for o in grad_model.graph.output]
    got = dict(zip(outputs, session(grad_model).run(None, feeds)))
    params = {k: torch.tensor(v, requires_grad=k in trainable) for k, v in weights.items()}
    loss = torch_loss(params, {k: torch.tensor(v) for k, v in feeds.items()})
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-5, atol=1e-6)
    worst = 0.0
    for name in trainable:
        expected = params[name].grad.numpy()
        scale = max(1.0, float(np.abs(expected).max()))
        error = float(np.abs(got[f"{name}_grad"] - expected).max()) / scale
        assert error <= TOLERANCE, (name, error)
        worst = max(worst, error)
    check_float16_rewrite(grad_model, feeds, got, trainable)
    return worst


def check_float16_rewrite(grad_model, feeds, float32_outputs, trainable):
    """The AMP rewrite colours forward and backward together; float16 gradients stay within 5e-3."""
    from amp_rewrite import rewrite

    result = rewrite(grad_model, target="float16")
    assert any(
        n.name.startswith("grad/") and n.op_type in ("MatMul", "Gemm", "Conv", "ConvTranspose")
        for n in result.model.graph.node
    )
    outputs = [o.name for o in result.model.graph.output]
    low = dict(zip(outputs, session(result.model).run(None, feeds)))
    for name in trainable:
        expected = float32_outputs[f"{name}_grad"]
        scale = max(1.0, float(np.abs(expected).max()))
        assert float(np.abs(low[f"{name}_grad"] - expected).max()) / scale < 5e-3, name


def test_mlp_matches_torch():
    rng = np.random.default_rng(0)
    w = {"W1": f32(rng, 8, 16), "b1": f32(rng, 16), "W2": f32(rng, 4, 16), "b2": f32(rng, 4)}
    nodes = [
        n("MatMul", ["x", "W1"], ["h0"]),
        n("Add", ["h0", "b1"], ["h1"]),
        n("Relu", ["h1"], ["h"]),
        n("Gemm", ["h", "W2", "b2"], ["logits"], transB=1),
        n("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"]),
    ]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8]),
        helper.make_tensor_value_info("labels", TensorProto.INT64, ["N"]),
    ]
    feeds = {"x": f32(rng, 5, 8, scale=1.0), "labels": rng.integers(0, 4, 5).astype(np.int64)}

    def reference(p, x):
        h = F.relu(x["x"] @ p["W1"] + p["b1"])
        return F.cross_entropy(h @ p["W2"].T + p["b2"], x["labels"])

    worst = compare(make(nodes, inputs, w), feeds, w, reference, set(w))
    print(f"\nMLP worst relative gradient error vs torch: {worst:.2e}")


def test_resnet_block_matches_torch():
    rng = np.random.default_rng(1)
    w = {
        "w1": f32(rng, 4, 3, 3, 3),
        "s1": 1 + f32(rng, 4, scale=0.1),
        "b1": f32(rng, 4, scale=0.1),
        "m1": np.zeros(4, np.float32),
        "v1": np.ones(4, np.float32),
        "w2": f32(rng, 4, 4, 3, 3),
        "s2": 1 + f32(rng, 4, scale=0.1),
        "b2": f32(rng, 4, scale=0.1),
        "m2": f32(rng, 4, scale=0.1),
        "v2": 1 + np.abs(f32(rng, 4, scale=0.1)),
        "w3": f32(rng, 4, 3, 1, 1),
        "wf": f32(rng, 5, 4),
        "bf": f32(rng, 5),
    }
    nodes = [
        n("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        n("BatchNormalization", ["c1", "s1", "b1", "m1", "v1"], ["n1", "rm1", "rv1"], training_mode=1),
        n("Relu", ["n1"], ["r1"]),
        n("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
        n("BatchNormalization", ["c2", "s2", "b2", "m2", "v2"], ["n2"]),
        n("Conv", ["x", "w3"], ["skip"]),
        n("Add", ["n2", "skip"], ["sum"]),
        n("Relu", ["sum"], ["r2"]),
        n("MaxPool", ["r2"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        n("AveragePool", ["p1"], ["p2"], kernel_shape=[2, 2], strides=[1, 1]),
        n("GlobalAveragePool", ["p2"], ["g"]),
        n("Flatten", ["g"], ["flat"]),
        n("Gemm", ["flat", "wf", "bf"], ["logits"], transB=1),
        n("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"]),
    ]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 6, 6]),
        helper.make_tensor_value_info("labels", TensorProto.INT64, ["N"]),
    ]
    feeds = {"x": f32(rng, 3, 3, 6, 6, scale=1.0), "labels": rng.integers(0, 5, 3).astype(np.int64)}

    def reference(p, x):
        h = F.conv2d(x["x"], p["w1"], padding=1)
        h = F.relu(
            F.batch_norm(h, p["m1"].clone(), p["v1"].clone(), p["s1"], p["b1"], training=True, eps=1e-5)
        )
        h = F.batch_norm(
            F.conv2d(h, p["w2"], padding=1), p["m2"], p["v2"], p["s2"], p["b2"], training=False, eps=1e-5
        )
        h = F.relu(h + F.conv2d(x["x"], p["w3"]))
        h = F.avg_pool2d(F.max_pool2d(h, 2, 2), 2, 1)
        logits = h.mean(dim=(2, 3)) @ p["wf"].T + p["bf"]
        return F.cross_entropy(logits, x["labels"])

    trainable = set(w) - {"m1", "v1", "m2", "v2"}
    worst = compare(make(nodes, inputs, w), feeds, w, reference, trainable)
    print(f"\nResNet block worst relative gradient error vs torch: {worst:.2e}")


@pytest.mark.parametrize("group", [1, 2])
def test_conv_transpose_upsampler_matches_torch(group):
    """A DBNet-style head: ConvTranspose stride 2 with output padding (grouped too), then a loss."""
    rng = np.random.default_rng(2)
    w = {"wt": f32(rng, 4, 6 // group, 3, 3), "bt": f32(rng, 6, scale=0.1), "wf": f32(rng, 3, 6, 1, 1)}
    nodes = [
        n(
            "ConvTranspose",
            ["x", "wt", "bt"],
            ["up"],
            strides=[2, 2],
            pads=[1, 1, 1, 1],
            output_padding=[1, 1],
            group=group,
        ),
        n("Relu", ["up"], ["r"]),
        n("Conv", ["r", "wf"], ["y"]),
        n("Mul", ["y", "y"], ["sq"]),
        n("ReduceMean", ["sq"], ["loss"], keepdims=0),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 3, 5])]
    feeds = {"x": f32(rng, 2, 4, 3, 5, scale=1.0)}

    def reference(p, x):
        up = F.conv_transpose2d(x["x"], p["wt"], p["bt"], stride=2, padding=1, output_padding=1, groups=group)
        return (F.conv2d(F.relu(up), p["wf"]) ** 2).mean()

    compare(make(nodes, inputs, w), feeds, w, reference, set(w))


def test_transformer_block_matches_torch():
    rng = np.random.default_rng(2)
    d, heads, t, vocab = 8, 2, 4, 10
    dh = d // heads
    w = {
        "emb": f32(rng, vocab, d),
        "pos": f32(rng, t, d),
        "g1": 1 + f32(rng, d, scale=0.1),
        "be1": f32(rng, d, scale=0.1),
        "wq": f32(rng, d, d),
        "wk": f32(rng, d, d),
        "wv": f32(rng, d, d),
        "wo": f32(rng, d, d),
        "g2": 1 + f32(rng, d, scale=0.1),
        "be2": f32(rng, d, scale=0.1),
        "w1": f32(rng, d, 2 * d),
        "c1": f32(rng, 2 * d, scale=0.1),
        "w2": f32(rng, 2 * d, d),
        "c2": f32(rng, d, scale=0.1),
        "heads_shape": np.array([0, 0, heads, dh], np.int64),
        "model_shape": np.array([0, 0, d], np.int64),
        "scale": np.array(math.sqrt(dh), np.float32),
        "half": np.array(0.5, np.float32),
        "one": np.array(1.0, np.float32),
        "inv_sqrt2": np.array(1 / math.sqrt(2), np.float32),
    }
    nodes = [
        n("Gather", ["emb", "tokens"], ["e"]),
        n("Add", ["e", "pos"], ["x"]),
        n("LayerNormalization", ["x", "g1", "be1"], ["ln1"]),
        *[n("MatMul", ["ln1", f"w{k}"], [f"{k}0"]) for k in "qkv"],
        *[n("Reshape", [f"{k}0", "heads_shape"], [f"{k}1"]) for k in "qkv"],
        n("Transpose", ["q1"], ["q"], perm=[0, 2, 1, 3]),
        n("Transpose", ["k1"], ["kT"], perm=[0, 2, 3, 1]),
        n("Transpose", ["v1"], ["v"], perm=[0, 2, 1, 3]),
        n("MatMul", ["q", "kT"], ["s0"]),
        n("Div", ["s0", "scale"], ["s"]),
        n("Softmax", ["s"], ["a"], axis=-1),
        n("MatMul", ["a", "v"], ["o0"]),
        n("Transpose", ["o0"], ["o1"], perm=[0, 2, 1, 3]),
        n("Reshape", ["o1", "model_shape"], ["o2"]),
        n("MatMul", ["o2", "wo"], ["o"]),
        n("Add", ["x", "o"], ["x2"]),
        n("LayerNormalization", ["x2", "g2", "be2"], ["ln2"]),
        n("MatMul", ["ln2", "w1"], ["f0"]),
        n("Add", ["f0", "c1"], ["f1"]),
        n("Mul", ["f1", "inv_sqrt2"], ["f2"]),
        n("Erf", ["f2"], ["f3"]),
        n("Add", ["f3", "one"], ["f4"]),
        n("Mul", ["f1", "f4"], ["f5"]),
        n("Mul", ["f5", "half"], ["gelu"]),
        n("MatMul", ["gelu", "w2"], ["f6"]),
        n("Add", ["f6", "c2"], ["f7"]),
        n("Add", ["x2", "f7"], ["out"]),
        n("Sub", ["out", "target"], ["diff"]),
        n("Mul", ["diff", "diff"], ["sq"]),
        n("ReduceMean", ["sq"], ["loss"], keepdims=0),
    ]
    inputs = [
        helper.make_tensor_value_info("tokens", TensorProto.INT64, ["N", t]),
        helper.make_tensor_value_info("target", TensorProto.FLOAT, ["N", t, d]),
    ]
    feeds = {
        "tokens": rng.integers(0, vocab, (3, t)).astype(np.int64),
        "target": f32(rng, 3, t, d, scale=1.0),
    }

    def reference(p, x):
        h = p["emb"][x["tokens"]] + p["pos"]
        a = F.layer_norm(h, (d,), p["g1"], p["be1"], eps=1e-5)
        q, k, v = ((a @ p[f"w{c}"]).reshape(3, t, heads, dh).transpose(1, 2) for c in "qkv")
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dh), dim=-1) @ v
        h2 = h + att.transpose(1, 2).reshape(3, t, d) @ p["wo"]
        f = F.gelu(F.layer_norm(h2, (d,), p["g2"], p["be2"], eps=1e-5) @ p["w1"] + p["c1"])
        out = h2 + f @ p["w2"] + p["c2"]
        return ((out - x["target"]) ** 2).mean()

    trainable = {"emb", "pos", "g1", "be1", "wq", "wk", "wv", "wo", "g2", "be2", "w1", "c1", "w2", "c2"}
    worst = compare(make(nodes, inputs, w), feeds, w, reference, trainable)
    print(f"\nTransformer block worst relative gradient error vs torch: {worst:.2e}")


@pytest.mark.parametrize("channels, products", [(4, 6), (2, 0)])
def test_conv_weight_gradient_is_a_product_per_kernel_offset_from_four_channels(channels, products):
    """From 4 input channels (static sizes, one group) dW is one Gemm per kernel offset; below,
    x correlated with dY. Both against torch."""
    rng = np.random.default_rng(3)
    w = {"w": f32(rng, 3, channels, 3, 2)}
    nodes = [
        n("Conv", ["x", "w"], ["y"], pads=[1, 0, 1, 1], strides=[2, 1]),
        n("Mul", ["y", "y"], ["sq"]),
        n("ReduceMean", ["sq"], ["loss"], keepdims=0),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", channels, 6, 5])]
    feeds = {"x": f32(rng, 2, channels, 6, 5, scale=1.0)}
    model = make(nodes, inputs, w)
    grads = build_gradient_graph(model, "loss", ["w"])
    assert sum(node.op_type == "Gemm" for node in grads.graph.node) == products

    def reference(p, x):
        return (F.conv2d(F.pad(x["x"], (0, 1, 1, 1)), p["w"], stride=(2, 1)) ** 2).mean()

    compare(model, feeds, w, reference, set(w))
