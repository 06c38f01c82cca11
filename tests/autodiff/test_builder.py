"""The builder's contract: outputs and names, wrt defaults, stop-gradients, unconnected sources,
aggregation, seeding, clear errors, opsets, dynamic batch, linear scaling and the AMP rewrite."""

from __future__ import annotations

import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import amp_rewrite
from amp_rewrite.autodiff import build_gradient_graph, covered_ops, register_gradient
from amp_rewrite.errors import GradientError
from helpers import init, make_model, node, run_ort, tensor

W = np.random.default_rng(0).standard_normal((3, 2)).astype(np.float32)  # a constant: drawn once, at import


def linear_model(opset=17, extra_nodes=(), extra_inits=()):
    """loss = mean(relu(x @ W + b)^2) with a dynamic batch; `unused` is a float initializer off the path."""
    nodes = [
        node("MatMul", ["x", "W"], ["h0"]),
        node("Add", ["h0", "b"], ["h1"]),
        node("Relu", ["h1"], ["h"]),
        node("Mul", ["h", "h"], ["sq"]),
        node("ReduceMean", ["sq"], ["loss"], keepdims=0),
        *extra_nodes,
    ]
    inits = [
        init("W", W),
        init("b", np.array([0.1, -0.2], np.float32)),
        init("unused", np.ones(2, np.float32)),
        init("shape", np.array([2], np.int64)),
        *extra_inits,
    ]
    return make_model(nodes, [tensor("x", ["N", 3])], [tensor("loss", [])], inits, opset=opset)


def feeds(batch=4, seed=1):
    return {"x": np.random.default_rng(seed).standard_normal((batch, 3)).astype(np.float32)}


def outputs(model, values):
    return dict(zip([o.name for o in model.graph.output], run_ort(model, values)))


def numpy_grads(x, b=np.array([0.1, -0.2], np.float32), relu=True):  # noqa: B008 - read-only
    h1 = x @ W + b
    dh = 2 * np.maximum(h1, 0) / h1.size * (h1 > 0) if relu else 2 * h1 / h1.size
    return {"W": x.T @ dh, "b": dh.sum(0)}


def test_structure_names_opset_and_forward_outputs_are_kept():
    model = linear_model()
    grad = build_gradient_graph(model, "loss")
    onnx.checker.check_model(grad, full_check=True)
    assert grad.ir_version == model.ir_version and grad.opset_import == model.opset_import
    assert [o.name for o in grad.graph.output] == [
        "loss",
        "W_grad",
        "b_grad",
    ]  # default wrt: used float inits
    forward = {n.name for n in model.graph.node}
    assert all(n.name in forward or n.name.startswith("grad/") for n in grad.graph.node)
    assert all(n.domain == "" for n in grad.graph.node)
    assert len(model.graph.output) == 1  # the input model is never modified


@pytest.mark.parametrize("batch", [1, 2, 7])
def test_dynamic_batch_gives_right_gradients(batch):
    grad = build_gradient_graph(linear_model(), "loss")
    values = feeds(batch)
    got = outputs(grad, values)
    for name, expected in numpy_grads(values["x"]).items():
        np.testing.assert_allclose(got[f"{name}_grad"], expected, rtol=1e-5, atol=1e-6)


def test_pairwise_aggregation_matches_sum_and_emits_no_sum():
    model = linear_model()
    summed = build_gradient_graph(model, "loss", aggregation="sum")
    pairwise = build_gradient_graph(model, "loss", aggregation="pairwise")
    assert "Sum" in {n.op_type for n in summed.graph.node}  # h feeds Mul twice
    assert "Sum" not in {n.op_type for n in pairwise.graph.node}
    values = feeds()
    a, b = outputs(summed, values), outputs(pairwise, values)
    for name in ("W_grad", "b_grad"):
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6)


def test_grad_output_seeds_the_backward_as_a_graph_input():
    grad = build_gradient_graph(linear_model(), "loss", grad_output="loss_scale")
    assert "loss_scale" in [i.name for i in grad.graph.input]
    values = feeds()
    plain = outputs(build_gradient_graph(linear_model(), "loss"), values)
    scaled = outputs(grad, {**values, "loss_scale": np.array(1024.0, np.float32)})
    np.testing.assert_allclose(scaled["W_grad"], 1024 * plain["W_grad"], rtol=1e-6)


def test_unconnected_sources_none_or_zeros():
    model = linear_model()
    dropped = build_gradient_graph(model, "loss", ["W", "unused"])
    assert [o.name for o in dropped.graph.output] == ["loss", "W_grad"]
    zeros = build_gradient_graph(model, "loss", ["W", "unused"], unconnected="zeros")
    got = outputs(zeros, feeds())
    np.testing.assert_array_equal(got["unused_grad"], np.zeros(2, np.float32))


