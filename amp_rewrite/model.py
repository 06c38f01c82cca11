"""Load and save models safely, and learn the element type of every tensor.

The model stays an `onnx.ModelProto` (see ARCHITECTURE.md for why not onnx-ir). Loading checks
what a hostile or broken file could do: not protobuf, no graph, external data that escapes the
model's folder or is missing. Saving writes to a temporary name beside the target and renames it
into place, so a crash never leaves half a file, and it never writes over the input.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import onnx
from onnx import TensorProto, helper

from amp_rewrite import elemtypes, tensordata
from amp_rewrite.errors import ModelError, OutputError

TWO_GB = 2**31
# Initializers larger than this are shown to shape inference as typed inputs, not data.
INFERENCE_DATA_LIMIT = 1024


# What ONNX Runtime accepts, by its version: (max IR version, max ai.onnx opset). Measured for the
# installed release; an unknown release uses the newest entry not above it, capped by the opsets
# of ORT's own schema registry. A model beyond these would load here but not in ONNX Runtime.
ORT_LIMITS = {(1, 31): (13, 26)}
# Above this many bytes of tensor data, onnx.checker runs on a data-free skeleton (it serialises).
CHECK_IN_FULL_LIMIT = 256 * 2**20


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
    for tensor in _all_tensors(graph):
        if tensor.data_location == TensorProto.EXTERNAL:
            yield tensor


def _all_tensors(graph: onnx.GraphProto, walked=None):
    """Every TensorProto in a graph and its subgraphs: initializers and tensor attributes.
    `walked`: `_walk(graph)` when the caller has it already."""
    graphs, attribute_tensors = walked or _walk(graph)
    for g in graphs:
        yield from g.initializer
    yield from attribute_tensors


def _walk(graph: onnx.GraphProto) -> tuple[list, list]:
    """(every graph, main first; every tensor attribute): one walk over the node attributes,
    which costs about a microsecond a node."""
    graphs, tensors = [graph], []
    for g in graphs:  # grows as subgraphs are found
        for node in g.node:
            for attr in node.attribute:
                if attr.HasField("t"):
                    tensors.append(attr.t)
                tensors.extend(attr.tensors)
                if attr.HasField("g"):
                    graphs.append(attr.g)
                graphs.extend(attr.graphs)
    return graphs, tensors


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


# --- the working copy -----------------------------------------------------------------------------

_DATA_FIELDS = {"raw_data", "float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data"}
_TENSOR_RARE_META = [f for f in TensorProto.DESCRIPTOR.fields if f.name not in _DATA_FIELDS | {"name", "data_type", "dims"}]


def working_copy(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict]:
    """A copy of `model` to rewrite in place, and {name: tensor} of what it borrows.

    Copying a model is mostly copying its weights (0.5 of 0.6 s for 600 MB), and most of them are
    about to be replaced by their converted bytes. So each main-graph initializer of raw data that
    the skeletons show only by its type (over INFERENCE_DATA_LIMIT values) is copied without its
    bytes (name, type, shape, metadata), and the rewrite reads the caller's tensor, never changing
    it: it writes the converted bytes into the copy, or at the end (`restore_borrowed`) the
    caller's tensor whole.
    """
    work = onnx.ModelProto()
    _copy_fields(work, model, skip={"graph"})
    _copy_fields(work.graph, model.graph, skip={"initializer"})
    borrowed = {}
    for tensor in model.graph.initializer:
        dims = tensor.dims[:]
        if math.prod(dims) > INFERENCE_DATA_LIMIT and tensor.HasField("raw_data"):
            # named, typed and shaped (validated): set at once; the rarely set fields one by one
            copy = work.graph.initializer.add(name=tensor.name, data_type=tensor.data_type, dims=dims)
            _copy_fields(copy, tensor, fields=_TENSOR_RARE_META)
            borrowed[tensor.name] = tensor
        else:
            work.graph.initializer.add().CopyFrom(tensor)
    return work, borrowed


def restore_borrowed(graph: onnx.GraphProto, borrowed: dict, replaced: set) -> None:
    """Give every borrowed initializer that was not replaced by converted bytes its own data."""
    if not borrowed:
        return
    for tensor in graph.initializer:
        source = borrowed.get(tensor.name)
        if source is not None and tensor.name not in replaced:
            tensor.CopyFrom(source)


def _is_repeated(field) -> bool:
    repeated = getattr(field, "is_repeated", None)  # protobuf >= 5.29; `label` is gone in 7
    return repeated if repeated is not None else field.label == field.LABEL_REPEATED


def _copy_fields(target, source, *, skip=frozenset(), fields=None) -> None:
    """Copy `source`'s fields into `target` (an empty message of the same type), but `skip`."""
    if fields is None:
        fields = [f for f, _ in source.ListFields() if f.name not in skip]
    for field in fields:
        value = getattr(source, field.name)
        if _is_repeated(field):
            if len(value):
                getattr(target, field.name).extend(value)
        elif field.message_type is not None:
            if source.HasField(field.name):
                getattr(target, field.name).CopyFrom(value)
        elif value:
            setattr(target, field.name, value)


