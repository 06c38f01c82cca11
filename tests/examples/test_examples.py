"""The shipped example models and scripts work.

Scripts run in subprocesses (helpers.run_script) and import the installed amp_rewrite, as the
tests do: CI installs the wheel, a developer an editable checkout.
"""

from __future__ import annotations

import importlib.util
import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto

import amp_rewrite
from helpers import ROOT, assert_close, load_script, load_tool, run_ort, run_reference, run_script

EXAMPLES = ROOT / "examples"
HAS_TORCH = importlib.util.find_spec("torch") is not None
synthetic = load_tool("synthetic")


def _feeds(name: str, model: onnx.ModelProto) -> dict:
    if name == "tiny_transformer.onnx":
        return synthetic.sample_feeds(model, batch=2, seq=8, seed=1)
    return {"image": np.random.default_rng(1).standard_normal((2, 3, 16, 16)).astype(np.float32)}


@pytest.fixture(params=["tiny_transformer.onnx", "tiny_cnn.onnx"])
def example(request, example_models):
    return request.param, example_models[request.param.removesuffix(".onnx")]


def test_example_is_small_valid_opset17_ir8(example):
    name, model = example
    onnx.checker.check_model(model, full_check=True)
    assert (EXAMPLES / name).stat().st_size < 200_000
    assert model.ir_version == 8 and model.opset_import[0].version == 17


def test_example_matches_its_generator(example):
    """The committed file is what make_examples.py writes, so regenerating it changes nothing."""
    make_examples = load_script("examples/make_examples.py")
    name, model = example
    assert make_examples.EXAMPLES[name]().SerializeToString() == model.SerializeToString()


def test_example_rewrites_and_matches_float32(example):
    name, model = example
    result = amp_rewrite.rewrite(model, target="float16", keep_io_types=True)
    low = [n for n in result.model.graph.node if n.op_type in ("MatMul", "Gemm", "Conv")]
    inferred = onnx.shape_inference.infer_shapes(result.model).graph.value_info
    types = {v.name: v.type.tensor_type.elem_type for v in inferred}
    assert low and all(types[n.output[0]] == TensorProto.FLOAT16 for n in low), "heavy ops not in float16"
    assert result.report.summary["casts_inserted"] > 0
    feeds = _feeds(name, model)
    expected = run_ort(model, feeds)
    assert_close(run_ort(result.model, feeds), expected, rtol=1e-2, atol=1e-2)
    # onnx.reference keeps float16 tensors in float16, as a GPU does (ORT's CPU provider does not)
    assert_close(run_reference(result.model, feeds), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not HAS_TORCH, reason="torch is optional")
def test_export_pipeline_example_runs_and_stays_close():
    done = run_script("examples/export_pipeline.py", timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    diff = re.search(r"float16 ONNX vs float32 ONNX: max abs diff (\S+)", done.stdout)
    assert diff and float(diff.group(1)) < 1e-2, done.stdout
    assert int(re.search(r"Cast nodes in the rewritten model: (\d+)", done.stdout).group(1)) > 0


@pytest.mark.skipif(
    not (HAS_TORCH and importlib.util.find_spec("transformers") and importlib.util.find_spec("onnxscript")),
    reason="torch, transformers and onnxscript are optional",
)
def test_finetune_export_example_trains_in_float16():
    done = run_script("examples/finetune_export.py", "--steps", "8", timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "constants frozen" in done.stderr, done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]
    losses = [float(row[1]) for row in rows]
    assert len(rows) == 8 and all(row[3] == "False" for row in rows) and losses[-1] < losses[0], done.stdout
