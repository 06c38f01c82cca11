"""Print or regenerate the autodiff coverage table (docs/autodiff_ops.md).

    python tools/autodiff_coverage.py            # print the Markdown table
    python tools/autodiff_coverage.py --write    # regenerate docs/autodiff_ops.md
    python tools/autodiff_coverage.py --check    # exit 1 when the file is stale

Per op: the inputs that carry a gradient, the rule's formula (its docstring), the standard ops its
backward emits (found by building the gradient of each case in tools/autodiff_cases.py), the
number of finite-difference cases, and whether ONNX Runtime's own gradient registry has the op.
A second table gives each emitted backward op's float16 AMP list, so the rewrite can colour
forward and backward together.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from amp_rewrite.autodiff import build_gradient_graph, covered_ops
from amp_rewrite.autodiff.contrib import DECOMPOSED
from amp_rewrite.autodiff.registry import REGISTRY
from autodiff_cases import CASES  # a sibling in tools/ (also read by tests/autodiff/test_rules.py)

ROOT = Path(__file__).resolve().parent.parent

DOC = ROOT / "docs" / "autodiff_ops.md"

# Op types with a builder in ONNX Runtime's gradient registry (training build), standard domain only.
ORT_REGISTRY = set(
    "Cast Sin Cos Log Tanh Sqrt Erf MatMul Split Relu Pow ReduceMean ReduceSum ReduceLogSumExp ReduceL2 Add Sub "
    "Mul Div Neg Concat Reshape Transpose Gemm MaxPool Gather Conv Squeeze Unsqueeze Sigmoid Softmax LogSoftmax "
    "SoftmaxCrossEntropyLoss GlobalAveragePool AveragePool Dropout GatherND GatherElements Gelu LayerNormalization "
    "BatchNormalization Slice Where Expand Exp Flatten TopK Clip Abs Min Max Tile Pad Identity ScatterND "
    "ScatterElements Trilu Reciprocal LeakyRelu ConvTranspose Resize Atan GlobalMaxPool".split()
)


LIMITS = [
    "Opset 13 or newer. Scatter-add needs opset 16: GatherElements, GatherND and overlapping MaxPool "
    "refuse older opsets with a clear error; Gather falls back to a one-hot MatMul.",
    "If: the gradient flows through the branch taken into every tensor the branches read from outside "
    "(zeros for the other branch's); weights stored inside branches (initializers, Constant nodes) are lifted "
    "to main-graph initializers first. The backward recomputes the branch's forward. Loop and Scan have no rule "
    "(mark their outputs stop-gradient): 'no gradient rule for op Loop', also when only a body capture needs one.",
    "Pad: constant mode with constant, non-negative pads. MaxPool/AveragePool: ceil_mode=0; MaxPool "
    "storage_order=0. Conv/AveragePool auto_pad=SAME_* needs static spatial sizes; AveragePool a static channel count.",
    "Resize: modes nearest (every nearest_mode), linear and cubic (cubic_coeff_a, exclude_outside) with "
    "coordinate_transformation_mode half_pixel, pytorch_half_pixel, asymmetric or align_corners; antialias, "
    "tf_half_pixel_for_nn, tf_crop_and_resize and keep_aspect_ratio_policy other than stretch are refused with one "
    "line naming the attribute.",
    "LSTM/GRU: default activations only; clip, peepholes (a non-zero P), input_forget=1 and layout=1 are "
    "refused with one line. Backpropagation runs in ONNX Scan ops (any sequence length); onnx.reference "
    "cannot run a reverse-time Scan, so their cases check ORT's float32 gradient against the differences.",
    "Fused ops: Attention without do_rotary, past_present_share_buffer, past_sequence_length and 4-D or [2B] "
    "masks; FusedMatMul without transBatch; SimplifiedLayerNormalization on the last axis only. Each refusal is "
    "one GradientError line naming the attribute.",
    "Einsum: no repeated subscript within one operand (diagonals). GatherND: batch_dims=0.",
    "Not differentiated: BatchNormalization running mean/variance, Clip bounds, Where condition, "
    "indices, shapes and axes. Floor, Ceil, Round and Sign have zero gradient.",
    "DequantizeLinear of a QuantizeLinear's output (QDQ): the straight-through estimator to the "
    "QuantizeLinear's x, dY inside the representable range and 0 where it saturates (torch's FakeQuantize); the "
    "pair must share its scale and zero point; block_size and float8 types are refused; scales, zero points and "
    "integer weights get no gradient. Checked against a numpy STE (tests/autodiff/test_quantize_ste.py), not by "
    "finite differences: rounding's are zero.",
    "Ranks come from ONNX shape inference; un-broadcasting trusts an inferred static 1 (a symbolic dim "
    "is resolved at run time).",
]


def case_model(case) -> onnx.ModelProto:
    """The case's nodes with loss = sum of ReduceSum over its outputs, in float32."""
    elem = TensorProto.FLOAT
    nodes = list(case.nodes(elem) if callable(case.nodes) else case.nodes)
    sums = [f"sum_{o}" for o in case.outputs]
    nodes += [helper.make_node("ReduceSum", [o], [s], keepdims=0) for o, s in zip(case.outputs, sums)]
    nodes.append(helper.make_node("Sum", sums, ["loss"]))
    inits = [
        onnx.numpy_helper.from_array(v.astype("float32") if v.dtype.kind == "f" else v, k)
        for k, v in case.consts.items()
    ]
    graph = helper.make_graph(
        nodes,
        "case",
        [helper.make_tensor_value_info(k, elem, v) for k, v in case.inputs.items()],
        [helper.make_tensor_value_info("loss", elem, [])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", case.opsets[0])], ir_version=8)


def emitted_ops() -> tuple[dict[str, set[str]], dict[str, int]]:
    """Backward op types per forward op type, and the number of test cases per op type."""
    emitted, cases = defaultdict(set), defaultdict(int)
    for case in CASES:
        cases[case.op] += 1
        model = case_model(case)
        scopes = tuple(f"grad/{n.name}/" for n in model.graph.node if n.op_type == case.op)
        grad = build_gradient_graph(model, "loss", list(case.inputs))
        emitted[case.op] |= {n.op_type for n in grad.graph.node if n.name.startswith(scopes)}
    return emitted, cases


def differentiable(rule) -> str:
    return "all float" if rule.differentiable is None else ", ".join(str(i) for i in rule.differentiable)


def render() -> str:
    emitted, cases = emitted_ops()
    lines = [
        "# Autodiff coverage",
        "",
        "Generated by `python tools/autodiff_coverage.py --write`; do not edit by hand.",
        "",
        f"{len(covered_ops())} op types have a gradient rule (ONNX Runtime's registry: about 80, half of them on",
        "training-only kernels). Every rule emits standard ONNX ops only. *Cases*: finite-difference cases in",
        "`tools/autodiff_cases.py` (each run at opsets 17 and 18 unless the op needs another, float64 against",
        "central differences, then float32 in ONNX Runtime CPU). *ORT*: whether ONNX Runtime's gradient",
        "registry has the op.",
        "",
        "| Op | Inputs with a gradient | Gradient | Backward ops emitted | Cases | ORT |",
        "|---|---|---|---|---|---|",
    ]
    for domain, op in covered_ops():
        rule = REGISTRY[(domain, op)]
        doc = " ".join((rule.fn.__doc__ or "").split()) or "zero (piecewise constant)"
        ops = ", ".join(sorted(emitted.get(op, ()))) or "—"
        name = f"{domain}::{op}" if domain else op
        lines.append(
            f"| {name} | {differentiable(rule)} | {doc} | {ops} | {cases.get(op, 0)} | "
            f"{'yes' if op in ORT_REGISTRY else 'no'} |"
        )
    lines += [
        "",
        "## ONNX Runtime's fused ops, decomposed before differentiation",
        "",
        "`build_gradient_graph` first rewrites these (emitted by ONNX Runtime's transformers optimizer for",
        "BERT/GPT-2 and by its graph optimizer) into the standard ops below, which the rules above differentiate;",
        "`tests/autodiff/test_real_model_rules.py` checks each forward against ONNX Runtime's kernel and each",
        "gradient against torch and finite differences.",
        "",
        "| Op | Standard-op form |",
        "|---|---|",
    ]
    for (domain, op), fn in sorted(DECOMPOSED.items()):
        lines.append(f"| {domain + '::' if domain else ''}{op} | {' '.join((fn.__doc__ or '').split())} |")
    lines += ["", "## Limits", "", *[f"- {limit}" for limit in LIMITS]]
    lines += [
        "",
        "## Backward ops and the float16 AMP lists",
        "",
        "The AMP rewrite colours the gradient graph like any other graph; these are the lists the",
        "backward ops fall in (`op_lists/float16.yaml`). Ops in no list stay float32.",
        "",
        "| Backward op | float16 list |",
        "|---|---|",
    ]
    lists = _float16_lists()
    for op in sorted(set().union(*emitted.values())):
        lines.append(f"| {op} | {lists(op)} |")
    return "\n".join(lines) + "\n"


def _float16_lists():
    try:
        from amp_rewrite.analysis.oplists import load_op_lists

        op_lists = load_op_lists("float16")
    except Exception:  # noqa: BLE001 - the rewrite package is optional for this table
        return lambda op: "?"

    def classify(op):
        entry = op_lists.classify("", op)
        return entry.list if entry else "none (float32)"

    return classify


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"regenerate {DOC.relative_to(ROOT)}")
    parser.add_argument("--check", action="store_true", help="exit 1 when the file is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        DOC.write_text(text)
    elif args.check:
        if not DOC.exists() or DOC.read_text() != text:
            print(
                f"{DOC.relative_to(ROOT)} is stale: run python tools/autodiff_coverage.py --write",
                file=sys.stderr,
            )
            return 1
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