# --- validation ----------------------------------------------------------------------------------


def ort_limits() -> tuple[int, dict[str, int]]:
    """(max IR version, {domain: max opset}) that the installed ONNX Runtime accepts."""
    if "ort" in _LIMITS_CACHE:
        return _LIMITS_CACHE["ort"]
    try:
        import onnxruntime
        from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

        version = tuple(int(x) for x in re.findall(r"\d+", onnxruntime.__version__)[:2])
        registry: dict[str, int] = {}
        for schema in ort_state.get_all_operator_schema():
            registry[schema.domain] = max(registry.get(schema.domain, 0), schema.since_version)
    except Exception:  # no ONNX Runtime: nothing to hold the model to
        _LIMITS_CACHE["ort"] = (onnx.IR_VERSION, {})
        return _LIMITS_CACHE["ort"]
    known = sorted(k for k in ORT_LIMITS if k <= version) or sorted(ORT_LIMITS)[:1]
    max_ir, max_opset = ORT_LIMITS[known[-1]]
    opsets = {d: v for d, v in registry.items() if d not in ("", "ai.onnx")}
    opsets[""] = min(max_opset, registry.get("", max_opset)) if known[-1] == version else registry.get("", max_opset)
    _LIMITS_CACHE["ort"] = (max_ir, opsets)
    return _LIMITS_CACHE["ort"]


_LIMITS_CACHE: dict = {}

ELEMENT_SIZE = {t: np.dtype(helper.tensor_dtype_to_np_dtype(t)).itemsize
                 for t in (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16,
                           TensorProto.INT8, TensorProto.UINT8, TensorProto.INT16, TensorProto.UINT16,
                           TensorProto.INT32, TensorProto.UINT32, TensorProto.INT64, TensorProto.UINT64,
                           TensorProto.BOOL, TensorProto.COMPLEX64, TensorProto.COMPLEX128)}
_TYPED_FIELD = {TensorProto.FLOAT: "float_data", TensorProto.DOUBLE: "double_data", TensorProto.INT64: "int64_data",
                TensorProto.UINT64: "uint64_data", TensorProto.UINT32: "uint64_data",
                TensorProto.COMPLEX64: "float_data", TensorProto.COMPLEX128: "double_data"}


def _where(path) -> str:
    return str(path) if path is not None else "model"


_KNOWN_TYPES = frozenset(TensorProto.DataType.values()) - {TensorProto.UNDEFINED}
FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE})


