"""Range-deny ops relaxed by exhaustion: the pointwise chain run on every float16 value
(`analysis/pointwise.py`). Each model sits between two MatMuls (allow ops), so the chain's colour
decides the casts; every rewrite runs in ONNX Runtime and onnx.reference against float32."""

import json

import numpy as np
import onnx

from amp_rewrite import ir, rewrite
from amp_rewrite.analysis import pointwise
from amp_rewrite.analysis.elemtypes import tensor_types
from amp_rewrite.cli import main
from amp_rewrite.onnx_facts import opsets
from amp_rewrite.options import RewriteOptions
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
)


def _between_matmuls(chain_nodes, x="h", y="g", extra_inits=(), seed=0):
    """x -> MatMul -> h -> chain -> g -> MatMul -> out, weights scaled so h spans about +-6."""
    rng = np.random.default_rng(seed)
    return make_model(
        [node("MatMul", ["x", "W1"], [x], "mm1"), *chain_nodes, node("MatMul", [y, "W2"], ["out"], "mm2")],
        [tensor("x", ["N", 16])],
        [tensor("out", ["N", 8])],
        [
            init("W1", rng.standard_normal((16, 32)).astype(np.float32)),
            init("W2", (rng.standard_normal((32, 8)) * 0.3).astype(np.float32)),
            *extra_inits,
        ],
    )


def _scalar(name, value, dtype=np.float32):
    return init(name, np.array(value, dtype))


def gelu_tanh():
    """GPT-2's gelu_new as the dynamo exporter writes it: 0.5x (1 + tanh(c (x + 0.044715 x^3)))."""
    return _between_matmuls(
        [
            node("Mul", ["h", "half"], ["hx"], "half_x"),
            node("Pow", ["h", "three"], ["cube"], "pow"),
            node("Mul", ["cube", "k"], ["kc"], "k_cube"),
            node("Add", ["h", "kc"], ["inner"], "inner"),
            node("Mul", ["inner", "c"], ["scaled"], "scaled"),
            node("Tanh", ["scaled"], ["t"], "tanh"),
            node("Add", ["t", "one"], ["t1"], "plus_one"),
            node("Mul", ["hx", "t1"], ["g"], "gelu"),
        ],
        extra_inits=[
            _scalar("half", 0.5),
            _scalar("three", 3.0),
            _scalar("k", 0.044715),
            _scalar("c", np.sqrt(2 / np.pi)),
            _scalar("one", 1.0),
        ],
    )


def _entry(result, name):
    return next(n for n in result.report.nodes if n["name"] == name)


def _casts(model):
    return sum(n.op_type == "Cast" for n in model.graph.node)


def test_gelu_tanh_pow_is_proved_safe_and_the_chain_runs_in_float16():
    model = gelu_tanh()
    result = rewrite(model)
    pow_entry = _entry(result, "pow")
    assert pow_entry["precision"] == "float16"
    assert pow_entry["relaxed"].startswith(
        "checked on every float16 value: the pointwise chain of 8 ops from 'h'"
    )
    assert "relaxed to infer" in pow_entry["because"]
    assert result.report.summary["deny_relaxed"] == 1
    assert all(_entry(result, n)["precision"] == "float16" for n in ("tanh", "gelu", "inner"))
    assert _casts(result.model) == 2  # the model's input and output only
    # feeds large enough that x**3 overflows float16 for some of them (|h| > 40)
    feeds = {"x": (np.random.default_rng(1).standard_normal((6, 16)) * 8).astype(np.float32)}
    check_both(model, result.model, feeds, rtol=2e-2, atol=5e-2)

    without = rewrite(model, pointwise_check=False)
    assert _entry(without, "pow")["precision"] == "float32" and "relaxed" not in _entry(without, "pow")
    assert _casts(without.model) > 2
    check_both(model, without.model, feeds, rtol=2e-2, atol=5e-2)


