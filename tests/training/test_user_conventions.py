"""What a new user brings (issue 26): torch's cross-entropy conventions (ignore_index=-100, label
smoothing) checked against torch.nn.functional.cross_entropy; bad labels, bad feeds and a provider
without the precision's kernels each one TrainingError line or warning; parameter discovery on
nodes with absent optional inputs, quantized and Constant-node weights."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from onnx import TensorProto, helper

from amp_rewrite.errors import TrainingError
from amp_rewrite.training import SGD, Trainer, parameters
from amp_rewrite.training.feeds import run_failure
from amp_rewrite.training.losses import CrossEntropy
from helpers import init, make_model, node, tensor
from training_models import softmax_regression

FEATURES, CLASSES, BATCH = 4, 3, 8


def trainer(loss="cross_entropy", model=None, **kwargs):
    kwargs = {"optimizer": SGD(0.1), "precision": "float32", "provider": "cpu", "verbose": False} | kwargs
    return Trainer(model or softmax_regression(FEATURES, CLASSES), loss=loss, **kwargs)


def batch(labels):
    rng = np.random.default_rng(0)
    return {
        "x": rng.standard_normal((len(labels), FEATURES)).astype(np.float32),
        "labels": np.array(labels, np.int64),
    }


def torch_loss(model_trainer, feeds, **options):
    torch = pytest.importorskip("torch", reason="the reference is torch's cross_entropy")
    w = model_trainer.weights()
    logits = feeds["x"] @ w["W"] + w["b"]
    return float(
        torch.nn.functional.cross_entropy(torch.tensor(logits), torch.tensor(feeds["labels"]), **options)
    )


@pytest.mark.parametrize(
    "labels, options",
    [
        ([0, 1, 2, -100, -100, 1, -100, -100], {}),  # half ignored: the mean is over the counted four
        ([0, 1, 2, 2, 0, 1, 1, 0], {"label_smoothing": 0.1}),
        ([0, -100, 2, 2, -100, 1, 1, 0], {"label_smoothing": 0.2}),
        ([0, 7, 2, 2, 7, 1, 1, 0], {"ignore_index": 7}),
    ],
    ids=["ignore-100", "smoothing", "ignore-and-smoothing", "own-ignore-index"],
)
def test_cross_entropy_matches_torch(labels, options):
    t = trainer(CrossEntropy(**options) if options else "cross_entropy")
    feeds = batch(labels)
    expected = torch_loss(t, feeds, **options)
    assert t.step(feeds).loss == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.2}], ids=["plain", "smoothing"])
def test_cross_entropy_gradient_through_a_batched_matmul_matches_torch(options):
    """The cross-entropy's gradient (softmax x dY, the labels' part scattered into it: no one-hot,
    `autodiff.scatter_sums`) through a [batch, seq, hidden] x [hidden, classes] MatMul (one product
    over every row: `rules.linalg`) equals torch's autograd: one SGD(lr=1) step gives W - dW."""
    torch = pytest.importorskip("torch", reason="the reference is torch's autograd")
    rng = np.random.default_rng(3)
    w = rng.normal(0, 0.5, (FEATURES, 5)).astype(np.float32)
    model = make_model(
        [node("MatMul", ["x", "W"], ["logits"])],
        [tensor("x", ["N", 3, FEATURES])],
        [tensor("logits", ["N", 3, 5])],
        [init("W", w)],
    )
    feeds = {
        "x": rng.standard_normal((2, 3, FEATURES)).astype(np.float32),
        "labels": np.array([[0, 4, -100], [2, 2, 1]], np.int64),
    }
    t = trainer(CrossEntropy(**options), model=model, optimizer=SGD(1.0))
    graph = t.step_graph.model.graph
    assert not any(n.op_type in ("OneHot", "ConstantOfShape") for n in graph.node)
    t.step(feeds)
    weight = torch.tensor(w, requires_grad=True)
    logits = torch.tensor(feeds["x"]) @ weight
    torch.nn.functional.cross_entropy(
        logits.reshape(-1, 5), torch.tensor(feeds["labels"]).reshape(-1), **options
    ).backward()
    np.testing.assert_allclose(w - t.weights()["W"], weight.grad.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "labels, message",
    [
        (
            [0, 1, 3, 2, 5, 1, 0, 0],
            r"^labels: 2 of this batch's labels are outside \[0, 3\) \(values 3, 5\); the ignore index is -100$",
        ),
        ([0, -1, 2, 2, 0, 1, 1, 0], r"outside \[0, 3\) \(values -1\)"),
        ([-100] * 8, r"^labels: every label of this batch is the ignore index -100: nothing to learn from"),
    ],
    ids=["too-large", "negative", "all-ignored"],
)
def test_bad_labels_are_refused_before_the_step_in_one_line(labels, message):
    t = trainer()
    before = t.weights()
    with pytest.raises(TrainingError, match=message) as error:
        t.step(batch(labels))
    assert "\n" not in str(error.value)
    assert t.step_count == 0 and all(np.array_equal(v, t.weights()[k]) for k, v in before.items())


