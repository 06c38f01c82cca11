"""Element types from the schemas alone (analysis.elemtypes.propagate) agree with ONNX shape
inference on a small graph that covers each way a type is known: a shared type parameter, a
fixed or single-choice parameter, a `to` attribute, a Constant's value, an int-only output."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from amp_rewrite.analysis import elemtypes
from amp_rewrite.analysis.elemtypes import check_dims, propagate, tensor_types
from amp_rewrite.errors import UsageError
from helpers import init, make_model, node, tensor


def mixed_model(statistics=False):
    """float32, float16, int64 and bool tensors through MatMul, Cast, Shape, Where, LayerNormalization,
    Constant nodes and an ArgMax; with `statistics`, LayerNormalization's Mean and InvStdDev too."""
    rng = np.random.default_rng(0)
    return make_model(
        [
            node("MatMul", ["x", "W"], ["m"], "mm"),
            node("Cast", ["m"], ["m16"], "to16", to=TensorProto.FLOAT16),
            node("Add", ["m16", "h"], ["s16"], "add16"),
            node("Shape", ["m"], ["shape"], "shape"),
            node("Constant", [], ["half"], "half", value_float=0.5),
            node("Constant", [], ["ten"], "ten", value=helper.make_tensor("v", TensorProto.INT64, [], [10])),
            node("Greater", ["m", "half"], ["pos"], "greater"),
            node("Where", ["pos", "m", "half"], ["w"], "where"),
            node(
                "LayerNormalization",
                ["w", "g", "b"],
                ["ln", "mean", "inv"] if statistics else ["ln"],
                "ln",
                axis=-1,
            ),
            node("ArgMax", ["ln"], ["idx"], "argmax", axis=1),
            node("Add", ["idx", "ten"], ["idx10"], "add_int"),
            node("Cast", ["s16"], ["y"], "to32", to=TensorProto.FLOAT),
        ],
        [tensor("x", [2, 4]), tensor("h", [2, 4], TensorProto.FLOAT16)],
        [
            tensor("y", [2, 4]),
            tensor("ln", [2, 4]),
            tensor("shape", [2], TensorProto.INT64),
            tensor("idx10", [2, 1], TensorProto.INT64),
            *([tensor("mean", [2, 1])] if statistics else []),
        ],
        [
            init("W", rng.standard_normal((4, 4)).astype(np.float32)),
            init("g", np.ones(4, np.float32)),
            init("b", np.zeros(4, np.float32)),
        ],
    )


def declared(model) -> dict:
    g = model.graph
    return {
        **{v.name: v.type.tensor_type.elem_type for v in g.input},
        **{t.name: t.data_type for t in g.initializer},
    }


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
        TensorProto.FLOAT16,
        TensorProto.BOOL,
        TensorProto.FLOAT,
        TensorProto.INT64,
        TensorProto.INT64,
    )


def test_an_op_without_a_schema_leaves_its_output_unknown_and_says_so():
    model = helper.make_model(
        helper.make_graph(
            [
                node("Relu", ["x"], ["r"], "relu"),
                node("Mystery", ["r"], ["y"], "mystery", domain="custom.domain"),
            ],
            "g",
            [tensor("x", [2])],
            [tensor("y", [2])],
        ),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("custom.domain", 1)],
        ir_version=8,
    )
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


def test_dims_size_shape_inference_without_touching_the_model(monkeypatch):
    """`dims` size the inputs' symbolic dims for inference only: intermediate tensors, outputs and
    declared value_info get concrete shapes; the model's own declarations stay symbolic."""
    model = make_model(
        [node("Relu", ["x"], ["h"], "relu"), node("Transpose", ["h"], ["y"], "t", perm=[1, 0, 2])],
        [tensor("x", ["batch", "seq", 4])],
        [tensor("y", ["seq", "batch", 4])],
    )
    model.graph.value_info.append(helper.make_tensor_value_info("h", TensorProto.FLOAT, ["batch", "seq", 4]))
    before = model.SerializeToString()

    def dims_of(shapes, name):
        return [d.dim_value or d.dim_param for d in shapes[name].dim]

    _, shapes = tensor_types(model, dims={"batch": 3, "seq": 5})
    assert dims_of(shapes, "x") == dims_of(shapes, "h") == [3, 5, 4] and dims_of(shapes, "y") == [5, 3, 4]
    assert model.SerializeToString() == before
    _, shapes = tensor_types(model)
    assert dims_of(shapes, "h") == ["batch", "seq", 4]
    monkeypatch.setattr(elemtypes, "SHAPE_INFERENCE_NODE_LIMIT", 1)  # above the limit: no inference, no sizes
    assert not elemtypes.sizes_dims(model)
    _, shapes = tensor_types(model, dims={"batch": 3, "seq": 5}, shape_inference=True)
    assert dims_of(shapes, "h") == ["batch", "seq", 4]


def test_a_dim_no_input_has_is_one_line_naming_those_it_has():
    model = make_model(
        [node("Relu", ["x"], ["y"], "relu")], [tensor("x", ["batch", "seq"])], [tensor("y", ["batch", "seq"])]
    )
    check_dims(model.graph, {"batch": 2, "seq": 3})
    with pytest.raises(
        UsageError,
        match=r"dim 'bacth': not a symbolic dim of the model's inputs "
        r"\(its inputs' symbolic dims are batch, seq\)",
    ):
        check_dims(model.graph, {"bacth": 2})
    fixed = make_model([node("Relu", ["x"], ["y"], "relu")], [tensor("x", [2])], [tensor("y", [2])])
    with pytest.raises(UsageError, match="its inputs have no symbolic dims"):
        check_dims(fixed.graph, {"batch": 2})
