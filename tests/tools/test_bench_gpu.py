"""tools/bench_gpu.py's smoke run: a tiny BERT and ResNet through every converter (one that is not
installed is a row saying so). Without CUDA it says so and prints the conversion columns; with
CUDA the timed ones too."""

from __future__ import annotations

import pytest

from amp_rewrite.runtime import cuda_loads
from helpers import load_tool


def test_bench_gpu_tiny(capsys):
    pytest.importorskip("torch", reason="torch exports the models")
    pytest.importorskip("transformers", reason="transformers configs build them")
    bench = load_tool("bench_gpu", needs=["exported"])
    assert bench.main(["--models", "bert,resnet50", "--tiny", "--runs", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| bert") or line.startswith("| resnet50")]
    variants = {line.split("|")[2].strip() for line in rows}
    assert {
        "float32",
        "amp-rewrite float16",
        "amp-rewrite bfloat16",
        "ORT float16",
        "onnxconverter-common",
    } <= variants
    assert "ORT optimizer + float16" in variants  # BERT's fused graph
    amp = next(line for line in rows if line.startswith("| bert") and "amp-rewrite float16" in line).split(
        "|"
    )
    float32 = next(line for line in rows if line.startswith("| bert") and "| float32 |" in line).split("|")
    assert float(amp[5]) < 0.6 * float(float32[5])  # MB: the weights in half
    occ = next(line for line in rows if line.startswith("| bert") and "onnxconverter-common" in line)
    try:  # only in the [bench] extra: without it the row says so
        import onnxconverter_common  # noqa: F401
    except ImportError:
        assert "conversion fails: No module named" in occ
    if cuda_loads():
        assert "speed-up" in out and "rel L2" in out
    else:
        assert "no CUDA here" in out and "ms" not in out.split("\n| model |")[1].splitlines()[0]
