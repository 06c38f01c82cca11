"""Built-in MSE, a model's own scalar loss output, and training a subset of the weights."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import numpy_helper

from amp_rewrite.errors import TrainingError
from amp_rewrite.training import SGD, Trainer
from helpers import init, make_model, node, tensor
from training_models import classification_batches, mlp


def linear_regression(features=3, outputs=2, with_loss_output=False):
    rng = np.random.default_rng(0)
    nodes = [node("MatMul", ["x", "W"], ["prediction"], name="matmul")]
    inputs, outputs_ = [tensor("x", ["N", features])], [tensor("prediction", ["N", outputs])]
    if with_loss_output:
        nodes += [
            node("Sub", ["prediction", "y"], ["error"], name="error"),
            node("Mul", ["error", "error"], ["squared"], name="squared"),
            node("ReduceMean", ["squared"], ["my_loss"], name="mean", keepdims=0),
        ]
        inputs.append(tensor("y", ["N", outputs]))
        outputs_ = [tensor("my_loss", [])]
    return make_model(
        nodes, inputs, outputs_, [init("W", rng.standard_normal((features, outputs)).astype(np.float32))]
    )


def numpy_mse_sgd(w, batches, lr, target_key):
    """Plain numpy: d mean((xW - y)^2) / dW = 2 x^T (xW - y) / size."""
    history = []
    for batch in batches:
        error = batch["x"] @ w - batch[target_key]
        history.append(float(np.mean(error**2)))
        w = w - lr * 2 * batch["x"].T @ error / error.size
    return history, w


def regression_batches(key, count=4):
    rng = np.random.default_rng(3)
    return [
        {
            "x": rng.standard_normal((8, 3)).astype(np.float32),
            key: rng.standard_normal((8, 2)).astype(np.float32),
        }
        for _ in range(count)
    ]


@pytest.mark.parametrize(
    "loss, key, with_loss_output",
    [("mse", "targets", False), ("my_loss", "y", True)],
    ids=["builtin-mse", "model-loss-output"],
)
def test_regression_losses_match_numpy_step_for_step(loss, key, with_loss_output):
    model = linear_regression(with_loss_output=with_loss_output)
    batches = regression_batches(key)
    trainer = Trainer(model, loss=loss, optimizer=SGD(0.1), precision="float32", provider="cpu")
    losses = [trainer.step(b).loss for b in batches]
    expected_losses, expected_w = numpy_mse_sgd(_initial(model, "W"), batches, 0.1, key)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    np.testing.assert_allclose(trainer.weights()["W"], expected_w, rtol=1e-5, atol=1e-6)


def _initial(model, name):
    return next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == name)


def test_only_the_trainable_weights_change():
    model = mlp(sizes=(4, 8, 3))
    trainer = Trainer(model, optimizer=SGD(0.5), precision="float32", provider="cpu", trainable=["w1", "b1"])
    frozen_before = {
        t.name: _initial(model, t.name) for t in model.graph.initializer if t.name in ("w0", "b0")
    }
    for batch in classification_batches(features=4, count=3):
        trainer.step(batch)
    assert set(trainer.weights()) == {"w1", "b1"}
    assert not np.array_equal(trainer.weights()["w1"], _initial(model, "w1"))
    exported = trainer.inference_model()
    for name, array in frozen_before.items():
        assert np.array_equal(_initial(exported, name), array)


def test_a_loss_output_that_is_not_scalar_is_a_clear_error():
    with pytest.raises(TrainingError, match="must be a scalar"):
        Trainer(
            linear_regression(), loss="prediction", optimizer=SGD(0.1), precision="float32", provider="cpu"
        )
