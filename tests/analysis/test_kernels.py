"""Provider-aware colouring: a node the provider has no target-type kernel for stays float32."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from amp_rewrite import cli, rewrite
from helpers import (
    ROOT,
    assert_close,
    init,
    load_tool,
    loaded_provider,
    make_model,
    node,
    run_ort,
    run_reference,
    tensor,
)
from kernel_facts import uncovered_low_nodes


def _sandwich(op: str, opset: int, extra_inputs=(), extra_inits=(), **attrs) -> onnx.ModelProto:
    """MatMul -> op -> MatMul: the op sits between two allow ops, so TF's rule would paint it."""
    rng = np.random.default_rng(3)
    w1, w2 = (init(n, rng.standard_normal((8, 8)).astype(np.float32) / 3) for n in ("w1", "w2"))
    return make_model(
        [
            node("MatMul", ["x", "w1"], ["h"], name="mm1"),
            node(op, ["h", *extra_inputs], ["a"], name="act", **attrs),
            node("MatMul", ["a", "w2"], ["y"], name="mm2"),
        ],
        [tensor("x", [2, 8])],
        [tensor("y", [2, 8])],
        [w1, w2, *extra_inits],
        opset=opset,
    )


def _numbers_match(model, result):
    feeds = {"x": np.random.default_rng(4).standard_normal((2, 8)).astype(np.float32)}
    expected = run_ort(model, feeds)
    assert_close(run_ort(result.model, feeds)[0], expected[0])
    assert_close(run_reference(result.model, feeds)[0], expected[0])


CLIP_BOUNDS = (["lo", "hi"], [init("lo", np.float32(0)), init("hi", np.float32(6))])


@pytest.mark.parametrize(
    "op,opset,extra", [("Clip", 11, CLIP_BOUNDS), ("Mish", 18, ([], []))], ids=["clip11", "mish"]
)
def test_op_without_cuda_kernel_stays_float32_and_says_why(op, opset, extra):
    model = _sandwich(op, opset, *extra)
    result = rewrite(model)  # provider="cuda" by default
    act = result.report.node("act")
    assert act["precision"] == "float32"
    assert f"no float16 kernel on CUDA at opset {opset}" in act["because"]
    assert result.report.node("mm1")["precision"] == result.report.node("mm2")["precision"] == "float16"
    assert result.report.summary["kernel_blocked"] == 1
    assert "for want of a float16 kernel" in result.report.to_text()
    assert uncovered_low_nodes(result.model) == []
    _numbers_match(model, result)
    anywhere = rewrite(model, provider="any")  # no kernel check: TF's rule paints it between the MatMuls
    assert anywhere.report.node("act")["precision"] == "float16"
    assert anywhere.report.summary["kernel_blocked"] == 0
    assert uncovered_low_nodes(anywhere.model) == [f"{op} 'act' (opset {opset})"]  # the test's table agrees


def test_clip_from_opset_12_has_a_float16_kernel():
    result = rewrite(_sandwich("Clip", 12, *CLIP_BOUNDS))
    assert result.report.node("act")["precision"] == "float16"


def test_cpu_provider_reads_the_cpu_table():
    """ORT's CPU provider registers no float16 MatMul (it inserts casts around it): nothing to gain."""
    model = _sandwich("Relu", 17)
    result = rewrite(model, provider="cpu")
    assert result.report.node("mm1")["precision"] == "float32"
    assert "no float16 kernel on CPU at opset 17" in result.report.node("mm1")["because"]
    assert result.report.summary["casts_inserted"] == 0