def _check_tensor_sizes(model: onnx.ModelProto, path, in_memory: bool = False, walked=None) -> tuple[int, int]:
    """Every tensor holds exactly the data its shape asks for; returns the bytes of data, all and
    of float tensors. `in_memory`: the model came as a ModelProto, so external data has no folder
    to come from. `walked`: `_walk(model.graph)` when the caller has it."""
    total = floats = 0
    for tensor in _all_tensors(model.graph, walked):
        data_type = tensor.data_type
        if data_type not in _KNOWN_TYPES:
            _fail(path, f"tensor {tensor.name!r} has unknown element type {data_type}")
        dims = tensor.dims[:]  # a list: the container is read once
        if dims and min(dims) < 0:
            _fail(path, f"tensor {tensor.name!r} has a negative dimension {dims}")
        count = math.prod(dims)
        size = ELEMENT_SIZE.get(data_type)
        if data_type in FLOAT_TYPES:
            floats += count * size  # what it holds, once the checks below pass
        external = tensor.data_location == TensorProto.EXTERNAL  # tensordata.is_external, inlined: 58k calls
        if external and in_memory:
            raise ModelError("model refers to external data but came in memory: pass its path instead")
        if external and size is not None:  # left on disk by lazy_weights
            have, need = int(tensordata.external_info(tensor)["length"]), count * size
            total += need
            if have != need:
                _fail(path, f"tensor {tensor.name!r} has {have} bytes of external data but its shape "
                            f"{list(tensor.dims)} needs {need}")
        elif tensor.HasField("raw_data") and size is not None:
            have, need = len(tensor.raw_data), count * size
            total += have
            if have != need:
                _fail(path, f"tensor {tensor.name!r} holds {have} bytes of data but its shape "
                            f"{list(tensor.dims)} needs {need}")
        elif tensor.data_type in (TensorProto.STRING,):
            continue
        elif size is not None:
            field = _TYPED_FIELD.get(tensor.data_type, "int32_data")
            have = len(getattr(tensor, field))
            if tensor.data_type in (TensorProto.COMPLEX64, TensorProto.COMPLEX128):
                have //= 2
            total += have * size
            if have != count:
                _fail(path, f"tensor {tensor.name!r} holds {have} values but its shape {list(tensor.dims)} "
                            f"needs {count}")
    return total, floats


def _free_names(graph: onnx.GraphProto) -> set[str]:
    """Names a (sub)graph reads that it does not define: what it takes from outer scopes."""
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    defined.update(name for node in graph.node for name in node.output if name)
    free = set()
    for node in graph.node:
        free.update(name for name in node.input if name and name not in defined)
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                free.update(_free_names(sub) - defined)
    free.update(v.name for v in graph.output if v.name not in defined)
    return free


