"""tools/bench_train.py: the BERT as ONNX Runtime training's artifacts take it computes the same
logits, and a one-round run of the trainer prints its row."""

from __future__ import annotations

import sys

import numpy as np
import onnxruntime as ort
from onnx import TensorProto

from helpers import init, load_tool, make_model, node, tensor


def _tiny_lm(vocab=7, hidden=4, seq=3):
    """input_ids -> embedding -> LayerNormalization (one output, as the TorchScript export writes
    it) -> MatMul to [N, seq, vocab] logits."""
    rng = np.random.default_rng(0)
    return make_model(
        [
            node("Gather", ["embedding", "input_ids"], ["embedded"]),
            node("LayerNormalization", ["embedded", "gamma", "beta"], ["normed"], axis=-1),
            node("MatMul", ["normed", "head"], ["logits"]),
        ],
        [tensor("input_ids", ["N", seq], TensorProto.INT64)],
        [tensor("logits", ["N", seq, vocab])],
        [
            init("embedding", rng.standard_normal((vocab, hidden)).astype(np.float32)),
            init("gamma", rng.standard_normal(hidden).astype(np.float32)),
            init("beta", rng.standard_normal(hidden).astype(np.float32)),
            init("head", rng.standard_normal((hidden, vocab)).astype(np.float32)),
        ],
    )


def _run(model, ids):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"input_ids": ids})


def test_bert_for_ort_training_keeps_the_logits(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the tool puts tools/ first: undone after
    bench = load_tool("bench_train", needs=("procmem",))
    model = _tiny_lm()
    ids = np.array([[1, 2, 3], [6, 0, 5]], np.int64)
    (logits,) = _run(model, ids)
    changed = bench._bert_for_ort_training(model)
    norms = [n for n in changed.graph.node if n.op_type == "LayerNormalization"]
    assert [len(n.output) for n in norms] == [3]  # Mean and InvStdDev, which its gradient reads
    assert [o.name for o in changed.graph.output] == ["flat_logits"]
    flat, *_ = _run(changed, ids)
    assert flat.shape == (6, 7)
    np.testing.assert_array_equal(flat, logits.reshape(6, 7))


def test_one_round_of_the_trainer_prints_its_row(monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", list(sys.path))
    bench = load_tool("bench_train", needs=("procmem",))
    argv = ["--models", "mlp", "--threads", "1", "--rounds", "2", "--warmup", "0", "--contenders", "trainer"]
    assert bench.main(argv + ["--batch", "8"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 | trainer |")]
    assert len(rows) == 1
    ms, ratio, megabytes = (float(cell) for cell in rows[0].split("|")[3].split("/"))
    assert ms > 0 and ratio == 1.0 and megabytes >= 0  # the only contender is its own baseline
