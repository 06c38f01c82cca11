"""Issue 40, item 5: kernels checked against attributes as well as types.

ONNX Runtime's CPU provider registers ScatterElements and ScatterND for float16 and bfloat16, but
refuses a reduction in them when the node runs (caustic-nmr's GNN: ScatterElements with
reduction="add"). op_lists/kernel_attributes.yaml says which; the rewrite keeps such a node
float32 for the provider it colours for, and the summary says which provider that was.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from amp_rewrite import rewrite
from amp_rewrite.analysis import kernels
from helpers import assert_close, check_both, make_model, node, run_ort, tensor

REDUCTIONS = ("none", "add", "mul", "max", "min")
LOW = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}


def _runs_on_cpu(op: str, reduction: str, low: int) -> bool:
    """One node of `op` with `reduction` in type `low` (Casts around it), run on ORT's CPU provider."""
    shape = [2, 3] if op == "ScatterElements" else [2, 1]
    attrs = {"axis": 0} if op == "ScatterElements" else {}
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["x"], ["xl"], to=low),
            helper.make_node("Cast", ["u"], ["ul"], to=low),
            helper.make_node(op, ["xl", "i", "ul"], ["yl"], reduction=reduction, **attrs),
            helper.make_node("Cast", ["yl"], ["y"], to=TensorProto.FLOAT),
        ],
        "probe",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3]),
            helper.make_tensor_value_info("i", TensorProto.INT64, shape),
            helper.make_tensor_value_info("u", TensorProto.FLOAT, [2, 3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    feeds = {
        "x": np.zeros((4, 3), np.float32),
        "i": np.zeros(shape, np.int64),
        "u": np.ones((2, 3), np.float32),
    }
    try:
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        session.run(None, feeds)
    except Exception as error:  # ORT's errors have no common Python class
        assert "not supported" in str(error), error
        return False
    return True


@pytest.mark.parametrize("op", ["ScatterElements", "ScatterND"])
@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_the_cpu_rules_are_what_the_installed_onnxruntime_does(op, target):
    """Each value the data file refuses is refused by ORT's CPU provider, and each it does not runs."""
    check = kernels.KernelCheck("cpu", target)
    probe = onnx.NodeProto()
    refused = {}
    for reduction in REDUCTIONS:
        del probe.attribute[:]
        probe.attribute.append(helper.make_attribute("reduction", reduction))
        refused[reduction] = check.refuses("", op, 18, probe, "T") is not None
    ran = {reduction: _runs_on_cpu(op, reduction, LOW[target]) for reduction in REDUCTIONS}
    assert refused == {reduction: not ok for reduction, ok in ran.items()}
    assert not refused["none"]


def _scatter(reduction: str | None) -> onnx.ModelProto:
    attrs = {"axis": 0} if reduction is None else {"axis": 0, "reduction": reduction}
    return make_model(
        [node("ScatterElements", ["x", "idx", "u"], ["y"], "scatter", **attrs)],
        [tensor("x", [6, 16]), tensor("idx", [3, 16], TensorProto.INT64), tensor("u", [3, 16])],
        [tensor("y", [6, 16])],
        opset=18,
    )


def _feeds():
    rng = np.random.default_rng(0)
    return {
        "x": rng.standard_normal((6, 16)).astype(np.float32),
        "idx": rng.integers(0, 6, (3, 16)),
        "u": rng.standard_normal((3, 16)).astype(np.float32),
    }


# the user makes ScatterElements an allow op: no allow op of the standard lists has a float16 CPU
# kernel, so a CPU colouring would otherwise make nothing low
AS_ALLOW = {"allow": ["ScatterElements"], "never_worse": False}


def test_scatter_add_coloured_for_cpu_stays_float32_and_runs_there():
    model = _scatter("add")
    result = rewrite(model, provider="cpu", **AS_ALLOW)
    scatter = result.report.node("scatter")
    assert scatter["precision"] == "float32"
    assert "no float16 kernel on CPU for ScatterElements reduction='add'" in scatter["because"]
    assert result.report.summary["coloured_for"] == "CPU"
    assert result.report.summary["kernel_blocked"] == 1
    assert "coloured for ONNX Runtime's CPU provider" in result.report.to_text()
    assert not any("--opset" in note for note in result.report.notes)  # no opset lifts an attribute's refusal
    check_both(model, result.model, _feeds())


@pytest.mark.parametrize("reduction", [None, "none", "max"])
def test_scatter_the_cpu_kernel_runs_in_float16_stays_float16(reduction):
    """No reduction attribute is its default, "none": the CPU kernel runs it in float16."""
    model = _scatter(reduction)
    result = rewrite(model, provider="cpu", **AS_ALLOW)
    assert result.report.node("scatter")["precision"] == "float16"
    assert any(n.op_type == "ScatterElements" for n in result.model.graph.node)
    check_both(model, result.model, _feeds())


def test_scatter_add_coloured_for_cuda_is_float16_and_says_so():
    """CUDA reduces in float16 (no rule): low, and the summary names the provider it is for."""
    model = _scatter("add")
    result = rewrite(model, **AS_ALLOW)
    assert result.report.node("scatter")["precision"] == "float16"
    assert result.report.summary["coloured_for"] == "CUDA"
    assert "coloured for ONNX Runtime's CUDA provider" in result.report.to_text()
    feeds = _feeds()
    expected = run_ort(model, feeds)
    assert_close(ReferenceEvaluator(result.model).run(None, feeds), expected)
    with pytest.raises(Exception, match="not supported"):  # why a CPU deployment needs its own colouring
        run_ort(result.model, feeds)
    anywhere = rewrite(model, provider="any", **AS_ALLOW)
    assert anywhere.report.summary["coloured_for"] is None
    assert "coloured without a kernel check" in anywhere.report.to_text()


def test_checks_where_the_provider_refuses_a_node_say_so_in_one_line(tmp_path, capsys):
    """Coloured for CUDA and validated on ORT's CPU provider (where CUDA does not load), the
    ScatterElements(add) would fail mid-run ("internal error"): a UsageError naming it instead.
    Coloured for CPU it validates there."""
    from amp_rewrite import cli, driver
    from amp_rewrite.errors import UsageError
    from helpers import on_cuda

    model = _scatter("add")
    if on_cuda():
        assert driver.check(model, validate=True, **AS_ALLOW).passed
    else:
        for check in ({"validate": True}, {"tolerance": True}):  # the fallback's runs too
            with pytest.raises(UsageError, match="coloured for CUDA's kernels: ScatterElements 'scatter'"):
                driver.check(model, **check, **AS_ALLOW)
        path = tmp_path / "m.onnx"
        onnx.save(model, path)
        out = str(tmp_path / "out.onnx")
        assert (
            cli.main([str(path), "-o", out, "--validate", "--allow", "ScatterElements", "--even-if-worse"])
            == 2
        )
        error = capsys.readouterr().err
        assert "error: ONNX Runtime's CPU provider" in error and "ScatterElements 'scatter'" in error
        assert (
            "internal error" not in error and len(error.strip().splitlines()) <= 2
        )  # the CPU notice, then it
    checked = driver.check(model, validate=True, provider="cpu", **AS_ALLOW)
    assert checked.passed and checked.result.report.node("scatter")["precision"] == "float32"
