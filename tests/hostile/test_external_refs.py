"""External data no model can use to escape its folder (issue 24, findings 1, 3, 5).

Every reference anywhere in the model (graph, subgraph, model-local function, sparse initializer)
goes through one resolver: relative to the model's folder (never the current directory), inside it
after symlinks, a regular file, its range within the file, its length the one the shape needs.
The /etc/passwd-style case plants a secret beside a temporary folder and points a function's
Constant at it, by a relative path and by ../ x 40 to its absolute path.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import amp_rewrite
from amp_rewrite import errors
from amp_rewrite import io as model_io
from amp_rewrite.cli import main
from helpers import load_script

make_corpus = load_script("tests/hostile/make_corpus.py")

SECRET = b"TOPSECRET:" * 12  # 120 bytes; 64 of them are what a 4x4 float32 Constant asks for


def _external(tensor: TensorProto, location: str, length: int | None = 64, offset: int = 0) -> TensorProto:
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    del tensor.external_data[:]
    pairs = [("location", location), ("offset", str(offset))] + (
        [("length", str(length))] if length is not None else []
    )
    for key, value in pairs:
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def _function_model(location: str, length: int | None = 64) -> onnx.ModelProto:
    """y = x @ K, K a 4x4 Constant inside a model-local function, its data external at `location`."""
    k = _external(TensorProto(name="K", data_type=TensorProto.FLOAT, dims=[4, 4]), location, length)
    body = [helper.make_node("Constant", [], ["k"], value=k), helper.make_node("MatMul", ["x", "k"], ["y"])]
    fn = helper.make_function("local", "Secret", ["x"], ["y"], body, [helper.make_opsetid("", 17)])
    graph = helper.make_graph(
        [helper.make_node("Secret", ["x"], ["y"], domain="local", name="call")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    model = helper.make_model(
        graph, functions=[fn], opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)]
    )
    model.ir_version = 8
    return model


def _subgraph_model(location: str) -> onnx.ModelProto:
    """An If whose then-branch holds the external initializer."""
    k = _external(numpy_helper.from_array(np.ones((4, 4), np.float32), "K"), location)
    then = helper.make_graph(
        [helper.make_node("MatMul", ["x", "K"], ["t"])],
        "then",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, [1, 4])],
        [k],
    )
    other = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["e"])],
        "else",
        [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, [1, 4])],
    )
    cond = helper.make_tensor("c", TensorProto.BOOL, [], [True])
    nodes = [
        helper.make_node("Constant", [], ["c"], value=cond),
        helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _sparse_model(location: str) -> onnx.ModelProto:
    """A sparse initializer whose values are external."""
    model = make_corpus.valid_model()
    values = _external(numpy_helper.from_array(np.ones(16, np.float32), "S"), location)
    indices = numpy_helper.from_array(np.arange(16, dtype=np.int64), "S_idx")
    model.graph.sparse_initializer.append(helper.make_sparse_tensor(values, indices, [4, 32]))
    return model


def _sparse_attribute_model(location: str) -> onnx.ModelProto:
    """A Constant whose sparse_value has external values."""
    model = make_corpus.valid_model()
    values = _external(numpy_helper.from_array(np.ones(16, np.float32), "SV"), location)
    indices = numpy_helper.from_array(np.arange(16, dtype=np.int64), "SV_idx")
    sparse = helper.make_sparse_tensor(values, indices, [4, 32])
    model.graph.node.insert(
        0, helper.make_node("Constant", [], ["sv"], name="sparse_const", sparse_value=sparse)
    )
    return model


def _initializer_model(location: str) -> onnx.ModelProto:
    model = make_corpus.valid_model()
    _external(model.graph.initializer[0], location, length=512)
    return model


PLACES = {
    "function": _function_model,
    "subgraph": _subgraph_model,
    "sparse": _sparse_model,
    "sparse_attribute": _sparse_attribute_model,
    "initializer": _initializer_model,
}


@pytest.fixture()
def planted(tmp_path):
    """tmp/secret.txt beside tmp/models/deep/: the secret is outside the model's folder."""
    secret = tmp_path / "secret.txt"
    secret.write_bytes(SECRET)
    folder = tmp_path / "models" / "deep"
    folder.mkdir(parents=True)
    return secret, folder


def _write(folder: Path, model: onnx.ModelProto) -> Path:
    path = folder / "model.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def _listing(root: Path) -> dict:
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def _refused(capsys, code, fragment):
    err = capsys.readouterr().err.strip()
    assert code == 3, err
    assert len(err.splitlines()) == 1 and err.startswith("amp-rewrite: error: "), err
    assert fragment in err, err
    assert "TOPSECRET" not in err
    return err


@pytest.mark.parametrize("place", sorted(PLACES))
@pytest.mark.parametrize("how", ["relative", "dotdot_to_absolute"])
def test_no_reference_anywhere_reads_a_file_outside_the_folder(place, how, planted, capsys, monkeypatch):
    secret, folder = planted
    location = "../../secret.txt" if how == "relative" else "../" * 40 + str(secret).lstrip("/")
    path = _write(folder, PLACES[place](location))
    root = secret.parent
    before = _listing(root)
    for cwd in (folder, root, Path("/")):  # never resolved against the current directory
        monkeypatch.chdir(cwd)
        code = main([str(path), "-o", str(root / "out.onnx"), "--target", "bfloat16"])
        _refused(capsys, code, "escapes the model's folder")
    with pytest.raises(errors.ModelError, match="escapes the model's folder"):
        amp_rewrite.rewrite(str(path), target="bfloat16")
    with pytest.raises(errors.ModelError, match="escapes the model's folder"):
        model_io.load(path, lazy_weights=True)
    assert _listing(root) == before  # no output, nothing changed


