"""The model's own Casts that convert nothing in the result are removed (transform/noop_casts.py).

Decision under test: after colouring, a Cast of the source whose `to` is its input's element type
(a no-op), or which takes back a value another of the model's Casts widened exactly (float16 ->
float32 -> float16), is removed and its readers read its input; kept are a Cast whose output is a
graph output, every Cast that really converts, and everything in a model the rewrite leaves
unchanged. Each model is the pattern torch's eager attention exports (Softmax, then
`.to(float32)` twice on float32 tensors) or a variation of it; every test checks the result in
full, and runs both models in ONNX Runtime and onnx.reference.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from amp_rewrite import rewrite
from amp_rewrite.plan import Step
from amp_rewrite.report import html, picture_graph
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

FLOAT, F16, BF16, INT64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.INT64


def _casts(graph) -> dict:
    """Cast node name -> (input, to) of `graph`'s own nodes."""
    return {n.name: (n.input[0], n.attribute[0].i) for n in graph.node if n.op_type == "Cast"}


def _elem_types(model) -> dict:
    g = onnx.shape_inference.infer_shapes(model, strict_mode=True).graph
    return {v.name: v.type.tensor_type.elem_type for v in (*g.input, *g.value_info, *g.output)}


def attention(extra_nodes=(), extra_outputs=(), seed=0):
    """One attention head as torch's eager attention exports it: scores = q k^T, Softmax, then
    Cast(to=FLOAT) twice on the float32 probabilities, then probabilities @ v, and a projection."""
    rng = np.random.default_rng(seed)
    nodes = [
        node("MatMul", ["x", "Wq"], ["q"], "q"),
        node("MatMul", ["x", "Wk"], ["k"], "k"),
        node("MatMul", ["x", "Wv"], ["v"], "v"),
        node("Transpose", ["k"], ["kt"], "kt", perm=[0, 2, 1]),
        node("MatMul", ["q", "kt"], ["scores"], "scores"),
        node("Softmax", ["scores"], ["p"], "softmax", axis=-1),
        node("Cast", ["p"], ["p1"], "cast", to=FLOAT),
        node("Cast", ["p1"], ["p2"], "cast_1", to=FLOAT),
        node("MatMul", ["p2", "v"], ["ctx"], "ctx"),
        node("MatMul", ["ctx", "Wo"], ["y"], "proj"),
        *extra_nodes,
    ]
    return make_model(
        nodes,
        [tensor("x", [2, 4, 8])],
        [tensor("y", [2, 4, 8]), *extra_outputs],
        [init(name, weights(rng, 8, 8)) for name in ("Wq", "Wk", "Wv", "Wo")],
    )


@pytest.mark.parametrize("placement", ["cost", "tf"])
@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_the_exports_softmax_casts_are_removed(placement, target):
    """Under cost placement Softmax is low: the first Cast widens it to float32 and the second, its
    `to` retargeted, narrows it back (a round trip: both go). Under tf Softmax stays float32: the
    first Cast is a no-op (goes), the second converts float32 -> low (stays)."""
    model = attention()
    result = rewrite(model, target=target, placement=placement)
    if target == "float16":
        check_both(model, result.model, rtol=3e-2, atol=3e-2)
    else:  # ONNX Runtime's CPU provider has no bfloat16 MatMul: onnx.reference computes it
        onnx.checker.check_model(result.model, full_check=True)
        feeds = random_feeds(model)
        assert_close(run_reference(result.model, feeds), run_ort(model, feeds), 5e-2, 5e-2)
    g = result.model.graph
    own = {n: c for n, c in _casts(g).items() if not n.startswith("amp/")}
    removed = {e["name"] for e in result.report.nodes if e.get("removed")}
    low = F16 if target == "float16" else BF16
    if own:  # tf: Softmax float32, so the second Cast really converts
        assert own == {"cast_1": ("p", low)} and removed == {"cast"}
    else:
        assert removed == {"cast", "cast_1"}
        assert next(n for n in g.node if n.name == "ctx").input[0] == "p"
        assert _elem_types(result.model)["p"] == low
    assert result.report.summary["casts_removed"] == len(removed)
    assert not {"p1", "p2"} & {v.name for v in g.value_info}


