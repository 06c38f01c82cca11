"""Issue 40, item 4: GRU and LSTM encoders as float16 as ORT's converter makes them, for CUDA.

ONNX Runtime's CUDA provider has float16 GRU, LSTM and RNN kernels (op_lists/kernels_cuda.json),
its CPU provider none: coloured for CUDA they are float16, for CPU float32. What kept a GRU
encoder short of 100% was its zero initial state, a ConstantOfShape (as torch exports it) in no
op list: float32, with a Cast to the float16 GRU. Now a clear op whose fill is retyped when every
reader is low. The models are built here the way TorchScript exports nn.GRU / nn.LSTM.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from amp_rewrite import rewrite
from helpers import check_both, init, make_model, node, tensor, weights

float16 = pytest.importorskip("onnxconverter_common.float16")

VOCAB, EMBED, HIDDEN, CLASSES = 50, 8, 16, 5


def encoder(cell: str, fill=None, opset: int = 14) -> onnx.ModelProto:
    """ids [batch, seq] -> embedding Gather -> Transpose -> bidirectional `cell` (initial states
    ConstantOfShape([2, batch, HIDDEN]) filled with `fill`, its value attribute absent when None)
    -> Transpose, Reshape -> MatMul head: logits [seq, batch, CLASSES]."""
    rng = np.random.default_rng(0)
    gates = {"GRU": 3, "LSTM": 4}[cell]
    value = {} if fill is None else {"value": helper.make_tensor("fill", TensorProto.FLOAT, [1], [fill])}
    nodes = [
        node("Gather", ["emb", "ids"], ["e"], "embed"),
        node("Transpose", ["e"], ["x"], "to_time", perm=[1, 0, 2]),
        node("Shape", ["ids"], ["shape"], "shape"),
        node("Gather", ["shape", "zero"], ["batch"], "batch", axis=0),
        node("Unsqueeze", ["batch", "axes"], ["batch1"], "unsqueeze"),
        node("Concat", ["two", "batch1", "hidden"], ["state_shape"], "concat", axis=0),
        node("ConstantOfShape", ["state_shape"], ["h0"], "zeros", **value),
    ]
    states = ["h0", "h0"] if cell == "LSTM" else ["h0"]
    outputs = ["Y", "Y_h", "Y_c"] if cell == "LSTM" else ["Y", "Y_h"]
    nodes += [
        node(
            cell,
            ["x", "W", "R", "B", "", *states],
            outputs,
            "rnn",
            hidden_size=HIDDEN,
            direction="bidirectional",
        ),
        node("Transpose", ["Y"], ["Yt"], "merge_t", perm=[0, 2, 1, 3]),
        node("Reshape", ["Yt", "merge_shape"], ["Ym"], "merge"),
        node("MatMul", ["Ym", "head"], ["logits"], "head"),
    ]
    inits = [
        init("emb", weights(rng, VOCAB, EMBED)),
        init("W", weights(rng, 2, gates * HIDDEN, EMBED)),
        init("R", weights(rng, 2, gates * HIDDEN, HIDDEN)),
        init("B", weights(rng, 2, 2 * gates * HIDDEN)),
        init("head", weights(rng, 2 * HIDDEN, CLASSES)),
        init("zero", np.array(0, np.int64)),
        init("axes", np.array([0], np.int64)),
        init("two", np.array([2], np.int64)),
        init("hidden", np.array([HIDDEN], np.int64)),
        init("merge_shape", np.array([0, 0, 2 * HIDDEN], np.int64)),
    ]
    return make_model(
        nodes,
        [tensor("ids", ["batch", "seq"], TensorProto.INT64)],
        [tensor("logits", ["seq", "batch", CLASSES])],
        inits,
        opset=opset,
    )


def _feeds():
    return {"ids": np.random.default_rng(1).integers(0, VOCAB, (3, 7))}


def _fill(model) -> onnx.TensorProto:
    zeros = next(n for n in model.graph.node if n.name == "zeros")
    return next(a.t for a in zeros.attribute if a.name == "value")


def _casts(model):
    return sum(n.op_type == "Cast" for n in model.graph.node)


@pytest.mark.parametrize("cell", ["GRU", "LSTM"])
@pytest.mark.parametrize("fill", [None, 0.0])
def test_encoder_coloured_for_cuda_is_all_float16(cell, fill):
    model = encoder(cell, fill)
    result = rewrite(model)  # provider auto: CUDA's kernels
    summary = result.report.summary
    assert result.report.node("rnn")["precision"] == "float16"
    assert result.report.node("zeros")["precision"] == "float16"
    assert summary["nodes_low"] == summary["nodes_float"]  # 100%, as ORT's converter
    theirs = float16.convert_float_to_float16(model, keep_io_types=True)
    assert _casts(result.model) <= _casts(theirs)
    fill_value = _fill(result.model)
    assert fill_value.data_type == TensorProto.FLOAT16
    check_both(model, result.model, _feeds())  # ORT's CPU provider runs the float16 GRU with casts


@pytest.mark.parametrize("cell", ["GRU", "LSTM"])
def test_encoder_coloured_for_cpu_keeps_the_recurrent_op_float32(cell):
    """ORT's CPU provider has no float16 GRU/LSTM kernel: float32, and the model runs there."""
    model = encoder(cell)
    result = rewrite(model, provider="cpu")
    rnn = result.report.node("rnn")
    assert rnn["precision"] == "float32" and "no float16 kernel on CPU" in rnn["because"]
    assert result.report.node("zeros")["precision"] == "float32"
    check_both(model, result.model, _feeds())


def test_a_fill_float16_cannot_hold_stays_float32():
    """A ConstantOfShape filled with 1e6 (beyond 65504) keeps its float32 fill and a Cast."""
    model = encoder("GRU", fill=1e6)
    result = rewrite(model)
    assert result.report.node("zeros")["precision"] == "float32"
    assert result.report.node("rnn")["precision"] == "float16"
    fill_value = _fill(result.model)
    assert fill_value.data_type == TensorProto.FLOAT
    onnx.checker.check_model(result.model, full_check=True)
