"""The float16 step graph: low-precision forward/backward, float32 loss/scale/optimizer region,
checked on ONNX Runtime and on onnx.reference (which keeps float16 tensors float16, like a GPU)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto
from onnx.reference import ReferenceEvaluator

import amp_rewrite
from amp_rewrite.training import Adam, Trainer
from amp_rewrite.training.step_graph import precision_options
from helpers import assert_close, init, make_model, node, random_feeds, run_ort, tensor, weights
from training_models import classification_batches, softmax_regression, softmax_regression_gradient


def make_trainer(precision="float16", **kwargs):
    return Trainer(
        softmax_regression(),
        optimizer=Adam(0.05),
        precision=precision,
        provider="cpu",
        gradient_builder=softmax_regression_gradient,
        **kwargs,
    )


def float16_tensors(model: onnx.ModelProto) -> set[str]:
    inferred = onnx.shape_inference.infer_shapes(model)
    return {v.name for v in inferred.graph.value_info if v.type.tensor_type.elem_type == TensorProto.FLOAT16}


def reference_step(trainer, batch, state=None):
    """One step of the trainer's step graph under onnx.reference, from `state` (default: current)."""
    feeds = dict(state or trainer.state())
    feeds.update(batch)
    feeds["opt/lr"] = np.array(trainer.lr, np.float32)
    names = [o.name for o in trainer.step_graph.model.graph.output]
    return dict(zip(names, ReferenceEvaluator(trainer.step_graph.model).run(None, feeds)))


def test_float16_step_graph_computes_matmuls_in_float16_and_keeps_the_training_region_float32():
    model = make_trainer().step_graph.model
    low = float16_tensors(model)
    assert {"logits", "W_grad"} <= low
    assert not any(name.startswith(("loss/", "opt/")) or name == "scale/loss_scale" for name in low)
    assert all(i.type.tensor_type.elem_type != TensorProto.FLOAT16 for i in model.graph.input)
    assert all(o.type.tensor_type.elem_type != TensorProto.FLOAT16 for o in model.graph.output)


def test_float16_steps_track_float32_steps_on_ort_and_on_the_reference_evaluator():
    batches = classification_batches(count=4)
    mixed, full = make_trainer(), make_trainer("float32")
    for batch in batches:
        expected = reference_step(mixed, batch)
        result, reference = mixed.step(batch), full.step(batch)
        assert not result.skipped and not expected["scale/skipped"]
        assert result.loss == pytest.approx(reference.loss, rel=1e-2, abs=1e-3)
        assert result.loss == pytest.approx(float(expected[mixed.step_graph.loss_output]), rel=1e-2, abs=1e-3)
        for name, array in full.weights().items():
            np.testing.assert_allclose(mixed.weights()[name], array, rtol=1e-2, atol=1e-2)
            np.testing.assert_allclose(mixed.weights()[name], expected[f"{name}/next"], rtol=1e-2, atol=1e-2)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy reports the float16 overflow we provoke
def test_float16_gradient_overflow_is_caught_in_graph_and_leaves_state_bit_identical():
    """At scale 2^24 the float16 logits gradient overflows (65504 max): the step must be skipped."""
    trainer = make_trainer()
    state = trainer.state()
    state["scale/loss_scale"] = np.array(2.0**24, np.float32)
    out = reference_step(trainer, classification_batches(count=1)[0], state)
    assert bool(out["scale/skipped"]) and float(out["scale/loss_scale/next"]) == 2.0**23
    for name in trainer.step_graph.weights:
        assert out[f"{name}/next"].tobytes() == state[name].tobytes()
    state["scale/loss_scale"] = np.array(2.0**10, np.float32)
    out = reference_step(trainer, classification_batches(count=1)[0], state)
    assert not bool(out["scale/skipped"])


def test_training_keeps_layernorm_and_softmax_float32_in_float16_only():
    """op_lists/training_float16.yaml: the inference evidence for float16 LayerNormalization and
    Softmax does not cover their backward, so a float16 step keeps them float32; bfloat16 has no
    training file and keeps its own lists."""
    lists = precision_options("float16").lists()
    for op in ("LayerNormalization", "Softmax"):
        entry = lists.classify("", op)
        assert entry.list == "deny" and "training step" in entry.reason
    assert precision_options("bfloat16").lists().classify("", "LayerNormalization").list == "infer"
    model = _ln_softmax_model()
    inference = amp_rewrite.rewrite(model, target="float16")
    training = amp_rewrite.rewrite(model, precision_options("float16"))
    assert inference.report.node("ln")["precision"] == "float16"
    kept = training.report.node("ln")
    assert kept["precision"] == "float32" and kept["list"] == "deny"
    feeds = random_feeds(model, seed=4)
    for result in (inference, training):
        assert_close(run_ort(result.model, feeds), run_ort(model, feeds), rtol=1e-2, atol=1e-3)


def _ln_softmax_model():
    rng = np.random.default_rng(2)
    return make_model(
        [
            node("MatMul", ["x", "W0"], ["h"], "mm0"),
            node("LayerNormalization", ["h", "g", "b"], ["n"], "ln", axis=-1),
            node("MatMul", ["n", "W1"], ["s"], "mm1"),
            node("Softmax", ["s"], ["p"], "sm", axis=-1),
            node("MatMul", ["p", "W2"], ["y"], "mm2"),
        ],
        [tensor("x", [2, 8])],
        [tensor("y", [2, 8])],
        [
            init("W0", weights(rng, 8, 8)),
            init("g", np.ones(8, np.float32)),
            init("b", np.zeros(8, np.float32)),
            init("W1", weights(rng, 8, 8)),
            init("W2", weights(rng, 8, 8)),
        ],
    )


def test_a_float16_step_passes_the_gradient_through_max_of_a_float32_tensor():
    """MatMul (float16) -> LeakyRelu -> Max with a constant -> MatMul: the first weight's float16
    step follows its float32 step. Max's gradient compared its input with the float16 result
    (rounded from a float32 input), matched nothing and zeroed it (openwakeword's embedding)."""
    from amp_rewrite.training import SGD

    rng = np.random.default_rng(0)
    nodes = [
        node("MatMul", ["x", "W1"], ["h"], name="mm1"),
        node("LeakyRelu", ["h"], ["l"], name="act"),
        node("Max", ["l", "c"], ["m"], name="pick"),
        node("MatMul", ["m", "W2"], ["y"], name="mm2"),
    ]
    params = [
        init("W1", (rng.standard_normal((8, 16)) * 0.5).astype(np.float32)),
        init("W2", (rng.standard_normal((16, 4)) * 0.5).astype(np.float32)),
        init("c", np.array(-0.3, np.float32)),
    ]
    model = make_model(nodes, [tensor("x", [32, 8])], [tensor("y", [32, 4])], params, opset=17)
    batch = {
        "x": rng.standard_normal((32, 8)).astype(np.float32),
        "targets": rng.standard_normal((32, 4)).astype(np.float32),
    }
    moved = {}
    for precision in ("float32", "float16"):
        trainer = Trainer(
            model, loss="mse", optimizer=SGD(1.0), precision=precision, provider="cpu", verbose=False
        )
        before = trainer.weights()["W1"].astype(np.float64)
        assert not trainer.step(batch).skipped
        moved[precision] = (trainer.weights()["W1"] - before).ravel()
    full, low = moved["float32"], moved["float16"]
    assert np.linalg.norm(low) > 0.9 * np.linalg.norm(full)
    assert full @ low / (np.linalg.norm(full) * np.linalg.norm(low)) > 0.99
