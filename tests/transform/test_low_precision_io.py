"""`low_precision_io` / `--low-precision-io`: graph inputs and outputs whose names fully match take
the target type, the rest follow keep_io_types; a pattern that matches none is one line."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto

import amp_rewrite
from amp_rewrite.cli import main
from amp_rewrite.errors import UsageError
from helpers import (
    assert_close,
    init,
    make_model,
    node,
    run_ort,
    run_reference,
    tensor,
    weights,
)

F16 = TensorProto.FLOAT16
CACHE = [r"past\..*", r"present\..*"]


def cached_step(seed=0):
    """One attention step over a key cache: present.0 = Concat(past.0, x Wk); y = softmax(present
    q) . present Wo, with an int64 `mask` beside (like a decoder's attention_mask)."""
    rng = np.random.default_rng(seed)
    nodes = [
        node("MatMul", ["x", "Wk"], ["k"], "k"),
        node("Unsqueeze", ["k", "ax1"], ["k3"], "k3"),
        node("Concat", ["past.0", "k3"], ["present.0"], "cat", axis=1),
        node("MatMul", ["x", "Wq"], ["q"], "q"),
        node("Unsqueeze", ["q", "ax2"], ["q3"], "q3"),
        node("MatMul", ["present.0", "q3"], ["s"], "s"),
        node("Softmax", ["s"], ["a"], "sm", axis=1),
        node("Mul", ["a", "present.0"], ["c"], "c"),
        node("ReduceSum", ["c", "ax1"], ["ctx"], "ctx", keepdims=0),
        node("MatMul", ["ctx", "Wo"], ["y"], "y"),
        node("Cast", ["mask"], ["mask_f"], "mask_cast", to=TensorProto.FLOAT),
        node("ReduceSum", ["mask_f"], ["n"], "n", keepdims=0),
    ]
    inits = [
        init("Wk", weights(rng, 4, 4)),
        init("Wq", weights(rng, 4, 4)),
        init("Wo", weights(rng, 4, 4)),
        init("ax1", np.array([1], np.int64)),
        init("ax2", np.array([2], np.int64)),
    ]
    inputs = [
        tensor("x", [1, 4]),
        tensor("mask", [1, "total"], TensorProto.INT64),
        tensor("past.0", [1, "past", 4]),
    ]
    outputs = [tensor("y", [1, 4]), tensor("present.0", [1, "total", 4]), tensor("n", [])]
    return make_model(nodes, inputs, outputs, inits, opset=18)


def feeds(seed=1, past=3):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((1, 4)).astype(np.float32),
        "mask": np.ones((1, past + 1), np.int64),
        "past.0": rng.standard_normal((1, past, 4)).astype(np.float32),
    }


def elem_types(model) -> dict:
    return {v.name: v.type.tensor_type.elem_type for v in (*model.graph.input, *model.graph.output)}


def test_matching_io_takes_the_target_type_and_the_rest_stays():
    model = cached_step()
    out = amp_rewrite.rewrite(model, low_precision_io=CACHE).model
    onnx.checker.check_model(out, full_check=True)
    assert elem_types(out) == {
        "x": TensorProto.FLOAT,
        "mask": TensorProto.INT64,
        "past.0": F16,
        "y": TensorProto.FLOAT,
        "present.0": F16,
        "n": TensorProto.FLOAT,
    }
    by_output = {o: n for n in out.graph.node for o in n.output}
    assert by_output["present.0"].op_type == "Concat" and "past.0" in by_output["present.0"].input
    assert not [
        n.name for n in out.graph.node if n.op_type == "Cast" and n.input[0] in ("past.0", "present.0")
    ]
    f = feeds()
    expected = run_ort(model, f)
    half = {**f, "past.0": f["past.0"].astype(np.float16)}
    got = run_ort(out, half)
    assert got[1].dtype == np.float16 and got[0].dtype == np.float32
    assert_close(got, expected, 2e-2, 2e-2)
    assert_close(run_reference(out, half), expected, 2e-2, 2e-2)


def test_patterns_match_whole_names_and_add_to_no_keep_io_types():
    model = cached_step()
    only_past = amp_rewrite.rewrite(model, low_precision_io=[r"past\.0"]).model
    assert elem_types(only_past)["past.0"] == F16 and elem_types(only_past)["present.0"] == TensorProto.FLOAT
    everything = amp_rewrite.rewrite(model, keep_io_types=False, low_precision_io=CACHE).model
    assert {k for k, v in elem_types(everything).items() if v == F16} == {
        "x",
        "past.0",
        "y",
        "present.0",
        "n",
    }
    f = feeds()
    half = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in f.items()}
    assert_close(run_ort(only_past, {**f, "past.0": half["past.0"]}), run_ort(model, f), 2e-2, 2e-2)
    assert_close(run_ort(everything, half), run_ort(model, f), 2e-2, 2e-2)


@pytest.mark.parametrize(
    "pattern, words",
    [
        ("past", "matches no float32 graph input or output"),  # full match: a prefix is not enough
        ("mask", "matches no float32 graph input or output"),  # an int64 input: nothing to lower
        ("past(", "not a valid regular expression"),
    ],
)
def test_a_pattern_that_matches_nothing_is_one_line(pattern, words):
    with pytest.raises(UsageError, match=words) as caught:
        amp_rewrite.rewrite(cached_step(), low_precision_io=[r"present\..*", pattern])
    assert "\n" not in str(caught.value)


def test_cli_flag_is_repeatable_and_refuses_a_pattern_matching_nothing(tmp_path, capsys):
    source, output = tmp_path / "step.onnx", tmp_path / "step.fp16.onnx"
    onnx.save(cached_step(), source)
    assert (
        main(
            [
                str(source),
                "-o",
                str(output),
                "--quiet",
                "--low-precision-io",
                r"past\..*",
                "--low-precision-io",
                r"present\..*",
            ]
        )
        == 0
    )
    types = elem_types(onnx.load(output))
    assert types["past.0"] == types["present.0"] == F16 and types["x"] == types["y"] == TensorProto.FLOAT
    # --validate feeds the rewrite its float16 inputs as declared (the original's samples, rounded)
    assert (
        main(
            [
                str(source),
                "-o",
                str(output),
                "--quiet",
                "--force",
                "--validate",
                "--reference",
                "always",
                "--low-precision-io",
                r"past\..*",
                "--low-precision-io",
                r"present\..*",
            ]
        )
        == 0
    )
    assert main([str(source), "-o", str(tmp_path / "no.onnx"), "--low-precision-io", "cache.*"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'cache.*' matches no float32 graph input or output" in err
    assert not (tmp_path / "no.onnx").exists()