def test_stop_gradient_blocks_one_path():
    """loss = sum(h * stop(h)) with h = x*w: only one factor carries a gradient, so it halves."""
    nodes = [
        node("Mul", ["x", "w"], ["h"]),
        node("Identity", ["h"], ["h_const"]),
        node("Mul", ["h", "h_const"], ["sq"]),
        node("ReduceSum", ["sq"], ["loss"], keepdims=0),
    ]
    model = make_model(
        nodes, [tensor("x", ["N", 2])], [tensor("loss", [])], [init("w", np.array([0.5, -2.0], np.float32))]
    )
    values = {"x": np.random.default_rng(2).standard_normal((3, 2)).astype(np.float32)}
    full = outputs(build_gradient_graph(model, "loss"), values)["w_grad"]
    half = outputs(build_gradient_graph(model, "loss", stop_gradients=["h_const"]), values)["w_grad"]
    np.testing.assert_allclose(half, full / 2, rtol=1e-6)
    # stopping every path leaves w unconnected
    stopped = build_gradient_graph(model, "loss", ["w"], stop_gradients=["h"], unconnected="zeros")
    np.testing.assert_array_equal(outputs(stopped, values)["w_grad"], 0)


def test_gradient_wrt_graph_input_and_intermediate():
    grad = build_gradient_graph(linear_model(), "loss", ["x", "h1"])
    values = feeds()
    got = outputs(grad, values)
    h1 = values["x"] @ W + np.array([0.1, -0.2], np.float32)
    dh1 = 2 * np.maximum(h1, 0) / h1.size * (h1 > 0)
    np.testing.assert_allclose(got["h1_grad"], dh1, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got["x_grad"], dh1 @ W.T, rtol=1e-5, atol=1e-7)


def test_loss_as_its_own_source_and_non_scalar_loss_seeded_with_ones():
    got = outputs(build_gradient_graph(linear_model(), "loss", ["loss"]), feeds())
    assert got["loss_grad"] == 1.0
    grad = build_gradient_graph(linear_model(), "h", ["b"])  # d sum(h) / db
    values = feeds()
    h1 = values["x"] @ W + np.array([0.1, -0.2], np.float32)
    np.testing.assert_allclose(outputs(grad, values)["b_grad"], (h1 > 0).sum(0), rtol=1e-6)


def test_missing_rule_is_one_clear_error():
    model = linear_model()
    model.graph.node[2].op_type = "Shrink"  # no rule for Shrink
    with pytest.raises(
        GradientError, match=r"no gradient rule for op Shrink \(node 'Relu_h'\).*stop_gradients"
    ):
        build_gradient_graph(model, "loss")
    # stopping the gradient before the op makes the graph buildable
    build_gradient_graph(model, "loss", ["W"], stop_gradients=["h1"], unconnected="zeros")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(loss="nope"), "loss tensor 'nope' is not in the graph"),
        (dict(loss="shape"), "not a floating-point tensor"),
        (dict(loss="loss", wrt=["shape"]), "wrt tensor 'shape' is not a floating-point tensor"),
        (dict(loss="loss", wrt=["zz"]), "wrt tensor 'zz' is not in the graph"),
        (dict(loss="loss", aggregation="tree"), "aggregation must be one of"),
        (dict(loss="loss", unconnected="skip"), "unconnected must be one of"),
    ],
)
def test_bad_arguments_raise_gradient_error(kwargs, message):
    with pytest.raises(GradientError, match=message):
        build_gradient_graph(linear_model(), **kwargs)


def test_opset_13_uses_attribute_forms_and_runs():
    grad = build_gradient_graph(linear_model(opset=13), "loss")
    onnx.checker.check_model(grad, full_check=True)
    values = feeds()
    np.testing.assert_allclose(
        outputs(grad, values)["W_grad"], numpy_grads(values["x"])["W"], rtol=1e-5, atol=1e-6
    )


def test_scatter_rules_explain_the_opset_they_need():
    emb = init("E", np.random.default_rng(2).standard_normal((5, 2)).astype(np.float32))
    nodes = [node("GatherElements", ["E", "ids"], ["e"]), node("ReduceSum", ["e"], ["loss"], keepdims=0)]
    model = make_model(
        nodes, [tensor("ids", ["N", 2], TensorProto.INT64)], [tensor("loss", [])], [emb], opset=13
    )
    with pytest.raises(GradientError, match="GatherElements node 'GatherElements_e'.*opset 16"):
        build_gradient_graph(model, "loss")


def test_old_opsets_are_refused_clearly():
    model = linear_model(opset=17)
    model.opset_import[0].version = 12
    with pytest.raises(GradientError, match="opset 13 or newer"):
        build_gradient_graph(model, "loss")


