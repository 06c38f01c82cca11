"""Sample inputs and training checkpoints (.npz) that are broken or hostile (issue 24, findings 5, 8).

io.npz reads bounded (sizes from the zip directory before inflating), checks CRCs, refuses object
arrays and headers that disagree with their bytes; --inputs samples must match the declared
types and shapes (exit 2, one line, never ONNX Runtime's exit 70). `Trainer.load` verifies the
whole checkpoint first: a truncated, bit-flipped, empty or mismatched file leaves it unchanged.
"""

from __future__ import annotations

import io
import json
import os
import struct
import zipfile

import numpy as np
import pytest

from amp_rewrite.cli import main
from amp_rewrite.errors import TrainingError, UsageError
from amp_rewrite.io import npz
from amp_rewrite.training import SGD, Adam, Trainer
from helpers import load_script
from training_models import classification_batches, softmax_regression, softmax_regression_gradient

make_corpus = load_script("tests/hostile/make_corpus.py")


def _npy(array, allow_pickle=False) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, array, allow_pickle=allow_pickle)
    return buffer.getvalue()


def _zip(path, members: dict, compression=zipfile.ZIP_STORED):
    with zipfile.ZipFile(path, "w", compression=compression) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


class _Payload:
    """Unpickling this runs a command: an object array must never be unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _set_sizes(path, file_size: int) -> None:
    """Make the zip's central directory claim `file_size` for its (only) member."""
    data = bytearray(path.read_bytes())
    at = data.rfind(b"PK\x01\x02")
    data[at + 24 : at + 28] = struct.pack("<I", file_size)
    path.write_bytes(bytes(data))


GOOD = {"x": np.ones((2, 4), np.float32)}


def _case(kind, tmp_path):
    """An .npz for --inputs of the corpus's valid model, and the fragment its error line holds."""
    path = tmp_path / "s.npz"
    if kind == "wrong_dtype":
        np.savez(path, x=np.ones((2, 4), np.int64))
        return path, "is int64, the model declares float32"
    if kind == "wrong_shape":
        np.savez(path, x=np.ones((3, 5), np.float32))
        return path, "has shape [3, 5], the model declares [2, 4]"
    if kind == "object_array":
        _zip(path, {"x.npy": _npy(np.array([_Payload(tmp_path / "pwned")], dtype=object), allow_pickle=True)})
        return path, "object array"
    if kind == "bad_crc":
        np.savez(path, **GOOD)
        data = bytearray(path.read_bytes())
        at = data.find(np.ones(1, np.float32).tobytes())
        data[at + 2] ^= 0xFF
        path.write_bytes(bytes(data))
        return path, "Bad CRC"
    if kind == "directory_claims_huge":
        _zip(path, {"x.npy": _npy(GOOD["x"])}, zipfile.ZIP_DEFLATED)
        _set_sizes(path, 0xFFFFFFF0)  # 4 GiB claimed; more than the (patched) limit
        return path, "not inflated"
    if kind == "directory_lies_small":
        _zip(path, {"x.npy": _npy(GOOD["x"])}, zipfile.ZIP_DEFLATED)
        _set_sizes(path, 64)
        return path, "not a readable .npz"
    if kind == "header_lies":
        image = io.BytesIO()  # a header that claims 32 MB over 32 bytes of data
        np.lib.format.write_array_header_1_0(
            image, {"descr": "<f4", "fortran_order": False, "shape": (2000, 4000)}
        )
        _zip(path, {"x.npy": image.getvalue() + np.ones(8, np.float32).tobytes()})
        return path, "holds 32 bytes of data but its shape [2000, 4000]"
    if kind == "truncated":
        np.savez(path, **GOOD)
        path.write_bytes(path.read_bytes()[:100])
        return path, "not a readable .npz"
    if kind == "empty":
        path.write_bytes(b"")
        return path, "not a readable .npz"
    if kind == "not_npy_member":
        _zip(path, {"x.npy": _npy(GOOD["x"]), "notes.txt": b"hello"})
        return path, "is not a .npy array"
    if kind == "fifo":
        os.mkfifo(path)
        return path, "is not a regular file"
    raise AssertionError(kind)


KINDS = [
    "wrong_dtype",
    "wrong_shape",
    "object_array",
    "bad_crc",
    "directory_claims_huge",
    "directory_lies_small",
    "header_lies",
    "truncated",
    "empty",
    "not_npy_member",
    "fifo",
]


