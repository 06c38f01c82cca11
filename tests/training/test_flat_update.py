"""The update over flat buffers (flat_update.py, CUDA's one-session step) against the per-tensor
update in its If: the same state, bit for bit, step after step, a skipped step included; its node
count does not grow with the number of weights; no If, so no host sync."""

from __future__ import annotations

import numpy as np
import pytest

from amp_rewrite.training import Adam, AdamW, DynamicLossScale, FixedLossScale, build_step_graph
from amp_rewrite.training.runner import SessionRunner
from amp_rewrite.training.step_graph import apply_precision
from amp_rewrite.training.step_placement import UPDATE_PREFIXES, place, update_memory
from training_models import OPTIMIZERS, classification_batches, mlp

SIZES = (16, 24, 12, 3)


def _batches():
    batches = classification_batches(features=SIZES[0], classes=SIZES[-1], count=6)
    batches[3] = {**batches[3], "x": np.full_like(batches[3]["x"], np.inf)}  # a step that is skipped
    return batches


def _runner(optimizer, loss_scale, flat, precision="float32", trainable=None):
    step = build_step_graph(mlp(SIZES), "cross_entropy", optimizer, loss_scale, trainable, flat_update=flat)
    step = apply_precision(step, precision)
    return step, SessionRunner(step, step.initial_state, optimizer.lr, "cpu", precision, threads=1)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("loss_scale", [DynamicLossScale(2.0**8, growth_interval=2), FixedLossScale(1.0)])
def test_the_flat_update_is_the_per_tensor_update(name, loss_scale):
    optimizer = OPTIMIZERS[name]()
    flat_step, flat = _runner(optimizer, loss_scale, flat=True)
    _, per_tensor = _runner(optimizer, loss_scale, flat=False)
    assert flat_step.flat and not [n for n in flat_step.model.graph.node if n.op_type == "If"]
    # a clip's sum of squares is one sum over all gradients, not a sum of per-tensor sums
    exact = optimizer.max_grad_norm is None
    skipped_steps = []
    for batch in _batches():
        (loss, skipped), (expected_loss, expected_skipped) = flat.run(batch), per_tensor.run(batch)
        assert skipped == expected_skipped
        skipped_steps.append(skipped)
        np.testing.assert_array_equal(loss, expected_loss)  # NaN on the skipped step
        for state in per_tensor.state.values:
            got, expected = flat.state.read(state), per_tensor.state.read(state)
            assert got.shape == expected.shape and got.dtype == expected.dtype, state
            if exact:
                np.testing.assert_array_equal(got, expected, err_msg=state)
            else:
                np.testing.assert_allclose(got, expected, rtol=2e-6, atol=1e-7, err_msg=state)
    assert skipped_steps == [False, False, False, True, False, False]


def test_one_weight_is_a_row_of_the_flat_buffer():
    flat_step, flat = _runner(Adam(0.01), DynamicLossScale(2.0**8), flat=True, trainable=["w1"])
    _, per_tensor = _runner(Adam(0.01), DynamicLossScale(2.0**8), flat=False, trainable=["w1"])
    assert flat_step.weights == ("w1",)
    assert not [n for n in flat_step.model.graph.node if n.op_type == "If"]
    # the rows (weight, exp_avg, exp_avg_sq, gradient) in, the scaled rows out; the state back
    splits = [len(n.output) for n in flat_step.model.graph.node if n.op_type == "Split"]
    assert splits == [4, 3]
    for batch in _batches():
        assert flat.run(batch)[1] == per_tensor.run(batch)[1]
        for state in per_tensor.state.values:
            assert flat.state.read(state).tobytes() == per_tensor.state.read(state).tobytes(), state


def test_a_skipped_step_keeps_every_state_bit_for_bit():
    _, flat = _runner(AdamW(0.01), DynamicLossScale(2.0**8), flat=True)
    batches = _batches()
    flat.run(batches[0])
    before = {name: flat.state.read(name) for name in flat.state.values}
    assert flat.run(batches[3])[1]  # skipped
    for name, value in before.items():
        after = flat.state.read(name)
        if name == "scale/loss_scale":
            assert after == value / 2  # backed off
        elif name == "scale/good_steps":
            assert after == 0 < value  # the run of finite steps starts again
        else:
            assert after.tobytes() == value.tobytes(), name


def _update_nodes(sizes):
    step = build_step_graph(mlp(sizes), "cross_entropy", AdamW(1e-3), DynamicLossScale(), flat_update=True)
    step = apply_precision(step, "float16", "cuda")
    by_prefix = [n for n in step.model.graph.node if n.name.startswith(UPDATE_PREFIXES)]
    return place(step.model), by_prefix, len(step.weights)


def test_the_update_has_as_many_kernels_for_two_weights_as_for_twelve():
    small, small_nodes, small_weights = _update_nodes((8, 5, 3))
    big, big_nodes, big_weights = _update_nodes((8, 7, 6, 5, 4, 5, 3))
    assert (small_weights, big_weights) == (4, 12)
    # one Concat of every row (weights, exp_avg, exp_avg_sq, gradients), one Mul of each row by its
    # step scalar (the unscale, AdamW's decay, the moments' betas), one Split of the rows; the
    # finite check; AdamW's 10 other ops; a Concat of the next rows, one of the old, a Where and a
    # Split back; one Concat and one Cast of the float16 gradients
    assert small.update_nodes == big.update_nodes == 20
    # what grows with the weights is one Reshape per tensor and kind (an alias: no kernel)
    ops = {n.op_type for n in big_nodes}
    grown = [op for op in ops if _count(big_nodes, op) != _count(small_nodes, op)]
    assert grown == ["Reshape"]
    assert not big.host_syncs and not big.no_kernel


