"""Trainer API: checkpoints, export, fit, feeds and configuration errors."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest

from amp_rewrite.errors import TrainingError
from amp_rewrite.training import SGD, Adam, AdamW, Trainer
from helpers import run_ort
from training_models import classification_batches, mlp, softmax_regression, softmax_regression_gradient


def make_trainer(optimizer=None, model=None, **kwargs):
    options = {
        "precision": "float32",
        "provider": "cpu",
        "gradient_builder": softmax_regression_gradient,
        "loss_scale": "dynamic",
        **kwargs,
    }  # the scaler is on (float32's default is none)
    return Trainer(model or softmax_regression(), optimizer=optimizer or Adam(0.05), **options)


@pytest.mark.parametrize(
    "make_optimizer, precision",
    [
        (lambda: SGD(0.2, momentum=0.9), "float32"),
        (lambda: AdamW(0.05), "float32"),
        (lambda: Adam(0.05), "float16"),
    ],
    ids=["sgd", "adamw", "adam-float16"],
)
def test_checkpoint_then_continue_is_bit_identical_to_not_stopping(tmp_path, make_optimizer, precision):
    batches = classification_batches(count=6)
    batches[2] = dict(batches[2], x=np.full_like(batches[2]["x"], np.inf))  # a skip inside the first half
    straight = make_trainer(make_optimizer(), precision=precision)
    straight_results = [straight.step(b) for b in batches[:3]]
    straight.lr = 0.04
    straight_results += [straight.step(b) for b in batches[3:]]

    first = make_trainer(make_optimizer(), precision=precision)
    results = [first.step(b) for b in batches[:3]]
    first.lr = 0.04  # the learning rate is saved too
    first.save(tmp_path / "ckpt.npz")
    resumed = make_trainer(make_optimizer(), precision=precision)
    resumed.load(tmp_path / "ckpt.npz")
    results += [resumed.step(b) for b in batches[3:]]

    assert [repr(r) for r in results] == [repr(r) for r in straight_results]  # repr: nan == nan
    for name, array in straight.state().items():
        assert resumed.state()[name].tobytes() == array.tobytes(), name
    assert os.listdir(tmp_path) == ["ckpt.npz"]  # no temporary file left behind


def test_loading_a_checkpoint_of_another_optimizer_is_a_clear_error(tmp_path):
    make_trainer(SGD(0.1)).save(tmp_path / "sgd.npz")
    with pytest.raises(TrainingError, match="optimizer"):
        make_trainer(Adam(0.1)).load(tmp_path / "sgd.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a checkpoint")
    with pytest.raises(TrainingError, match="cannot read checkpoint"):
        make_trainer(SGD(0.1)).load(tmp_path / "junk.npz")


def test_export_writes_the_trained_float32_inference_model(tmp_path):
    trainer = make_trainer()
    batches = classification_batches(count=4)
    trainer.fit(batches, epochs=2, progress=False)
    trainer.export(tmp_path / "trained.onnx")
    exported = onnx.load(tmp_path / "trained.onnx")
    onnx.checker.check_model(exported)
    x = batches[0]["x"]
    weights = trainer.weights()
    (logits,) = run_ort(exported, {"x": x})
    np.testing.assert_allclose(logits, x @ weights["W"] + weights["b"], rtol=1e-5, atol=1e-6)
    assert exported.ir_version == softmax_regression().ir_version
    assert exported.opset_import == softmax_regression().opset_import


def test_fit_lowers_the_loss_and_reports_progress(capsys):
    trainer = make_trainer(Adam(0.1))
    losses = trainer.fit(classification_batches(count=4, batch=32), epochs=5, progress=True)
    assert losses[-1] < losses[0]
    progress = capsys.readouterr().err
    assert "epoch 5/5" in progress and "scale 32768" in progress and "4/4" in progress


def test_fit_over_a_one_shot_iterator_for_several_epochs_is_a_clear_error():
    with pytest.raises(TrainingError, match="one-shot"):
        make_trainer().fit(iter(classification_batches(count=2)), epochs=2, progress=False)


def test_learning_rate_changes_between_steps_without_rebuilding():
    batch = classification_batches(count=1)[0]
    frozen = make_trainer(SGD(0.5))
    frozen.lr = 0.0
    before = frozen.weights()
    frozen.step(batch)
    assert all(np.array_equal(before[k], v) for k, v in frozen.weights().items())
    assert frozen.step_count == 1


def model_with_labels_input():
    model = softmax_regression()
    model.graph.input.append(onnx.helper.make_tensor_value_info("labels", onnx.TensorProto.INT64, ["N"]))
    return model


class GradScalerLike:
    """Stands in for an optimizer that already scales its loss (torch GradScaler / Keras LossScaleOptimizer)."""

    def get_scale(self):
        return 65536.0


@pytest.mark.parametrize(
    "configure, message",
    [
        (lambda: make_trainer(GradScalerLike()), "already does loss scaling"),
        (lambda: make_trainer(object()), "amp_rewrite.training optimizer"),
        (lambda: make_trainer(precision="float8"), "precision"),
        (lambda: make_trainer(provider="tpu"), "provider"),
        (lambda: make_trainer(loss="nll"), "neither a built-in"),
        (lambda: make_trainer(model=model_with_labels_input()), "already has an input named 'labels'"),
        (lambda: SGD(0.1, nesterov=True), "nesterov"),
        (lambda: Adam(-1.0), "lr"),
        (lambda: Trainer("/nonexistent/model.onnx", optimizer=SGD(0.1)), "cannot load model"),
    ],
    ids=[
        "loss-scaled-optimizer",
        "foreign-optimizer",
        "precision",
        "provider",
        "loss",
        "labels-clash",
        "nesterov",
        "negative-lr",
        "missing-model",
    ],
)
def test_bad_configurations_are_one_line_training_errors(configure, message):
    with pytest.raises(TrainingError, match=message) as error:
        configure()
    assert "\n" not in str(error.value)


def test_missing_feed_names_what_the_step_needs():
    with pytest.raises(TrainingError, match="missing feed 'labels'"):
        make_trainer().step({"x": np.zeros((2, 4), np.float32)})


def test_step_graph_keeps_ir_version_and_pins_training_nodes_under_prefixes():
    trainer = make_trainer()
    model = trainer.step_graph.model
    assert model.ir_version == softmax_regression().ir_version
    own = [n for n in model.graph.node if not n.name.startswith(("grad/", "fc"))]
    assert own and all(n.name.startswith(("loss/", "scale/", "opt/")) for n in own)
    assert {o.name for o in model.graph.output} >= {"scale/skipped", "W/next", "scale/loss_scale/next"}


def test_opset_13_and_18_step_graphs_train_identically_and_keep_their_opset():
    """Reduce ops take axes as attributes or inputs depending on the opset; both paths must agree."""
    runs = {}
    for opset in (13, 18):
        trainer = Trainer(
            mlp(sizes=(6, 8, 3), opset=opset), optimizer=Adam(0.01), precision="float32", provider="cpu"
        )
        runs[opset] = [trainer.step(b).loss for b in classification_batches(features=6, count=3)]
        assert [o.version for o in trainer.step_graph.model.opset_import if o.domain == ""] == [opset]
    np.testing.assert_allclose(runs[13], runs[18], rtol=1e-6)


def test_without_an_optimizer_the_trainer_uses_adamw_at_a_fine_tuning_rate():
    """The signature shows the default; each trainer gets its own copy."""
    import inspect

    default = inspect.signature(Trainer.__init__).parameters["optimizer"].default
    assert isinstance(default, AdamW) and default.lr == 1e-4 and default.weight_decay == 0.01
    assert default.warmup_steps == 10  # Adam's first steps overshoot a fine-tune without it (tests/corpus.py)
    trainer = Trainer(softmax_regression(), precision="float32", provider="cpu", verbose=False)
    assert isinstance(trainer.optimizer, AdamW) and trainer.optimizer.lr == 1e-4
    assert trainer.optimizer is not default