def test_squares_that_feed_a_mean_stay_float32():
    """RMSNorm's x**2 is summed next: x**2 alone leaves float16's range beyond |x| = 256."""
    model = _between_matmuls(
        [
            node("Pow", ["h", "two"], ["sq"], "pow"),
            node("ReduceMean", ["sq"], ["ms"], "mean", axes=[-1]),
            node("Add", ["ms", "eps"], ["mse"], "eps"),
            node("Sqrt", ["mse"], ["rms"], "sqrt"),
            node("Div", ["h", "rms"], ["g"], "div"),
        ],
        extra_inits=[_scalar("two", 2.0), _scalar("eps", 1e-6)],
    )
    result = rewrite(model)
    assert _entry(result, "pow")["precision"] == "float32"
    assert result.report.summary["deny_relaxed"] == 0
    check_both(model, result.model)


def test_softplus_spelt_with_exp_and_log_stays_float32():
    """log(1 + exp(x)) is x for large x, but exp(x) is inf in float16 beyond 11.1: log(inf) = inf."""
    model = _between_matmuls(
        [
            node("Exp", ["h"], ["e"], "exp"),
            node("Add", ["e", "one"], ["e1"], "plus_one"),
            node("Log", ["e1"], ["g"], "log"),
        ],
        extra_inits=[_scalar("one", 1.0)],
    )
    result = rewrite(model)
    assert _entry(result, "exp")["precision"] == "float32"
    check_both(model, result.model)


def test_sigmoid_spelt_with_exp_and_reciprocal_is_proved_safe():
    """1 / (1 + exp(-x)): exp overflows for x < -11, and 1 / inf = 0 is what float32 gives too."""
    model = _between_matmuls(
        [
            node("Neg", ["h"], ["n"], "neg"),
            node("Exp", ["n"], ["e"], "exp"),
            node("Add", ["e", "one"], ["e1"], "plus_one"),
            node("Reciprocal", ["e1"], ["g"], "recip"),
        ],
        extra_inits=[_scalar("one", 1.0)],
    )
    result = rewrite(model)
    assert [_entry(result, n)["precision"] for n in ("exp", "recip")] == ["float16", "float16"]
    assert result.report.summary["deny_relaxed"] == 2
    assert _casts(result.model) == 2
    feeds = {"x": (np.random.default_rng(2).standard_normal((6, 16)) * 8).astype(np.float32)}
    check_both(model, result.model, feeds)


def test_a_chain_whose_output_nothing_reads_compared_nothing_and_is_not_relaxed():
    """MatMul -> Exp with Exp read by nothing: the chain hands on no value, so the run compares
    nothing and proves nothing; Exp keeps the deny list's float32 (it was relaxed with 'worst
    error 0.00' from a loop over zero outputs)."""
    rng = np.random.default_rng(5)
    model = make_model(
        [
            node("MatMul", ["x", "W1"], ["h"], "mm1"),
            node("Exp", ["h"], ["e"], "exp"),
            node("MatMul", ["h", "W2"], ["out"], "mm2"),
        ],
        [tensor("x", ["N", 16])],
        [tensor("out", ["N", 8])],
        [
            init("W1", rng.standard_normal((16, 32)).astype(np.float32)),
            init("W2", rng.standard_normal((32, 8)).astype(np.float32)),
        ],
    )
    scopes = ir.read_scopes(model.graph)
    types, _ = tensor_types(model, scopes=scopes)
    assert pointwise.relieved(scopes, RewriteOptions().lists(), types, opsets(model)) == {}
    result = rewrite(model)
    exp = _entry(result, "exp")
    assert exp["precision"] == "float32" and "relaxed" not in exp
    assert result.report.summary["deny_relaxed"] == 0
    check_both(model, result.model)
    # beside a compared chain (the sigmoid of the next test), a dead Exp of the same input stays denied
    beside = _between_matmuls(
        [
            node("Neg", ["h"], ["n"], "neg"),
            node("Exp", ["n"], ["e"], "exp"),
            node("Exp", ["h"], ["dead"], "dead"),
            node("Add", ["e", "one"], ["e1"], "plus_one"),
            node("Reciprocal", ["e1"], ["g"], "recip"),
        ],
        extra_inits=[_scalar("one", 1.0)],
    )
    result = rewrite(beside)
    assert [_entry(result, n)["precision"] for n in ("exp", "recip", "dead")] == [
        "float16",
        "float16",
        "float32",
    ]
    assert "relaxed" not in _entry(result, "dead") and result.report.summary["deny_relaxed"] == 2
    check_both(beside, result.model)