@pytest.mark.parametrize("location", ["sub/../../secret.txt", "no-such-folder/../../secret.txt", "sub/../.."])
def test_a_dotdot_through_any_folder_is_said_to_escape(location, planted, capsys):
    """Refused whether the folders on the way exist or not, and said as an escape (a name through
    a missing folder was 'missing')."""
    secret, folder = planted
    (folder / "sub").mkdir()
    path = _write(folder, PLACES["sparse"](location))
    _refused(capsys, main([str(path), "--dry-run"]), "escapes the model's folder")
    with pytest.raises(errors.ModelError, match="escapes the model's folder"):
        amp_rewrite.rewrite(str(path))


def test_function_reference_inside_the_folder_is_read_from_the_models_folder(planted, monkeypatch, tmp_path):
    """The same function model with its data beside it rewrites, from any current directory."""
    _, folder = planted
    weights = np.arange(16, dtype=np.float32).reshape(4, 4) / 8
    (folder / "k.bin").write_bytes(weights.tobytes())
    path = _write(folder, _function_model("k.bin"))
    monkeypatch.chdir(tmp_path)
    result = amp_rewrite.rewrite(str(path))
    x = np.ones((1, 4), np.float32)
    from helpers import run_ort

    got = run_ort(result.model, {"x": x})[0]
    np.testing.assert_allclose(got, x @ weights, rtol=1e-2)


def test_in_memory_model_with_external_data_in_a_function_needs_its_path(planted):
    with pytest.raises(errors.ModelError, match="pass its path"):
        amp_rewrite.rewrite(_function_model("k.bin"))


def _link(folder: Path, name: str, target) -> str:
    os.symlink(target, folder / name)
    return name


@pytest.mark.parametrize("kind", ["dev_zero_link", "fifo", "directory", "absolute_dev_zero", "link_out"])
def test_only_regular_files_inside_the_folder(kind, planted, capsys):
    secret, folder = planted
    location, fragment = {
        "dev_zero_link": (lambda: _link(folder, "z.bin", "/dev/zero"), "escapes the model's folder"),
        "fifo": (lambda: (os.mkfifo(folder / "f.bin"), "f.bin")[1], "is not a regular file"),
        "directory": (lambda: ((folder / "d").mkdir(), "d")[1], "is not a regular file"),
        "absolute_dev_zero": (lambda: "/dev/zero", "must be a relative path"),
        "link_out": (lambda: _link(folder, "s.bin", secret), "escapes the model's folder"),
    }[kind]
    path = _write(folder, _function_model(location()))
    code = main([str(path), "-o", str(folder / "out.onnx")])  # a FIFO would hang a plain open()
    _refused(capsys, code, fragment)
    assert not (folder / "out.onnx").exists()


@pytest.mark.parametrize(
    "location, fragment",
    [
        ("w\0.bin", "contains a NUL byte"),
        ("x" * 5000, "too long to be a file name"),
        ("loop.bin", "cannot be resolved"),
        ("", "has no file name"),
    ],
)
def test_unusable_names_are_one_line(location, fragment, planted, capsys):
    _, folder = planted
    _link(folder, "loop.bin", "loop2.bin")
    _link(folder, "loop2.bin", "loop.bin")
    path = _write(folder, _initializer_model(location))
    err = _refused(capsys, main([str(path), "-o", str(folder / "out.onnx")]), fragment)
    assert len(err) < 400  # a 5000-character name is cut
    with pytest.raises(errors.ModelError, match=fragment):
        amp_rewrite.rewrite(str(path))


@pytest.mark.parametrize("lazy", [True, False])
def test_a_length_the_file_cannot_hold_is_refused(lazy, planted, capsys, monkeypatch):
    """Finding 3: a 512x1024 float32 tensor (2 MiB, declared so) in a 1000-byte file was trusted by
    the lazy path and gave a broken output with exit 0."""
    _, folder = planted
    (folder / "w.bin").write_bytes(b"\1" * 1000)
    model = make_corpus.valid_model()
    big = _external(TensorProto(name="B", data_type=TensorProto.FLOAT, dims=[512, 1024]), "w.bin", 2097152)
    model.graph.initializer.append(big)
    path = _write(folder, model)
    args = [str(path), "-o", str(folder / "out.onnx")] + ([] if lazy else ["--validate"])
    _refused(capsys, main(args), "run past the end")
    assert sorted(p.name for p in folder.iterdir()) == ["model.onnx", "w.bin"]


@pytest.mark.parametrize(
    "length, offset, fragment",
    [
        (100, 0, "its shape [4, 4] needs 64"),
        (None, 100, "run past the end"),
        ("-5", 0, "not a whole number"),
        ("1_0", 0, "not a whole number"),
    ],
)
def test_lengths_and_offsets_are_checked_against_shape_and_file(length, offset, fragment, planted, capsys):
    _, folder = planted
    (folder / "k.bin").write_bytes(b"\0" * 120)
    model = _function_model("k.bin", length)
    k = model.functions[0].node[0].attribute[0].t
    for entry in k.external_data:
        if entry.key == "offset":
            entry.value = str(offset)
    path = _write(folder, model)
    _refused(capsys, main([str(path), "-o", str(folder / "out.onnx")]), fragment)
