"""Save models and files atomically: a temporary name beside the target, fsync, rename.

A crash or a full disk never leaves half a file, and the input is never written over (the CLI's
`output.OutputPlan` sees to that). Models with external data are streamed tensor by tensor, so
no copy of the model and no 2 GB protobuf limit, and replaced as an `output.OutputPair`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import onnx
from onnx import TensorProto

from amp_rewrite.errors import OutputError
from amp_rewrite.io import tensordata
from amp_rewrite.io.output import OutputPair, interrupt_hook, remove_quietly, write_tmp
from amp_rewrite.io.skeleton import data_size
from amp_rewrite.onnx_facts import ELEMENT_SIZE, all_graphs

TWO_GB = 2**31


def atomic_write(path, write) -> None:
    """Write through a temporary file beside `path` (fsync), then rename over it: a crash or a full
    disk never leaves half a file, and the previous file stays until the new one is complete."""
    path = Path(path)
    try:
        tmp = write_tmp(path, write)
    except OSError as exc:
        raise OutputError(f"{path}: cannot write ({exc.strerror or exc})") from None
    try:
        interrupt_hook("rename")
        os.replace(tmp, path)
    except OSError as exc:
        remove_quietly(tmp)
        raise OutputError(f"{path}: cannot write ({exc.strerror or exc})") from None
    except BaseException:
        remove_quietly(tmp)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda handle: handle.write(data))


EXTERNAL_THRESHOLD = 1024  # tensors of at least this many bytes go to the external data file
# ONNX Runtime memory-maps a tensor of external data when its offset is a multiple of the
# allocation granularity: "64KB for windows and 4K for other OSes" (onnxruntime,
# include/onnxruntime/core/graph/model_saving_options.h; its own saver aligns tensors over
# `align_threshold`, 1 MiB, so). Tensors from 1 MiB start on 64 KiB, which serves both; smaller
# ones on 4 KiB (a page), so a thousand biases do not cost 64 MB of padding.
MMAP_ALIGN, MMAP_ALIGN_FROM = 64 * 1024, 2**20
_ALIGN = 4096


def _big_tensors(model: onnx.ModelProto):
    for graph in all_graphs(model.graph):
        for tensor in graph.initializer:
            if tensor.data_type in (TensorProto.STRING, TensorProto.UNDEFINED):
                continue
            size = ELEMENT_SIZE.get(tensor.data_type)
            count = math.prod(tensor.dims)
            if size is not None and count * size >= EXTERNAL_THRESHOLD:
                yield tensor


def save(
    model: onnx.ModelProto, path, *, external_data: bool | str = False, keep_model: bool = True, keep=()
) -> None:
    """Save atomically; with external data (or above 2 GB, unasked) weights go to one data file
    beside it, `external_data` its name when a string (a plain file name in the model's folder).

    External data is streamed tensor by tensor (no copy of the model, no 2 GB serialisation):
    each big initializer is written to the data file and replaced by a reference while the model
    is serialised, then given its bytes back, so `model` is unchanged afterwards (with
    `keep_model=False` it keeps the references instead: no re-read, for callers done with it).
    The pair is replaced as `output.OutputPair` does it: the data file is named
    `<name>.<run>.data`, unique to this run, the model is renamed into place last, and the data
    files the replaced model named are removed after (never one of `keep`, the run's inputs).
    """
    path = Path(path)
    moved: list[tuple[TensorProto, int, int]] = []
    try:
        named = external_data if isinstance(external_data, str) else None
        with OutputPair(path, keep=keep, data_name=named) as pair:
            try:
                if external_data or data_size(model) >= TWO_GB - 2**26:
                    pair.write_data(lambda handle: moved.extend(_write_data(model, handle)))
                if moved:  # the references replace the bytes while serialising
                    _refer(moved, pair.data_name)
                elif pair.has_data:  # nothing big enough: one plain file
                    pair.drop_data()
                model_bytes = model.SerializeToString()
                pair.commit(lambda handle: handle.write(model_bytes))
                if not keep_model:
                    moved = []
            finally:
                if moved:
                    _restore(moved, pair.data_file)
    except OSError as exc:
        raise OutputError(f"{path}: cannot write ({exc.strerror or exc})") from None


def _write_data(model: onnx.ModelProto, handle) -> list:
    """Stream the big tensors into `handle`, each aligned for memory mapping (MMAP_ALIGN), a piece
    at a time (`tensordata.chunks`: a weight on disk is read, converted and written without ever
    being held whole): [(tensor, offset, length)]."""
    moved, offset = [], 0
    for tensor in _big_tensors(model):
        size = ELEMENT_SIZE[tensor.data_type] * math.prod(tensor.dims)
        pad = (-offset) % (MMAP_ALIGN if size >= MMAP_ALIGN_FROM else _ALIGN)
        if pad:
            handle.write(b"\0" * pad)
            offset += pad
        length = 0
        for piece in tensordata.chunks(tensor):
            handle.write(piece)
            length += len(piece)
        moved.append((tensor, offset, length))
        offset += length
    return moved


def _refer(moved, data_name: str) -> None:
    """Make each moved tensor refer to its range of the data file (its bytes are there now)."""
    for tensor, offset, length in moved:
        tensor.ClearField("raw_data")
        for field in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
            tensor.ClearField(field)
        tensor.data_location = TensorProto.EXTERNAL
        del tensor.external_data[:]
        for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(length))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value


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