def test_two_dynamic_inputs_or_wide_constants_are_not_checked():
    """Pow(x, y) with y computed, and x**3 scaled per channel, are not functions of one value."""
    rng = np.random.default_rng(3)
    model = _between_matmuls(
        [
            node("MatMul", ["x", "W3"], ["y"], "mm3"),
            node("Pow", ["h", "y"], ["p"], "pow_xy"),
            node("Pow", ["h", "three"], ["c"], "pow_x3"),
            node("Mul", ["c", "per_channel"], ["cs"], "scale"),
            node("Tanh", ["cs"], ["t"], "tanh"),
            node("Add", ["p", "t"], ["g"], "sum"),
        ],
        extra_inits=[
            init("W3", (rng.standard_normal((16, 32)) * 0.1).astype(np.float32)),
            _scalar("three", 3.0),
            init("per_channel", np.full(32, 1e-3, np.float32)),
        ],
    )
    result = rewrite(model)
    assert _entry(result, "pow_xy")["precision"] == "float32"
    assert (
        _entry(result, "pow_x3")["precision"] == "float32"
    )  # its chain stops at the wide Mul: x**3 alone fails
    check_both(model, result.model, {"x": (rng.standard_normal((4, 16)) * 0.5).astype(np.float32)})


def test_a_relaxed_op_without_a_cuda_kernel_stays_float32():
    """tanh(sinh(x)) is safe in float16 (sinh overflows only where tanh saturates), but CUDA has
    no Sinh kernel at all: relaxed to infer, then blocked by the provider's kernel table."""
    model = _between_matmuls([node("Sinh", ["h"], ["s"], "sinh"), node("Tanh", ["s"], ["g"], "tanh")])
    cuda = rewrite(model)
    assert _entry(cuda, "sinh")["precision"] == "float32"
    assert (
        "relaxed" in _entry(cuda, "sinh") and "no float16 kernel on CUDA" in _entry(cuda, "sinh")["because"]
    )
    anywhere = rewrite(model, provider="any")
    assert _entry(anywhere, "sinh")["precision"] == "float16"
    check_both(model, anywhere.model)


def test_the_check_fails_where_float16_disagrees_and_says_where():
    """x**2 / 65536 is in range in float32 for every float16 x, but x**2 is inf in float16 beyond 256."""
    model = _between_matmuls(
        [node("Pow", ["h", "two"], ["sq"], "pow"), node("Mul", ["sq", "tiny"], ["g"], "tiny")],
        extra_inits=[_scalar("two", 2.0), _scalar("tiny", 2.0**-16)],
    )
    result = rewrite(model)
    assert _entry(result, "pow")["precision"] == "float32"
    scopes = ir.read_scopes(model.graph)
    types, _ = tensor_types(model, scopes=scopes)
    view = pointwise._ScopeView(scopes[0], None, set())
    chain = pointwise._chain(view, "h")
    assert [model.graph.node[n].name for n in chain] == ["pow", "tiny"]
    ok, detail = pointwise._verdict(
        pointwise._describe(view, "h", chain), pointwise._opset_key(opsets(model))
    )
    assert not ok and detail.startswith("float16 gives inf where float32 gives")
    assert pointwise.relieved(scopes, RewriteOptions.of().lists(), types, opsets(model)) == {}


