"""Models that used to end in exit 70 ("a bug in amp-rewrite") or in a misleading line (issue 24, 5, 7).

Invalid UTF-8 in a domain, a function call without an input its body reads: ModelError lines
(checked when a stage fails, so valid models pay nothing). A valid model with a string output
validates (strings compared exactly). An If nested 50 deep is past protobuf's depth limit: the
line says so instead of "truncated".
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import amp_rewrite
from amp_rewrite import errors
from amp_rewrite.cli import main
from helpers import load_script

make_corpus = load_script("tests/hostile/make_corpus.py")


def _varint(n: int) -> bytes:
    out = b""
    while True:
        low, n = n & 0x7F, n >> 7
        if not n:
            return out + bytes([low])
        out += bytes([low | 0x80])


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _nested_ifs(depth: int) -> bytes:
    """A model whose If is nested `depth` deep, encoded by hand (upb cannot build one past its limit)."""

    def value(name):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 4]).SerializeToString()

    def branch(name, out):
        return helper.make_graph(
            [helper.make_node("Relu", ["x"], [out], name=name)],
            name,
            [],
            [helper.make_tensor_value_info(out, TensorProto.FLOAT, [2, 4])],
        ).SerializeToString()

    graph = branch("leaf", "o0")
    for d in range(1, depth + 1):
        then = _field(1, b"then_branch") + _varint(20 << 3) + _varint(5) + _field(6, graph)
        other = (
            _field(1, b"else_branch") + _varint(20 << 3) + _varint(5) + _field(6, branch(f"e{d}", f"e{d}"))
        )
        node = (
            _field(1, b"c")
            + _field(2, f"o{d}".encode())
            + _field(3, f"if{d}".encode())
            + _field(4, b"If")
            + _field(5, then)
            + _field(5, other)
        )
        graph = _field(1, node) + _field(2, f"g{d}".encode()) + _field(12, value(f"o{d}"))
    cond = helper.make_node(
        "Constant", [], ["c"], name="cc", value=helper.make_tensor("v", TensorProto.BOOL, [], [True])
    )
    main_graph = helper.make_graph(
        [cond],
        "main",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info(f"o{depth}", TensorProto.FLOAT, [2, 4])],
    )
    model = helper.make_model(helper.make_graph([], "", [], []), opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    model.ClearField("graph")
    return model.SerializeToString() + _field(7, main_graph.SerializeToString() + _field(1, node))


def test_an_if_nested_past_protobufs_limit_says_what_the_limit_is(tmp_path, capsys):
    path = tmp_path / "deep.onnx"
    path.write_bytes(_nested_ifs(50))
    assert main([str(path), "--dry-run"]) == 3
    err = capsys.readouterr().err
    assert "protobuf's limit of 100" in err and "truncated" not in err and len(err.strip().splitlines()) == 1


def test_an_if_nested_within_the_limit_rewrites(tmp_path):
    path = tmp_path / "deep.onnx"
    path.write_bytes(_nested_ifs(10))
    onnx.checker.check_model(amp_rewrite.rewrite(str(path)).model)


def _bad_utf8(where: str) -> bytes:
    model = make_corpus.valid_model()
    if where == "opset":
        model.opset_import.add(domain="qqqq", version=1)
    else:
        model.graph.node[1].domain = "qqqq"
        model.opset_import.add(domain="qqqq", version=1)
    return model.SerializeToString().replace(b"qqqq", b"\xff\xfe\xfd\xfc")


@pytest.mark.parametrize("where", ["opset", "node"])
def test_a_domain_that_is_not_utf8_is_a_model_error(where, tmp_path, capsys):
    path = tmp_path / "m.onnx"
    path.write_bytes(_bad_utf8(where))
    assert main([str(path), "--dry-run"]) == 3
    err = capsys.readouterr().err.strip()
    assert "not valid UTF-8 text" in err and len(err.splitlines()) == 1, err
    with pytest.raises(errors.ModelError, match="not valid UTF-8"):
        amp_rewrite.rewrite(str(path))


def test_a_function_call_without_an_input_its_body_reads(tmp_path, capsys):
    body = [helper.make_node("Add", ["a", "b"], ["c"])]
    fn = helper.make_function("local", "F", ["a", "b"], ["c"], body, [helper.make_opsetid("", 17)])
    graph = helper.make_graph(
        [helper.make_node("F", ["x"], ["y"], domain="local", name="call")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
    )
    model = helper.make_model(
        graph, functions=[fn], opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)]
    )
    model.ir_version = 8
    path = tmp_path / "fn.onnx"
    path.write_bytes(model.SerializeToString())
    assert main([str(path), "--dry-run"]) == 3
    assert "calls function 'F' without its input 'b'" in capsys.readouterr().err
    with pytest.raises(errors.ModelError, match="without its input 'b'"):
        amp_rewrite.rewrite(model)


def test_a_valid_model_with_a_string_output_validates(tmp_path, capsys):
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"], name="mm"),
        helper.make_node(
            "Constant", [], ["s"], name="c", value=helper.make_tensor("v", TensorProto.STRING, [1], [b"hi"])
        ),
        helper.make_node("Identity", ["s"], ["t"], name="i"),
    ]
    w1 = make_corpus.valid_model().graph.initializer[0]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [
            helper.make_tensor_value_info("h", TensorProto.FLOAT, [2, 32]),
            helper.make_tensor_value_info("t", TensorProto.STRING, [1]),
        ],
        [w1],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "s.onnx"
    path.write_bytes(model.SerializeToString())
    report = tmp_path / "r.json"
    assert main([str(path), "--dry-run", "--validate", "--report", str(report)]) == 0, capsys.readouterr().err
    runs = json.loads(report.read_text())["validation"]["runs"]
    strings = [s for stats in runs.values() for s in stats if s["name"] == "t"]
    assert strings and all(s["passed"] and s["max_abs"] == 0 for s in strings)

    from amp_rewrite.checks.validate import compare

    assert not compare([np.array(["a"])], [np.array(["b"])], rtol=1, atol=1)["passed"]


def test_an_opset_older_than_onnx_runtime_supports_is_refused(tmp_path, capsys):
    """Hypothesis found it: at ai.onnx opset 1 Cast's `to` is a string, so the rewrite's casts were invalid."""
    model = make_corpus.valid_model()
    model.opset_import[0].version = 1
    path = tmp_path / "old.onnx"
    path.write_bytes(model.SerializeToString())
    assert main([str(path), "--dry-run"]) == 3
    assert "older than ONNX Runtime supports (at least 7)" in capsys.readouterr().err


def test_a_function_call_with_more_inputs_than_the_function_declares(tmp_path, capsys):
    """Hypothesis found it: onnx's inliner asserts (a RuntimeError, exit 70) on such a call."""
    body = [helper.make_node("Add", ["a", "b"], ["c"])]
    fn = helper.make_function("local", "F", ["a", "b"], ["c"], body, [helper.make_opsetid("", 17)])
    graph = helper.make_graph(
        [helper.make_node("F", ["x", "x", "x"], ["y"], domain="local", name="call")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
    )
    model = helper.make_model(
        graph, functions=[fn], opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)]
    )
    model.ir_version = 8
    with pytest.raises(errors.ModelError, match="with 3 inputs; it declares 2"):
        amp_rewrite.rewrite(model)
