"""Every gradient rule against central finite differences in float64 (onnx.reference), then the
same gradient graph in float32 through ONNX Runtime CPU against the float64 result.

Tolerances: float64 analytic vs finite differences (eps 1e-6) within 1e-5 relative to
max(1, |numeric|); float32 ONNX Runtime vs float64 analytic within rtol 2e-3 / atol 2e-4. Ops that onnx.reference
runs only in float32 (Erf, Gelu, Celu) use float32 differences, step 1e-2, tolerance 2e-3.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from amp_rewrite.autodiff import build_gradient_graph
from amp_rewrite.autodiff.gradcheck import max_gradient_error, numeric_gradients
from helpers import IR_VERSION, load_tool, run_ort

_cases = load_tool("autodiff_cases")  # tools/autodiff_cases.py: shared with tools/autodiff_coverage.py
CASES, OpCase = _cases.CASES, _cases.OpCase

PARAMS = [pytest.param(case, opset, id=f"{case.id}-op{opset}") for case in CASES for opset in case.opsets]


def case_feeds(case: OpCase, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    custom = case.feeds(rng) if case.feeds else {}
    feeds = {}
    for name, dims in case.inputs.items():
        shape = [case.batch if isinstance(d, str) else d for d in dims]
        if name in custom:
            feeds[name] = np.asarray(custom[name], dtype=np.float64)
        elif name in case.positive:
            feeds[name] = rng.uniform(0.5, 2.0, shape)
        else:
            feeds[name] = rng.standard_normal(shape)
    return feeds


def forward_model(case: OpCase, opset: int, elem: int, outputs=None) -> onnx.ModelProto:
    np_type = helper.tensor_dtype_to_np_dtype(elem)
    nodes = case.nodes(elem) if callable(case.nodes) else case.nodes
    inputs = [helper.make_tensor_value_info(k, elem, v) for k, v in case.inputs.items()]
    consts = [
        numpy_helper.from_array(v.astype(np_type) if np.issubdtype(v.dtype, np.floating) else v, k)
        for k, v in case.consts.items()
    ]
    outs = outputs or [helper.make_tensor_value_info(o, elem, None) for o in case.outputs]
    graph = helper.make_graph(list(nodes), "case", inputs, outs, consts)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION)


def loss_model(case: OpCase, opset: int, elem: int, feeds) -> onnx.ModelProto:
    """The case's op followed by loss = sum_o sum(o * R_o), R_o random and fixed."""
    probe = ReferenceEvaluator(forward_model(case, opset, case.fd_elem))
    shapes = [np.shape(v) for v in probe.run(None, feeds)]
    model = forward_model(case, opset, elem)
    rng = np.random.default_rng(1)
    graph = model.graph
    terms = []
    for out, shape in zip(case.outputs, shapes):
        weight = rng.standard_normal(shape).astype(helper.tensor_dtype_to_np_dtype(elem))
        graph.initializer.append(numpy_helper.from_array(weight, f"R_{out}"))
        graph.node.append(helper.make_node("Mul", [out, f"R_{out}"], [f"weighted_{out}"]))
        graph.node.append(helper.make_node("ReduceSum", [f"weighted_{out}"], [f"loss_{out}"], keepdims=0))
        terms.append(f"loss_{out}")
    graph.node.append(helper.make_node("Sum", terms, ["loss"]))
    del graph.output[:]  # the case outputs have no declared shape; the loss is what we check
    graph.output.append(helper.make_tensor_value_info("loss", elem, []))
    onnx.checker.check_model(model, full_check=True)
    return model


def float32(feeds):
    return {k: v.astype(np.float32) for k, v in feeds.items()}


@pytest.mark.parametrize(("case", "opset"), PARAMS)
def test_rule_matches_finite_differences(case: OpCase, opset: int):
    feeds = case_feeds(case)
    if case.fd_elem == TensorProto.FLOAT:
        feeds = float32(feeds)
    wrt = list(case.inputs)
    model64 = loss_model(case, opset, case.fd_elem, feeds)
    grad64 = build_gradient_graph(model64, "loss", wrt)
    onnx.checker.check_model(grad64, full_check=True)
    assert grad64.opset_import[0].version == opset and grad64.ir_version == IR_VERSION
    names = [f"{w}_grad" for w in wrt]
    grad32 = build_gradient_graph(loss_model(case, opset, TensorProto.FLOAT, feeds), "loss", wrt)
    onnx.checker.check_model(grad32, full_check=True)
    got = dict(zip([o.name for o in grad32.graph.output], run_ort(grad32, float32(feeds))))
    numeric = numeric_gradients(model64, "loss", feeds, wrt, eps=case.eps)
    if not case.reference_runs_gradient:
        assert max_gradient_error(numeric, {w: got[f"{w}_grad"] for w in wrt}) < 2e-3
        return
    analytic = dict(zip(wrt, ReferenceEvaluator(grad64).run(names, feeds)))
    for w in wrt:
        assert analytic[w].shape == feeds[w].shape, w
    assert max_gradient_error(numeric, analytic) < case.rtol
    for w in wrt:
        np.testing.assert_allclose(got[f"{w}_grad"], analytic[w], rtol=2e-3, atol=2e-4)