def _check_structure(graph: onnx.GraphProto, outer: set[str], path, label: str = "main graph") -> None:
    """Names defined once, every input defined somewhere visible, no cycles: one line each."""
    main_io = (*graph.input, *graph.output) if not outer else ()  # bodies may leave types to inference
    for value in main_io:
        kind = value.type.WhichOneof("value")
        if kind is None:
            _fail(path, f"{label}: {value.name!r} has no type")
        if kind == "tensor_type" and not value.type.tensor_type.elem_type:
            _fail(path, f"{label}: {value.name!r} has no element type")
    defined: dict[str, str] = {}
    for kind, names in (("graph input", [v.name for v in graph.input]),
                        ("initializer", [t.name for t in graph.initializer])):
        for name in names:
            if not name:
                _fail(path, f"{label}: an {kind} has an empty name")
            if name in defined and not (kind == "initializer" and defined[name] == "graph input"):
                _fail(path, f"{label}: tensor name {name!r} is defined twice ({defined[name]} and {kind})")
            defined[name] = kind
    node_names: set[str] = set()
    producer: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        if node.name:
            if node.name in node_names:
                _fail(path, f"{label}: node name {node.name!r} is used twice (ONNX requires unique node names)")
            node_names.add(node.name)
        for name in node.output:
            if not name:
                continue
            if name in defined or name in producer:
                _fail(path, f"{label}: tensor name {name!r} is defined twice (output of node "
                            f"{node.name or node.op_type!r})")
            producer[name] = i
    visible = outer | set(defined) | set(producer)
    edges: list[set[int]] = [set() for _ in graph.node]
    for i, node in enumerate(graph.node):
        reads = [name for name in node.input if name]
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                _check_structure(sub, visible, path, f"subgraph {attr.name!r} of node {node.name or node.op_type!r}")
                reads.extend(_free_names(sub))
        for name in reads:
            if name not in visible:
                _fail(path, f"{label}: node {node.name or node.op_type!r} reads {name!r}, which nothing defines")
            if name in producer:
                edges[producer[name]].add(i)
    for value in graph.output:
        if value.name not in visible:
            _fail(path, f"{label}: graph output {value.name!r} is not produced by any node")
    indegree = [0] * len(graph.node)
    for targets in edges:
        for j in targets:
            indegree[j] += 1
    ready = [i for i, d in enumerate(indegree) if d == 0]
    done = 0
    while ready:
        i = ready.pop()
        done += 1
        for j in edges[i]:
            indegree[j] -= 1
            if indegree[j] == 0:
                ready.append(j)
    if done != len(graph.node):
        stuck = next(graph.node[i] for i, d in enumerate(indegree) if d > 0)
        _fail(path, f"{label}: the graph has a cycle (through node {stuck.name or stuck.op_type!r})")


def _passes_checker(model: onnx.ModelProto) -> bool:
    try:
        onnx.checker.check_model(model)
        return True
    except Exception:
        return False


def _breaks_rules_checker_skips(graph: onnx.GraphProto, graphs=None) -> bool:
    """Rules onnx.checker leaves alone: unique node names, typed graph inputs and outputs.
    `graphs`: `graph` and its subgraphs when the caller has them."""
    for g in graphs or _graphs(graph):
        names = [node.name for node in g.node if node.name]
        if len(names) != len(set(names)):
            return True
    for value in (*graph.input, *graph.output):  # the main graph's; bodies may leave them to inference
        kind = value.type.WhichOneof("value")
        if kind is None or (kind == "tensor_type" and not value.type.tensor_type.elem_type):
            return True
    return False


def _one_line(message: str) -> str:
    text = message.split("==> Context:")[0]
    text = " ".join(text.split())
    return text[:300] or "invalid model"