def test_a_cast_whose_output_is_a_graph_output_stays():
    """Cast(to=FLOAT) of float32 Exp (deny) is a no-op, but its output is a graph output: it stays,
    name and type. p1, the export's first Cast, is made a graph output too: that Cast stays, and
    the second, the round trip back to float16, still goes (it reads p directly)."""
    model = attention(
        extra_nodes=[
            node("Exp", ["y"], ["ey"], "exp"),
            node("Cast", ["ey"], ["ey_out"], "cast_out", to=FLOAT),
        ],
        extra_outputs=[tensor("ey_out", [2, 4, 8])],
    )
    model.graph.output.append(helper.make_tensor_value_info("p1", FLOAT, [2, 4, 4]))
    result = rewrite(model)
    check_both(model, result.model, rtol=3e-2, atol=3e-2)
    casts = _casts(result.model.graph)
    types = _elem_types(result.model)
    assert casts["cast_out"] == ("ey", FLOAT) and types["ey"] == FLOAT  # a no-op, kept for its output's name
    assert casts["cast"] == ("p", FLOAT) and types["p"] == F16  # p1 is a graph output: kept, float32
    assert [o.name for o in result.model.graph.output] == ["y", "ey_out", "p1"]
    assert types["ey_out"] == types["p1"] == FLOAT
    assert {e["name"] for e in result.report.nodes if e.get("removed")} == {"cast_1"}
    assert next(n for n in result.model.graph.node if n.name == "ctx").input[0] == "p"


def test_real_conversions_stay():
    """float32 -> float16 -> float32 in the source rounds on purpose (the float32 is read by a deny
    op: the second Cast converts too); Cast(to=INT64) of a float tensor and the int64 back to float
    (retargeted to float16, still a conversion): all stay."""
    rng = np.random.default_rng(1)
    model = make_model(
        [
            node("MatMul", ["x", "W1"], ["m"], "mm1"),
            node("Exp", ["m"], ["e"], "exp"),
            node("Cast", ["e"], ["e16"], "to_half", to=F16),
            node("Cast", ["e16"], ["e32"], "back", to=FLOAT),
            node("Log", ["e32"], ["l"], "log"),
            node("Cast", ["m"], ["i"], "to_int", to=INT64),
            node("Cast", ["i"], ["f"], "int_back", to=FLOAT),
            node("Add", ["l", "f"], ["s"], "add"),
            node("MatMul", ["s", "W2"], ["y"], "mm2"),
        ],
        [tensor("x", [2, 4])],
        [tensor("y", [2, 4])],
        [init("W1", weights(rng, 4, 4, scale=0.1)), init("W2", weights(rng, 4, 4))],
    )
    result = rewrite(model)
    check_both(model, result.model)
    own = {n: c for n, c in _casts(result.model.graph).items() if not n.startswith("amp/")}
    assert set(own) == {"to_half", "back", "to_int", "int_back"}
    assert own["to_half"] == ("e", F16) and own["back"] == ("e16", FLOAT) and own["to_int"][1] == INT64
    assert result.report.summary["casts_removed"] == 0


def test_a_model_left_unchanged_keeps_its_noop_casts():
    """Without an allow op nothing is rewritten (casts would not pay), its no-op Casts included."""
    model = make_model(
        [
            node("Relu", ["x"], ["r"], "relu"),
            node("Cast", ["r"], ["c"], "cast", to=FLOAT),
            node("Sigmoid", ["c"], ["y"], "sig"),
        ],
        [tensor("x", [2, 4])],
        [tensor("y", [2, 4])],
    )
    result = rewrite(model)
    assert result.model.SerializeToString() == model.SerializeToString() and not result.changed


