"""One resolver for every file a model or an op list names: inside its folder, a regular file, in range.

An external-data `location` (in a graph, a subgraph, a model-local function, a sparse initializer,
a tensor attribute) and an op list's `extends:` are untrusted text. Each is resolved against the
folder of the file that names it (never the current directory), symlinks included, and must stay
inside it; only a regular file is opened (no /dev/zero, no FIFO), and only within its size. What
is wrong is one line of the caller's error class; the outside file's contents are never quoted.
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import TensorProto

from amp_rewrite.errors import ModelError
from amp_rewrite.onnx_facts import ELEMENT_SIZE, walk

MAX_NAME = 4096  # longer names are refused before the file system sees them (PATH_MAX)
_PACKED_4BIT = {
    getattr(TensorProto, name) for name in ("INT4", "UINT4", "FLOAT4E2M1") if hasattr(TensorProto, name)
}
_BYTE_TYPES = {
    getattr(TensorProto, name)
    for name in ("FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ", "FLOAT8E8M0")
    if hasattr(TensorProto, name)
}


def shown(name: str) -> str:
    """A name as an error line shows it: quoted, control characters escaped, long ones cut."""
    return repr(name if len(name) <= 120 else name[:100] + "...") + (
        "" if len(name) <= 120 else f" ({len(name)} characters)"
    )


def contained_file(
    folder: Path, name: str, *, what: str, error=ModelError, inside: str = "the model's folder"
) -> Path:
    """`name` resolved inside `folder` (symlinks followed, then checked), a regular file; else one line.

    `what` says what the name is ("external data file", "op list") and `inside` what the folder
    is, for the message."""
    if not isinstance(name, str) or not name:
        raise error(f"{what} has no file name")
    if "\0" in name:
        raise error(f"{what} {shown(name)} contains a NUL byte")
    if len(name) > MAX_NAME or any(
        len(part.encode("utf-8", "surrogateescape")) > 255 for part in name.split("/")
    ):
        raise error(f"{what} {shown(name)} is too long to be a file name")
    if os.path.isabs(name) or name.startswith(("\\", "/")):
        raise error(f"{what} {shown(name)} must be a relative path inside {inside}")
    if os.path.normpath(name).split(os.sep)[0] == "..":  # as written, whatever exists on the way
        raise error(f"{what} {shown(name)} escapes {inside}")
    try:
        base = Path(os.path.realpath(folder, strict=True))
        target = Path(os.path.realpath(base / name, strict=True))
    except FileNotFoundError:
        raise error(f"{what} {shown(name)} is missing") from None
    except OSError as exc:  # ELOOP, ENAMETOOLONG, EACCES: a name that cannot be a file here
        raise error(
            f"{what} {shown(name)} cannot be resolved ({os.strerror(exc.errno) if exc.errno else exc})"
        ) from None
    except (RuntimeError, ValueError) as exc:  # older Pythons: a symlink loop is a RuntimeError
        raise error(
            f"{what} {shown(name)} cannot be resolved ({'symlink loop' if isinstance(exc, RuntimeError) else exc})"
        ) from None
    if target != base and base not in target.parents:
        raise error(f"{what} {shown(name)} escapes {inside}")
    try:
        mode = os.stat(target).st_mode
    except OSError as exc:
        raise error(f"{what} {shown(name)} cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(mode):
        raise error(f"{what} {shown(name)} is not a regular file")
    return target


def open_regular(path: Path, *, what: str, error=ModelError):
    """Open `path` for reading, refusing anything but a regular file at the moment it is opened
    (O_NONBLOCK: a FIFO swapped in after the check cannot hang the open)."""
    flags = (
        os.O_RDONLY
        | getattr(os, "O_NONBLOCK", 0)
        | getattr(os, "O_CLOEXEC", 0)
        | getattr(os, "O_NOFOLLOW", 0)
    )
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise error(f"{what} {shown(str(path))} cannot be opened ({exc.strerror or exc})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise error(f"{what} {shown(str(path))} is not a regular file")
    return os.fdopen(fd, "rb")


def read_bounded(path: Path, limit: int, *, what: str, error=ModelError) -> bytes:
    """The whole of a regular file of at most `limit` bytes (an op list, say): one line if larger."""
    with open_regular(path, what=what, error=error) as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise error(f"{what} {shown(str(path))} is larger than {limit} bytes")
    return data


# --- every tensor of a model -----------------------------------------------------------------------


def _sparse_parts(sparse_tensors) -> Iterator[TensorProto]:
    for s in sparse_tensors:
        yield s.values
        yield s.indices


def _attribute_tensors(attr: onnx.AttributeProto, graphs: list) -> Iterator[TensorProto]:
    """An attribute's tensors (dense and sparse); its subgraphs go on `graphs`."""
    if attr.HasField("t"):
        yield attr.t
    yield from attr.tensors
    yield from _sparse_parts([attr.sparse_tensor] if attr.HasField("sparse_tensor") else [])
    yield from _sparse_parts(attr.sparse_tensors)
    if attr.HasField("g"):
        graphs.append(attr.g)
    graphs.extend(attr.graphs)


def _function_tensors(model: onnx.ModelProto) -> Iterator[TensorProto]:
    """Tensors of model-local function bodies (and their subgraphs) and attribute defaults, in
    place (the loader writes their bytes back into these very messages)."""
    for function in model.functions:
        graphs: list = []
        for attr in function.attribute_proto:
            yield from _attribute_tensors(attr, graphs)
        for node in function.node:
            for attr in node.attribute:
                yield from _attribute_tensors(attr, graphs)
        for graph in graphs:  # grows as subgraphs are found
            yield from graph.initializer
            yield from _sparse_parts(graph.sparse_initializer)
            for node in graph.node:
                for attr in node.attribute:
                    yield from _attribute_tensors(attr, graphs)


