"""The CPU step's update run by numpy over blocks (host_update.py) against the one-graph step run
by ONNX Runtime: the same state step after step, skipped steps included; bit for bit where this
machine's powf rounds Adam's beta^t as ONNX Runtime's Pow does (probed), else within TOLERANCE,
the promise host_update.py states (another powf an ulp apart moves 1 - beta2^t by ~5e-5)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from amp_rewrite.training import (
    SGD,
    AdamW,
    DynamicLossScale,
    FixedLossScale,
    build_step_graph,
    host_update,
)
from amp_rewrite.training.runner import SessionRunner
from amp_rewrite.training.split_runner import SplitRunner
from amp_rewrite.training.step_graph import apply_precision
from training_models import OPTIMIZERS, classification_batches, mlp

SIZES = (16, 96, 3)
TOLERANCE = 1e-4  # relative, on the state after six steps: what an ulp in beta^t costs (measured 5e-5)  # w0 has 1536 elements: two blocks of the patched 1000, w1 one; biases whole


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Blocks made small here, so that a weight spans two."""
    monkeypatch.setattr(host_update, "BIG", 100)
    monkeypatch.setattr(host_update, "BLOCK", 1000)


def _batches():
    batches = classification_batches(features=SIZES[0], classes=SIZES[-1], count=6)
    batches[3] = {**batches[3], "x": np.full_like(batches[3]["x"], np.inf)}  # a step that is skipped
    return batches


def _runners(optimizer, precision, loss_scale, **split_options):
    step = build_step_graph(mlp(SIZES), "cross_entropy", optimizer, loss_scale)
    step = apply_precision(step, precision)
    state = step.initial_state
    one_graph = SessionRunner(step, state, optimizer.lr, "cpu", precision, threads=1)
    split = SplitRunner(step, state, optimizer.lr, "cpu", precision, threads=1, **split_options)
    return one_graph, split


@functools.cache
def _power_is_onnx_runtimes() -> bool:
    """Whether the host's small Pow equals ONNX Runtime's on Adam's 98 values of beta^t here."""
    from helpers import session

    betas = np.repeat(np.array([0.9, 0.999], np.float32), 49)
    steps = np.tile(np.arange(1, 50, dtype=np.float32), 2)
    expected = session(_pow_graph([98])).run(None, {"beta": betas, "t": steps})[0]
    return host_update._power(betas, steps).tobytes() == expected.tobytes()


def _assert_same_steps(one_graph, split, exact=True):
    exact = exact and _power_is_onnx_runtimes()
    for batch in _batches():
        (loss, skipped), (expected_loss, expected_skipped) = split.run(batch), one_graph.run(batch)
        assert skipped == expected_skipped
        np.testing.assert_allclose(loss, expected_loss, rtol=0 if exact else 1e-5)  # NaN on the skipped step
        for name in one_graph.state.values:
            got, expected = split.state.read(name), one_graph.state.read(name)
            if exact:
                assert got.tobytes() == expected.tobytes(), name
            else:
                np.testing.assert_allclose(got, expected, rtol=TOLERANCE, atol=1e-7, err_msg=name)


@pytest.mark.parametrize(
    "precision, loss_scale", [("float32", FixedLossScale(1.0)), ("float16", DynamicLossScale())]
)
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_the_host_update_is_the_one_graph_step_bit_for_bit(optimizer, precision, loss_scale):
    one_graph, split = _runners(OPTIMIZERS[optimizer](), precision, loss_scale)
    assert split.host_update is not None
    assert sorted(split.host_update.blocked_sizes()) == [288, 1536]  # w1, w0 (in blocks); biases whole
    # a global-norm clip's sum of squares is added in another order: float32 rounding apart
    _assert_same_steps(one_graph, split, exact=optimizer != "adamw-clip")
    assert split.state.read("opt/step") == 5  # six steps, one skipped


class TanhSGD(SGD):
    """An optimizer of a user's own, written with an op the host update has no kernel for."""

    def emit_update(self, e, weight, grad, slots, lr, step):
        delta = e.op("Mul", [e.op("Tanh", [grad], "squashed"), lr], "delta")
        return e.op("Sub", [weight, delta], "weight"), {}


def test_an_update_the_host_cannot_run_stays_in_onnx_runtime():
    one_graph, split = _runners(TanhSGD(0.1), "float32", FixedLossScale(1.0))
    assert split.host_update is None
    _assert_same_steps(one_graph, split)


def test_the_host_update_can_be_turned_off():
    one_graph, split = _runners(AdamW(0.01), "float32", FixedLossScale(1.0), host_update=False)
    assert split.host_update is None
    _assert_same_steps(one_graph, split)


def test_the_trainer_on_cpu_updates_on_the_host():
    from amp_rewrite.training import Trainer

    trainer = Trainer(mlp(SIZES), optimizer=AdamW(0.01), provider="cpu", verbose=False, threads=1)
    assert isinstance(trainer.engine, SplitRunner) and trainer.engine.host_update is not None