def _count(nodes, op_type):
    return sum(n.op_type == op_type for n in nodes)


def test_low_gradients_are_concatenated_low_and_cast_once(monkeypatch):
    """The CUDA float16 step: the Gemm weights' gradients are float16, the biases' float32. Grouped,
    the low ones come first in every flat buffer and reach float32 through one Cast, not one each;
    the state is the ungrouped step's, bit for bit (run here on ONNX Runtime's CPU provider with its
    graph optimisations off: they would drop the ungrouped step's float16 rounding of a gradient
    between two Casts, which the CUDA provider keeps)."""
    from amp_rewrite.training import flat_update, step_graph

    def cuda_step():
        step = build_step_graph(
            mlp(SIZES), "cross_entropy", AdamW(0.01), DynamicLossScale(), flat_update=True
        )
        return apply_precision(step, "float16", "cuda")

    grouped = cuda_step()
    with monkeypatch.context() as patch:
        patch.setattr(step_graph, "group_low_gradients", lambda model: model)
        plain = cuda_step()

    def casts_into_the_update(model):
        update = [
            n
            for n in model.graph.node
            if n.name.startswith("scale/") or n.output[0] == flat_update.FLAT_STATE
        ]
        return [
            n.name
            for n in model.graph.node
            if n.op_type == "Cast" and any(n.output[0] in r.input for r in update)
        ]

    assert len(casts_into_the_update(plain.model)) == 3  # w0, w1, w2
    assert casts_into_the_update(grouped.model) == ["scale/Cast"]
    concat = next(n for n in grouped.model.graph.node if n.output[0] == flat_update.FLAT_STATE)
    # the weights', exp_avg's and exp_avg_sq's rows (6 tensors each), then the gradients' row: the
    # low gradients' one Cast, then the biases'
    assert len(concat.input) == 3 * 6 + 1 + 3
    states = {id(step): dict(step.initial_state) for step in (grouped, plain)}
    for batch in _batches():
        outputs = {id(step): _run_unoptimised(step, states[id(step)], batch) for step in (grouped, plain)}
        mine, theirs = outputs[id(grouped)], outputs[id(plain)]
        assert mine["scale/skipped"] == theirs["scale/skipped"]
        for state in plain.next_state:
            assert mine[state].tobytes() == theirs[state].tobytes(), state
        assert len(grouped.next_state) == len(plain.next_state) == 3 * 6 + 3


def _run_unoptimised(step, state: dict, batch: dict) -> dict:
    """One step with ONNX Runtime's graph optimisations off; `state` takes the next values.
    Returns them by state name, with the skip flag."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        step.model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    feeds = {**state, "opt/lr": np.array(0.01, np.float32), **batch}
    names = ["scale/skipped", *step.next_state.values()]
    values = dict(zip(names, session.run(names, {i.name: feeds[i.name] for i in session.get_inputs()})))
    state.update({name: values[out] for name, out in step.next_state.items()})
    return {"scale/skipped": values["scale/skipped"], **{name: state[name] for name in step.next_state}}


def _count(nodes, op_type):
    return sum(n.op_type == op_type for n in nodes)


def test_a_step_over_named_dims_has_no_nonzero_and_no_host_sync():
    """y = x @ W + s * v, x [N, 4], s [M, 3] (M is 1 or N, known only at run time): the gradient
    reaching s * v is summed over the rows without a NonZero, and the CUDA step waits for no host."""
    from helpers import init, make_model, node, tensor

    rng = np.random.default_rng(0)
    model = make_model(
        [
            node("MatMul", ["x", "W"], ["h"]),
            node("Mul", ["s", "v"], ["sv"]),
            node("Add", ["h", "sv"], ["y"]),
        ],
        [tensor("x", ["N", 4]), tensor("s", ["M", 3])],
        [tensor("y", ["N", 3])],
        [init("W", rng.standard_normal((4, 3)).astype(np.float32)), init("v", np.ones(3, np.float32))],
    )
    step = build_step_graph(model, "mse", AdamW(1e-3), DynamicLossScale(), flat_update=True)
    step = apply_precision(step, "float16", "cuda")
    assert not [n for n in step.model.graph.node if n.op_type in ("NonZero", "If")]
    assert place(step.model).host_syncs == {}


def test_the_update_holds_nine_weights_worth_at_most():
    """AdamW's rows: the first buffer and its scaled copy are freed before the chain; at the gate the
    old rows, the next and the kept (three weights' worth each) are live: 9, not the 12 of keeping
    the first Concat for the Where."""
    step = build_step_graph(mlp(SIZES), "cross_entropy", AdamW(1e-3), DynamicLossScale(), flat_update=True)
    peak, weights = update_memory(step.model, list(step.weights))
    assert weights == 4 * sum(step.initial_state[w].size for w in step.weights)
    assert peak == 9 * weights


def test_a_skipped_step_keeps_a_negative_zero_weight():
    """The gate is a Where on the old values themselves: -0.0 stays -0.0 (w - 0 * x would not, for
    x < 0), and so do the slots, on a step skipped first thing."""
    step = build_step_graph(
        mlp(SIZES), "cross_entropy", AdamW(0.01), DynamicLossScale(2.0**8), flat_update=True
    )
    state = {name: np.array(value) for name, value in step.initial_state.items()}
    state["w0"].flat[:3] = (-0.0, np.float32(-1e-30), -0.0)
    runner = SessionRunner(step, state, 0.01, "cpu", "float32", threads=1)
    before = {name: runner.state.read(name).tobytes() for name in step.weights}
    assert runner.run(_batches()[3])[1]  # skipped
    assert {name: runner.state.read(name).tobytes() for name in step.weights} == before
