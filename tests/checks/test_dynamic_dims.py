"""A dim declared -1 (PaddleOCR's classifier: x [-1, 3, '?', '?']) is dynamic, as ONNX Runtime
reads it: `--inputs` samples of any size there are accepted, and synthesised inputs size it as a
symbolic dim."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from amp_rewrite.cli import main
from amp_rewrite.io.samples import synthesise
from helpers import init, node, run_ort, weights


def _classifier() -> onnx.ModelProto:
    """x [-1, 3, '?', '?'] -> Conv -> GlobalAveragePool -> Flatten -> Gemm: the dims as exported."""
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, "h", "w"])
    x.type.tensor_type.shape.dim[0].dim_value = -1  # written by hand: make_tensor_value_info refuses -1
    graph = helper.make_graph(
        [
            node("Conv", ["x", "k"], ["c"], pads=[1, 1, 1, 1]),
            node("GlobalAveragePool", ["c"], ["p"]),
            node("Flatten", ["p"], ["f"]),
            node("Gemm", ["f", "w", "b"], ["y"]),
        ],
        "classifier",
        [x],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", 2])],
        [init("k", weights(rng, 8, 3, 3, 3)), init("w", weights(rng, 8, 2)), init("b", weights(rng, 2))],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_inputs_of_any_size_where_the_model_declares_minus_one(tmp_path, capsys):
    model = _classifier()
    path = tmp_path / "cls.onnx"
    onnx.save(model, path)
    sample = np.random.default_rng(1).standard_normal((4, 3, 48, 192)).astype(np.float32)
    assert run_ort(model, {"x": sample})[0].shape == (4, 2)  # ONNX Runtime runs it as dynamic
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, **{"0/x": sample})
    for flags in (["--validate"], ["--calibrate"]):
        code = main([str(path), "-o", str(tmp_path / "out.onnx"), "--force", "--inputs", str(inputs), *flags])
        err = capsys.readouterr().err
        assert code == 0, err
        assert "declares" not in err


def test_synthesised_inputs_size_minus_one_as_a_symbolic_dim():
    feeds = synthesise(_classifier(), dims={"h": 8, "w": 8})[0]
    assert feeds["x"].shape == (1, 3, 8, 8)
    run_ort(_classifier(), feeds)
