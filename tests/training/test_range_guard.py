"""The Trainer's range guard (training/range_guard.py): a float16 step that no loss scale makes
finite keeps float32 the ops whose float16 values were not, rebuilds the step around the same
state, and trains; the ops are named in a line, in `kept_for_range` and in the step's report."""

from __future__ import annotations

import numpy as np

from amp_rewrite.training import SGD, Trainer
from helpers import init, make_model, node, tensor, weights


def _shrinker():
    """relu([x; x] * 1e-4) @ W on inputs near 1e5: x itself passes float16's 65504. ONNX Runtime's
    CPU provider computes float16 Muls in float32 and drops the Cast pairs around them, but its
    Concat has a float16 kernel: the Cast to float16 before it stores inf. Synthesised inputs
    (standard normal) would never show it."""
    rng = np.random.default_rng(0)
    return make_model(
        [
            node("Concat", ["x", "x"], ["t"], "concat", axis=0),
            node("Mul", ["t", "small"], ["h"], "shrink"),
            node("Relu", ["h"], ["r"], "relu"),
            node("MatMul", ["r", "W"], ["y"], "mm"),
        ],
        [tensor("x", [4, 8])],
        [tensor("y", [8, 3])],
        [init("small", np.float32(1e-4)), init("W", weights(rng, 8, 3))],
    )


def _batch(scale=1e5):
    rng = np.random.default_rng(1)
    x = rng.uniform(0.7, 1.0, (4, 8)).astype(np.float32) * np.float32(scale)
    return {"x": x, "targets": np.zeros((8, 3), np.float32)}


def test_what_no_scale_fixes_is_kept_float32_and_the_step_trains(caplog):
    said = []
    trainer = Trainer(
        _shrinker(), loss="mse", optimizer=SGD(1e-4), precision="float16", provider="cpu", trainable=["W"]
    )
    trainer._guard.say = said.append  # the line the Trainer prints (verbose)
    first = trainer.step(_batch())
    assert not first.skipped and np.isfinite(first.loss)
    # the reader of the Cast that gave inf (ONNX Runtime's CPU provider then computes the Mul
    # after it in float32, between Cast pairs it drops: no second round)
    assert list(trainer.kept_for_range) == ["concat"]
    assert "not finite in float16 at every loss scale" in trainer.kept_for_range["concat"]
    assert len(said) == 1 and "'concat'" in said[0] and "kept float32" in said[0]
    entry = trainer.step_graph.report.node("concat")
    assert entry["precision"] == "float32" and "kept float32 by the Trainer" in entry["because"]
    losses = [trainer.step(_batch()).loss for _ in range(5)]
    assert all(np.isfinite(losses)) and losses[-1] < first.loss

    float32 = Trainer(
        _shrinker(), loss="mse", optimizer=SGD(1e-4), precision="float32", provider="cpu", trainable=["W"]
    )
    expected = [float32.step(_batch()).loss for _ in range(6)]
    np.testing.assert_allclose([first.loss, *losses], expected, rtol=2e-2)


def test_float32_and_finite_steps_need_no_guard():
    trainer = Trainer(_shrinker(), loss="mse", precision="float16", provider="cpu", trainable=["W"])
    batch = _batch(scale=1e3)  # x fits float16
    assert not trainer.step(batch).skipped and trainer.kept_for_range == {}
    assert Trainer(_shrinker(), loss="mse", precision="float32", provider="cpu").kept_for_range == {}
