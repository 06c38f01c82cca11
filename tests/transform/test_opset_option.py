"""`opset=` / `--opset N`: the model converted by onnx.version_converter before colouring, and the
summary line that says when kernel-blocked nodes would run in the target type at a newer opset.
Every rewrite runs in ONNX Runtime and onnx.reference against the float32 original."""

import numpy as np
import onnx
import pytest

from amp_rewrite import rewrite
from amp_rewrite.cli import main
from amp_rewrite.errors import UsageError
from helpers import assert_close, init, make_model, node, run_ort, run_reference, tensor, weights


def relu6_classifier(blocks=4, opset=11):
    """A MobileNet-like classifier at opset 11: Conv -> Clip(0, 6) (ReLU6) blocks, pooled, Gemm."""
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [init("lo", np.array(0, np.float32)), init("hi", np.array(6, np.float32))], "x"
    for b in range(blocks):
        inits.append(init(f"W{b}", weights(rng, 8, 8 if b else 3, 3, 3) * 0.5))
        nodes += [
            node("Conv", [x, f"W{b}"], [f"c{b}"], f"conv{b}", pads=[1, 1, 1, 1]),
            node("Clip", [f"c{b}", "lo", "hi"], [f"r{b}"], f"relu6_{b}"),
        ]
        x = f"r{b}"
    inits += [init("Wfc", weights(rng, 8, 10)), init("bfc", weights(rng, 10))]
    nodes += [
        node("GlobalAveragePool", [x], ["pooled"], "pool"),
        node("Flatten", ["pooled"], ["flat"], "flatten"),
        node("Gemm", ["flat", "Wfc", "bfc"], ["logits"], "fc"),
    ]
    return make_model(nodes, [tensor("x", [1, 3, 8, 8])], [tensor("logits", [1, 10])], inits, opset=opset)


def _casts(model):
    return sum(n.op_type == "Cast" for n in model.graph.node)


@pytest.mark.even_if_worse
def test_opset_11_clips_stay_float32_and_the_summary_names_the_opset_that_runs_them():
    model = relu6_classifier()
    result = rewrite(model)
    clips = [e for e in result.report.nodes if e["op_type"] == "Clip"]
    assert all(
        e["precision"] == "float32" and "no float16 kernel on CUDA at opset 11" in e["because"] for e in clips
    )
    assert "4 Clip nodes stay float32 at opset 11: --opset 12 runs them in float16" in result.report.notes
    assert _casts(result.model) > 4


def test_opset_13_runs_every_clip_in_float16_with_few_casts():
    model = relu6_classifier()
    result = rewrite(model, opset=13)
    assert {o.domain: o.version for o in result.model.opset_import}[""] == 13
    assert all(e["precision"] == "float16" for e in result.report.nodes if e["op_type"] == "Clip")
    assert _casts(result.model) <= 4
    assert not any("--opset" in n for n in result.report.notes)
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)}
    expected = run_ort(model, feeds)
    assert_close(run_ort(result.model, feeds), expected, rtol=2e-2, atol=2e-2)
    assert_close(run_reference(result.model, feeds), expected, rtol=2e-2, atol=2e-2)


def test_cli_opset_and_a_conversion_the_converter_refuses(tmp_path, capsys):
    path = tmp_path / "m.onnx"
    onnx.save(relu6_classifier(), path)
    assert main([str(path), "-o", str(tmp_path / "out.onnx"), "--opset", "13", "--quiet"]) == 0
    assert onnx.load(tmp_path / "out.onnx").opset_import[0].version == 13
    with pytest.raises(UsageError, match="opset 0 must be a whole number"):
        rewrite(relu6_classifier(), opset=0)
    with pytest.raises(UsageError, match="--opset 1: onnx.version_converter cannot convert this model"):
        rewrite(relu6_classifier(), opset=1)


def test_bfloat16_convs_before_opset_22_name_the_opset_whose_schema_allows_them(example_models):
    """Conv's schema takes bfloat16 from opset 22 (ONNX Runtime's CUDA Conv too): before it the
    convs stay float32 and the summary says which opset runs them (ResNet-50's bfloat16 barely beat
    float32 on the H200: issue 40 item 6). MaxPool and BatchNormalization have no bfloat16 CUDA
    kernel at any opset: no line promises them."""
    model = example_models["tiny_cnn"]
    result = rewrite(model, target="bfloat16")
    convs = [e for e in result.report.nodes if e["op_type"] == "Conv"]
    assert convs and all(
        e["precision"] == "float32" and "does not allow bfloat16" in e["because"] for e in convs
    )
    assert result.report.notes == [
        f"{len(convs)} Conv nodes stay float32 at opset 17: --opset 22 runs them in bfloat16"
    ]
    converted = rewrite(model, target="bfloat16", opset=22, never_worse=False)
    assert all(e["precision"] == "bfloat16" for e in converted.report.nodes if e["op_type"] == "Conv")
    assert not any("--opset" in n for n in converted.report.notes)
    feeds = {"image": np.random.default_rng(2).standard_normal((2, 3, 16, 16)).astype(np.float32)}
    expected = run_ort(model, feeds)
    assert_close(run_reference(converted.model, feeds), expected, rtol=5e-2, atol=5e-2)
