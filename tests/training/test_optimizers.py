"""Float32 training matches torch.optim step for step, for every optimizer and option.

The MLP runs the whole pipeline (autodiff gradients); the softmax regression uses a hand-written
gradient, so the step-graph assembly is also checked independently of the autodiff package.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import numpy_helper

from amp_rewrite.training import SGD, Adam, AdamW, Trainer
from training_models import classification_batches, mlp, softmax_regression, softmax_regression_gradient

torch = pytest.importorskip("torch")

OPTIMIZERS = {
    "sgd": (lambda: SGD(0.5), lambda p: torch.optim.SGD(p, lr=0.5)),
    "sgd-momentum-wd": (
        lambda: SGD(0.3, momentum=0.9, weight_decay=0.01),
        lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.9, weight_decay=0.01),
    ),
    "sgd-nesterov": (
        lambda: SGD(0.3, momentum=0.8, nesterov=True),
        lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.8, nesterov=True),
    ),
    "adam": (lambda: Adam(0.05), lambda p: torch.optim.Adam(p, lr=0.05)),
    "adam-l2": (
        lambda: Adam(0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
        lambda p: torch.optim.Adam(p, lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    ),
    "adamw": (
        lambda: AdamW(0.05, weight_decay=0.1),
        lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1),
    ),
}


def torch_forward(params, x):
    """Softmax regression (W, b) or the Gemm/Relu MLP (w0, b0, w1, b1, ...)."""
    if "W" in params:
        return x @ params["W"] + params["b"]
    layers = len(params) // 2
    for i in range(layers):
        x = x @ params[f"w{i}"] + params[f"b{i}"]
        x = torch.relu(x) if i < layers - 1 else x
    return x


def torch_reference(model, make_optimizer, batches, max_grad_norm=None, factor=None):
    """Loss and weights after each step of the same model trained by torch eager (`factor`: a
    LambdaLR multiplier of the step index)."""
    params = {
        t.name: torch.tensor(numpy_helper.to_array(t).copy(), requires_grad=True)
        for t in model.graph.initializer
    }
    optimizer = make_optimizer(list(params.values()))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor) if factor else None
    history = []
    for batch in batches:
        optimizer.zero_grad()
        logits = torch_forward(params, torch.from_numpy(batch["x"]))
        loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(batch["labels"]))
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(params.values()), max_grad_norm)
        optimizer.step()
        if schedule is not None:
            schedule.step()
        history.append((loss.item(), {k: v.detach().numpy().copy() for k, v in params.items()}))
    return history


def ours(model, optimizer, batches, gradient_builder=softmax_regression_gradient, **kwargs):
    trainer = Trainer(
        model,
        optimizer=optimizer,
        precision="float32",
        provider="cpu",
        gradient_builder=gradient_builder,
        **kwargs,
    )
    history = []
    for batch in batches:
        result = trainer.step(batch)
        assert not result.skipped
        history.append((result.loss, trainer.weights()))
    return history


def assert_same_history(actual, expected):
    assert len(actual) == len(expected)
    for step, ((loss, weights), (ref_loss, ref_weights)) in enumerate(zip(actual, expected)):
        assert loss == pytest.approx(ref_loss, rel=1e-5), f"loss differs at step {step}"
        for name, ref in ref_weights.items():
            np.testing.assert_allclose(
                weights[name], ref, rtol=1e-5, atol=1e-5, err_msg=f"{name} at step {step}"
            )


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_float32_mlp_training_with_autodiff_matches_torch_step_for_step(name):
    make_ours, make_torch = OPTIMIZERS[name]
    model = mlp(sizes=(6, 16, 4))
    batches = classification_batches(features=6, classes=4, count=6)
    actual = ours(model, make_ours(), batches, gradient_builder=None)
    assert_same_history(actual, torch_reference(model, make_torch, batches))


@pytest.mark.parametrize("name", ["sgd-nesterov", "adamw"])
def test_step_graph_assembly_with_a_hand_written_gradient_matches_torch(name):
    make_ours, make_torch = OPTIMIZERS[name]
    model = softmax_regression(features=5, classes=4)
    batches = classification_batches(features=5, classes=4, count=6)
    assert_same_history(ours(model, make_ours(), batches), torch_reference(model, make_torch, batches))


def test_global_norm_clipping_matches_torch_clip_grad_norm():
    model = mlp(sizes=(6, 16, 4))
    batches = classification_batches(features=6, classes=4, count=4)
    expected = torch_reference(
        model, lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.5), batches, max_grad_norm=0.05
    )
    actual = ours(model, SGD(0.5, momentum=0.5, max_grad_norm=0.05), batches, gradient_builder=None)
    assert_same_history(actual, expected)


def test_warmup_matches_torch_adamw_with_a_linear_warmup_schedule():
    """warmup_steps=3: the rate is lr/3, 2lr/3, then lr, as torch's LambdaLR(min(1, (i + 1) / 3))."""
    model = mlp(sizes=(6, 16, 4))
    batches = classification_batches(features=6, classes=4, count=5)
    expected = torch_reference(
        model, lambda p: torch.optim.AdamW(p, lr=0.05), batches, factor=lambda i: min(1.0, (i + 1) / 3)
    )
    actual = ours(model, AdamW(0.05, warmup_steps=3), batches, gradient_builder=None)
    assert_same_history(actual, expected)
    assert (
        AdamW(0.05, warmup_steps=3).config()["warmup_steps"] == 3
        and "warmup_steps" not in AdamW(0.05).config()
    )


def test_fixed_loss_scale_changes_nothing_in_float32():
    """Scaling the seed and unscaling by a power of two is exact in float32."""
    model = softmax_regression()
    batches = classification_batches(count=3)
    unscaled = ours(model, Adam(0.05), batches, loss_scale=1.0)
    scaled = ours(model, Adam(0.05), batches, loss_scale=2.0**20)
    for (_, a), (_, b) in zip(unscaled, scaled):
        for name in a:
            np.testing.assert_array_equal(a[name], b[name])
