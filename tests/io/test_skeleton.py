"""Sizes without serialising the whole model (io/skeleton.py): the summary's model size is
exact below CHECK_IN_FULL_LIMIT, summed field by field."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from amp_rewrite.io.skeleton import byte_size
from helpers import ROOT, init, load_tool, make_model, node, tensor


def _with_everything():
    """A model that sets fields a sum over nodes and initializers alone would miss."""
    model = make_model(
        [node("Add", ["x", "b"], ["y"], "add")],
        [tensor("x", [2, 3])],
        [tensor("y", [2, 3])],
        [init("b", np.ones((2, 3), np.float32)), init("big", np.zeros(40_000, np.float32))],
    )
    model.graph.doc_string = "a graph's doc string"
    model.graph.value_info.append(tensor("unused", [7]))
    model.doc_string = "d" * 300  # a length over 127: a two-byte varint
    onnx.helper.set_model_props(model, {"k": "v"})
    return model


@pytest.mark.parametrize("which", ["examples", "stack", "fields"])
def test_the_size_is_what_serialising_gives(which):
    if which == "examples":
        models = [onnx.load(str(p)) for p in sorted((ROOT / "examples").glob("*.onnx"))]
    elif which == "stack":
        models = [load_tool("synthetic").transformer_stack(2000)]
    else:
        models = [_with_everything()]
    for model in models:
        assert byte_size(model) == len(model.SerializeToString())
