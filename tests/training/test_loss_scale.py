"""Injected Inf/NaN: skipped steps leave state bit-identical, scales back off, retry, growth."""

from __future__ import annotations

import numpy as np
import pytest

from amp_rewrite.errors import TrainingError
from amp_rewrite.training import SGD, Adam, DynamicLossScale, FixedLossScale, Trainer
from training_models import classification_batches, softmax_regression, softmax_regression_gradient


def make_trainer(optimizer=None, **kwargs):
    kwargs.setdefault("loss_scale", "dynamic")  # float32's default is no loss scale: these test the scaler
    return Trainer(
        softmax_regression(),
        optimizer=optimizer or Adam(0.05),
        precision="float32",
        provider="cpu",
        gradient_builder=softmax_regression_gradient,
        **kwargs,
    )


def poisoned(batch, value):
    bad = dict(batch)
    bad["x"] = batch["x"].copy()
    bad["x"][0, 0] = value
    return bad


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
def test_nonfinite_step_is_skipped_with_state_bit_identical_and_scale_halved(value):
    trainer = make_trainer(SGD(0.1, momentum=0.9))
    good, *_ = classification_batches(count=1)
    trainer.step(good)  # non-zero momentum and step count
    before = trainer.state()
    result = trainer.step(poisoned(good, value))
    after = trainer.state()
    assert result.skipped and result.loss_scale == 2.0**14
    assert trainer.step_count == 1
    for name, array in before.items():
        if not name.startswith("scale/"):
            assert after[name].tobytes() == array.tobytes(), name
    assert after["scale/good_steps"] == 0


def test_overflowing_scaled_gradient_is_skipped_although_the_loss_is_finite():
    trainer = make_trainer(loss_scale=DynamicLossScale(initial=2.0**24))
    first, batch = classification_batches(count=2)
    assert not trainer.step(first).skipped  # from the first finite step on, a skip is a skip
    scale = trainer.loss_scale
    batch = dict(batch, x=batch["x"] * np.float32(1e32))
    result = trainer.step(batch)
    assert np.isfinite(result.loss) and result.skipped and result.loss_scale == scale / 2


def test_until_a_first_step_is_finite_skip_mode_searches_for_the_scale():
    """The initial scale is a guess: the first batch is retried at the backed-off scale at once
    (magika v3.3 skipped its first 6 steps of 6), not skipped step after step."""
    trainer = make_trainer(loss_scale=DynamicLossScale(initial=2.0**24))
    batch = classification_batches(count=1)[0]
    batch = dict(batch, x=batch["x"] * np.float32(1e32))
    result = trainer.step(batch)
    assert not result.skipped and result.retries >= 1 and trainer.step_count == 1
    assert result.loss_scale == 2.0**24 / 2**result.retries


def test_retry_recomputes_the_batch_at_a_lower_scale_until_it_is_finite():
    batch = classification_batches(count=1)[0]
    batch = dict(batch, x=batch["x"] * np.float32(1e32))
    trainer = make_trainer(loss_scale=DynamicLossScale(initial=2.0**24), on_nonfinite="retry")
    result = trainer.step(batch)
    assert not result.skipped and result.retries >= 1
    assert result.loss_scale == 2.0**24 / 2**result.retries
    assert trainer.step_count == 1
    # the applied update is the one a run at the final scale computes directly
    direct = make_trainer(loss_scale=FixedLossScale(result.loss_scale))
    assert not direct.step(batch).skipped
    for name, array in direct.weights().items():
        np.testing.assert_array_equal(trainer.weights()[name], array)


def test_retry_gives_up_at_scale_one():
    trainer = make_trainer(loss_scale=DynamicLossScale(initial=4.0), on_nonfinite="retry")
    result = trainer.step(poisoned(classification_batches(count=1)[0], np.nan))
    assert result.skipped and result.retries == 2 and result.loss_scale == 1.0 and trainer.step_count == 0


def test_scale_grows_after_the_interval_and_respects_its_cap():
    trainer = make_trainer(loss_scale=DynamicLossScale(initial=8.0, growth_interval=3, max_scale=32.0))
    scales = [trainer.step(b).loss_scale for b in classification_batches(count=9)]
    assert scales == [8, 8, 16, 16, 16, 32, 32, 32, 32]


def test_a_nonfinite_step_resets_the_growth_counter_and_never_goes_below_the_floor():
    trainer = make_trainer(loss_scale=DynamicLossScale(initial=4.0, growth_interval=2, min_scale=2.0))
    good = classification_batches(count=1)[0]
    bad = poisoned(good, np.inf)
    scales = [trainer.step(b).loss_scale for b in [good, bad, good, bad, bad, good, good]]
    assert scales == [4, 2, 2, 2, 2, 2, 4]


def test_fixed_scale_skips_nonfinite_steps_without_changing():
    trainer = make_trainer(loss_scale=128)
    result = trainer.step(poisoned(classification_batches(count=1)[0], np.inf))
    assert result.skipped and result.loss_scale == 128.0


@pytest.mark.parametrize(
    "configure, message",
    [
        (lambda: make_trainer(loss_scale=100.0, on_nonfinite="retry"), "dynamic"),
        (lambda: make_trainer(loss_scale="static"), "loss_scale"),
        (lambda: make_trainer(loss_scale=-1.0), "positive"),
        (lambda: DynamicLossScale(initial=0.5), "min_scale"),
        (lambda: DynamicLossScale(growth_factor=1.0), "growth_factor"),
        (lambda: make_trainer(on_nonfinite="ignore"), "on_nonfinite"),
    ],
    ids=["retry-fixed", "unknown", "negative", "below-floor", "no-growth", "bad-policy"],
)
def test_bad_loss_scale_configurations_are_clear_errors(configure, message):
    with pytest.raises(TrainingError, match=message):
        configure()
