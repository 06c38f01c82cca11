"""The shipped example models and scripts, and the benchmark's smoke run, work from a checkout.

Scripts run in subprocesses with the checkout first on PYTHONPATH, as a user running them from a
clone would import this amp_rewrite and not an older install.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto

import amp_rewrite
from helpers import assert_close, run_ort, run_reference

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(ROOT / "tools"))

import synthetic  # noqa: E402  (tools/ is not a package)

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_OCC = importlib.util.find_spec("onnxconverter_common") is not None


def _feeds(name: str, model: onnx.ModelProto) -> dict:
    if name == "tiny_transformer.onnx":
        return synthetic.sample_feeds(model, batch=2, seq=8, seed=1)
    return {"image": np.random.default_rng(1).standard_normal((2, 3, 16, 16)).astype(np.float32)}


def _run_script(*args: str, timeout: int = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module", params=["tiny_transformer.onnx", "tiny_cnn.onnx"])
def example(request):
    return request.param, onnx.load(str(EXAMPLES / request.param))


def test_example_is_small_valid_opset17_ir8(example):
    name, model = example
    onnx.checker.check_model(model, full_check=True)
    assert (EXAMPLES / name).stat().st_size < 200_000
    assert model.ir_version == 8 and model.opset_import[0].version == 17


def test_example_matches_its_generator(example):
    """The committed file is what make_examples.py writes, so regenerating it changes nothing."""
    sys.path.insert(0, str(EXAMPLES))
    import make_examples

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


def test_bench_quick_runs_and_reports_valid_outputs():
    done = _run_script("tools/bench_rewrite.py", "--quick", "--markdown", timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {cells[2]: cells for cells in _markdown_rows(done.stdout, "1k")}
    ours = rows["amp-rewrite"]
    assert float(ours[3]) > 0 and ours[7] == "232/232" and ours[8] == "valid"
    if HAS_OCC:
        anchor = rows["onnxconverter-common"]
        assert float(anchor[3]) > 0 and anchor[8] == "valid"
    else:
        assert "not installed" in rows["onnxconverter-common"][3]


def _markdown_rows(text: str, size: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.startswith(f"| {size} ")]


@pytest.mark.skipif(not HAS_TORCH, reason="torch is optional")
def test_export_pipeline_example_runs_and_stays_close():
    done = _run_script("examples/export_pipeline.py", timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    diff = re.search(r"float16 ONNX vs float32 ONNX: max abs diff (\S+)", done.stdout)
    assert diff and float(diff.group(1)) < 1e-2, done.stdout
    assert int(re.search(r"Cast nodes in the rewritten model: (\d+)", done.stdout).group(1)) > 0
