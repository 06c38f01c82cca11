"""The ops the autodiff issue requires all have a rule and a finite-difference case, and
docs/autodiff_ops.md is what tools/autodiff_coverage.py generates today."""

from __future__ import annotations

from amp_rewrite.autodiff import covered_ops
from helpers import ROOT, load_tool

CASES = load_tool("autodiff_cases").CASES
REQUIRED = (
    "Conv BatchNormalization MaxPool AveragePool GlobalAveragePool Flatten Gemm MatMul Add Mul Sub Div Pow Sqrt "
    "Reciprocal Exp Log Erf Tanh Sigmoid Relu LeakyRelu Gelu Softmax LogSoftmax LayerNormalization ReduceMean "
    "ReduceSum Reshape Transpose Squeeze Unsqueeze Concat Split Slice Gather GatherElements Expand Where Cast "
    "Identity Dropout Clip Abs Neg Min Max Tile Pad Einsum CumSum SoftmaxCrossEntropyLoss NegativeLogLikelihoodLoss"
).split()


def test_every_required_op_has_a_rule_and_a_case():
    covered = {op for domain, op in covered_ops() if domain == ""}
    tested = {case.op for case in CASES}
    assert not [op for op in REQUIRED if op not in covered]
    assert not [op for op in REQUIRED if op not in tested]


def test_coverage_table_is_up_to_date():
    tool = load_tool("autodiff_coverage", needs=["autodiff_cases"])
    assert (ROOT / "docs" / "autodiff_ops.md").read_text() == tool.render(), (
        "run python tools/autodiff_coverage.py --write"
    )
