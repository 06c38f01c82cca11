"""Models with external data: load, rewrite, save with external data (about half the bytes), run."""

from __future__ import annotations

import os
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import amp_rewrite
from amp_rewrite import io as model_io
from amp_rewrite.cli import main
from amp_rewrite.io import loader
from helpers import assert_close, init, make_model, node, random_feeds, run_ort, tensor


def _weights_model(dim=64, layers=3):
    rng = np.random.default_rng(0)
    nodes, inits, source = [], [], "x"
    for i in range(layers):
        inits.append(init(f"W{i}", (rng.standard_normal((dim, dim)) / np.sqrt(dim)).astype(np.float32)))
        nodes += [
            node("MatMul", [source, f"W{i}"], [f"h{i}"], f"mm{i}"),
            node("Relu", [f"h{i}"], [f"r{i}"], f"relu{i}"),
        ]
        source = f"r{i}"
    inits.append(init("small", np.full(4, 0.5, np.float32)))  # stays inline (under the threshold)
    return make_model(nodes, [tensor("x", [2, dim])], [tensor(source, [2, dim])], inits)


@pytest.fixture()
def external_model(tmp_path):
    model = _weights_model()
    original = onnx.ModelProto()
    original.CopyFrom(model)
    path = tmp_path / "net.onnx"
    onnx.save(
        model,
        path,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="net.onnx.data",
        size_threshold=1024,
    )
    return path, original


def _data_file(model_path):
    """The one data file a saved model names (`<name>.<run>.data`, unique to the run that wrote it)."""
    model = onnx.load(str(model_path), load_external_data=False)
    names = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
    assert len(names) == 1 and re.fullmatch(
        re.escape(model_path.name) + r"\.[0-9a-f]{8}\.data", next(iter(names))
    )
    return model_path.parent / names.pop()


def _session(path):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def test_cli_keeps_external_data_and_halves_it(external_model, tmp_path):
    path, original = external_model
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    out = tmp_path / "net.fp16.onnx"
    assert main([str(path), "-o", str(out), "--quiet"]) == 0
    data_in, data_out = tmp_path / "net.onnx.data", _data_file(out)
    assert data_out.is_file()
    assert 0.45 <= data_out.stat().st_size / data_in.stat().st_size <= 0.55
    assert out.stat().st_size < 4096  # the weights are not inline
    onnx.checker.check_model(str(out), full_check=True)
    feeds = random_feeds(original)
    assert_close(_session(out).run(None, feeds), run_ort(original, feeds))
    assert {
        p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name in before
    } == before  # input untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, out.name, data_out.name])


def test_api_rewrites_a_path_with_external_data(external_model, tmp_path):
    path, original = external_model
    result = amp_rewrite.rewrite(str(path))
    assert all(t.data_location == onnx.TensorProto.DEFAULT for t in result.model.graph.initializer)
    feeds = random_feeds(original)
    assert_close(run_ort(result.model, feeds), run_ort(original, feeds))
    target = tmp_path / "api.onnx"
    before = result.model.SerializeToString()
    model_io.save(result.model, target, external_data=True)
    assert result.model.SerializeToString() == before  # saving leaves the model as it was
    assert _data_file(target).is_file()
    assert_close(_session(target).run(None, feeds), run_ort(original, feeds))


def test_in_memory_proto_with_external_references_needs_its_path(external_model):
    path, _ = external_model
    unloaded = onnx.load(str(path), load_external_data=False)
    with pytest.raises(amp_rewrite.ModelError, match="pass its path"):
        amp_rewrite.rewrite(unloaded)


def test_external_data_flag_on_an_inline_model(tmp_path):
    model = _weights_model()
    path = tmp_path / "inline.onnx"
    onnx.save(model, path)
    out = tmp_path / "out.onnx"
    assert main([str(path), "-o", str(out), "--quiet", "--external-data"]) == 0
    assert _data_file(out).is_file()
    feeds = random_feeds(model)
    assert_close(_session(out).run(None, feeds), run_ort(model, feeds))


