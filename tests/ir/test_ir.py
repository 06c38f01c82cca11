"""The IR: definitions and uses across scopes, producer/reader lookups, the one topological order."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from amp_rewrite import ir
from amp_rewrite.errors import ModelError


def _value(name):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, [2])


def _model(nodes, inputs=("x",), outputs=("z",)):
    graph = helper.make_graph(nodes, "g", [_value(i) for i in inputs], [_value(o) for o in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_uses_cross_scopes_and_name_graph_outputs():
    then = helper.make_graph([helper.make_node("Neg", ["y"], ["t"])], "then", [], [_value("t")])
    other = helper.make_graph([helper.make_node("Abs", ["x"], ["e"])], "else", [], [_value("e")])
    model = _model([
        helper.make_node("Relu", ["x"], ["y"]),
        helper.make_node("ReduceSum", ["y"], ["s"], keepdims=0),
        helper.make_node("Cast", ["s"], ["c"], to=TensorProto.BOOL),
        helper.make_node("If", ["c"], ["z"], then_branch=then, else_branch=other),
    ])
    scopes = ir.read_scopes(model.graph)
    assert [s.parent for s in scopes] == [None, 0, 0] and scopes[1].owner == (0, 3)
    uses, unsorted = ir.record_uses(scopes)
    assert not unsorted
    then_scope = next(s for s, scope in enumerate(scopes) if scope.graph.name == "then")
    else_scope = 3 - then_scope
    assert uses[(0, "y")] == [ir.Use(0, 1, 0), ir.Use(then_scope, 0, 0)]  # the branch reads the outer tensor
    assert uses[(0, "x")] == [ir.Use(0, 0, 0), ir.Use(else_scope, 0, 0)]
    assert uses[(0, "z")] == [ir.Use(0, -1, 0)]
    assert ir.resolve(scopes, then_scope, "y") == ir.Found(0, ir.Def("node", 0, 0))
    assert ir.resolve(scopes, then_scope, "t") == ir.Found(then_scope, ir.Def("node", 0, 0))
    assert ir.resolve(scopes, 1, "nothing") is None


def test_producers_and_readers_of_rows():
    rows = [(("x",), ("y",)), (("y", "y"), ("z", "")), (("x", ""), ("w",))]
    assert ir.producers(r[1] for r in rows) == {"y": 0, "z": 1, "w": 2}
    assert ir.readers(r[0] for r in rows) == {"x": [0, 2], "y": [1, 1]}


def test_sort_keeps_file_order_where_it_can_and_the_numbers():
    model = _model([
        helper.make_node("Add", ["b", "a"], ["z"], name="last"),
        helper.make_node("Neg", ["x"], ["a"], name="first"),
        helper.make_node("Abs", ["x"], ["b"], name="second"),
    ])
    x = np.array([1.5, -2.0], np.float32)
    ir.sort_graphs(model)
    assert [n.name for n in model.graph.node] == ["first", "second", "last"]
    onnx.checker.check_model(model)
    (z,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(z, np.abs(x) - x)


def test_a_cycle_is_one_line():
    nodes = [helper.make_node("Neg", ["b"], ["a"]), helper.make_node("Neg", ["a"], ["b"])]
    inputs = [n.input for n in nodes]
    with pytest.raises(ModelError, match="graph g has a cycle"):
        ir.topological_order(inputs, ir.producers(n.output for n in nodes), "graph g")