def _if_model():
    """A no-op Cast in the main graph read by a MatMul and, from the outer scope, by both branches
    of an If; each branch holds a no-op Cast of its own, one read inside it, one its output."""
    rng = np.random.default_rng(2)

    def branch(name: str, cast_is_output: bool):
        """then: MatMul -> Cast -> MatMul (the Cast retargeted: a no-op); else: MatMul -> Exp (deny,
        float32) -> Cast(to=FLOAT) as the branch's output (a no-op too, but an output)."""
        last = f"{name}_out"
        mm = node("MatMul", ["c", "Wb"], [f"{name}_mm"], f"{name}_mm")
        if cast_is_output:
            nodes = [
                mm,
                node("Exp", [f"{name}_mm"], [f"{name}_e"], f"{name}_exp"),
                node("Cast", [f"{name}_e"], [last], f"{name}_cast", to=FLOAT),
            ]
        else:
            nodes = [
                mm,
                node("Cast", [f"{name}_mm"], [f"{name}_c"], f"{name}_cast", to=FLOAT),
                node("MatMul", [f"{name}_c", "Wb"], [last], f"{name}_mm2"),
            ]
        return helper.make_graph(nodes, name, [], [tensor(last, [2, 4])])

    return make_model(
        [
            node("MatMul", ["x", "W"], ["m"], "mm"),
            node("Cast", ["m"], ["c"], "cast", to=FLOAT),
            node("MatMul", ["c", "W"], ["y"], "mm2"),
            node("ReduceSum", ["x"], ["total"], "total", keepdims=0),
            node("Greater", ["total", "zero"], ["flag"], "flag"),
            node(
                "If",
                ["flag"],
                ["z"],
                "if",
                then_branch=branch("then", False),
                else_branch=branch("else", True),
            ),
        ],
        [tensor("x", [2, 4])],
        [tensor("y", [2, 4]), tensor("z", [2, 4])],
        [
            init("W", weights(rng, 4, 4)),
            init("Wb", weights(rng, 4, 4)),
            init("zero", np.array(0.0, np.float32)),
        ],
    )


def test_noop_casts_feeding_and_inside_if_branches():
    model = _if_model()
    result = rewrite(model)
    for seed in range(3):  # both branches taken
        check_both(model, result.model, random_feeds(model, seed=seed))
    g = result.model.graph
    branches = {a.name: a.g for a in next(n for n in g.node if n.op_type == "If").attribute}
    removed = {e["name"] for e in result.report.nodes if e.get("removed")}
    # the main graph's Cast goes: mm2 and both branches' MatMuls read (a Cast of) m instead of c
    assert "cast" in removed and "cast" not in _casts(g)
    assert next(n for n in g.node if n.name == "mm2").input[0] == "m"
    for b in branches.values():
        mm = next(n for n in b.node if n.op_type == "MatMul")
        assert mm.input[0] == "m"  # from the outer scope: c was float16 already, so is m
    # inside a branch: the Cast between MatMuls goes, the one that is the branch's output stays
    assert "then_cast" in removed and "then_cast" not in _casts(branches["then_branch"])
    assert "else_cast" not in removed and "else_cast" in _casts(branches["else_branch"])
    assert result.report.summary["casts_removed"] == len(removed) == 2


def test_report_and_page_say_which_casts_were_removed():
    model = attention()
    result = rewrite(model)
    entries = {e["name"]: e for e in result.report.nodes}
    for name in ("cast", "cast_1"):
        e = entries[name]
        assert e["removed"] and e["step"] == Step.REMOVED_NO_OP.value
        assert e["because"].startswith(f"Cast '{name}' removed: ")
        assert all(
            g["step"] != Step.REMOVED_NO_OP.value for g in e["groups"].values()
        )  # colours keep their reasons
    assert "and back, exactly" in entries["cast_1"]["because"]
    assert "nothing reads it any more" in entries["cast"]["because"]
    s = result.report.summary
    assert s["casts_removed"] == 2 and s["nodes_mixed"] == 0  # removed nodes are not counted
    assert "Cast" not in {row["op_type"] for row in result.report.op_table()}
    assert "the model's own removed (converting nothing): 2" in result.report.to_text()
    page = html.render(result.report, model)
    assert "casts removed (converting nothing)" in page
    g = picture_graph.build(result.report, model)
    kinds = {name: kind for name, kind in zip(g.name, g.kind)}
    assert kinds["cast"] == kinds["cast_1"] == picture_graph.OTHER and kinds["softmax"] == picture_graph.LOW


def test_annotate_skips_removed_casts():
    model = attention()
    result = rewrite(model, annotate=True)
    assert not any(n.name in ("cast", "cast_1") for n in result.model.graph.node)
    assert all(
        n.doc_string.startswith("amp-rewrite: ") for n in result.model.graph.node if n.op_type == "MatMul"
    )
    assert_close(
        run_reference(result.model, {"x": np.ones((2, 4, 8), np.float32)}),
        run_ort(model, {"x": np.ones((2, 4, 8), np.float32)}),
        3e-2,
        3e-2,
    )


