"""If / Loop / Scan bodies, sequences and model-local functions.

Decision under test: a Loop's or Scan's carried value (initial value -> body input -> body
output -> result) takes one colour, coloured with the body and the outer graph together as TF
colours its while loops (a clear op per carried value); If outputs and scan inputs/outputs keep
their declared types; every cast lands in the graph that uses it. Model-local functions are
inlined first.
Every test runs the original and the rewritten model in ONNX Runtime and compares the numbers.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from amp_rewrite import rewrite
from helpers import (
    assert_close,
    check_both,
    init,
    make_model,
    node,
    random_feeds,
    run_ort,
    run_reference,
    tensor,
    weights,
)

FLOAT, F16, BOOL, INT64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BOOL, TensorProto.INT64


def _ops(graph, op_type):
    return [n for n in graph.node if n.op_type == op_type]


def _elem(graph, name):
    for value in (*graph.input, *graph.output, *graph.value_info):
        if value.name == name:
            return value.type.tensor_type.elem_type
    return None


def _check_both(model, result, feeds, rtol=2e-2, atol=2e-2):
    onnx.checker.check_model(result.model, full_check=True)
    assert_close(run_ort(result.model, feeds), run_ort(model, feeds), rtol=rtol, atol=atol)


def _cast_targets(graph):
    return {n.input[0]: n.attribute[0].i for n in graph.node if n.op_type == "Cast"}


def test_loop_with_float_carried_state_and_matmul_inside():
    rng = np.random.default_rng(0)
    body = helper.make_graph(
        [
            node("MatMul", ["h_in", "W"], ["mm"], name="body_mm"),
            node("Tanh", ["mm"], ["h_out"], name="body_tanh"),
            node("Identity", ["cond_in"], ["cond_out"], name="body_cond"),
            node("Identity", ["h_out"], ["scan_out"], name="body_scan"),
        ],
        "body",
        [tensor("i", [], INT64), tensor("cond_in", [], BOOL), tensor("h_in", [2, 4])],
        [tensor("cond_out", [], BOOL), tensor("h_out", [2, 4]), tensor("scan_out", [2, 4])],
    )
    model = make_model(
        [
            node("MatMul", ["x", "W0"], ["h0"], name="pre"),
            node("Loop", ["trip", "go", "h0"], ["h", "hs"], name="loop", body=body),
        ],
        [tensor("x", [2, 4]), tensor("trip", [], INT64)],
        [tensor("h", [2, 4]), tensor("hs", [None, 2, 4])],
        [init("W0", weights(rng, 4, 4)), init("W", weights(rng, 4, 4)), init("go", np.array(True))],
    )
    for placement in ("tf", "cost"):
        result = rewrite(model, target="float16", placement=placement)
        g = result.model.graph
        inner = _ops(g, "Loop")[0].attribute[0].g
        # The MatMul and Tanh inside the body are float16, and so is the carried state on all four
        # ends (h0 as the Loop reads it, h_in, h_out, h): the body casts nothing it carries.
        assert result.report.node("body_mm")["precision"] == "float16"
        groups = result.report.node("loop")["groups"]
        assert groups["V[0]"]["precision"] == "float16", placement
        assert _elem(inner, inner.input[2].name) == F16 and _elem(inner, inner.output[1].name) == F16
        assert "h_in" not in _cast_targets(inner) and not any(
            n.op_type == "Cast" and n.output[0] == inner.output[1].name for n in inner.node
        )
        # the scan output keeps its declared float32 (a Cast inside the body), W is read as float16
        assert _elem(inner, inner.output[2].name) == FLOAT
        assert any(t.name.startswith("W") and t.data_type == F16 for t in g.initializer)
        feeds = {"x": weights(rng, 2, 4), "trip": np.array(3, np.int64)}
        _check_both(model, result, feeds)
        assert_close(run_reference(result.model, feeds), run_reference(model, feeds), rtol=2e-2, atol=2e-2)


@pytest.mark.even_if_worse
def test_scan_state_takes_one_colour_and_scan_inputs_keep_their_types():
    """The Scan's state (s0 -> s_in -> s_out -> s) is one colour with the Add that makes it; the
    scanned input and output keep their declared float32 (regression: the Scan's group once went
    float16 while its body kept float32, "Inferred elem type differs ... (10) vs (1)")."""
    rng = np.random.default_rng(0)
    body = helper.make_graph(
        [
            node("Add", ["s_in", "x_t"], ["s_out"], name="acc"),
            node("Identity", ["s_out"], ["y_t"], name="copy"),
        ],
        "body",
        [tensor("s_in", [2]), tensor("x_t", [2])],
        [tensor("s_out", [2]), tensor("y_t", [2])],
    )
    model = make_model(
        [node("Scan", ["s0", "xs"], ["s", "ys"], name="scan", num_scan_inputs=1, body=body)],
        [tensor("s0", [2]), tensor("xs", [3, 2])],
        [tensor("s", [2]), tensor("ys", [3, 2])],
        opset=11,
    )
    result = rewrite(model, target="float16", allow=["Add", "Scan", "Identity"])
    assert result.report.node("acc")["precision"] == "float16"
    groups = result.report.node("scan")["groups"]
    assert groups["V[0]"]["precision"] == "float16"
    assert all(
        "boundary" in g["reason"] and g["precision"] == "float32" for k, g in groups.items() if k != "V[0]"
    )
    body = _ops(result.model.graph, "Scan")[0].attribute[0].g
    assert _elem(body, body.input[0].name) == F16 and _elem(body, body.input[1].name) == FLOAT
    feeds = {"s0": weights(rng, 2), "xs": weights(rng, 3, 2)}
    _check_both(model, result, feeds)
    assert_close(run_reference(result.model, feeds), run_reference(model, feeds), rtol=2e-2, atol=2e-2)


def test_if_branches_with_outer_scope_capture():
    rng = np.random.default_rng(0)

    def branch(name, op):
        return helper.make_graph(
            [
                node("MatMul", ["x", "W"], [f"{name}_mm"], name=f"{name}_mm"),
                node(op, [f"{name}_mm"], [f"{name}_out"], name=f"{name}_act"),
            ],
            name,
            [],
            [tensor(f"{name}_out", [2, 3])],
        )

    model = make_model(
        [
            node("ReduceSum", ["x"], ["total"], name="total", keepdims=0),
            node("Greater", ["total", "zero"], ["c"], name="cond"),
            node(
                "If",
                ["c"],
                ["y"],
                name="if",
                then_branch=branch("then", "Relu"),
                else_branch=branch("else", "Sigmoid"),
            ),
        ],
        [tensor("x", [2, 4])],
        [tensor("y", [2, 3])],
        [init("W", weights(rng, 4, 3)), init("zero", np.array(0.0, np.float32))],
    )
    from amp_rewrite import io as model_io

    flat = make_model([node("Relu", ["x"], ["y"], name="relu")], [tensor("x", [2])], [tensor("y", [2])])
    assert (
        model_io.load(model).nested and not model_io.load(flat).nested
    )  # read_scopes walks only when nested
    result = rewrite(model, target="float16")
    g = result.model.graph
    if_node = _ops(g, "If")[0]
    for attr in if_node.attribute:
        # x is captured from the outer scope and cast inside each branch that reads it.
        assert _cast_targets(attr.g).get("x") == F16, attr.name
        assert not any(n.op_type == "Cast" and n.input[0] == "x" for n in g.node)
    assert result.report.node("then_mm")["precision"] == "float16"
    for seed in range(3):
        feeds = random_feeds(model, seed=seed)
        _check_both(model, result, feeds)


@pytest.mark.even_if_worse
def test_nested_if_in_loop():
    rng = np.random.default_rng(0)
    inner_then = helper.make_graph(
        [node("MatMul", ["h_in", "W"], ["t_out"], name="t_mm")], "t", [], [tensor("t_out", [2, 2])]
    )
    inner_else = helper.make_graph(
        [node("Neg", ["h_in"], ["e_out"], name="e_neg")], "e", [], [tensor("e_out", [2, 2])]
    )
    body = helper.make_graph(
        [
            node("Identity", ["cond_in"], ["cond_out"], name="c"),
            node("If", ["flag"], ["h_out"], name="inner_if", then_branch=inner_then, else_branch=inner_else),
        ],
        "body",
        [tensor("i", [], INT64), tensor("cond_in", [], BOOL), tensor("h_in", [2, 2])],
        [tensor("cond_out", [], BOOL), tensor("h_out", [2, 2])],
    )
    model = make_model(
        [node("Loop", ["trip", "", "x"], ["y"], name="loop", body=body)],
        [tensor("x", [2, 2]), tensor("trip", [], INT64), tensor("flag", [], BOOL)],
        [tensor("y", [2, 2])],
        [init("W", weights(rng, 2, 2))],
    )
    result = rewrite(model, target="float16")
    assert result.report.node("t_mm")["precision"] == "float16"
    then = _ops(_ops(result.model.graph, "Loop")[0].attribute[0].g, "If")[0].attribute
    then_graph = next(a.g for a in then if a.name == "then_branch")
    # h_in belongs to the Loop body and is cast in the then-branch that uses it, not in the body.
    assert _cast_targets(then_graph).get("h_in") == F16
    for flag in (True, False):
        feeds = {"x": weights(rng, 2, 2), "trip": np.array(2, np.int64), "flag": np.array(flag)}
        _check_both(model, result, feeds)


@pytest.mark.even_if_worse
def test_sequence_ops_keep_their_tensor_types():
    """Regression: SplitToSequence / SequenceInsert tie their tensor input to the sequence's
    element type beyond the type parameters; making the tensor float16 gave an invalid model."""
    rng = np.random.default_rng(0)
    model = make_model(
        [
            node("MatMul", ["x", "W"], ["h"], name="mm"),
            node("SplitToSequence", ["h"], ["seq"], name="split", axis=0),
            node("SequenceInsert", ["seq", "h"], ["seq2"], name="insert"),
            node("ConcatFromSequence", ["seq2"], ["y"], name="concat", axis=0),
        ],
        [tensor("x", [2, 3])],
        [tensor("y", [None, 3])],
        [init("W", weights(rng, 3, 3))],
        opset=17,
    )
    result = rewrite(
        model, target="float16", allow=["SplitToSequence", "SequenceInsert", "ConcatFromSequence"]
    )
    assert result.report.node("mm")["precision"] == "float16"
    assert result.report.node("split")["precision"] == "float32"
    _check_both(model, result, {"x": weights(rng, 2, 3)})


def _sequence_model(rng, split=False, exp=False):
    """MatMul -> [SequenceEmpty + 2 SequenceInsert | SplitToSequence] -> SequenceAt + ConcatFromSequence
    -> Add -> MatMul; `exp`: the second insert reads Exp(h) (a deny op) instead of h."""
    start = (
        [
            node("Concat", ["h", "h"], ["hh"], name="twice", axis=0),
            node("SplitToSequence", ["hh", "halves"], ["seq"], name="split", axis=0),
        ]
        if split
        else [
            node("SequenceEmpty", [], ["empty"], name="empty", dtype=FLOAT),
            node("SequenceInsert", ["empty", "h"], ["seq"], name="insert0"),
        ]
    )
    second = [node("Exp", ["h"], ["e"], name="exp")] if exp else []
    model = make_model(
        [
            node("MatMul", ["x", "W"], ["h"], name="mm"),
            *start,
            *second,
            node("SequenceInsert", ["seq", "e" if exp else "h"], ["seq2"], name="insert"),
            node("Identity", ["seq2"], ["seq3"], name="same"),  # Identity's V is a tensor or a sequence
            node("SequenceAt", ["seq3", "zero"], ["at"], name="at"),
            node("ConcatFromSequence", ["seq3"], ["y0"], name="concat", axis=0, new_axis=1),
            node("Add", ["y0", "at"], ["y1"], name="add"),
            node("MatMul", ["y1", "W"], ["y"], name="mm2"),
        ],
        [tensor("x", [2, 3])],
        [tensor("y", [None, 2, 3])],
        [
            init("W", weights(rng, 3, 3)),
            init("zero", np.array(0, np.int64)),
            init("halves", np.array([2, 2], np.int64)),
        ],
        opset=17,
    )
    return onnx.shape_inference.infer_shapes(model)  # sequence value_infos, retyped with their tensors


@pytest.mark.parametrize("placement", ["tf", "cost"])
def test_sequence_ops_are_clear_ops_of_their_element_type(placement):
    """Sequence ops are clear (as TF's TensorList ops): the sequence and the tensors an op ties to
    its elements are one group, coloured like a tensor: between two MatMuls, all float16, and
    no Cast on a sequence (none can convert one)."""
    rng = np.random.default_rng(0)
    model = _sequence_model(rng)
    result = rewrite(model, target="float16", placement=placement)
    for name in ("empty", "insert0", "insert", "same", "at", "concat", "add"):
        assert result.report.node(name)["precision"] == "float16", name
    assert [n.op_type for n in result.model.graph.node].count("Cast") == 2  # the model's input and output
    seq = next(v for v in result.model.graph.value_info if v.name == "seq2")
    assert seq.type.sequence_type.elem_type.tensor_type.elem_type == F16
    check_both(model, result.model, {"x": weights(rng, 2, 3)})


def test_the_tie_rule_decides_a_sequence_and_its_reason_says_so():
    """SplitToSequence has no float16 CUDA kernel: the sequence ties every op that reads it to
    its float32, and their reasons say the tie decided (not a schema: the schema allows it);
    with provider 'any' the same ops are float16. A deny op tied in makes the cluster deny."""
    rng = np.random.default_rng(1)
    model = _sequence_model(rng, split=True)
    result = rewrite(model, target="float16")
    assert result.report.node("split")["groups"]["T+S"]["reason"].endswith(
        "no float16 kernel on CUDA at opset 17"
    )
    for name in ("insert", "same", "at", "concat"):
        entry = result.report.node(name)
        assert entry["precision"] == "float32" and entry["step"] == "tied", name
        assert "tied by a sequence to SplitToSequence 'split', which stays float32" in entry["because"]
        assert "does not allow" not in entry["because"]
    check_both(model, result.model, {"x": weights(rng, 2, 3)})
    anywhere = rewrite(model, target="float16", provider="any")
    assert all(anywhere.report.node(n)["precision"] == "float16" for n in ("split", "insert", "at", "concat"))
    check_both(model, anywhere.model, {"x": weights(rng, 2, 3)})
    denied = _sequence_model(rng, exp=True)
    for placement in ("tf", "cost"):
        result = rewrite(denied, target="float16", placement=placement)
        assert result.report.node("insert")["precision"] == "float32"
        assert result.report.node("insert0")["step"] == "tied", placement
        assert "tied by a sequence to a float32 op" in result.report.node("insert0")["because"]
        check_both(denied, result.model, {"x": weights(rng, 2, 3)})


def test_model_local_function_is_inlined_and_coloured():
    rng = np.random.default_rng(0)
    function = helper.make_function(
        "local",
        "Block",
        ["a", "w"],
        ["b"],
        [helper.make_node("MatMul", ["a", "w"], ["m"]), helper.make_node("Relu", ["m"], ["b"])],
        [helper.make_opsetid("", 18)],
    )
    graph = helper.make_graph(
        [
            helper.make_node("Block", ["x", "W"], ["h"], domain="local", name="block1"),
            helper.make_node("Block", ["h", "W"], ["y"], domain="local", name="block2"),
        ],
        "g",
        [tensor("x", [2, 4])],
        [tensor("y", [2, 4])],
        [init("W", weights(rng, 4, 4))],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("local", 1)],
        functions=[function],
        ir_version=8,
    )
    onnx.checker.check_model(model, full_check=True)
    result = rewrite(model, target="float16")
    g = result.model.graph
    assert not result.model.functions
    matmuls = _ops(g, "MatMul")
    assert len(matmuls) == 2
    assert result.report.summary["allow_ops_low"] == 2
    _check_both(model, result, {"x": weights(rng, 2, 4)})
    np.testing.assert_allclose(
        run_reference(result.model, {"x": np.ones((2, 4), np.float32)})[0],
        run_ort(model, {"x": np.ones((2, 4), np.float32)})[0],
        rtol=2e-2,
        atol=2e-2,
    )