def model_tensors(model: onnx.ModelProto, walked=None, sparse=None) -> Iterator[TensorProto]:
    """Every TensorProto in `model`: initializers and sparse initializers of every graph and
    subgraph, tensor attributes (dense and sparse), model-local function bodies and their
    attribute defaults, training-info graphs. `walked`, `sparse`: what `walk(model.graph,
    sparse)` gave, when the caller has it (the loader shares one walk with validation)."""
    if walked is None:
        sparse = []
        walked = walk(model.graph, sparse)
    graphs, attribute_tensors = walked
    for info in model.training_info:
        for graph in (info.initialization, info.algorithm):
            more: list = []
            extra, extra_tensors = walk(graph, more)
            graphs = [*graphs, *extra]
            attribute_tensors = [*attribute_tensors, *extra_tensors]
            sparse = [*sparse, *more]
    for graph in graphs:
        yield from graph.initializer
        yield from _sparse_parts(graph.sparse_initializer)
    yield from attribute_tensors
    yield from _sparse_parts(sparse)
    yield from _function_tensors(model)


def is_external(tensor: TensorProto) -> bool:
    return tensor.data_location == TensorProto.EXTERNAL


def declared_bytes(tensor: TensorProto) -> int | None:
    """Bytes a tensor's shape and element type ask for; None for types without a fixed size."""
    count = math.prod(tensor.dims)
    if tensor.data_type in _PACKED_4BIT:
        return (count + 1) // 2
    size = ELEMENT_SIZE.get(tensor.data_type) or (1 if tensor.data_type in _BYTE_TYPES else None)
    return None if size is None else count * size


# --- external data ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reference:
    """A checked external-data reference: a regular file inside the model's folder and a range in it."""

    path: Path
    offset: int
    length: int

    def read(self) -> bytes:
        """The referenced bytes, exactly `length` of them (the file may have changed since)."""
        with open_regular(self.path, what="external data file") as handle:
            handle.seek(self.offset)
            data = handle.read(self.length)
        if len(data) != self.length:
            raise ModelError(
                f"external data file {shown(str(self.path))} changed while being read "
                f"(expected {self.length} bytes at offset {self.offset})"
            )
        return data

    def parts(self, size: int) -> Iterator[memoryview]:
        """The referenced bytes, `size` at a time, read into one buffer: each piece is valid until
        the next is asked for (streaming: never the whole range, nor a new allocation per piece)."""
        buffer = memoryview(bytearray(min(size, self.length)))
        with open_regular(self.path, what="external data file") as handle:
            handle.seek(self.offset)
            left = self.length
            while left:
                got = handle.readinto(buffer[: min(size, left)])
                if not got:
                    raise ModelError(
                        f"external data file {shown(str(self.path))} changed while being read "
                        f"(expected {self.length} bytes at offset {self.offset})"
                    )
                left -= got
                yield buffer[:got]


def _number(info: dict, key: str, name: str, where) -> int | None:
    value = info.get(key)
    if value is None or value == "":
        return None
    if not (value.isascii() and value.isdigit()) or len(value) > 20:
        raise ModelError(
            f"{where}: external data of tensor {shown(name)} has {key} {shown(value)}, "
            f"not a whole number of bytes"
        )
    return int(value)


def resolve(tensor: TensorProto, folder: Path, where) -> Reference:
    """The checked reference of one external tensor of the model at `where` (in `folder`): its file
    contained and regular, its length the one the tensor's shape needs, its range within the file."""
    try:
        info = {entry.key: entry.value for entry in tensor.external_data}
        name = tensor.name
    except UnicodeDecodeError:
        raise ModelError(f"{where}: an external data reference is not valid UTF-8 text") from None
    need = declared_bytes(tensor)
    if need is None:
        raise ModelError(
            f"{where}: tensor {shown(name)} of element type {tensor.data_type} cannot have external data"
        )
    what = f"{where}: external data of tensor {shown(name)}:"
    path = contained_file(folder, info.get("location", ""), what=f"{what} file")
    offset = _number(info, "offset", name, where) or 0
    length = _number(info, "length", name, where)
    if length is None:
        length = need
    if length != need:
        raise ModelError(
            f"{where}: tensor {shown(name)} has {length} bytes of external data but its shape "
            f"{list(tensor.dims)} needs {need}"
        )
    size = os.stat(path).st_size
    if offset + length > size:
        raise ModelError(
            f"{what} bytes {offset}..{offset + length} run past the end of "
            f"{shown(info.get('location', ''))} ({size} bytes)"
        )
    return Reference(path, offset, length)


def point_at(tensor: TensorProto, ref: Reference) -> None:
    """Make `tensor` refer to a checked reference by absolute path (what `tensordata` reads; never saved)."""
    del tensor.external_data[:]
    for key, value in (("location", str(ref.path)), ("offset", str(ref.offset)), ("length", str(ref.length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def checked_reference(tensor: TensorProto) -> Reference:
    """The reference `point_at` left on a tensor (an absolute path the loader checked)."""
    info = {entry.key: entry.value for entry in tensor.external_data}
    location = info.get("location", "")
    if not os.path.isabs(location) or "length" not in info:
        raise ModelError(
            f"tensor {shown(tensor.name)} refers to external data that was not loaded through "
            f"its model's path (pass the model as a path)"
        )
    return Reference(Path(location), int(info.get("offset") or 0), int(info["length"]))