def _inserted_casts(graph):
    return Counter((n.input[0], n.attribute[0].i) for n in graph.node if n.name.startswith("amp/"))


def test_a_noop_cast_renamed_for_a_main_output_goes_and_the_output_keeps_its_name():
    """Found by hypothesis (test_properties): without keep_io_types the outputs are float16, so the
    no-op Casts writing them are renamed and an inserted Cast writes each output from the new
    name. The no-op goes, the inserted Cast reads its input, the output keeps its name; left in,
    a second rewrite would remove it (not idempotent)."""
    model = make_model(
        [
            node("Cast", ["x"], ["t0"], "n0", to=TensorProto.FLOAT),
            node("Cast", ["x"], ["t1"], "n1", to=FLOAT),
        ],
        [tensor("x", [2, 4])],
        [tensor("t0", [2, 4]), tensor("t1", [2, 4])],
    )
    result = rewrite(
        model, keep_io_types=False
    )  # no allow op: the Casts read x as float32 (one inserted Cast)
    out = result.model
    onnx.checker.check_model(out, full_check=True)
    assert not {"n0", "n1"} & set(_casts(out.graph)) and result.report.summary["casts_removed"] == 2
    assert [(o.name, o.type.tensor_type.elem_type) for o in out.graph.output] == [("t0", F16), ("t1", F16)]
    assert rewrite(out, keep_io_types=False).model.SerializeToString() == out.SerializeToString()
    x = random_feeds(model)["x"]
    assert_close(run_ort(out, {"x": x.astype(np.float16)}), run_ort(model, {"x": x}))


def test_a_noop_cast_whose_removal_would_duplicate_an_inserted_cast_stays():
    """e = Exp(x) (deny, float32) feeds a low MatMul (one inserted Cast of e to float16) and a
    no-op Cast(to=FLOAT) whose output feeds a low MatMul and a float32 Log: removing it would
    leave two Casts of e to float16. It stays (one cast per tensor and direction). Under tf: cost
    placement colours the Cast's input float16 and so makes it a real conversion."""
    rng = np.random.default_rng(4)
    model = make_model(
        [
            node("Exp", ["x"], ["e"], "exp"),
            node("Cast", ["e"], ["c"], "cast", to=FLOAT),
            node("MatMul", ["e", "W"], ["y0"], "mm0"),
            node("MatMul", ["c", "W"], ["y1"], "mm1"),
            node("Log", ["c"], ["y2"], "log"),
        ],
        [tensor("x", [2, 4])],
        [tensor("y0", [2, 4]), tensor("y1", [2, 4]), tensor("y2", [2, 4])],
        [init("W", weights(rng, 4, 4))],
    )
    result = rewrite(model, placement="tf")
    check_both(model, result.model)
    assert _casts(result.model.graph)["cast"] == ("e", FLOAT) and result.report.summary["casts_removed"] == 0
    assert all(count == 1 for count in _inserted_casts(result.model.graph).values())


def test_fold_noop_casts_false_keeps_the_models_casts():
    """The toggle (bench_placement's bf991a5 baseline uses it): every Cast of the model stays."""
    model = attention()
    result = rewrite(model, fold_noop_casts=False)
    check_both(model, result.model, rtol=3e-2, atol=3e-2)
    own = {n for n in _casts(result.model.graph) if not n.startswith("amp/")}
    assert own == {"cast", "cast_1"}
    assert result.report.summary["casts_removed"] == 0 and rewrite(model).report.summary["casts_removed"] == 2