def _checker_skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its big initializers as typed graph inputs (for the checker at any size)."""
    skeleton = _inference_skeleton(model)
    skeleton.ir_version = model.ir_version
    skeleton.metadata_props.extend(model.metadata_props)
    return skeleton


class Validated(NamedTuple):
    """What validation counted on the way, so later stages need not walk the model again."""

    data_bytes: int  # bytes of tensor data
    float_bytes: int  # of float tensors (initializers and tensor attributes): the weights
    nested: bool  # some node holds a subgraph


def validate(model: onnx.ModelProto, path=None, *, skeleton: bool = False, in_memory: bool = False,
             checker: bool = True) -> Validated:
    """Refuse a model that is invalid or that ONNX Runtime could not load: one ModelError line.
    Returns the bytes of tensor data it counted on the way and whether it holds subgraphs.

    Checks, cheapest first: versions against ONNX Runtime's limits, names and structure (cycles,
    undefined inputs, duplicates), tensor data sizes, then onnx.checker (on a data-free skeleton
    when the model is big, so no 2 GB serialisation). `checker=False` stops before onnx.checker
    when the rules it does not cover (unique node names, typed I/O) hold.
    """
    where = _where(path)
    if not model.HasField("graph"):
        _fail(where, "model has no graph")
    if model.ir_version <= 0:
        _fail(where, "model has no IR version")
    max_ir, max_opsets = ort_limits()
    if model.ir_version > max(max_ir, 3) or model.ir_version > onnx.IR_VERSION:
        _fail(where, f"IR version {model.ir_version} is newer than ONNX Runtime supports (at most {max_ir}); "
                     f"re-export with an older IR version")
    seen_domains = set()
    for opset in model.opset_import:
        domain = "" if opset.domain == "ai.onnx" else opset.domain
        if domain in seen_domains:
            _fail(where, f"opset for domain {opset.domain or 'ai.onnx'!r} is imported twice")
        seen_domains.add(domain)
        limit = max_opsets.get(domain)
        if domain == "" and opset.version > onnx.defs.onnx_opset_version():
            limit = min(limit or opset.version, onnx.defs.onnx_opset_version())
        if limit is not None and opset.version > limit:
            _fail(where, f"opset {opset.version} of domain {opset.domain or 'ai.onnx'!r} is newer than "
                         f"ONNX Runtime supports (at most {limit})")
        if opset.version < 1:
            _fail(where, f"opset version {opset.version} of domain {opset.domain or 'ai.onnx'!r} is not valid")
    if not seen_domains:
        _fail(where, "model imports no opset")
    if not model.graph.output:
        _fail(where, "the main graph has no outputs (ONNX Runtime cannot load it)")
    walked = _walk(model.graph)
    data_bytes, float_bytes = _check_tensor_sizes(model, where, in_memory, walked)
    found = Validated(data_bytes, float_bytes, len(walked[0]) > 1)
    if not checker and not _breaks_rules_checker_skips(model.graph, walked[0]):
        return found
    target = model if data_bytes < CHECK_IN_FULL_LIMIT and not skeleton else _checker_skeleton(model)
    if _passes_checker(target) and not _breaks_rules_checker_skips(model.graph, walked[0]):
        return found  # the common case; the structure walk below only runs to name a problem
    _check_structure(model.graph, set(), where)
    for attempt in range(2):
        try:
            onnx.checker.check_model(target)
            return found
        except onnx.checker.ValidationError as exc:
            message = _one_line(str(exc))
            if attempt == 0 and "topologically sorted" in message:
                # structure was checked above, so the nodes are only out of order: the rewrite
                # sorts them; check the rest on a sorted copy
                from amp_rewrite.pipeline import sort_graphs

                copy = onnx.ModelProto()
                copy.CopyFrom(target)
                sort_graphs(copy)
                target = copy
                continue
            _fail(where, f"invalid ONNX model: {message}")
        except Exception as exc:  # the checker's own failures are ours to state plainly
            _fail(where, f"invalid ONNX model: {_one_line(str(exc)) or type(exc).__name__}")


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
    types: dict = {}  # (element type, *dims) -> TypeProto: weights share a few shapes
    for tensor in source.initializer:
        dims = tensor.dims[:]
        if math.prod(dims) <= INFERENCE_DATA_LIMIT:
            graph.initializer.append(tensor)
        elif tensor.name not in declared:
            key = (tensor.data_type, *dims)
            if key not in types:
                types[key] = _tensor_type(tensor.data_type, dims)
            graph.input.add(name=tensor.name, type=types[key])
    return skeleton


def _tensor_type(elem_type: int, dims) -> onnx.TypeProto:
    """onnx's make_tensor_type_proto without its per-call checks (58k weights at 100k nodes)."""
    proto = onnx.TypeProto()
    proto.tensor_type.elem_type = elem_type
    shape = proto.tensor_type.shape
    shape.SetInParent()  # a scalar has a shape with no dims, not no shape
    for d in dims:
        shape.dim.add().dim_value = d
    return proto