def test_loss_options_are_checked():
    with pytest.raises(TrainingError, match="label_smoothing must be in"):
        CrossEntropy(label_smoothing=1.5)


def fixed_batch_model():
    """x [8, 4] fixed, ids int64 [N] (an embedding beside it): both kinds of feed."""
    rng = np.random.default_rng(0)
    nodes = [
        node("Gather", ["table", "ids"], ["rows"], name="embed"),
        node("Gemm", ["x", "W"], ["h"], name="fc"),
        node("Add", ["h", "rows"], ["logits"], name="add"),
    ]
    inits = [
        init("table", rng.standard_normal((5, CLASSES)).astype(np.float32)),
        init("W", rng.standard_normal((FEATURES, CLASSES)).astype(np.float32)),
    ]
    return make_model(
        nodes,
        [tensor("x", [BATCH, FEATURES]), tensor("ids", [BATCH], TensorProto.INT64)],
        [tensor("logits", [BATCH, CLASSES])],
        inits,
    )


def good_feeds():
    feeds = batch([0, 1, 2, 0, 1, 2, 0, 1])
    return feeds | {"ids": np.arange(BATCH, dtype=np.int64) % 5}


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda f: f | {"x": np.zeros((16, FEATURES), np.float32)},
            r"^feed 'x': got float32\[16, 4\], needs float32\[8, 4\] \(dim 0 is fixed at 8\)$",
        ),
        (lambda f: f | {"x": np.zeros((BATCH, FEATURES + 1), np.float32)}, r"dim 1 is fixed at 4"),
        (lambda f: f | {"x": np.zeros((BATCH, 2, 2), np.float32)}, r"needs float32\[8, 4\] \(rank 2\)"),
        (
            lambda f: f | {"ids": np.zeros(BATCH, np.float32)},
            r"^feed 'ids': got float32\[8\], needs int64\[8\] \(integer values\)$",
        ),
        (
            lambda f: f | {"labels": f["labels"].astype(np.float64)},
            r"feed 'labels': got float64\[8\], needs int64",
        ),
        (
            lambda f: {k: v for k, v in f.items() if k != "ids"},
            r"^missing feed 'ids' \(the step needs: x, ids, labels\)$",
        ),
        (
            lambda f: f | {"mask": np.ones(BATCH)},
            r"^feed 'mask' is not an input of the step \(it needs: x, ids, labels\)$",
        ),
    ],
    ids=["batch", "width", "rank", "type", "label-type", "missing", "unknown"],
)
def test_bad_feeds_are_one_training_error_line_before_the_step(change, message):
    t = trainer(model=fixed_batch_model())
    assert np.isfinite(t.step(good_feeds()).loss)
    with pytest.raises(TrainingError, match=message) as error:
        t.step(change(good_feeds()))
    assert "\n" not in str(error.value)


def test_a_symbolic_dim_must_agree_across_feeds():
    """labels' batch dim follows the logits' 'N', which x fixes."""
    feeds = batch([0, 1, 2, 0, 1, 2, 0, 1])
    feeds["labels"] = feeds["labels"][:4]
    with pytest.raises(
        TrainingError, match=r"^feed 'labels': dim 0 \('N'\) is 4, but feed 'x' gave 'N' = 8$"
    ):
        trainer().step(feeds)


def test_onnx_runtime_failures_become_one_line_with_advice():
    error = RuntimeError(
        "[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : Could not find an implementation for Gemm(13) "
        "node with name 'fc'\nmore"
    )
    text = str(run_failure(error, "bfloat16"))
    assert "\n" not in text and "[ONNXRuntimeError]" not in text
    assert text.endswith("use precision='float16', or a CUDA machine")