def _update_graph(scale_shape):
    """w/next = w - g * s: `s` one number, or a row that broadcasts over w's columns."""
    from onnx import TensorProto, helper

    tensor = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    graph = helper.make_graph(
        [helper.make_node("Mul", ["g", "s"], ["step"]), helper.make_node("Sub", ["w", "step"], ["w/next"])],
        "update",
        [tensor("w", [40, 30]), tensor("g", [40, 30]), tensor("s", scale_shape)],
        [tensor("w/next", [40, 30])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("scale_shape, blocked", [([], True), ([30], False)])
def test_a_big_op_reads_only_big_tensors_of_its_shape_and_scalars(scale_shape, blocked):
    from helpers import session

    rng = np.random.default_rng(0)
    arrays = {"w": rng.standard_normal((40, 30), np.float32), "g": rng.standard_normal((40, 30), np.float32)}
    arrays["s"] = rng.standard_normal(scale_shape).astype(np.float32)
    expected = session(_update_graph(scale_shape)).run(None, arrays)[0]
    if not blocked:  # a row broadcast over blocks of a flattened w would read the wrong elements
        with pytest.raises(host_update.Unsupported, match="operands of several shapes"):
            host_update.HostUpdate.compile(_update_graph(scale_shape), dict(arrays), {"w": "w/next"})
        return
    update = host_update.HostUpdate.compile(_update_graph(scale_shape), dict(arrays), {"w": "w/next"})
    update.run()
    assert update.blocked_sizes() == [1200]
    assert arrays["w"].tobytes() == expected.tobytes()


def test_the_gradient_graph_writes_the_gradients_without_identity_copies():
    """At a loss scale of 1 the unscaled gradients are Identities of the gradients; into a graph
    output ONNX Runtime would copy each, so the split makes their producers write them."""
    from amp_rewrite.training.split_step import split_step_graph

    step = build_step_graph(mlp(SIZES), "cross_entropy", AdamW(0.01), FixedLossScale(1.0))
    gradient = split_step_graph(step).gradient.graph
    producers = {out: node for node in gradient.node for out in node.output}
    outputs = [o.name for o in gradient.output if o.name.startswith("scale/unscaled/")]
    assert len(outputs) == len(step.weights)
    assert all(producers[name].op_type != "Identity" for name in outputs)
    assert {producers[name].op_type for name in outputs} <= {"Gemm", "ReduceSum"}


@pytest.mark.parametrize("start", [-7, 7])
def test_small_integer_division_truncates_as_onnx_runtime_does(start):
    from onnx import TensorProto, helper

    from helpers import session

    count = lambda name: helper.make_tensor_value_info(name, TensorProto.INT64, [])  # noqa: E731
    graph = helper.make_graph(
        [helper.make_node("Div", ["n", "two"], ["n/next"])],
        "halve",
        [count("n")],
        [count("n/next")],
        [helper.make_tensor("two", TensorProto.INT64, [], [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    arrays = {"n": np.array(start, np.int64)}
    expected = session(model).run(None, dict(arrays))[0]
    host_update.HostUpdate.compile(model, arrays, {"n": "n/next"}).run()
    assert arrays["n"] == expected and arrays["n"].dtype == np.int64


def test_every_tensor_of_two_elements_or_more_runs_in_blocks_by_default(monkeypatch):
    monkeypatch.setattr(host_update, "BIG", 2)  # the default, under this module's small blocks
    one_graph, split = _runners(AdamW(0.01, warmup_steps=3), "float16", DynamicLossScale())
    assert sorted(split.host_update.blocked_sizes()) == [3, 96, 288, 1536]  # b1, b0, w1, w0
    _assert_same_steps(one_graph, split)


def _pow_graph(shape):
    from onnx import TensorProto, helper

    tensor = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    graph = helper.make_graph(
        [helper.make_node("Pow", ["beta", "t"], ["beta_t"])],
        "power",
        [tensor("beta"), tensor("t")],
        [tensor("beta_t")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_beta_to_the_t_is_onnx_runtimes_within_an_ulp():
    """Adam's bias corrections: numpy's SIMD power differs from ONNX Runtime's by an ulp on 11 of
    these 98 values on AVX-512 machines; the host update computes them through C's powf, as ONNX
    Runtime's CPU Pow does (equal where the two share a libm, as here)."""
    from helpers import session

    run = session(_pow_graph([])).run
    for beta in (0.9, 0.999):
        for t in range(1, 50):
            arrays = {
                "beta": np.array(beta, np.float32),
                "t": np.array(t, np.float32),
                "result": np.array(0, np.float32),
            }
            expected = run(None, {"beta": arrays["beta"], "t": arrays["t"]})[0]
            host_update.HostUpdate.compile(_pow_graph([]), arrays, {"result": "beta_t"}).run()
            np.testing.assert_array_max_ulp(arrays["result"], expected, maxulp=1)


def test_with_another_power_the_state_stays_within_the_stated_tolerance(monkeypatch):
    """What another machine's powf may do: numpy's SIMD power, an ulp off on beta^t."""
    monkeypatch.setitem(host_update._LIBM_POWER, np.dtype(np.float32), np.power)
    one_graph, split = _runners(OPTIMIZERS["adamw-warmup"](), "float32", FixedLossScale(1.0))
    _assert_same_steps(one_graph, split, exact=False)


def test_a_big_pow_stays_in_onnx_runtime():
    """Elementwise Pow over a weight has no exact host kernel: the apply session runs it."""
    arrays = {name: np.full(400, 0.5, np.float32) for name in ("beta", "t", "result")}
    with pytest.raises(host_update.Unsupported, match="op Pow"):
        host_update.HostUpdate.compile(_pow_graph([400]), arrays, {"result": "beta_t"})