def _collect_value_infos(graph: onnx.GraphProto, types: dict, shapes: dict, graphs=None) -> None:
    """Declared types and shapes of `graph` and its subgraphs (`graphs`, when the caller has them)."""
    for g in graphs if graphs is not None else _graphs(graph):
        for value in (*g.input, *g.output, *g.value_info):
            if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type:
                types.setdefault(value.name, value.type.tensor_type.elem_type)
                if value.type.tensor_type.HasField("shape"):
                    shapes.setdefault(value.name, value.type.tensor_type.shape)
        for tensor in g.initializer:
            types.setdefault(tensor.name, tensor.data_type)


# Above this many nodes, shape inference (20-40 µs a node) runs only when the schemas alone
# leave a type unknown: shapes then come from the model's own value_info (FLOPs "where known").
SHAPE_INFERENCE_NODE_LIMIT = 20_000


def tensor_types(model: onnx.ModelProto, *, shape_inference: bool | None = None, scopes=None):
    """Element type and shape (when known) of every named tensor: (types, shapes).

    Types come from the declarations and the schemas (`elemtypes.propagate`); ONNX shape
    inference, on a skeleton so models of any size work, adds shapes and any type the schemas
    could not give. `shape_inference=None` runs it for models up to SHAPE_INFERENCE_NODE_LIMIT
    nodes, and beyond only when a type is missing. `scopes`: `graph.read_scopes(model.graph)`
    when the caller has it already.
    """
    types: dict[str, int] = {}
    shapes: dict[str, object] = {}
    _collect_value_infos(model.graph, types, shapes, [scope.graph for scope in scopes] if scopes else None)
    complete = elemtypes.propagate(model, types, scopes)
    if shape_inference is None:
        shape_inference = not complete or len(model.graph.node) <= SHAPE_INFERENCE_NODE_LIMIT
    if not shape_inference:
        return types, shapes
    try:
        inferred = onnx.shape_inference.infer_shapes(_inference_skeleton(model), strict_mode=False)
    except Exception:
        return types, shapes
    _collect_value_infos(inferred.graph, types, shapes)
    return types, shapes


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
    for graph in _graphs(model.graph):
        for tensor in graph.initializer:
            if tensor.data_type in (TensorProto.STRING, TensorProto.UNDEFINED):
                continue
            size = ELEMENT_SIZE.get(tensor.data_type)
            count = math.prod(tensor.dims)
            if size is not None and count * size >= EXTERNAL_THRESHOLD:
                yield tensor


def _graphs(graph: onnx.GraphProto) -> list:
    return _walk(graph)[0]


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
    if not external_data and _data_size(model) < TWO_GB - 2**26:
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


def _data_size(model: onnx.ModelProto) -> int:
    """Bytes of tensor data in the model (without serialising it)."""
    total = 0
    for tensor in _all_tensors(model.graph):
        if tensor.HasField("raw_data"):
            total += len(tensor.raw_data)  # upb: no copy (ByteSize() would serialise the tensor)
        else:
            size = ELEMENT_SIZE.get(tensor.data_type, 8)
            total += size * (int(np.prod(tensor.dims, dtype=np.int64)) if tensor.dims else 1)
    return total


def byte_size(model: onnx.ModelProto, data: int | None = None) -> int:
    """The model's serialised size: exact while small; above CHECK_IN_FULL_LIMIT of tensor data,
    tensor data plus an estimate for the rest (upb's ByteSize() serialises, doubling memory).
    `data`, when the caller knows it, saves a walk over every tensor."""
    data = _data_size(model) if data is None else data
    if data < CHECK_IN_FULL_LIMIT:
        return model.ByteSize()
    return data + 64 * (len(model.graph.node) + len(model.graph.initializer))  # subgraphs: small, left out


def checker_target(model: onnx.ModelProto, data: int | None = None, *, skeleton: bool = False) -> onnx.ModelProto:
    """What onnx.checker should see: the model, or above CHECK_IN_FULL_LIMIT (or with weights
    left on disk) its data-free skeleton."""
    data = _data_size(model) if data is None else data
    return model if data < CHECK_IN_FULL_LIMIT and not skeleton else _checker_skeleton(model)
