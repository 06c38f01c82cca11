"""Load and save models safely, and learn the element type of every tensor.

The model stays an `onnx.ModelProto` (see ARCHITECTURE.md for why not onnx-ir). Loading checks
what a hostile or broken file could do: not protobuf, no graph, external data that escapes the
model's folder or is missing. Saving writes to a temporary name beside the target and renames it
into place, so a crash never leaves half a file, and it never writes over the input.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import TensorProto, external_data_helper

from amp_rewrite.errors import ModelError, OutputError

TWO_GB = 2**31
# Initializers larger than this are shown to shape inference as typed inputs, not data.
INFERENCE_DATA_LIMIT = 1024


@dataclass
class LoadedModel:
    model: onnx.ModelProto
    path: Path | None  # None when the model came in memory
    had_external_data: bool


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
    for tensor in _all_tensors(graph):
        if tensor.data_location == TensorProto.EXTERNAL:
            yield tensor


def _all_tensors(graph: onnx.GraphProto):
    """Every TensorProto in a graph and its subgraphs: initializers and tensor attributes."""
    stack = [graph]
    while stack:
        g = stack.pop()
        yield from g.initializer
        for node in g.node:
            for attr in node.attribute:
                if attr.HasField("t"):
                    yield attr.t
                yield from attr.tensors
                if attr.HasField("g"):
                    stack.append(attr.g)
                stack.extend(attr.graphs)


def _load_external_data(model: onnx.ModelProto, path: Path) -> bool:
    base_dir = path.parent
    found = False
    for tensor in list(_external_tensors(model.graph)):
        found = True
        info = {e.key: e.value for e in tensor.external_data}
        _safe_external_path(base_dir, info.get("location", ""), path)
        try:
            external_data_helper.load_external_data_for_tensor(tensor, str(base_dir))
        except (OSError, ValueError) as exc:
            _fail(path, f"cannot read external data for {tensor.name!r}: {exc}")
        tensor.data_location = TensorProto.DEFAULT
        del tensor.external_data[:]
    return found


def load(source) -> LoadedModel:
    """A path or a ModelProto -> LoadedModel; every failure is one ModelError line."""
    if isinstance(source, onnx.ModelProto):
        if not source.HasField("graph"):
            raise ModelError("model has no graph")
        return LoadedModel(source, None, False)
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
    if not model.HasField("graph") or not model.opset_import:
        _fail(path, "not an ONNX model (no graph or no opset imports)")
    had_external = _load_external_data(model, path)
    return LoadedModel(model, path, had_external)


def _inference_skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with large initializers shown as typed inputs: cheap to shape-infer at any size."""
    skeleton = onnx.ModelProto()
    skeleton.ir_version = max(model.ir_version, 4)
    skeleton.opset_import.extend(model.opset_import)
    skeleton.functions.extend(model.functions)
    graph = skeleton.graph
    source = model.graph
    graph.name = source.name
    graph.node.extend(source.node)
    graph.input.extend(source.input)
    graph.output.extend(source.output)
    graph.value_info.extend(source.value_info)
    declared = {v.name for v in source.input}
    for tensor in source.initializer:
        count = 1
        for d in tensor.dims:
            count *= d
        if count <= INFERENCE_DATA_LIMIT:
            graph.initializer.append(tensor)
        elif tensor.name not in declared:
            graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
    return skeleton


def _collect_value_infos(graph: onnx.GraphProto, types: dict, shapes: dict) -> None:
    stack = [graph]
    while stack:
        g = stack.pop()
        for value in (*g.input, *g.output, *g.value_info):
            if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type:
                types.setdefault(value.name, value.type.tensor_type.elem_type)
                if value.type.tensor_type.HasField("shape"):
                    shapes.setdefault(value.name, value.type.tensor_type.shape)
        for tensor in g.initializer:
            types.setdefault(tensor.name, tensor.data_type)
        for node in g.node:
            for attr in node.attribute:
                if attr.HasField("g"):
                    stack.append(attr.g)
                stack.extend(attr.graphs)


def tensor_types(model: onnx.ModelProto) -> tuple[dict[str, int], dict[str, object]]:
    """Element type and shape (when known) of every named tensor, from shape inference.

    Inference runs on a skeleton so models of any size work; where it cannot run, the declared
    types stand and the graph builder completes them from the schemas.
    """
    types: dict[str, int] = {}
    shapes: dict[str, object] = {}
    _collect_value_infos(model.graph, types, shapes)
    for node in _constant_nodes(model.graph):
        value = next((a for a in node.attribute if a.name == "value"), None)
        if value is not None and node.output:
            types.setdefault(node.output[0], value.t.data_type)
    try:
        inferred = onnx.shape_inference.infer_shapes(_inference_skeleton(model), strict_mode=False)
    except Exception:
        return types, shapes
    _collect_value_infos(inferred.graph, types, shapes)
    return types, shapes


def _constant_nodes(graph: onnx.GraphProto):
    stack = [graph]
    while stack:
        g = stack.pop()
        for node in g.node:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                yield node
            for attr in node.attribute:
                if attr.HasField("g"):
                    stack.append(attr.g)
                stack.extend(attr.graphs)


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


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, fsync, then rename over it."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        _remove_quietly(tmp)
        raise OutputError(f"{path}: cannot write ({exc.strerror or exc})") from None
    except BaseException:
        _remove_quietly(tmp)
        raise


def _remove_quietly(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def save(model: onnx.ModelProto, path, *, external_data: bool = False) -> None:
    """Save atomically; with external data (or above 2 GB) weights go to `<name>.data` beside it."""
    path = Path(path)
    if not external_data and model.ByteSize() < TWO_GB:
        atomic_write_bytes(path, model.SerializeToString())
        return
    data_name = f"{path.name}.data"
    tmp_dir = tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent or ".")
    try:
        tmp_model = Path(tmp_dir) / path.name
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        onnx.save_model(copy, str(tmp_model), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data_name, size_threshold=1024)
        if (Path(tmp_dir) / data_name).exists():
            os.replace(Path(tmp_dir) / data_name, path.parent / data_name)
        os.replace(tmp_model, path)
    except OSError as exc:
        raise OutputError(f"{path}: cannot write ({exc.strerror or exc})") from None
    finally:
        for leftover in Path(tmp_dir).glob("*"):
            _remove_quietly(leftover)
        try:
            os.rmdir(tmp_dir)
        except OSError:
            pass