def _input_cast_model(float32_reader: bool):
    """x -> Cast(to=FLOAT) -> MatMuls (an export that casts its input first), and with
    `float32_reader` also Log(|x| + 1) + the Cast's output, which keeps the Cast's output float32
    (found by hypothesis: with keep_io_types=False the first rewrite left a round trip that a
    second rewrite then removed)."""
    rng = np.random.default_rng(3)
    nodes = [
        node("Cast", ["x"], ["t0"], "n0", to=TensorProto.FLOAT),
        node("MatMul", ["t0", "W1"], ["t1"], "n1"),
        node("MatMul", ["t0", "W2"], ["t2"], "n2"),
    ]
    outputs = ["t1", "t2"]
    inits = [init("W1", weights(rng, 4, 4)), init("W2", weights(rng, 4, 4))]
    if float32_reader:
        nodes += [
            node("Abs", ["x"], ["a"], "abs"),
            node("Add", ["a", "one"], ["p"], "pos"),
            node("Log", ["p"], ["l"], "log"),
            node("Add", ["t0", "l"], ["t3"], "n3"),
        ]
        outputs.append("t3")
        inits.append(init("one", np.ones(1, np.float32)))
    return make_model(nodes, [tensor("x", [2, 4])], [tensor(t, [2, 4]) for t in outputs], inits)


@pytest.mark.parametrize("float32_reader", [False, True])
def test_an_input_cast_folds_with_the_cast_inserted_before_it(float32_reader):
    """keep_io_types=False makes x float16; the model's Cast(to=FLOAT) then sits between x's
    inserted float32 Cast and (retargeted, or as an inserted Cast) a float16 one: a round trip.
    The MatMuls read x itself, no inserted Cast is left without a reader, and rewriting the
    result again changes nothing."""
    model = _input_cast_model(float32_reader)
    result = rewrite(model, keep_io_types=False)
    out = result.model
    onnx.checker.check_model(out, full_check=True)
    readers = {n.name: list(n.input) for n in out.graph.node}
    assert readers["n1"][0] == readers["n2"][0] == "x"
    if not float32_reader:
        assert "n0" not in readers and result.report.summary["casts_removed"] == 1
    # x is a float16 source to the cost model too: with a float32 reader the model's own Cast (or an
    # inserted one, never both) makes its one float32 copy
    assert sum(n.op_type == "Cast" and n.input[0] == "x" for n in out.graph.node) <= 1
    read = {name for inputs in readers.values() for name in inputs} | {o.name for o in out.graph.output}
    assert all(n.output[0] in read for n in out.graph.node)  # nothing dead
    assert len(result.report.casts) == sum(n.name.startswith("amp/") for n in out.graph.node)
    again = rewrite(out, keep_io_types=False).model
    assert again.SerializeToString() == out.SerializeToString()
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float16)
    expected = run_ort(model, {"x": x.astype(np.float32)})
    assert_close(run_ort(out, {"x": x}), expected, 2e-2, 2e-2)
    assert_close(run_reference(out, {"x": x}), expected, 2e-2, 2e-2)


def test_a_folded_cast_whose_readers_read_an_inserted_cast_keeps_it():
    """Found by hypothesis: with keep_io_types=False, x is float16 and an inserted Cast widens it
    for two of the model's Casts; one (to float32, read by a float32 Mul) folds and its reader reads
    the inserted Cast, the other (retargeted to float16) takes x back: the inserted Cast was dropped
    as read by folded Casts only, and the Mul read a name nothing wrote."""
    rng = np.random.default_rng(0)
    model = make_model(
        [
            node("Cast", ["x"], ["t0"], "n0", to=TensorProto.FLOAT),
            node("MatMul", ["x", "W1"], ["t1"], "n1"),
            node("Cast", ["x"], ["t3"], "n3", to=TensorProto.FLOAT),
            node("MatMul", ["t3", "W4"], ["t4"], "n4"),
            node("Mul", ["t0", "c"], ["t8"], "n8"),
        ],
        [tensor("x", [2, 4])],
        [tensor("t1", [2, 4]), tensor("t4", [2, 4]), tensor("t8", [2, 4])],
        [
            init("W1", rng.standard_normal((4, 4)).astype(np.float32)),
            init("W4", rng.standard_normal((4, 4)).astype(np.float32)),
            init("c", np.array(0.5, np.float32)),
        ],
        opset=17,
    )
    for placement in ("tf", "cost"):
        result = rewrite(model, keep_io_types=False, placement=placement)
        onnx.checker.check_model(result.model, full_check=True)
        feeds = {"x": rng.standard_normal((2, 4)).astype(np.float16)}
        expected = run_ort(model, {"x": feeds["x"].astype(np.float32)})
        for got, want in zip(run_ort(result.model, feeds), expected):
            np.testing.assert_allclose(got.astype(np.float32), want, rtol=2e-2, atol=2e-2)
