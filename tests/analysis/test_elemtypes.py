"""Element types from the schemas alone (analysis.elemtypes.propagate) agree with ONNX shape
inference on a small graph that covers each way a type is known: a shared type parameter, a
fixed or single-choice parameter, a `to` attribute, a Constant's value, an int-only output."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from amp_rewrite.analysis.elemtypes import propagate, tensor_types
from helpers import init, make_model, node, tensor


def mixed_model(statistics=False):
    """float32, float16, int64 and bool tensors through MatMul, Cast, Shape, Where, LayerNormalization,
    Constant nodes and an ArgMax; with `statistics`, LayerNormalization's Mean and InvStdDev too."""
    rng = np.random.default_rng(0)
    return make_model(
        [node("MatMul", ["x", "W"], ["m"], "mm"),
         node("Cast", ["m"], ["m16"], "to16", to=TensorProto.FLOAT16),
         node("Add", ["m16", "h"], ["s16"], "add16"),
         node("Shape", ["m"], ["shape"], "shape"),
         node("Constant", [], ["half"], "half", value_float=0.5),
         node("Constant", [], ["ten"], "ten", value=helper.make_tensor("v", TensorProto.INT64, [], [10])),
         node("Greater", ["m", "half"], ["pos"], "greater"),
         node("Where", ["pos", "m", "half"], ["w"], "where"),
         node("LayerNormalization", ["w", "g", "b"], ["ln", "mean", "inv"] if statistics else ["ln"], "ln", axis=-1),
         node("ArgMax", ["ln"], ["idx"], "argmax", axis=1),
         node("Add", ["idx", "ten"], ["idx10"], "add_int"),
         node("Cast", ["s16"], ["y"], "to32", to=TensorProto.FLOAT)],
        [tensor("x", [2, 4]), tensor("h", [2, 4], TensorProto.FLOAT16)],
        [tensor("y", [2, 4]), tensor("ln", [2, 4]), tensor("shape", [2], TensorProto.INT64),
         tensor("idx10", [2, 1], TensorProto.INT64), *([tensor("mean", [2, 1])] if statistics else [])],
        [init("W", rng.standard_normal((4, 4)).astype(np.float32)), init("g", np.ones(4, np.float32)),
         init("b", np.zeros(4, np.float32))])


def declared(model) -> dict:
    g = model.graph
    return {**{v.name: v.type.tensor_type.elem_type for v in g.input}, **{t.name: t.data_type for t in g.initializer}}


def inferred(model) -> dict:
    g = onnx.shape_inference.infer_shapes(model, strict_mode=True).graph
    return {v.name: v.type.tensor_type.elem_type for v in (*g.value_info, *g.output)}


def test_propagate_gives_every_node_output_the_type_shape_inference_gives():
    model = mixed_model()
    types = declared(model)
    assert propagate(model, types)  # every node output typed
    expected = inferred(model)
    outputs = [name for n in model.graph.node for name in n.output]
    assert {name: types[name] for name in outputs} == {name: expected[name] for name in outputs}
    assert (types["m16"], types["pos"], types["half"], types["ten"], types["idx"]) == (
        TensorProto.FLOAT16, TensorProto.BOOL, TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT64)


def test_an_op_without_a_schema_leaves_its_output_unknown_and_says_so():
    model = helper.make_model(helper.make_graph(
        [node("Relu", ["x"], ["r"], "relu"), node("Mystery", ["r"], ["y"], "mystery", domain="custom.domain")],
        "g", [tensor("x", [2])], [tensor("y", [2])]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("custom.domain", 1)], ir_version=8)
    types = declared(model)
    assert not propagate(model, types)
    assert types["r"] == TensorProto.FLOAT and "y" not in types


def test_what_the_schemas_leave_unknown_shape_inference_fills_in():
    """LayerNormalization's statistics (U: float32 or bfloat16, chosen by stash_type) have no type
    the schema alone can give: propagate says so, and tensor_types takes it from shape inference,
    with the shapes."""
    model = mixed_model(statistics=True)
    types = declared(model)
    assert not propagate(model, types)
    assert "mean" not in types and "inv" not in types
    types, shapes = tensor_types(model)
    assert types["mean"] == types["inv"] == TensorProto.FLOAT == inferred(model)["mean"]
    assert types["m16"] == TensorProto.FLOAT16 and types["idx10"] == TensorProto.INT64
    assert [d.dim_value for d in shapes["m"].dim] == [2, 4]
