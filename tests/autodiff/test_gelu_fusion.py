"""GELU written out in ops (TorchScript's erf form, the tanh approximation) is one com.microsoft node
in the gradient graph, whose backward reads x alone; its gradient matches torch autograd's F.gelu
and finite differences of the unfused model; patterns that are not exactly GELU stay as they are."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from amp_rewrite.autodiff import build_gradient_graph
from amp_rewrite.autodiff.gradcheck import max_gradient_error, numeric_gradients

torch = pytest.importorskip("torch")

SQRT2, K = math.sqrt(2), math.sqrt(2 / math.pi)
# name -> (torch's approximate, [(op, inputs, output)] from h to y; numbers are Constant nodes)
PATTERNS = {
    "erf-div": ("none", [("Div", ["h", 1.4142135381698608], "d"), ("Erf", ["d"], "e"), ("Add", ["e", 1.0], "a"),
                         ("Mul", ["h", "a"], "m"), ("Mul", ["m", 0.5], "y")]),
    "erf-mul-half-first": ("none", [("Mul", ["h", 0.5], "hh"), ("Mul", [1 / SQRT2, "h"], "d"), ("Erf", ["d"], "e"),
                                    ("Add", [1.0, "e"], "a"), ("Mul", ["hh", "a"], "y")]),
    "tanh-pow": ("tanh", [("Mul", [0.5, "h"], "hh"), ("Pow", ["h", 3.0], "p"), ("Mul", [0.044715, "p"], "kp"),
                          ("Add", ["h", "kp"], "i"), ("Mul", [K, "i"], "si"), ("Tanh", ["si"], "t"),
                          ("Add", [1.0, "t"], "a"), ("Mul", ["hh", "a"], "y")]),
    "tanh-cube-half-last": ("tanh", [("Mul", ["h", "h"], "h2"), ("Mul", ["h2", "h"], "p"),
                                     ("Mul", ["p", 0.044715], "kp"), ("Add", ["kp", "h"], "i"),
                                     ("Mul", ["i", K], "si"), ("Tanh", ["si"], "t"), ("Add", ["t", 1.0], "a"),
                                     ("Mul", ["a", 0.5], "ah"), ("Mul", ["h", "ah"], "y")]),
}  # fmt: skip
X = np.random.default_rng(0).standard_normal((6, 8)).astype(np.float32) * 2
W = np.random.default_rng(1).standard_normal((8, 5)).astype(np.float32)
R = np.random.default_rng(2).standard_normal((6, 5)).astype(np.float32)


def pattern_model(steps, elem=TensorProto.FLOAT) -> onnx.ModelProto:
    """loss = sum(gelu(x @ w) * r), the GELU as `steps`."""
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc")]
    for k, (op, inputs, out) in enumerate(steps):
        names = []
        for j, value in enumerate(inputs):
            if isinstance(value, str):
                names.append(value)
                continue
            names.append(f"c{k}_{j}")
            tensor = numpy_helper.from_array(np.array(value, dtype), names[-1])
            nodes.append(helper.make_node("Constant", [], [names[-1]], name=names[-1], value=tensor))
        nodes.append(helper.make_node(op, names, [out], name=f"gelu/{out}"))
    nodes += [
        helper.make_node("Mul", ["y", "r"], ["yr"], name="weigh"),
        helper.make_node("ReduceSum", ["yr"], ["loss"], name="loss", keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "gelu",
        [helper.make_tensor_value_info("x", elem, [6, 8])],
        [helper.make_tensor_value_info("loss", elem, [])],
        [numpy_helper.from_array(W.astype(dtype), "w"), numpy_helper.from_array(R.astype(dtype), "r")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def ort_gradient(model: onnx.ModelProto):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["loss", "w_grad"], {"x": X})


@pytest.mark.parametrize("name", list(PATTERNS))
def test_exported_gelu_is_one_node_with_torch_and_finite_difference_gradients(name):
    approximate, steps = PATTERNS[name]
    grads = build_gradient_graph(pattern_model(steps), "loss", ["w"])
    ops = [(n.domain, n.op_type) for n in grads.graph.node]
    fused = ("com.microsoft", "Gelu" if approximate == "none" else "FastGelu")
    assert ops.count(fused) == 1
    assert not {"Div", "Pow", "Constant"} & {op for _, op in ops}  # the pattern and its numbers are gone
    backward = [n for n in grads.graph.node if n.name.startswith("grad/")]
    assert not {i for n in backward for i in n.input} & {out for _, _, out in steps if out != "y"}
    loss, w_grad = ort_gradient(grads)

    w = torch.tensor(W, requires_grad=True)
    expected = (
        torch.nn.functional.gelu(torch.tensor(X) @ w, approximate=approximate) * torch.tensor(R)
    ).sum()
    expected.backward()
    np.testing.assert_allclose(loss, expected.item(), rtol=1e-5)
    np.testing.assert_allclose(w_grad, w.grad.numpy(), rtol=1e-5, atol=1e-5)

    # the unfused formula in float64; onnx.reference's Erf runs in float32, hence the larger step
    reference = pattern_model(steps, TensorProto.DOUBLE)
    numeric = numeric_gradients(reference, "loss", {"x": X.astype(np.float64)}, ["x"], eps=1e-3)
    x_grads = build_gradient_graph(pattern_model(steps), "loss", ["x"])
    session = ort.InferenceSession(x_grads.SerializeToString(), providers=["CPUExecutionProvider"])
    assert max_gradient_error(numeric, {"x": session.run(["x_grad"], {"x": X})[0]}) < 2e-3


@pytest.mark.parametrize(
    "change",
    ["sqrt2 rounded to 1.414", "Erf output also read elsewhere", "float64"],
)
def test_what_is_not_exactly_gelu_keeps_its_ops(change):
    steps = [list(s) for s in PATTERNS["erf-div"][1]]
    elem = TensorProto.FLOAT
    if change.startswith("sqrt2"):
        steps[0][1] = ["h", 1.414]
    elif change.startswith("Erf"):
        steps[-1] = ("Mul", ["m", "e"], "y")  # y = x * (1 + erf) * erf: the erf is read twice
    else:
        elem = TensorProto.DOUBLE  # ONNX Runtime's CPU provider has no double Gelu
    grads = build_gradient_graph(pattern_model(steps, elem), "loss", ["w"])
    assert not [n for n in grads.graph.node if n.domain == "com.microsoft"]
    assert any(n.op_type == "Erf" for n in grads.graph.node)
