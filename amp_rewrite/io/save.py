"""Save models and files atomically: a temporary name beside the target, fsync, rename.

A crash or a full disk never leaves half a file, and the input is never written over. Models with
external data are streamed tensor by tensor, so no copy of the model and no 2 GB protobuf limit.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from pathlib import Path

import onnx
from onnx import TensorProto

from amp_rewrite.errors import OutputError
from amp_rewrite.io import tensordata
from amp_rewrite.io.skeleton import data_size
from amp_rewrite.onnx_facts import ELEMENT_SIZE, all_graphs

TWO_GB = 2**31

def check_output_path(output: Path, inputs: list[Path], force: bool) -> None:
    """Refuse to write over an input, or over an existing file without `force`."""
    for source in inputs:
        if source is not None and output.resolve() == source.resolve():
            raise OutputError(f"{output}: output path is the input model; choose another -o")
    if output.exists() and not force:
        raise OutputError(f"{output}: already exists (use --force to replace it)")
    if output.exists() and output.is_dir():
        raise OutputError(f"{output}: is a directory")
    parent = output.parent if str(output.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"{output}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise OutputError(f"{output}: folder {parent} is not writable")


def atomic_write(path, write) -> None:
    """Write through a temporary file beside `path` (fsync), then rename over it: a crash or a full
    disk never leaves half a file, and the previous file stays until the new one is complete."""
    path = Path(path)
    try:
        tmp = _write_tmp(path, write)
    except OSError as exc:
        raise OutputError(f"{path}: cannot write ({exc.strerror or exc})") from None
    try:
        _interrupt_hook("rename")
        os.replace(tmp, path)
    except OSError as exc:
        _remove_quietly(tmp)
        raise OutputError(f"{path}: cannot write ({exc.strerror or exc})") from None
    except BaseException:
        _remove_quietly(tmp)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda handle: handle.write(data))


def _remove_quietly(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


EXTERNAL_THRESHOLD = 1024  # tensors of at least this many bytes go to the external data file
_ALIGN = 4096


def _interrupt_hook(stage: str) -> None:
    """Test hook: AMP_REWRITE_TEST_PAUSE=stage:seconds sleeps at that point of a write."""
    spec = os.environ.get("AMP_REWRITE_TEST_PAUSE", "")
    if spec.startswith(stage + ":"):
        time.sleep(float(spec.split(":", 1)[1]))




def _big_tensors(model: onnx.ModelProto):
    for graph in all_graphs(model.graph):
        for tensor in graph.initializer:
            if tensor.data_type in (TensorProto.STRING, TensorProto.UNDEFINED):
                continue
            size = ELEMENT_SIZE.get(tensor.data_type)
            count = math.prod(tensor.dims)
            if size is not None and count * size >= EXTERNAL_THRESHOLD:
                yield tensor


def _file_mode() -> int:
    """The mode a plainly created file gets (0666 less the umask); mkstemp's is 0600."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _write_tmp(path: Path, write) -> str:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, _file_mode())
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        _remove_quietly(tmp)
        raise
    return tmp


def save(model: onnx.ModelProto, path, *, external_data: bool = False, keep_model: bool = True) -> None:
    """Save atomically; with external data (or above 2 GB) weights go to `<name>.data` beside it.

    External data is streamed tensor by tensor (no copy of the model, no 2 GB serialisation):
    each big initializer is written to the data file and replaced by a reference while the model
    is serialised, then given its bytes back, so `model` is unchanged afterwards (with
    `keep_model=False` it keeps the references instead: no re-read, for callers done with it).
    Both files are written to temporary names and renamed into place, data first.
    """
    path = Path(path)
    if not external_data and data_size(model) < TWO_GB - 2**26:
        atomic_write_bytes(path, model.SerializeToString())
        return
    data_name = f"{path.name}.data"
    data_path = path.parent / data_name
    moved: list[tuple[TensorProto, int, int]] = []
    data_tmp = model_tmp = None
    try:
        def write_data(handle):
            offset = 0
            for tensor in _big_tensors(model):
                blob = tensordata.tensor_bytes(tensor)
                pad = (-offset) % _ALIGN
                if pad:
                    handle.write(b"\0" * pad)
                    offset += pad
                handle.write(blob)
                moved.append((tensor, offset, len(blob)))
                offset += len(blob)
                del blob

        data_tmp = _write_tmp(data_path, write_data)
        if not moved:  # nothing big enough: one plain file
            _remove_quietly(data_tmp)
            data_tmp = None
            atomic_write_bytes(path, model.SerializeToString())
            return
        for tensor, offset, length in moved:  # the references replace the bytes while serialising
            tensor.ClearField("raw_data")
            for field in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                tensor.ClearField(field)
            tensor.data_location = TensorProto.EXTERNAL
            del tensor.external_data[:]
            for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(length))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
        model_bytes = model.SerializeToString()
        model_tmp = _write_tmp(path, lambda handle: handle.write(model_bytes))
        del model_bytes
        _interrupt_hook("rename")
        os.replace(data_tmp, data_path)
        data_tmp = None
        _interrupt_hook("between")
        os.replace(model_tmp, path)
        model_tmp = None
        if not keep_model:
            moved = []
    except OSError as exc:
        raise OutputError(f"{path}: cannot write ({exc.strerror or exc})") from None
    finally:
        if moved:
            _restore(moved, Path(data_tmp) if data_tmp else data_path)
        for leftover in (data_tmp, model_tmp):
            if leftover:
                _remove_quietly(leftover)


def _restore(moved, source: Path) -> None:
    """Give moved tensors their bytes back (read from the data file just written)."""
    pending = [m for m in moved if m[0].data_location == TensorProto.EXTERNAL]
    if not pending:
        return
    with open(source, "rb") as handle:
        for tensor, offset, length in pending:
            handle.seek(offset)
            tensor.raw_data = handle.read(length)
            tensor.data_location = TensorProto.DEFAULT
            del tensor.external_data[:]
