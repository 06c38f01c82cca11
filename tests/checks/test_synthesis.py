"""Synthesised inputs respect what the model needs (issue 37, item 4: mtcnn pnet's Conv on a
1x1 image, silero_vad's reflect Pad on {1,1}, caustic-nmr's Gather out of its table all ended
--validate with an internal error); where no synthesis fits, one line, exit 2, naming the input."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import amp_rewrite
from amp_rewrite import driver, errors
from amp_rewrite.cli import main
from amp_rewrite.io.samples import synthesise
from helpers import init, node, run_ort, weights

RNG = np.random.default_rng(0)


def _model(nodes, x, y, initializers, opset=17):
    graph = helper.make_graph(nodes, "g", [x], [y], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def pnet():
    """A 3x3 Conv (dilated 2: a 5x5 window), MaxPool 2x2 then a 3x3 Conv, on x [1, 3, h, w]."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, "h", "w"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b", "c", "d"])
    nodes = [
        node("Conv", ["x", "k1"], ["c1"], dilations=[2, 2]),
        node("MaxPool", ["c1"], ["p"], kernel_shape=[2, 2]),
        node("Conv", ["p", "k2"], ["y"]),
    ]
    return _model(
        nodes,
        x,
        y,
        [
            init("k1", weights(RNG, 4, 3, 3, 3)),
            init("k2", weights(RNG, 4, 4, 3, 3)),
        ],
    )


def vad():
    """A reflect Pad of 4 each side on x [1, n], then a MatMul."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "n"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])
    nodes = [node("Pad", ["x", "pads"], ["p"], mode="reflect"), node("MatMul", ["w", "p"], ["y"])]
    pads = init("pads", np.array([0, 4, 0, 4], np.int64))
    return _model(nodes, x, y, [pads, init("w", weights(RNG, 2, 1))], opset=18)


def lookup():
    """ids [1, s] (int64) index a 2-row table, then a MatMul."""
    x = helper.make_tensor_value_info("ids", TensorProto.INT64, [1, "s"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b", "c"])
    nodes = [node("Gather", ["table", "ids"], ["e"]), node("MatMul", ["e", "w"], ["y"])]
    return _model(nodes, x, y, [init("table", weights(RNG, 2, 4)), init("w", weights(RNG, 4, 4))])


@pytest.mark.parametrize("make", [vad, lookup])
def test_what_a_node_reading_an_input_needs_is_synthesised_at_once(make):
    run_ort(make(), synthesise(make())[0])  # ONNX Runtime accepts them as made


def test_a_window_deeper_in_the_graph_gets_samples_made_again_larger():
    """pnet's second Conv needs h >= 10, which no node reading x says: the check grows them."""
    model = pnet()
    samples = synthesise(model)
    with pytest.raises(Exception, match="Invalid input shape"):
        run_ort(model, samples[0])
    checked = driver.check(model, validate=True, provider="cpu", samples=samples)
    assert checked.validation.passed and samples.scale > 1
    run_ort(model, samples[0])


@pytest.mark.parametrize("make", [pnet, vad, lookup])
def test_the_api_validates_each(make):
    assert driver.check(make(), validate=True, provider="cpu").validation.passed


@pytest.mark.parametrize("make", [pnet, vad, lookup])
def test_the_cli_validates_each(make, tmp_path, capsys):
    path = tmp_path / "m.onnx"
    onnx.save(make(), path)
    assert main([str(path), "-o", str(tmp_path / "out.onnx"), "--validate", "--provider", "cpu"]) == 0, (
        capsys.readouterr().err
    )  # noqa: E501


def test_where_no_synthesis_fits_one_line_names_the_input(tmp_path, capsys):
    """A Reshape to a fixed 12 elements needs n = 12: nothing a node's own attributes say."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "n"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])
    nodes = [node("Reshape", ["x", "shape"], ["r"]), node("MatMul", ["r", "w"], ["y"])]
    model = _model(nodes, x, y, [init("shape", np.array([3, 4], np.int64)), init("w", weights(RNG, 4, 4))])
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    for flags in (["--validate"], ["--calibrate"]):
        code = main([str(path), "-o", str(tmp_path / "out.onnx"), "--force", *flags, "--provider", "cpu"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, err
        assert "synthesised inputs" in err[0] and "'x'" in err[0] and "--dim" in err[0], err
    with pytest.raises(errors.UsageError, match="--dim NAME=SIZE"):
        driver.check(model, validate=True, provider="cpu")
    assert main([str(path), "-o", str(tmp_path / "out.onnx"), "--force", "--validate", "--dim", "n=12"]) == 0
    assert amp_rewrite.rewrite(model).model is not None
