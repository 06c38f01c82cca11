"""Weights on disk are streamed: the CLI leaves external weights there (lazy_weights), the rewrite
defers their conversion, and the saver converts and writes them a piece at a time into one data
file, each big tensor 64 KiB aligned, the same bytes as the eager rewrite; memory stays below the
model's size (a subprocess measures it)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import amp_rewrite
from amp_rewrite.cli import main
from amp_rewrite.io import loader, save
from amp_rewrite.io.save import MMAP_ALIGN, MMAP_ALIGN_FROM
from helpers import init, load_tool, make_model, node, tensor

DIM = 512  # a 512 x 512 float32 weight is 1 MiB: loader.LAZY_MIN_BYTES, so it stays on disk
SENTINEL = float(np.finfo(np.float32).min)


def streamed_model(big: float | None = None):
    """y = Relu(x W0 + M) W1 and ReduceSumSquare(W1): W0 plain, M an attention-style mask holding
    float32's lowest (a sentinel), W1 read in float16 and float32 (a float16 copy is made);
    `big`: W0 holds that value once (out of float16's range)."""
    rng = np.random.default_rng(0)
    w0 = (rng.standard_normal((DIM, DIM)) / np.sqrt(DIM)).astype(np.float32)
    if big is not None:
        w0[3, 5] = big
    mask = np.zeros((2, DIM), np.float32)
    mask[:, ::7] = SENTINEL
    w1 = (rng.standard_normal((DIM, DIM)) / np.sqrt(DIM)).astype(np.float32)
    nodes = [
        node("MatMul", ["x", "W0"], ["h"], "mm0"),
        node("Add", ["h", "M"], ["m"], "mask"),
        node("Relu", ["m"], ["r"], "relu"),
        node("MatMul", ["r", "W1"], ["y"], "mm1"),
        node("ReduceSumSquare", ["W1"], ["n"], "norm", keepdims=0),
    ]
    return make_model(
        nodes,
        [tensor("x", [2, DIM])],
        [tensor("y", [2, DIM]), tensor("n", [])],
        [init("W0", w0), init("M", np.tile(mask, (DIM // 2, 1))[:2]), init("W1", w1)],
    )


def saved(model, folder, name="net.onnx"):
    path = folder / name
    onnx.save(
        model,
        path,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=f"{name}.data",
        size_threshold=1024,
    )
    return path


def data_files(path):
    model = onnx.load(str(path), load_external_data=False)
    return model, {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}


def run(path, x):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, {"x": x})


@pytest.mark.parametrize("big, flags", [(None, []), (1e5, ["--clamp"])])
def test_streamed_output_is_the_eager_rewrite_byte_for_byte(tmp_path, big, flags):
    model = streamed_model(big)
    path = saved(model, tmp_path)
    assert loader.LAZY_MIN_BYTES <= DIM * DIM * 4
    out = tmp_path / "net.fp16.onnx"
    assert main([str(path), "-o", str(out), "--quiet", *flags]) == 0
    eager = amp_rewrite.rewrite(str(path), clamp=bool(flags)).model  # the API reads every weight
    streamed, files = data_files(out)
    assert len(files) == 1
    ours = {
        t.name: onnx.numpy_helper.to_array(t, base_dir=str(tmp_path)).tobytes()
        for t in streamed.graph.initializer
    }
    theirs = {t.name: onnx.numpy_helper.to_array(t).tobytes() for t in eager.graph.initializer}
    assert ours == theirs
    types = {t.name: t.data_type for t in streamed.graph.initializer}
    assert (
        types["W0"] == types["W1_fp16"] == onnx.TensorProto.FLOAT16 and types["W1"] == onnx.TensorProto.FLOAT
    )
    assert types["M"] == onnx.TensorProto.FLOAT16  # the sentinel became -65504
    for t in streamed.graph.initializer:
        info = {e.key: e.value for e in t.external_data}
        if t.data_location == onnx.TensorProto.EXTERNAL and int(info["length"]) >= MMAP_ALIGN_FROM:
            assert int(info["offset"]) % MMAP_ALIGN == 0 and set(info) == {"location", "offset", "length"}
    x = np.random.default_rng(1).standard_normal((2, DIM)).astype(np.float32)
    expected, got = run(path, x), run(out, x)
    np.testing.assert_allclose(got[0], expected[0], rtol=2e-2, atol=2e-2 * np.abs(expected[0]).max())
    if not flags:
        np.testing.assert_allclose(got[1], expected[1], rtol=1e-6)  # W1 stayed float32 for the norm


def test_external_data_takes_the_name_given(tmp_path, capsys):
    path = saved(streamed_model(), tmp_path)
    out = tmp_path / "net.fp16.onnx"
    assert main([str(path), "-o", str(out), "--quiet", "--external-data", "weights.bin"]) == 0
    assert data_files(out)[1] == {"weights.bin"} and (tmp_path / "weights.bin").is_file()
    other = tmp_path / "other.onnx"  # a new model, but its data file would replace an existing one
    again = [str(path), "-o", str(other), "--quiet", "--external-data", "weights.bin"]
    assert main(again) == 5 and "weights.bin: already exists" in capsys.readouterr().err
    assert not other.exists()
    assert main([str(path), "-o", str(out), "--quiet", "--force", "--external-data", "weights.bin"]) == 0
    assert data_files(out)[1] == {"weights.bin"} and len(list(tmp_path.glob("*.data"))) == 1  # the input's
    assert (
        main([str(path), "-o", str(out), "--force", "--external-data", "net.onnx.data"]) == 5
    )  # the input's
    assert main([str(path), "-o", str(out), "--force", "--external-data", "sub/w.bin"]) == 2
    assert "without a folder" in capsys.readouterr().err
    x = np.random.default_rng(1).standard_normal((2, DIM)).astype(np.float32)
    assert np.isfinite(run(out, x)[0]).all()


def test_a_model_over_two_gigabytes_gets_external_data_unasked(tmp_path, monkeypatch):
    module = importlib.import_module("amp_rewrite.io.save")
    model = streamed_model()
    monkeypatch.setattr(module, "TWO_GB", 2**26 + 2**20)  # the threshold less 64 MiB: 1 MiB here
    save(model, tmp_path / "big.onnx")
    written, files = data_files(tmp_path / "big.onnx")
    assert (
        len(files) == 1
        and sum(t.data_location == onnx.TensorProto.EXTERNAL for t in written.graph.initializer) == 3
    )


MEASURE = (
    "import resource, subprocess, sys\n"
    "code = subprocess.run(sys.argv[1:]).returncode\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, code)"
)


def test_peak_memory_stays_well_below_the_model(tmp_path):
    """320 MiB of weights (5 x 64 MiB): the CLI's peak RSS, measured in a child of its own, stays
    under 0.6x the model; holding the float16 weights, as before streaming, needed about 0.65x
    above the interpreter's own ~90 MB. tools/big_model.py measures 2 and 8 GiB."""
    big_model = load_tool("big_model")
    path = big_model.build(tmp_path, 5 * 64 / 1024, 4096)
    size = path.stat().st_size + (tmp_path / "big.onnx.data").stat().st_size
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            MEASURE,
            sys.executable,
            "-m",
            "amp_rewrite",
            str(path),
            "-o",
            str(tmp_path / "out.onnx"),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    peak, code = map(int, done.stdout.split())
    assert code == 0, done.stderr
    assert peak < 0.6 * size, (peak, size)
    written, files = data_files(tmp_path / "out.onnx")
    assert len(files) == 1 and all(t.data_type == onnx.TensorProto.FLOAT16 for t in written.graph.initializer)
