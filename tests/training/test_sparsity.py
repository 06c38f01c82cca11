"""Sparse weights keep their zeros (training/sparsity.py): in the per-tensor step, the flat one and
the Trainer's engine, in float32 and float16; the values that are not zero move exactly as in the
dense step; `keep_sparsity=False` trains them dense."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import numpy_helper

from amp_rewrite.autodiff import build_gradient_graph
from amp_rewrite.training import SGD, AdamW, FixedLossScale, Trainer, build_step_graph, sparsity
from amp_rewrite.training.runner import SessionRunner
from training_models import classification_batches, mlp

SIZES = (16, 24, 12, 3)


def _pruned(share=0.6, seed=3):
    """The MLP with `share` of w0's values set to exact zeros (as magnitude pruning leaves it)."""
    model = mlp(SIZES)
    tensor = next(t for t in model.graph.initializer if t.name == "w0")
    values = numpy_helper.to_array(tensor).copy()
    values[np.random.default_rng(seed).random(values.shape) < share] = 0
    tensor.CopyFrom(numpy_helper.from_array(values, "w0"))
    return model, values


def _batches():
    return classification_batches(features=SIZES[0], classes=SIZES[-1], count=4)


def _session(model, optimizer, nonzero, flat):
    builder = sparsity.keeping_zeros(build_gradient_graph, nonzero)
    step = build_step_graph(
        model, "cross_entropy", optimizer, FixedLossScale(1.0), None, builder, flat_update=flat
    )
    return SessionRunner(step, step.initial_state, optimizer.lr, "cpu", "float32", threads=1)


@pytest.mark.parametrize("flat", [False, True], ids=["per-tensor", "flat"])
@pytest.mark.parametrize("optimizer", [lambda: SGD(0.1), lambda: AdamW(0.01)], ids=["sgd", "adamw"])
def test_zeros_stay_and_the_rest_moves_as_in_the_dense_step(flat, optimizer):
    model, w0 = _pruned()
    nonzero = sparsity.sparse_weights(model, ["w0", "w1", "b0"])
    assert list(nonzero) == ["w0"] and np.array_equal(nonzero["w0"], w0 != 0)
    masked = _session(model, optimizer(), nonzero, flat)
    dense = _session(model, optimizer(), {}, flat)
    batch = _batches()[0]
    masked.run(batch), dense.run(batch)
    kept, moved = masked.state.read("w0"), dense.state.read("w0")
    assert np.all(kept[w0 == 0] == 0) and np.all(moved[w0 == 0] != 0)  # the dense step moves them
    # one step from the same weights: where w0 is not zero, the masked update is the dense one
    np.testing.assert_array_equal(kept[w0 != 0], moved[w0 != 0])
    for name in ("w1", "b0", "b2"):
        np.testing.assert_array_equal(masked.state.read(name), dense.state.read(name))
    for batch in _batches()[1:]:
        masked.run(batch)
    assert np.all(masked.state.read("w0")[w0 == 0] == 0)


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_the_trainer_keeps_them_and_says_so(precision, capsys):
    model, w0 = _pruned()
    trainer = Trainer(model, precision=precision, provider="cpu", optimizer=AdamW(0.01))
    assert list(trainer.kept_sparse) == ["w0"]
    assert trainer.kept_sparse["w0"] == pytest.approx((w0 == 0).mean())
    assert "1 sparse keeps its zeros (w0 " in capsys.readouterr().err
    losses = [trainer.step(batch).loss for batch in _batches() * 2]
    weights = trainer.weights()["w0"]
    assert np.all(weights[w0 == 0] == 0) and not np.array_equal(weights[w0 != 0], w0[w0 != 0])
    assert losses[-1] < losses[0]


def test_keep_sparsity_false_trains_them_dense():
    model, w0 = _pruned()
    trainer = Trainer(model, provider="cpu", precision="float32", optimizer=AdamW(0.01), keep_sparsity=False)
    assert trainer.kept_sparse == {}
    trainer.step(_batches()[0])
    assert np.all(trainer.weights()["w0"][w0 == 0] != 0)


@pytest.mark.parametrize(
    ("share", "size", "sparse"),
    [
        (0.5, 64, True),  # half zeros: a Keras LSTM's recurrence bias, a 2:4 pruned layer
        (0.97, 256, True),  # a mel filterbank
        (0.45, 256, False),  # some zeros are not structure
        (1.0, 256, False),  # all zeros: a bias initialised so, trained from there
        (0.75, 48, False),  # too small to tell
    ],
)
def test_what_counts_as_sparse(share, size, sparse):
    values = np.arange(1, size + 1, dtype=np.float32)
    values[: round(share * size)] = 0
    model = mlp(SIZES)
    model.graph.initializer.append(numpy_helper.from_array(values, "table"))
    assert ("table" in sparsity.sparse_weights(model, ["table"])) == sparse
    assert "table" not in sparsity.sparse_weights(model, ["w0"])  # only the trained tensors


def test_the_summary_line():
    assert sparsity.summary({}) == ""
    assert sparsity.summary({"a": 0.5, "b": 0.97}) == "; 2 sparse keep their zeros (a 50%, b 97%)"
    assert sparsity.summary(dict.fromkeys("abcde", 0.5)).endswith("(a 50%, b 50%, c 50% and 2 more)")