def test_bfloat16_on_cpu_says_it_runs_float32_and_names_the_fix(caplog, capsys):
    with caplog.at_level(logging.WARNING, logger="amp_rewrite.training"):
        t = trainer(precision="bfloat16", verbose=True)
    assert "0 of" in capsys.readouterr().err
    warnings = [r.getMessage() for r in caplog.records if "bfloat16" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert (
        "runs no node in bfloat16 on cpu" in warnings[0]
        and "precision='float16', or a CUDA machine" in warnings[0]
    )
    assert np.isfinite(t.step(batch([0, 1, 2, 0, 1, 2, 0, 1])).loss)


def test_float16_on_cpu_counts_its_float16_nodes(capsys):
    trainer(precision="float16", verbose=True)
    line = next(
        line for line in capsys.readouterr().err.splitlines() if "step-graph nodes run in float16" in line
    )
    assert int(line.split(": ")[1].split()[0]) > 0


# --- parameter discovery ----------------------------------------------------------------------


def test_absent_and_empty_optional_inputs_never_crash_discovery():
    """Conv without bias, Gemm without C, LayerNorm without bias, a Conv whose bias is named ""."""
    rng = np.random.default_rng(0)
    w = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    nodes = [
        node("Conv", ["x", "k1"], ["c1"], name="conv_no_bias"),
        node("Conv", ["c1", "k2", ""], ["c2"], name="conv_empty_bias"),
        node("Flatten", ["c2"], ["flat"], name="flat"),
        node("Gemm", ["flat", "fc"], ["h"], name="gemm_no_c"),
        node("LayerNormalization", ["h", "scale"], ["y"], name="ln_no_bias", axis=-1),
    ]
    model = make_model(
        nodes,
        [tensor("x", ["N", 1, 4, 4])],
        [tensor("y", ["N", 3])],
        [init("k1", w(2, 1, 3, 3)), init("k2", w(2, 2, 1, 1)), init("fc", w(8, 3)), init("scale", w(3))],
    )
    found = parameters.find(model.graph)
    assert set(found.names) == {"k1", "k2", "fc", "scale"} and not found.left_out


def test_quantized_weights_are_left_out_in_one_line_and_constant_weights_found():
    """A DequantizeLinear int8 weight (through a Transpose) and a ConvInteger weight are named as
    left out; a Constant-node weight reached through Reshape is a parameter."""
    rng = np.random.default_rng(0)
    nodes = [
        node("DequantizeLinear", ["wq", "s", "z"], ["wd"], name="dq"),
        node("Transpose", ["wd"], ["wt"], name="t", perm=[1, 0]),
        node("MatMul", ["x", "wt"], ["h"], name="mm"),
        node("Constant", [], ["c"], name="const", value=_tensor(rng.standard_normal(12).astype(np.float32))),
        node("Reshape", ["c", "shape"], ["cw"], name="reshape"),
        node("MatMul", ["h", "cw"], ["y"], name="mm2"),
    ]
    inits = [
        init("wq", rng.integers(-5, 5, (4, 4)).astype(np.int8)),
        init("s", np.array(0.1, np.float32)),
        init("z", np.array(0, np.int8)),
        init("shape", np.array([4, 3], np.int64)),
    ]
    model = make_model(nodes, [tensor("x", ["N", 4])], [tensor("y", ["N", 3])], inits)
    found = parameters.find(model.graph)
    assert found.names == ("c",)
    assert found.left_out == (
        "left out 1 quantized weights (wq): integer weights cannot be trained; "
        "fine-tune the float model and quantize after"
    )


def _tensor(array):
    from onnx import numpy_helper

    return numpy_helper.from_array(array)


def test_batch_norm_running_statistics_are_never_parameters():
    """Inference-mode BatchNormalization: scale and bias train, the running mean and variance are
    statistics (torch's buffers, not parameters) and stay constants."""
    rng = np.random.default_rng(0)

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    nodes = [
        node("Conv", ["x", "k"], ["c"], name="conv"),
        node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["y"], name="bn"),
    ]
    model = make_model(
        nodes,
        [tensor("x", ["N", 1, 4, 4])],
        [tensor("y", ["N", 2, 2, 2])],
        [
            init("k", w(2, 1, 3, 3)),
            init("gamma", w(2)),
            init("beta", w(2)),
            init("mean", w(2)),
            init("var", np.abs(w(2))),
        ],
    )
    found = parameters.find(model.graph)
    assert set(found.names) == {"k", "gamma", "beta"} and set(found.frozen) == {"mean", "var"}


def test_mse_targets_follow_the_computed_output_shape_not_a_wrong_declaration():
    """ddddocr declares its output [1, seqlen] and computes [T, 1, C]: the targets feed is held to
    what the graph computes (shape inference), and a feed of the declared shape is refused."""
    rng = np.random.default_rng(0)
    shape_nodes = [
        node("Shape", ["x"], ["x_shape"], name="shape"),
        node("Slice", ["x_shape", "zero", "one"], ["n"], name="slice"),
        node("Concat", ["n", "two_three"], ["new_shape"], name="concat", axis=0),
    ]
    nodes = [
        node("MatMul", ["x", "W"], ["h"], name="mm"),
        *shape_nodes,
        node("Reshape", ["h", "new_shape"], ["r"], name="reshape"),
        node("Transpose", ["r"], ["y"], name="transpose", perm=[1, 0, 2]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [tensor("x", ["N", 4])],
        [tensor("y", [1, "seqlen"])],
        [
            init("W", rng.standard_normal((4, 6)).astype(np.float32)),
            init("zero", np.array([0])),
            init("one", np.array([1])),
            init("two_three", np.array([2, 3])),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)  # as exported
    t = trainer(loss="mse", model=model)
    x = rng.standard_normal((5, 4)).astype(np.float32)
    targets = rng.standard_normal((2, 5, 3)).astype(np.float32)
    losses = [t.step({"x": x, "targets": targets}).loss for _ in range(3)]
    assert losses[-1] < losses[0]
    with pytest.raises(
        TrainingError, match=r"^feed 'targets': got float32\[1, 30\], needs float32\[2, N, 3\] \(rank 3\)$"
    ):
        t.step({"x": x, "targets": np.zeros((1, 30), np.float32)})
