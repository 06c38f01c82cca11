"""The colouring passes on small hand-built graphs, one TensorFlow AMP step at a time.

Each model is built so that one pass decides the vertex under test. The colouring graph is built
and painted as the pipeline does (analysis.graph.build, analysis.paint.colour); the test asserts
the colour and the reason (the step, and the node it came through), then rewrites the model and
checks (with placement="tf", whose passes these are) that the rewritten tensors have the painted types and that ONNX Runtime (and
onnx.reference, which computes float16 in float16) gives the original's numbers.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx
from onnx import TensorProto

import amp_rewrite
from amp_rewrite import ir
from amp_rewrite.analysis import graph, paint
from amp_rewrite.analysis.elemtypes import tensor_types
from amp_rewrite.analysis.oplists import load_op_lists
from amp_rewrite.options import RewriteOptions
from amp_rewrite.plan import FP32, LOW, Step
from helpers import (
    assert_close,
    init,
    make_model,
    node,
    random_feeds,
    run_ort,
    run_reference,
    tensor,
    weights,
)

F16 = TensorProto.FLOAT16


class Painted(NamedTuple):
    colour: str  # LOW or FP32
    step: Step
    via: str | None  # the node it came through
    detail: str | None = None  # for the steps that carry one (NOT_PAINTED, BLOCKED, MEASURED)


def colours(model, target="float16", keep_io_types=True):
    """{node name: Painted} for the first float group of each node; also keyed
    `(node name, type parameter)` for nodes with several groups, and `("out", tensor name)` for
    each output of a group."""
    scopes = ir.read_scopes(model.graph)
    types, shapes = tensor_types(model, scopes=scopes)
    cg = graph.build(model, load_op_lists(target), types=types, shapes=shapes, scopes=scopes)
    plan = paint.colour(cg, low_io=RewriteOptions(keep_io_types=keep_io_types).low_io_names(model.graph))
    found = {}
    for v, vertex in enumerate(cg.vertices):
        name = cg.node(vertex.scope, vertex.node).name
        reason = plan.reason[v]
        via = (
            None
            if reason.via is None
            else cg.node(cg.vertices[reason.via].scope, cg.vertices[reason.via].node).name
        )
        entry = Painted(plan.colour[v], reason.step, via, reason.detail)
        found.setdefault(name, entry)
        found[name, vertex.group.type_param] = entry
        for slot in vertex.group.outputs:
            found["out", cg.node(vertex.scope, vertex.node).output[slot]] = entry
    return found


def output_types(model) -> dict:
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True).graph
    return {v.name: v.type.tensor_type.elem_type for v in (*inferred.value_info, *inferred.output)}


def check_rewrite(model, painted: dict, target="float16", rtol=2e-2, atol=2e-2, removed=()):
    """Rewrite; every painted tensor inside the graph has its colour's type, but the outputs of the
    Casts named in `removed`, which are gone (converting nothing); numbers match the original."""
    result = amp_rewrite.rewrite(model, target=target, placement="tf")  # the passes under test
    onnx.checker.check_model(result.model, full_check=True)
    types = output_types(result.model)
    low = {"float16": F16, "bfloat16": TensorProto.BFLOAT16}[target]
    outputs = {o.name for o in model.graph.output}  # kept float32 under their names (keep_io_types)
    inner = {key[1]: entry for key, entry in painted.items() if key[0] == "out" and key[1] not in outputs}
    gone = {x for n in model.graph.node if n.name in removed for x in n.output}
    assert {n.name for n in result.model.graph.node}.isdisjoint(removed) and gone.isdisjoint(types)
    inner = {name: entry for name, entry in inner.items() if name not in gone}
    assert inner
    for name, entry in inner.items():
        assert types[name] == (low if entry[0] == LOW else TensorProto.FLOAT), (name, entry)
    feeds = random_feeds(model, seed=4)
    expected = run_ort(model, feeds)
    if target == "float16":
        assert_close(run_ort(result.model, feeds), expected, rtol, atol)
    assert_close(run_reference(result.model, feeds), expected, rtol, atol)
    return result


def deny_spreads_model():
    """x -> Exp (deny) -> Relu (clear) -> Add (infer) -> Tanh (infer) -> MatMul (allow) -> y,
    and Exp -> Neg (clear, leads to no infer/deny op) -> z."""
    rng = np.random.default_rng(0)
    return make_model(
        [
            node("Exp", ["x"], ["e"], "exp"),
            node("Relu", ["e"], ["r"], "relu"),
            node("Add", ["r", "b"], ["a"], "add"),
            node("Tanh", ["a"], ["t"], "tanh"),
            node("MatMul", ["t", "W"], ["y"], "mm"),
            node("Neg", ["e"], ["z"], "neg"),
        ],
        [tensor("x", [2, 4])],
        [tensor("y", [2, 4]), tensor("z", [2, 4])],
        [init("b", weights(rng, 4)), init("W", weights(rng, 4, 4))],
    )


def test_deny_spreads_forward_through_infer_and_clear_ops():
    c = colours(deny_spreads_model())
    assert c["mm"] == (LOW, Step.ALLOW_LIST, None, None)
    assert c["exp"] == (FP32, Step.DENY_LIST, None, None)
    assert c["relu"] == (FP32, Step.DOWNSTREAM_OF_DENY, "exp", None)  # clear, and it leads to an infer op
    assert c["add"] == (FP32, Step.DOWNSTREAM_OF_DENY, "relu", None)
    assert c["tanh"] == (FP32, Step.DOWNSTREAM_OF_DENY, "add", None)
    # a clear op after deny that leads to no infer or deny op is not painted float32 by deny
    assert c["neg"] == (FP32, Step.NOT_PAINTED, None, "clear op not between low-precision ops")
    check_rewrite(deny_spreads_model(), c)


def test_deny_does_not_spread_into_allow_and_stops_at_an_allow_op():
    """Exp -> MatMul -> Add: the allow op stays low and the infer op after it is not downstream of deny."""
    rng = np.random.default_rng(1)
    model = make_model(
        [
            node("Exp", ["x"], ["e"], "exp"),
            node("MatMul", ["e", "W"], ["m"], "mm"),
            node("Add", ["m", "b"], ["a"], "add"),
            node("MatMul", ["a", "W2"], ["y"], "mm2"),
        ],
        [tensor("x", [2, 4])],
        [tensor("y", [2, 4])],
        [init("W", weights(rng, 4, 4)), init("b", weights(rng, 4)), init("W2", weights(rng, 4, 4))],
    )
    c = colours(model)
    assert c["exp"][:2] == (FP32, Step.DENY_LIST)
    assert c["mm"] == (LOW, Step.ALLOW_LIST, None, None)
    assert c["add"] == (LOW, Step.BETWEEN_ALLOW, "mm", None)
    check_rewrite(model, c)


def between_allow_model():
    """x -> Sigmoid (infer, before any allow) -> MatMul -> Add (infer) -> Tanh (infer) -> MatMul -> y;
    MatMul -> Sigmoid (infer, leads to no allow op) -> z."""
    rng = np.random.default_rng(2)
    return make_model(
        [
            node("Sigmoid", ["x"], ["s0"], "sig_before"),
            node("MatMul", ["s0", "W1"], ["m1"], "mm1"),
            node("Add", ["m1", "b"], ["a"], "add"),
            node("Tanh", ["a"], ["t"], "tanh"),
            node("MatMul", ["t", "W2"], ["y"], "mm2"),
            node("Sigmoid", ["m1"], ["z"], "sig_after"),
        ],
        [tensor("x", [2, 4])],
        [tensor("y", [2, 4]), tensor("z", [2, 4])],
        [init("W1", weights(rng, 4, 4)), init("b", weights(rng, 4)), init("W2", weights(rng, 4, 4))],
    )


def test_infer_ops_between_two_allow_ops_are_low_and_others_stay_float32():
    c = colours(between_allow_model())
    assert c["mm1"] == c["mm2"] == (LOW, Step.ALLOW_LIST, None, None)
    assert c["add"] == (LOW, Step.BETWEEN_ALLOW, "mm1", None)
    assert c["tanh"] == (LOW, Step.BETWEEN_ALLOW, "add", None)
    assert c["sig_before"] == (FP32, Step.NOT_PAINTED, None, "infer op not between low-precision ops")
    assert c["sig_after"] == (FP32, Step.NOT_PAINTED, None, "infer op not between low-precision ops")
    check_rewrite(between_allow_model(), c)


def test_bfloat16_infer_op_fed_by_allow_and_no_deny_follows_it():
    """bfloat16 only (step 4): the Sigmoid after the MatMul follows it; in float16 it stays float32."""
    c = colours(between_allow_model(), target="bfloat16")
    assert c["sig_after"] == (LOW, Step.INFER_AFTER_ALLOW, "mm1", None)
    assert c["sig_before"][0] == FP32  # fed by no allow op
    check_rewrite(between_allow_model(), c, target="bfloat16", rtol=8e-2, atol=8e-2)


def clear_both_ways_model():
    """x -> Transpose (clear) -> MatMul -> Reshape (clear) -> Relu (clear) -> y, and
    x -> Sigmoid (infer, float32) -> Neg (clear, next to no low op) -> z."""
    rng = np.random.default_rng(3)
    return make_model(
        [
            node("Transpose", ["x"], ["xt"], "transpose", perm=[1, 0]),
            node("MatMul", ["xt", "W"], ["m"], "mm"),
            node("Reshape", ["m", "shape"], ["r"], "reshape"),
            node("Relu", ["r"], ["y"], "relu"),
            node("Sigmoid", ["x"], ["s"], "sig"),
            node("Neg", ["s"], ["z"], "neg"),
        ],
        [tensor("x", [4, 2])],
        [tensor("y", [8]), tensor("z", [4, 2])],
        [init("W", weights(rng, 4, 4)), init("shape", np.array([8], np.int64))],
    )


def test_clear_ops_take_low_precision_from_both_sides():
    c = colours(clear_both_ways_model())
    assert c["mm"] == (LOW, Step.ALLOW_LIST, None, None)
    assert c["transpose"] == (LOW, Step.CLEAR_NEXT_TO_LOW, "mm", None)  # backwards, from its reader
    assert c["reshape"] == (LOW, Step.CLEAR_NEXT_TO_LOW, "mm", None)  # forwards, from its producer
    assert c["relu"] == (LOW, Step.CLEAR_NEXT_TO_LOW, "reshape", None)  # on through clear ops
    assert c["neg"] == (FP32, Step.NOT_PAINTED, None, "clear op not between low-precision ops")
    assert c["sig"][0] == FP32
    check_rewrite(clear_both_ways_model(), c)


def cast_model():
    """MatMul -> Cast(to=float) -> MatMul -> y (every reader low), and
    MatMul -> Cast(to=float) -> LogSoftmax (deny, a float32 reader) -> z."""
    rng = np.random.default_rng(4)
    return make_model(
        [
            node("MatMul", ["x", "W1"], ["m"], "mm1"),
            node("Cast", ["m"], ["c_low"], "cast_low", to=TensorProto.FLOAT),
            node("MatMul", ["c_low", "W2"], ["y"], "mm2"),
            node("Cast", ["m"], ["c_f32"], "cast_f32", to=TensorProto.FLOAT),
            node("LogSoftmax", ["c_f32"], ["z"], "softmax"),
        ],
        [tensor("x", [2, 4])],
        [tensor("y", [2, 4]), tensor("z", [2, 4])],
        [init("W1", weights(rng, 4, 4)), init("W2", weights(rng, 4, 4))],
    )


def test_cast_whose_readers_are_all_low_is_retargeted_and_one_with_a_float32_reader_is_not():
    c = colours(cast_model())
    assert c["softmax"][:2] == (FP32, Step.DENY_LIST)
    assert c["cast_low", "T2"] == (LOW, Step.ALL_CONSUMERS_LOW, "mm2", None)
    assert c["cast_f32", "T2"][:2] == (FP32, Step.NOT_PAINTED)
    assert c["cast_f32", "T2"].detail.startswith("output typed by an attribute")
    # retargeted to float16 on a float16 input, cast_low converts nothing and is removed: mm2 reads m
    result = check_rewrite(cast_model(), c, removed=("cast_low",))
    to = {n.name: n.attribute[0].i for n in result.model.graph.node if n.name in ("cast_low", "cast_f32")}
    assert to == {"cast_f32": TensorProto.FLOAT}
    assert next(n for n in result.model.graph.node if n.name == "mm2").input[0] == "m"


def test_cast_that_is_also_a_graph_output_keeps_its_type():
    """A Cast read only by a low op but also a graph output stays float32: the output keeps its type."""
    rng = np.random.default_rng(5)
    model = make_model(
        [
            node("MatMul", ["x", "W1"], ["m"], "mm1"),
            node("Cast", ["m"], ["c"], "cast", to=TensorProto.FLOAT),
            node("MatMul", ["c", "W2"], ["y"], "mm2"),
        ],
        [tensor("x", [2, 4])],
        [tensor("y", [2, 4]), tensor("c", [2, 4])],
        [init("W1", weights(rng, 4, 4)), init("W2", weights(rng, 4, 4))],
    )
    c = colours(model)
    assert c["cast", "T2"][:2] == (FP32, Step.NOT_PAINTED)
    assert c["cast", "T2"].detail.startswith("output typed by an attribute")
    assert c["mm2"][0] == LOW
    check_rewrite(model, c)


def test_without_an_allow_op_nothing_is_painted():
    """As TensorFlow: without allow ops the casts cannot pay off, so every vertex stays float32."""
    model = make_model(
        [node("Add", ["x", "x"], ["a"], "add"), node("Relu", ["a"], ["y"], "relu")],
        [tensor("x", [2, 4])],
        [tensor("y", [2, 4])],
    )
    c = colours(model)
    assert {entry[0] for entry in c.values()} == {FP32}
    assert not amp_rewrite.rewrite(model).changed
