"""ONNX Runtime's com.microsoft ops get their type groups from op_lists/schemas_contrib.json
(tools/gen_contrib_schemas.py), the way standard ops get theirs from onnx.defs: the same groups
whatever ONNX Runtime registry is present, and the file is what the generator makes of the
installed ONNX Runtime."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

from amp_rewrite import api
from amp_rewrite.analysis import schemas
from amp_rewrite.analysis.oplists import shipped_path
from helpers import assert_close, init, load_tool, make_model, node, run_ort, tensor, weights

F16, F32 = "tensor(float16)", "tensor(float)"


@pytest.fixture
def no_live_registry(monkeypatch):
    """ONNX Runtime's own registry made empty: only the shipped file can answer."""
    monkeypatch.setattr(schemas, "_onnxruntime_schemas", lambda: {})
    schemas.signature.cache_clear()
    schemas.type_groups.cache_clear()
    yield
    schemas.signature.cache_clear()
    schemas.type_groups.cache_clear()


def test_skip_layer_normalization_groups_come_from_the_file(no_live_registry):
    sig = schemas.signature("com.microsoft", "SkipLayerNormalization", 1)
    found = {g.type_param: g for g in schemas.type_groups(sig, 5, 4)}
    assert found["T"] == schemas.TypeGroup("T", (0, 1, 2, 3, 4), (0, 3))
    assert found["U"] == schemas.TypeGroup("U", (), (1, 2)) and found["U"].output_only
    assert sig.admits("T", F16) and not sig.admits("U", F16) and sig.admits("U", F32)


def test_the_file_is_the_generators_output_for_the_installed_onnxruntime():
    import json

    import onnxruntime

    made_with = json.loads(shipped_path("schemas_contrib.json").read_text())["source"].split()[1]
    if made_with != onnxruntime.__version__:  # a newer ONNX Runtime than the file's: regenerate it
        pytest.skip(
            f"schemas_contrib.json is onnxruntime {made_with}'s; {onnxruntime.__version__} is installed"
        )
    gen = load_tool("gen_contrib_schemas")
    assert shipped_path("schemas_contrib.json").read_text() == gen.render(gen.current_table())


def _bias_gelu_model():
    """MatMul -> com.microsoft:BiasGelu -> MatMul: two allow ops around a fused activation."""
    rng = np.random.default_rng(0)
    return make_model(
        [
            node("MatMul", ["x", "W1"], ["h"], "mm1"),
            node("BiasGelu", ["h", "b"], ["g"], "gelu", domain="com.microsoft"),
            node("MatMul", ["g", "W2"], ["y"], "mm2"),
        ],
        [tensor("x", ["N", 8])],
        [tensor("y", ["N", 4])],
        [init("W1", weights(rng, 8, 16)), init("b", weights(rng, 16)), init("W2", weights(rng, 16, 4))],
        extra_opsets=[("com.microsoft", 1)],
    )


def _input_types(model, name):
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.value_info]}
    types.update({i.name: i.data_type for i in model.graph.initializer})
    target = next(n for n in model.graph.node if n.name == name)
    return [types.get(i) for i in target.input]


def test_fused_activation_is_low_for_cuda_from_the_file_alone(no_live_registry):
    """CUDA has float16 BiasGelu: the chain is one low region, a cast at each end only."""
    result = api.rewrite(_bias_gelu_model(), provider="cuda")
    assert len(result.report.casts) == 2
    producers = {o: n for n in result.model.graph.node for o in n.output}
    gelu = next(n for n in result.model.graph.node if n.name == "gelu")
    assert producers[gelu.input[0]].name == "mm1"  # no cast between the low MatMul and it
    assert _input_types(result.model, "mm1")[1] == TensorProto.FLOAT16
    assert _input_types(result.model, "gelu")[1] == TensorProto.FLOAT16


def test_fused_activation_stays_float32_where_the_cpu_has_no_kernel(no_live_registry):
    """ORT's CPU BiasGelu is float32 only: coloured for the CPU, it stays float32 and runs."""
    original = _bias_gelu_model()
    result = api.rewrite(original, provider="cpu")
    assert _input_types(result.model, "gelu")[1] == TensorProto.FLOAT
    feeds = {"x": np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32)}
    assert_close(run_ort(result.model, feeds), run_ort(original, feeds), rtol=2e-2, atol=2e-2)