@pytest.mark.parametrize("kind", KINDS)
def test_bad_sample_files_are_usage_errors(kind, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(npz, "memory_limit", lambda: 2**20)
    model = tmp_path / "model.onnx"
    model.write_bytes(make_corpus.valid_model().SerializeToString())
    path, fragment = _case(kind, tmp_path)
    code = main([str(model), "--validate", "--dry-run", "--inputs", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("amp-rewrite: error: --inputs") and fragment in err[0], err
    assert not (tmp_path / "pwned").exists()


def test_a_zip_bomb_is_refused_before_it_is_inflated(tmp_path, monkeypatch):
    """64 MiB of zeros deflate to 64 KiB; with a 1 MiB limit the directory alone refuses it."""
    monkeypatch.setattr(npz, "memory_limit", lambda: 2**20)
    path = _zip(tmp_path / "bomb.npz", {"x.npy": _npy(np.zeros(2**24, np.float32))}, zipfile.ZIP_DEFLATED)
    assert path.stat().st_size < 2**20
    opened = []
    monkeypatch.setattr(zipfile.ZipFile, "open", lambda *a, **k: opened.append(a) or pytest.fail("inflated"))
    with pytest.raises(UsageError, match="more than 1048576 bytes"):
        npz.read_npz(path, what="--inputs bomb.npz")
    assert not opened


def test_good_samples_still_load(tmp_path):
    np.savez_compressed(tmp_path / "s.npz", **{"0/x": GOOD["x"], "1/x": GOOD["x"] * 2})
    arrays = npz.read_npz(tmp_path / "s.npz", what="s")
    assert arrays["1/x"].tolist() == (GOOD["x"] * 2).tolist() and arrays["0/x"].flags.writeable


# --- checkpoints ------------------------------------------------------------------------------------


def _trainer(optimizer=None):
    return Trainer(
        softmax_regression(),
        optimizer=optimizer or Adam(0.05),
        precision="float32",
        provider="cpu",
        gradient_builder=softmax_regression_gradient,
        loss_scale="dynamic",
    )


def _rewrite_checkpoint(path, edit) -> None:
    """Load the checkpoint's arrays, let `edit` change them, save them again (np.savez)."""
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    edit(arrays)
    np.savez(path, **arrays)


def _meta_edit(change):
    def edit(arrays):
        meta = json.loads(str(arrays["meta"]))
        change(meta)
        arrays["meta"] = np.array(json.dumps(meta), dtype=np.str_)

    return edit


def _last_tensor_wrong_shape(arrays):
    last = f"state_{len(arrays['names']) - 1}"
    arrays[last] = np.zeros(tuple(arrays[last].shape) + (2,), arrays[last].dtype)


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


BROKEN = {
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "cannot read checkpoint"),
    "bit_flipped": (_flip_a_byte, "cannot read checkpoint"),
    "empty": (lambda p: p.write_bytes(b""), "cannot read checkpoint"),
    "meta_without_lr": (
        lambda p: _rewrite_checkpoint(p, _meta_edit(lambda m: m.pop("lr"))),
        "metadata lacks lr",
    ),
    "meta_lr_not_a_number": (
        lambda p: _rewrite_checkpoint(p, _meta_edit(lambda m: m.update(lr="fast"))),
        "lr 'fast'",
    ),
    "meta_missing": (lambda p: _rewrite_checkpoint(p, lambda a: a.pop("meta")), "no metadata"),
    "names_missing": (lambda p: _rewrite_checkpoint(p, lambda a: a.pop("names")), "no state names"),
    "last_tensor_wrong_shape": (
        lambda p: _rewrite_checkpoint(p, _last_tensor_wrong_shape),
        r"is \w+\[.*\], expected",
    ),
    "tensor_missing": (lambda p: _rewrite_checkpoint(p, lambda a: a.pop("state_0")), "is missing"),
    "wrong_dtype": (
        lambda p: _rewrite_checkpoint(p, lambda a: a.update(state_0=a["state_0"].astype(np.float64))),
        "is float64",
    ),
    "object_array": (
        lambda p: _zip(
            p, {"meta.npy": _npy(np.array([_Payload(p.parent / "pwned")], dtype=object), allow_pickle=True)}
        ),
        "object array",
    ),
}


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_a_bad_checkpoint_leaves_the_trainer_unchanged(kind, tmp_path):
    """Finding 8: these raised BadZipFile/EOFError/KeyError, or left the Trainer half-loaded."""
    path = tmp_path / "ckpt.npz"
    source = _trainer()
    source.step(classification_batches(count=1)[0])  # the checkpoint differs from a fresh trainer
    source.lr = 0.01
    source.save(path)
    BROKEN[kind][0](path)
    target = _trainer()
    before = {name: value.copy() for name, value in target.state().items()}
    lr = target.lr
    with pytest.raises(TrainingError, match=BROKEN[kind][1]) as info:
        target.load(path)
    assert "\n" not in str(info.value)
    after = target.state()
    assert all(after[name].tobytes() == value.tobytes() for name, value in before.items())
    assert target.lr == lr
    assert not (tmp_path / "pwned").exists()


def test_a_good_checkpoint_still_loads_and_another_optimizers_is_refused(tmp_path):
    source = _trainer()
    source.step(classification_batches(count=1)[0])
    source.lr = 0.01
    source.save(tmp_path / "ckpt.npz")
    target = _trainer()
    target.load(tmp_path / "ckpt.npz")
    assert target.lr == source.lr
    assert all(target.state()[n].tobytes() == v.tobytes() for n, v in source.state().items())
    with pytest.raises(TrainingError, match="optimizer"):
        _trainer(SGD(0.1)).load(tmp_path / "ckpt.npz")