def test_custom_rule_can_be_registered():
    try:

        @register_gradient("Shrink", differentiable=(0,))
        def shrink_grad(ctx):
            """dY where |x| > lambd (bias 0), else 0."""
            e, x = ctx.emit, ctx.x(0)
            outside = e.op("Greater", [e.op("Abs", [x]), ctx.const(ctx.attr("lambd", 0.5), x)])
            return [e.op("Where", [outside, ctx.dy(), ctx.const(0, x)])]

        assert ("", "Shrink") in covered_ops()
        model = linear_model()
        model.graph.node[2].op_type = "Shrink"
        model.graph.node[2].attribute.append(helper.make_attribute("lambd", 0.0))
        values = feeds()
        got = outputs(build_gradient_graph(model, "loss"), values)
        expected = numpy_grads(values["x"], relu=False)["W"]  # Shrink with lambd=0 is the identity
        np.testing.assert_allclose(got["W_grad"], expected, rtol=1e-5, atol=1e-6)
    finally:
        from amp_rewrite.autodiff.registry import REGISTRY

        REGISTRY.pop(("", "Shrink"), None)


def test_build_time_is_linear_in_graph_size():
    """A residual tanh chain: twice the nodes should take about twice the time, never four times."""

    def chain(length):
        nodes, prev = [], "x"
        for i in range(length):
            nodes += [
                node("Mul", [prev, "W"], [f"m{i}"]),
                node("Tanh", [f"m{i}"], [f"t{i}"]),
                node("Add", [prev, f"t{i}"], [f"r{i}"]),
            ]
            prev = f"r{i}"
        nodes.append(node("ReduceSum", [prev], ["loss"], keepdims=0))
        return make_model(
            nodes, [tensor("x", ["N", 2])], [tensor("loss", [])], [init("W", np.ones(2, np.float32))]
        )

    def seconds(model):
        start = time.perf_counter()
        build_gradient_graph(model, "loss")
        return time.perf_counter() - start

    small, large = chain(300), chain(1200)
    seconds(small)
    assert seconds(large) < 8 * seconds(small) + 0.5


def test_gradient_graph_goes_through_the_amp_rewrite():
    """Forward and backward are coloured together; the float16 gradients stay close to float32."""
    grad = build_gradient_graph(linear_model(), "loss")
    result = amp_rewrite.rewrite(grad, target="float16")
    onnx.checker.check_model(result.model, full_check=True)
    values = feeds()
    fp32, fp16 = outputs(grad, values), outputs(result.model, values)
    for name in ("W_grad", "b_grad"):
        assert fp16[name].dtype == np.float32  # keep_io_types
        np.testing.assert_allclose(fp16[name], fp32[name], rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("training", [True, False])
def test_dropout_gradient_uses_the_forward_mask(training):
    """Random masks defeat finite differences: check dX = R * mask / (1 - ratio) from the same run."""
    r = np.random.default_rng(2).standard_normal((4, 6)).astype(np.float32)
    nodes = [
        node("Dropout", ["x", "ratio", "training"], ["y"], seed=3),
        node("Mul", ["y", "R"], ["yr"]),
        node("ReduceSum", ["yr"], ["loss"], keepdims=0),
    ]
    model = make_model(
        nodes,
        [tensor("x", ["N", 6]), tensor("training", [], TensorProto.BOOL)],
        [tensor("loss", [])],
        [init("ratio", np.array(0.3, np.float32)), init("R", r)],
    )
    grad = build_gradient_graph(model, "loss", ["x"])
    grad.graph.output.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, None))
    x = np.random.default_rng(3).standard_normal((4, 6)).astype(np.float32)
    got = outputs(grad, {"x": x, "training": np.array(training)})
    expected = r * (got["y"] != 0) / 0.7 if training else r
    np.testing.assert_allclose(got["x_grad"], expected, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 5])
def test_a_broadcast_over_unknown_dims_is_summed_without_a_data_dependent_shape(rows):
    """y = a + s * w with a [N, 3] and s [M, 3]: whether M is 1 (s broadcast over a's rows) is known
    only at run time. The gradient reaching s * w is summed over the rows exactly when M is 1, by a
    reshape to (N/M, M) pairs, never by a NonZero (a host sync on CUDA)."""
    nodes = [
        node("Mul", ["s", "w"], ["b"]),
        node("Add", ["a", "b"], ["y"]),
        node("Mul", ["y", "y"], ["sq"]),
        node("ReduceSum", ["sq"], ["loss"], keepdims=0),
    ]
    w = np.array([0.5, -1.0, 2.0], np.float32)
    model = make_model(
        nodes, [tensor("a", ["N", 3]), tensor("s", ["M", 3])], [tensor("loss", [])], [init("w", w)]
    )
    grad = build_gradient_graph(model, "loss")
    assert not [n for n in grad.graph.node if n.op_type == "NonZero"]
    rng = np.random.default_rng(3)
    a = rng.standard_normal((5, 3)).astype(np.float32)
    s = rng.standard_normal((rows, 3)).astype(np.float32)
    got = outputs(grad, {"a": a, "s": s})["w_grad"]
    expected = (2 * (a + s * w) * s).sum(0)  # s broadcast over a's rows when rows == 1
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
