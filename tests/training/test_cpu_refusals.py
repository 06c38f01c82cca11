"""The CPU probe (training/cpu_refusals.py) finds a float16 refusal when shape inference left an
input's rank unknown: a gradient's ScatterND (caustic-nmr's embedding) was probed with rank-1
inputs, which do not fit together, and the refusal surfaced only when the step ran."""

from __future__ import annotations

from onnx import TensorProto, helper

from amp_rewrite.training import cpu_refusals


def _scatter_add(data_shape):
    """ScatterND(reduction='add') in float16; `data_shape` None: the data's rank is unknown."""
    node = helper.make_node(
        "ScatterND", ["data", "indices", "updates"], ["y"], name="scatter", reduction="add"
    )
    inputs = [
        helper.make_tensor_value_info("data", TensorProto.FLOAT16, data_shape),
        helper.make_tensor_value_info("indices", TensorProto.INT64, [4, 1]),
        helper.make_tensor_value_info("updates", TensorProto.FLOAT16, None),
    ]
    graph = helper.make_graph(
        [node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)]
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_refusal_is_found_with_the_ranks_unknown():
    assert "scatter" in cpu_refusals.refused_nodes(_scatter_add([6, 3]))
    refused = cpu_refusals.refused_nodes(_scatter_add(None))
    assert "not supported" in refused["scatter"], refused
