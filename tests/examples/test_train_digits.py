"""Mixed-precision training reaches float32 accuracy on the digits example (within 1 point)."""

from __future__ import annotations

import pytest

from helpers import load_script

pytest.importorskip("sklearn")
train_digits = load_script("examples/train_digits.py")

EPOCHS = 5


@pytest.fixture(scope="module")
def float32_curve():
    return train_digits.train("float32", EPOCHS, provider="cpu")


def test_float32_run_learns_the_task(float32_curve):
    assert float32_curve[-1] > float32_curve[0] and float32_curve[-1] > 0.9


def test_float16_amp_on_onnx_runtime_is_within_one_point_of_float32(float32_curve):
    mixed = train_digits.train("float16", EPOCHS, provider="cpu")
    assert abs(mixed[-1] - float32_curve[-1]) <= 0.01


def test_float16_amp_with_true_float16_arithmetic_is_within_one_point_of_float32(float32_curve):
    """onnx.reference keeps float16 tensors float16 (ORT's CPU provider computes them in float32)."""
    mixed = train_digits.train_on_reference("float16", EPOCHS)
    assert abs(mixed[-1] - float32_curve[-1]) <= 0.01