def test_bfloat16_proves_the_chain_on_every_bfloat16_value():
    """bfloat16 keeps Pow deny for precision, not range (op_lists/bfloat16.yaml): the same
    exhaustion over its 65,282 values, in its own units, relaxes GPT-2's GELU (its FFN then runs
    in bfloat16, as in float16: issue 40's bfloat16 gap) and refuses a high power, whose
    rounding the exponent multiplies."""
    model = gelu_tanh()
    result = rewrite(model, target="bfloat16")
    pow_entry = _entry(result, "pow")
    assert pow_entry["precision"] == "bfloat16"
    assert pow_entry["relaxed"].startswith("checked on every bfloat16 value: the pointwise chain of 8 ops")
    assert _casts(result.model) == 2
    feeds = random_feeds(model)  # ORT's CPU provider has no bfloat16 MatMul: onnx.reference computes it
    assert_close(run_reference(result.model, feeds), run_ort(model, feeds), 5e-2, 5e-2)

    high = _between_matmuls(  # x exactly a bfloat16 value is rounded once; 1.1 x, rounded, x 64 in the power
        [
            node("Mul", ["h", "a"], ["ha"], "scale"),
            node("Pow", ["ha", "p"], ["hp"], "pow"),
            node("Mul", ["hp", "tiny"], ["g"], "tiny"),
        ],
        extra_inits=[_scalar("a", 1.1), _scalar("p", 64.0), _scalar("tiny", 2.0**-100)],
    )
    scopes = ir.read_scopes(high.graph)
    view = pointwise._ScopeView(scopes[0], None, set())
    described = pointwise._describe(view, "h", pointwise._chain(view, "h"))
    ok, detail = pointwise._verdict(described, pointwise._opset_key(opsets(high)), "bfloat16")
    assert not ok and detail.startswith("bfloat16 gives"), detail
    assert _entry(rewrite(high, target="bfloat16"), "pow")["precision"] == "float32"


def test_cli_checks_by_default_and_can_leave_it_to_the_lists(tmp_path):
    source = tmp_path / "gelu.onnx"
    onnx.save(gelu_tanh(), source)
    for flag, relaxed in (([], True), (["--no-pointwise-check"], False)):
        report = tmp_path / f"report{len(flag)}.json"
        assert (
            main(
                [
                    str(source),
                    "-o",
                    str(tmp_path / f"out{len(flag)}.onnx"),
                    "--quiet",
                    "--report",
                    str(report),
                    *flag,
                ]
            )
            == 0
        )
        entry = next(n for n in json.loads(report.read_text())["nodes"] if n["name"] == "pow")
        assert ("relaxed" in entry) is relaxed and entry["precision"] == ("float16" if relaxed else "float32")


def test_a_chain_tensor_read_by_an_if_branch_is_checked_too():
    """x**3 feeds tanh (safe) and an If branch: the branch would see inf, so the check fails."""
    from onnx import helper

    then_branch = helper.make_graph(
        [node("Mul", ["cube", "k"], ["then_out"], "then_mul")], "then", [], [tensor("then_out", None)]
    )
    else_branch = helper.make_graph(
        [node("Identity", ["t"], ["else_out"], "else_id")], "else", [], [tensor("else_out", None)]
    )
    model = _between_matmuls(
        [
            node("Pow", ["h", "three"], ["cube"], "pow"),
            node("Tanh", ["cube"], ["t"], "tanh"),
            node("ReduceMax", ["h"], ["hm"], "hmax", keepdims=0),
            node("Greater", ["hm", "zero"], ["c"], "cond"),
            node("If", ["c"], ["branch"], "if", then_branch=then_branch, else_branch=else_branch),
            node("Add", ["t", "branch"], ["g"], "add"),
        ],
        extra_inits=[_scalar("three", 3.0), _scalar("k", 1e-4), _scalar("zero", 0.0)],
    )
    result = rewrite(model)
    assert _entry(result, "pow")["precision"] == "float32"
    assert "relaxed" not in _entry(result, "pow")
    check_both(
        model, result.model, {"x": (np.random.default_rng(4).standard_normal((4, 16)) * 3).astype(np.float32)}
    )
