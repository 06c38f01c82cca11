"""The step runner: one copy of the state in ONNX Runtime's memory, updated in place by the step."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from amp_rewrite.errors import TrainingError
from amp_rewrite.training import AdamW, Trainer
from amp_rewrite.training.log_sum_exp import log_sum_exp_by_log_softmax
from amp_rewrite.training.runner import check_in_place
from training_models import classification_batches, mlp


def test_the_step_updates_the_one_copy_of_the_state_in_place():
    trainer = Trainer(
        mlp((4, 8, 3)), optimizer=AdamW(0.01), precision="float16", provider="cpu", verbose=False, threads=1
    )
    values = trainer.engine.state.values
    where = {name: value.data_ptr() for name, value in values.items()}
    before = trainer.state()
    batches = classification_batches(count=2)
    assert not any(trainer.step(b).skipped for b in batches)
    assert {name: value.data_ptr() for name, value in values.items()} == where  # the same buffers
    after = trainer.state()
    assert after["opt/step"] == 2 and not np.array_equal(after["w1"], before["w1"])
    assert not np.array_equal(after["opt/w1/exp_avg"], before["opt/w1/exp_avg"])
    assert set(trainer.step_graph.initial_state) == set()  # the trainer keeps no initial copy


def _state_graph(reader_after_writer: bool):
    """w/next = a gated update of w; m/next = m + (w or x): a reader of w the writer does not wait for."""
    nodes = [
        helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
        helper.make_node("IsNaN", ["s"], ["scale/skipped"]),
        helper.make_node("Not", ["scale/skipped"], ["ok"]),
        helper.make_node("Mul", ["w", "s"], ["new"]),
        helper.make_node("Where", ["ok", "new", "w"], ["w/next"]),
    ]
    read = "w" if reader_after_writer else "x"
    nodes.append(helper.make_node("Add", ["m", read], ["m/next"], name="late_reader"))
    value = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [2])  # noqa: E731
    graph = helper.make_graph(
        nodes,
        "g",
        [value("x"), value("w"), value("m")],
        [
            value("w/next"),
            value("m/next"),
            helper.make_tensor_value_info("scale/skipped", TensorProto.BOOL, []),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_in_place_check_refuses_a_reader_that_may_run_after_the_writer():
    state = {"w": "w/next", "m": "m/next"}
    check_in_place(_state_graph(reader_after_writer=False), state)
    with pytest.raises(RuntimeError, match="'late_reader' reads state 'w'"):
        check_in_place(_state_graph(reader_after_writer=True), state)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"threads": -1}, "threads must be a whole number >= 0"),
        ({"threads": 1.5}, "threads must be a whole number >= 0"),
        ({"bucket_mb": 4}, "bucket_mb is a data-parallel option: pass distributed='mpi' too"),
        ({"distributed": "nccl"}, "distributed must be None or 'mpi'"),
        ({"colour": 1}, "unexpected option 'colour'"),
    ],
)
def test_bad_runner_options_are_one_line(options, message):
    with pytest.raises(TrainingError, match=message):
        Trainer(mlp((4, 8, 3)), optimizer=AdamW(0.01), provider="cpu", verbose=False, **options)


@pytest.mark.parametrize("opset, keepdims", [(13, 1), (13, 0), (18, 1), (18, 0)])
def test_log_sum_exp_over_the_last_axis_runs_as_log_softmax_within_float32_rounding(opset, keepdims):
    """ONNX Runtime's ReduceLogSumExp kernel is scalar; the session runs x[..., :1] - LogSoftmax(x)[..., :1]
    under the same output name, the gradient's Exp(x - lse) as Softmax(x), and leaves a reduction over
    another axis alone."""
    axes = {"axes": [-1]} if opset < 18 else {}
    inputs = ["x"] if opset < 18 else ["x", "last"]
    nodes = [
        helper.make_node("ReduceLogSumExp", inputs, ["lse"], name="loss/lse", keepdims=keepdims, **axes),
        helper.make_node("ReduceLogSumExp", ["x", "first"] if opset >= 18 else ["x"], ["other"], keepdims=0,
                         **({} if opset >= 18 else {"axes": [0]})),
        helper.make_node("Sub", ["x", "lse" if keepdims else "x"], ["d"], name="grad/Sub"),
        helper.make_node("Exp", ["d"], ["p"], name="grad/Exp"),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes,
        "lse",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, 1000])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("lse", "other", "p")],
        [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("last", [-1]), ("first", [0]))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    fast = log_sum_exp_by_log_softmax(model)
    ops = [n.op_type for n in fast.graph.node]
    assert ops.count("ReduceLogSumExp") == 1 and "LogSoftmax" in ops  # the axis-0 one stays
    assert ops.count("Softmax") == keepdims and ops.count("Exp") == 1 - keepdims
    assert [n.op_type for n in model.graph.node][:2] == ["ReduceLogSumExp"] * 2  # the input is not changed
    x = {"x": (np.random.default_rng(0).standard_normal((6, 1000)) * 4).astype(np.float32)}

    def run(m):
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, x)

    (lse, other, p), (expected, expected_other, expected_p) = run(fast), run(model)
    assert lse.shape == expected.shape == ((6, 1) if keepdims else (6,))
    np.testing.assert_allclose(lse, expected, rtol=2e-6)
    np.testing.assert_array_equal(other, expected_other)
    np.testing.assert_allclose(p, expected_p, rtol=1e-4, atol=1e-9)
    plain = mlp((4, 8, 3))
    assert log_sum_exp_by_log_softmax(plain) is plain  # nothing to change: no copy