def test_rerun_with_force_replaces_model_and_data_together(external_model, tmp_path):
    path, original = external_model
    out = tmp_path / "o.onnx"
    assert main([str(path), "-o", str(out), "--quiet"]) == 0
    first_data = _data_file(out)
    first = first_data.read_bytes()
    assert main([str(path), "-o", str(out), "--quiet", "--force"]) == 0
    second_data = _data_file(out)
    assert second_data != first_data and second_data.read_bytes() == first  # a new name, the same bytes
    assert not first_data.exists()  # the replaced model's data is removed after
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files left


def test_external_data_in_a_subfolder_is_allowed(tmp_path):
    model = _weights_model()
    original = onnx.ModelProto()
    original.CopyFrom(model)
    (tmp_path / "weights").mkdir()
    path = tmp_path / "net.onnx"
    onnx.save(model, path, save_as_external_data=True, location="weights/w.bin", size_threshold=1024)
    result = amp_rewrite.rewrite(str(path))
    feeds = random_feeds(original)
    assert_close(run_ort(result.model, feeds), run_ort(original, feeds))


@pytest.mark.skipif(os.name != "posix", reason="symlinks")
def test_symlink_inside_the_folder_is_allowed(tmp_path):
    model = _weights_model()
    original = onnx.ModelProto()
    original.CopyFrom(model)
    path = tmp_path / "net.onnx"
    onnx.save(model, path, save_as_external_data=True, location="real.bin", size_threshold=1024)
    loaded = onnx.load(str(path), load_external_data=False)
    for t in loaded.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "link.bin"
    os.symlink(tmp_path / "real.bin", tmp_path / "link.bin")
    (tmp_path / "linked.onnx").write_bytes(loaded.SerializeToString())
    result = amp_rewrite.rewrite(str(tmp_path / "linked.onnx"))
    feeds = random_feeds(original)
    assert_close(run_ort(result.model, feeds), run_ort(original, feeds))


def test_cli_leaves_big_weights_on_disk_until_saved_and_matches_the_in_memory_rewrite(tmp_path, monkeypatch):
    """The CLI (rewrite + save only) loads big external weights lazily: same output, fewer copies."""
    monkeypatch.setattr(loader, "LAZY_MIN_BYTES", 8 * 1024)  # the 64x64 weights (16 KiB) count as big
    model = _weights_model()
    huge = np.zeros(64, np.float32)
    huge[3] = 1e6  # out of the float16 range: its reader stays float32, the tensor is not converted
    model.graph.initializer.append(init("huge", huge))
    model.graph.node.append(node("Add", ["r2", "huge"], ["y"], "add_huge"))
    del model.graph.output[:]
    model.graph.output.append(tensor("y", [2, 64]))
    onnx.checker.check_model(model)
    original = onnx.ModelProto()
    original.CopyFrom(model)  # onnx.save below turns `model`'s weights into references
    path = tmp_path / "big.onnx"
    onnx.save(
        model,
        path,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="big.onnx.data",
        size_threshold=0,
    )
    loaded = model_io.load(path, lazy_weights=True)
    assert (
        loaded.lazy
        and sum(t.data_location == onnx.TensorProto.EXTERNAL for t in loaded.model.graph.initializer) == 3
    )
    out = tmp_path / "big.fp16.onnx"
    assert main([str(path), "-o", str(out), "--quiet"]) == 0
    eager = amp_rewrite.rewrite(str(path)).model  # everything read up front
    lazy_out = onnx.load(str(out))
    assert {t.name: (t.data_type, numpy_helper_bytes(t)) for t in lazy_out.graph.initializer} == {
        t.name: (t.data_type, numpy_helper_bytes(t)) for t in eager.graph.initializer
    }
    onnx.checker.check_model(str(out), full_check=True)
    feeds = random_feeds(original)
    assert_close(_session(out).run(None, feeds), run_ort(original, feeds), rtol=2e-2, atol=2e-2)
    assert str(tmp_path) not in out.read_bytes().decode("latin-1")  # no absolute path leaked into the model


def numpy_helper_bytes(t):
    return onnx.numpy_helper.to_array(t).tobytes()
