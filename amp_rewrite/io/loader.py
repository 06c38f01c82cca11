"""Load a model safely: a path or a ModelProto in, a `LoadedModel` out, every failure one line.

The model stays an `onnx.ModelProto` (see ARCHITECTURE.md for why not onnx-ir). Loading checks
what a hostile or broken file could do: not protobuf, no graph, external data that escapes the
model's folder or is missing; `input_checks.validate` then checks the model itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import TensorProto

from amp_rewrite.errors import ModelError
from amp_rewrite.io.input_checks import validate
from amp_rewrite.onnx_facts import all_tensors

@dataclass
class LoadedModel:
    model: onnx.ModelProto
    path: Path | None  # None when the model came in memory
    had_external_data: bool
    owned: bool = False  # True when nobody else holds `model` (read from a file): no copy needed
    lazy: bool = False  # big external weights stay on disk (tensordata reads them one at a time)
    data_bytes: int = 0  # bytes of tensor data, counted while validating
    float_bytes: int | None = None  # bytes of float weights, counted while validating
    nested: bool = True  # some node holds a subgraph (False: validation saw none)
    checked: bool = True  # False: loaded with checker=False, onnx.checker has not seen it yet

    def validate_in_full(self) -> None:
        """Run the checks `load(checker=False)` left out: a ModelError if the input is at fault."""
        if self.checked:
            return
        if self.owned:  # rewritten in place by now: read the input again
            load(self.path, lazy_weights=self.lazy)
        else:
            validate(self.model, self.path if self.path is not None else "model", skeleton=self.lazy,
                     in_memory=self.path is None)
        self.checked = True


def _fail(path, message: str):
    raise ModelError(f"{path}: {message}")


def _safe_external_path(base_dir: Path, location: str, model_path) -> Path:
    """Resolve an external-data location, refusing anything outside the model's folder."""
    if not location or os.path.isabs(location) or location.startswith(("/", "\\")):
        _fail(model_path, f"external data location {location!r} must be a relative path inside the model's folder")
    base = base_dir.resolve()
    target = (base / location).resolve()
    if target != base and base not in target.parents:
        _fail(model_path, f"external data location {location!r} escapes the model's folder")
    if not target.is_file():
        _fail(model_path, f"external data file {location!r} is missing")
    return target
def _external_tensors(graph: onnx.GraphProto):
    for tensor in all_tensors(graph):
        if tensor.data_location == TensorProto.EXTERNAL:
            yield tensor


LAZY_MIN_BYTES = 2**20  # with lazy_weights, external tensors from this size stay on disk


def _load_external_data(model: onnx.ModelProto, path: Path, lazy: bool = False) -> tuple[bool, bool]:
    """Read (or, with `lazy`, point at) every external tensor: (any external, any left on disk)."""
    base_dir = path.parent
    found = left = False
    for tensor in list(_external_tensors(model.graph)):
        found = True
        info = {e.key: e.value for e in tensor.external_data}
        target = _safe_external_path(base_dir, info.get("location", ""), path)
        # read it ourselves from the checked, resolved path (onnx's helper refuses any symlink,
        # even one inside the folder, with an exception of its own)
        try:
            offset = int(info.get("offset") or 0)
            length = int(info["length"]) if info.get("length") else None
        except ValueError:
            _fail(path, f"external data for {tensor.name!r} has a non-numeric offset or length")
        if offset < 0 or (length is not None and length < 0):
            _fail(path, f"external data for {tensor.name!r} has a negative offset or length")
        if lazy and (length if length is not None else target.stat().st_size - offset) >= LAZY_MIN_BYTES:
            _point_at(tensor, target, offset, length)  # read when needed (tensordata), one at a time
            left = True
            continue
        try:
            with open(target, "rb") as handle:
                handle.seek(offset)
                tensor.raw_data = handle.read() if length is None else handle.read(length)
        except OSError as exc:
            _fail(path, f"cannot read external data for {tensor.name!r} ({exc.strerror or exc})")
        tensor.data_location = TensorProto.DEFAULT
        del tensor.external_data[:]
    return found, left


def _point_at(tensor: TensorProto, target: Path, offset: int, length: int | None) -> None:
    """Refer to the checked, resolved file by absolute path (never saved: `save` writes the bytes)."""
    if length is None:
        length = target.stat().st_size - offset
    del tensor.external_data[:]
    for key, value in (("location", str(target)), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def load(source, *, lazy_weights: bool = False, checker: bool = True) -> LoadedModel:
    """A path or a ModelProto -> LoadedModel; every failure is one ModelError line.

    `lazy_weights` leaves big external-data tensors on disk until they are read or saved: for
    a caller that will only rewrite and `save`, so memory stays near the converted size.
    `checker=False` leaves onnx.checker out of validation, for a caller that runs it on what it
    makes and calls `validate_in_full` when anything fails (see `pipeline.rewrite`)."""
    if isinstance(source, LoadedModel):
        return source
    if isinstance(source, onnx.ModelProto):
        if not source.HasField("graph"):
            raise ModelError("model has no graph")
        found = validate(source, "model", in_memory=True, checker=checker)
        return LoadedModel(source, None, False, data_bytes=found.data_bytes, float_bytes=found.float_bytes,
                           nested=found.nested, checked=checker)
    if not isinstance(source, (str, os.PathLike)):
        raise ModelError(f"expected a path or an onnx.ModelProto, got {type(source).__name__}")
    path = Path(source)
    if not path.exists():
        _fail(path, "no such file")
    if not path.is_file():
        _fail(path, "not a file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        _fail(path, f"cannot read ({exc.strerror})")
    if not data:
        _fail(path, "empty file, not an ONNX model")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception:
        _fail(path, "not an ONNX model (protobuf parse failed: truncated or not a model file)")
    del data
    if not model.HasField("graph") or not model.opset_import:
        _fail(path, "not an ONNX model (no graph or no opset imports)")
    had_external, lazy = _load_external_data(model, path, lazy_weights)
    found = validate(model, path, skeleton=lazy, checker=checker)
    return LoadedModel(model, path, had_external, owned=True, lazy=lazy, data_bytes=found.data_bytes,
                       float_bytes=found.float_bytes, nested=found.nested, checked=checker)


