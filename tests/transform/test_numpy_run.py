"""The range run's numpy evaluator (transform/numpy_run.py) against ONNX Runtime on the same graph,
op by op, and the forms it leaves to ONNX Runtime."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from amp_rewrite.transform import numpy_run, range_run
from helpers import init, load_tool, node, run_ort, tensor, weights

RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 3, 8)).astype(np.float32)

CASES = {  # name: (nodes, initializers, opset)
    "arithmetic": (
        [
            node("Add", ["x", "b"], ["a"]),
            node("Sub", ["a", "x"], ["s"]),
            node("Mul", ["s", "a"], ["m"]),
            node("Div", ["m", "b"], ["d"]),
            node("Abs", ["d"], ["ab"]),
            node("Sqrt", ["ab"], ["sq"]),
            node("Pow", ["sq", "two"], ["y"]),
        ],
        [init("b", RNG.uniform(1, 2, 8).astype(np.float32)), init("two", np.float32(2))],
        17,
    ),
    "activations": (
        [
            node("Erf", ["x"], ["e"]),
            node("Tanh", ["e"], ["t"]),
            node("Sigmoid", ["x"], ["sg"]),
            node("Relu", ["x"], ["r"]),
            node("Exp", ["r"], ["ex"]),
            node("Neg", ["ex"], ["n"]),
            node("Add", ["n", "t"], ["nt"]),
            node("Add", ["nt", "sg"], ["y"]),
        ],
        [],
        17,
    ),
    "attention": (
        [
            node("MatMul", ["x", "w"], ["q"]),
            node("Reshape", ["q", "heads"], ["qh"]),
            node("Transpose", ["qh"], ["qt"], perm=[0, 2, 1, 3]),
            node("Transpose", ["qh"], ["kt"], perm=[0, 2, 3, 1]),
            node("MatMul", ["qt", "kt"], ["scores"]),
            node("Softmax", ["scores"], ["p"], axis=-1),
            node("MatMul", ["p", "qt"], ["ctx"]),
            node("Transpose", ["ctx"], ["ct"], perm=[0, 2, 1, 3]),
            node("Reshape", ["ct", "merge"], ["merged"]),
            node("LayerNormalization", ["merged", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5),
        ],
        [
            init("w", weights(RNG, 8, 8)),
            init("heads", np.array([0, 0, 2, 4], np.int64)),
            init("merge", np.array([0, 0, -1], np.int64)),
            init("gamma", weights(RNG, 8)),
            init("beta", weights(RNG, 8)),
        ],
        17,
    ),
    "shapes-and-reductions": (
        [
            node("ReduceMean", ["x", "axes"], ["mean"], keepdims=1),
            node("Sub", ["x", "mean"], ["c"]),
            node("ReduceSum", ["c", "axes"], ["s"], keepdims=0),
            node("Unsqueeze", ["s", "axes"], ["u"]),
            node("Concat", ["u", "c"], ["cat"], axis=-1),
            node("Shape", ["cat"], ["shape"]),
            node("Cast", ["shape"], ["fshape"], to=TensorProto.FLOAT),
            node("Gather", ["cat", "index"], ["g"], axis=0),
            node("Unsqueeze", ["g", "axes"], ["gu"]),
            node("Squeeze", ["gu", "axes"], ["sq"]),
            node("Gemm", ["sq", "gw", "gb"], ["gemm"], transB=1, alpha=0.5),
            node("ReduceSum", ["fshape", "none"], ["total"], keepdims=1),
            node("Mul", ["gemm", "total"], ["y"]),
        ],
        [
            init("axes", np.array([-1], np.int64)),
            init("index", np.array(1, np.int64)),
            init("gw", weights(RNG, 5, 9)),
            init("gb", weights(RNG, 5)),
            init("none", np.array([], np.int64)),
        ],
        18,
    ),
    "softmax-opset-11": ([node("Softmax", ["x"], ["y"], axis=1)], [], 11),
}


def _model(nodes, initializers, opset):
    """x [2, 3, 8] -> y of unknown shape (the checker wants one declared: ONNX Runtime does not)."""
    graph = helper.make_graph(nodes, "g", [tensor("x", [2, 3, 8])], [tensor("y", None)], initializers)
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid("com.example", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _run(model):
    g = model.graph
    return numpy_run.run_nodes(g.node, g.initializer, numpy_run.opset_of(model), {"x": X}, ["y"])


@pytest.mark.parametrize("case", list(CASES))
def test_numpy_computes_what_onnx_runtime_computes(case):
    nodes, initializers, opset = CASES[case]
    model = _model(nodes, initializers, opset)
    expected = run_ort(model, {"x": X})[0]
    got = _run(model)
    assert got is not None, "every op of this case runs in numpy"
    assert got[0].shape == expected.shape and got[0].dtype == expected.dtype
    np.testing.assert_allclose(got[0], expected, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize(
    "nodes, opset",
    [
        ([node("Softplus", ["x"], ["y"])], 17),  # an op not in the table
        ([node("LeakyRelu", ["x"], ["y"], alpha=0.2)], 17),  # likewise, with an attribute
        ([node("Add", ["x", "x"], ["y"], domain="com.example")], 17),  # another domain
        ([node("LayerNormalization", ["x", "x8"], ["y"], stash_type=0)], 17),  # a form not handled
    ],
)
def test_what_numpy_does_not_run_is_left_to_onnx_runtime(nodes, opset):
    assert _run(_model(nodes, [init("x8", np.ones(8, np.float32))], opset)) is None


def test_the_range_run_of_a_transformer_stack_opens_no_session(monkeypatch):
    """The synthetic stack's cone runs in numpy, with the largest values ONNX Runtime finds."""
    synthetic = load_tool("synthetic")
    model = synthetic.transformer_stack(300)
    names = [n.output[0] for n in model.graph.node if n.op_type in ("Add", "LayerNormalization")][-4:]
    types = dict.fromkeys(names, TensorProto.FLOAT)
    # as before numpy_run: ONNX Runtime's session
    monkeypatch.setattr(numpy_run, "run_nodes", lambda *a: None)
    with_ort = range_run.largest_values(model, names, types)
    monkeypatch.undo()

    def no_session(*args, **kwargs):
        raise AssertionError("the range run opened an ONNX Runtime session")

    monkeypatch.setattr(range_run, "open_session", no_session)
    assert range_run.largest_values(model, names, types) == pytest.approx(with_ort, rel=1e-4)