def test_kernel_without_declared_types_is_unknown_and_noted():
    """CUDA's Resize-19 kernel declares T1 only: its roi group (T2) is unknown, coloured as before."""
    rng = np.random.default_rng(5)
    model = make_model(
        [
            node("MatMul", ["x", "w1"], ["h"], name="mm1"),
            node(
                "Resize",
                ["h", "roi", "scales"],
                ["a"],
                name="act",
                mode="linear",
                coordinate_transformation_mode="tf_crop_and_resize",
            ),
            node("MatMul", ["a", "w2"], ["y"], name="mm2"),
        ],
        [tensor("x", [2, 8])],
        [tensor("y", [2, 8])],
        [
            init("w1", rng.standard_normal((8, 8)).astype(np.float32)),
            init("w2", rng.standard_normal((16, 8)).astype(np.float32)),
            init("roi", np.array([0, 0, 1, 1], np.float32)),
            init("scales", np.array([1, 2], np.float32)),
        ],
        opset=19,
    )
    cuda, anywhere = rewrite(model), rewrite(model, provider="any")
    assert any("Resize at opset 19 declares no types for T2" in n for n in cuda.report.notes)
    assert (
        cuda.report.node("act")["groups"]["T2"]["precision"]
        == anywhere.report.node("act")["groups"]["T2"]["precision"]
    )
    assert cuda.report.node("act")["groups"]["T1"]["precision"] == "float16"
    assert uncovered_low_nodes(cuda.model) == []


def test_unknown_provider_is_one_line_error(tmp_path, capsys):
    with pytest.raises(Exception, match="unknown provider 'tpu'"):
        rewrite(_sandwich("Relu", 17), provider="tpu")
    path = tmp_path / "m.onnx"
    onnx.save(_sandwich("Mish", 18), path)
    assert cli.main([str(path), "--provider", "tpu", "--dry-run"]) == 2


def test_cli_provider_colours_and_validates(tmp_path, capsys):
    path = tmp_path / "m.onnx"
    onnx.save(_sandwich("Clip", 11, *CLIP_BOUNDS), path)
    report = tmp_path / "r.json"
    assert cli.main([str(path), "--report", str(report), "--validate", "--quiet", "--force"]) == 0
    data = json.loads(report.read_text())
    assert data["summary"]["kernel_blocked"] == 1 and data["validation"]["passed"]
    assert (
        cli.main(
            [str(path), "--provider", "any", "--report", str(report), "--validate", "--quiet", "--force"]
        )
        == 0
    )
    data = json.loads(report.read_text())
    assert data["summary"]["kernel_blocked"] == 0 and data["validation"]["provider"] == loaded_provider()


CORPUS = ["examples/tiny_cnn.onnx", "examples/tiny_transformer.onnx", "synthetic", "mobilenet11"]


def _mobilenet_block(opset: int) -> onnx.ModelProto:
    """Conv -> Clip(0, 6) (ReLU6) -> depthwise Conv -> Clip -> Conv at `opset`."""
    rng = np.random.default_rng(6)
    nodes, inits, x = [], [init("lo", np.float32(0)), init("hi", np.float32(6))], "x"
    for i, (cin, cout, group) in enumerate([(3, 8, 1), (8, 8, 8), (8, 4, 1)]):
        inits.append(init(f"w{i}", rng.standard_normal((cout, cin // group, 3, 3)).astype(np.float32) / 4))
        nodes.append(node("Conv", [x, f"w{i}"], [f"c{i}"], name=f"conv{i}", group=group, pads=[1, 1, 1, 1]))
        x = f"c{i}"
        if i < 2:
            nodes.append(node("Clip", [x, "lo", "hi"], [f"r{i}"], name=f"relu6_{i}"))
            x = f"r{i}"
    nodes[-1].output[0] = "y"
    return make_model(nodes, [tensor("x", [1, 3, 8, 8])], [tensor("y", [1, 4, 8, 8])], inits, opset=opset)


@pytest.mark.parametrize("case", CORPUS)
@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_corpus_has_no_low_node_without_a_cuda_kernel(case, target):
    if case == "synthetic":
        model = load_tool("synthetic").transformer_stack(80)
    elif case == "mobilenet11":
        model = _mobilenet_block(11)
    else:
        model = onnx.load(ROOT / case)
    result = rewrite(model, target=target)
    assert uncovered_low_nodes(result.model, target) == []
    if case == "mobilenet11" and target == "float16":
        assert [result.report.node(f"relu6_{i}")["precision"] for i in range(2)] == ["float32"] * 2
        assert result.report.summary["kernel_blocked"] == 2
