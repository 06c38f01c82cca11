"""Refuse a model that is invalid or that ONNX Runtime could not load, in one `ModelError` line.

Checks run cheapest first: versions against ONNX Runtime's limits, tensor data sizes, then
onnx.checker; the structure walk (duplicate names, undefined inputs, cycles) runs only to name a
problem the checker found or skips. Validation counts on the way what later stages would walk
the model again for (`Validated`).
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

import networkx as nx
import onnx
from onnx import TensorProto

from amp_rewrite import ir
from amp_rewrite.errors import ModelError
from amp_rewrite.io import tensordata
from amp_rewrite.io.skeleton import CHECK_IN_FULL_LIMIT, checker_skeleton
from amp_rewrite.onnx_facts import (
    ELEMENT_SIZE,
    FLOAT_TYPES,
    KNOWN_TYPES,
    TYPED_FIELD,
    all_graphs,
    all_tensors,
    walk,
)

# What ONNX Runtime accepts, by its version: (max IR version, max ai.onnx opset). Measured for the
# installed release; an unknown release uses the newest entry not above it, capped by the opsets
# of ORT's own schema registry. A model beyond these would load here but not in ONNX Runtime.
ORT_LIMITS = {(1, 31): (13, 26)}
ORT_MIN_OPSET = 7  # older ai.onnx opsets ONNX Runtime does not guarantee (and Cast's `to` was a string)


def _fail(path, message: str):
    raise ModelError(f"{path}: {message}")


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
    opsets[""] = (
        min(max_opset, registry.get("", max_opset)) if known[-1] == version else registry.get("", max_opset)
    )
    _LIMITS_CACHE["ort"] = (max_ir, opsets)
    return _LIMITS_CACHE["ort"]


_LIMITS_CACHE: dict = {}


def _where(path) -> str:
    return str(path) if path is not None else "model"


def _check_tensor_sizes(
    model: onnx.ModelProto, path, in_memory: bool = False, walked=None
) -> tuple[int, int]:
    """Every tensor holds exactly the data its shape asks for; returns the bytes of data, all and
    of float tensors. `in_memory`: the model came as a ModelProto, so external data has no folder
    to come from. `walked`: `walk(model.graph)` when the caller has it."""
    total = floats = 0
    for tensor in all_tensors(model.graph, walked):
        data_type = tensor.data_type
        if data_type not in KNOWN_TYPES:
            _fail(path, f"tensor {tensor.name!r} has unknown element type {data_type}")
        dims = tensor.dims[:]  # a list: the container is read once
        if dims and min(dims) < 0:
            _fail(path, f"tensor {tensor.name!r} has a negative dimension {dims}")
        count = math.prod(dims)
        size = ELEMENT_SIZE.get(data_type)
        if data_type in FLOAT_TYPES:
            floats += count * size  # what it holds, once the checks below pass
        external = (
            tensor.data_location == TensorProto.EXTERNAL
        )  # tensordata.is_external, inlined: once per tensor
        if external and in_memory:
            raise ModelError("model refers to external data but came in memory: pass its path instead")
        if external and size is not None:  # left on disk by lazy_weights
            have, need = int(tensordata.external_info(tensor)["length"]), count * size
            total += need
            if have != need:
                _fail(
                    path,
                    f"tensor {tensor.name!r} has {have} bytes of external data but its shape "
                    f"{list(tensor.dims)} needs {need}",
                )
        elif tensor.HasField("raw_data") and size is not None:
            have, need = len(tensor.raw_data), count * size
            total += have
            if have != need:
                _fail(
                    path,
                    f"tensor {tensor.name!r} holds {have} bytes of data but its shape "
                    f"{list(tensor.dims)} needs {need}",
                )
        elif tensor.data_type in (TensorProto.STRING,):
            continue
        elif size is not None:
            field = TYPED_FIELD.get(tensor.data_type, "int32_data")
            have = len(getattr(tensor, field))
            if tensor.data_type in (TensorProto.COMPLEX64, TensorProto.COMPLEX128):
                have //= 2
            total += have * size
            if have != count:
                _fail(
                    path,
                    f"tensor {tensor.name!r} holds {have} values but its shape {list(tensor.dims)} "
                    f"needs {count}",
                )
    return total, floats


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
    for kind, names in (
        ("graph input", [v.name for v in graph.input]),
        ("initializer", [t.name for t in graph.initializer]),
    ):
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
                _fail(
                    path, f"{label}: node name {node.name!r} is used twice (ONNX requires unique node names)"
                )
            node_names.add(node.name)
        for name in node.output:
            if not name:
                continue
            if name in defined or name in producer:
                _fail(
                    path,
                    f"{label}: tensor name {name!r} is defined twice (output of node "
                    f"{node.name or node.op_type!r})",
                )
            producer[name] = i
    visible = outer | set(defined) | set(producer)
    deps = nx.DiGraph()
    deps.add_nodes_from(range(len(graph.node)))
    for i, node in enumerate(graph.node):
        reads = [name for name in node.input if name]
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                _check_structure(
                    sub, visible, path, f"subgraph {attr.name!r} of node {node.name or node.op_type!r}"
                )
                reads.extend(ir.captures(sub))
        for name in reads:
            if name not in visible:
                _fail(
                    path, f"{label}: node {node.name or node.op_type!r} reads {name!r}, which nothing defines"
                )
            if name in producer:
                deps.add_edge(producer[name], i)
    for value in graph.output:
        if value.name not in visible:
            _fail(path, f"{label}: graph output {value.name!r} is not produced by any node")
    try:
        cycle = nx.find_cycle(deps)
    except nx.NetworkXNoCycle:
        return
    stuck = graph.node[cycle[0][0]]
    _fail(path, f"{label}: the graph has a cycle (through node {stuck.name or stuck.op_type!r})")


def _passes_checker(model: onnx.ModelProto) -> bool:
    try:
        onnx.checker.check_model(model)
        return True
    except Exception:
        return False


def _breaks_rules_checker_skips(graph: onnx.GraphProto, graphs=None, names_unique: bool = False) -> bool:
    """Rules onnx.checker leaves alone: unique node names, typed graph inputs and outputs.
    `graphs`: `graph` and its subgraphs when the caller has them; `names_unique`: the caller has
    made the node names unique (the loader), so they are not read again (0.05 s at 100k nodes)."""
    for g in () if names_unique else graphs or all_graphs(graph):
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


class Validated(NamedTuple):
    """What validation counted on the way, so later stages need not walk the model again."""

    data_bytes: int  # bytes of tensor data
    float_bytes: int  # of float tensors (initializers and tensor attributes): the weights
    nested: bool  # some node holds a subgraph


def validate(
    model: onnx.ModelProto,
    path=None,
    *,
    skeleton: bool = False,
    in_memory: bool = False,
    checker: bool = True,
    walked=None,
    names_unique: bool = False,
) -> Validated:
    """Refuse a model that is invalid or that ONNX Runtime could not load: one ModelError line.
    Returns the bytes of tensor data it counted on the way and whether it holds subgraphs.

    Checks, cheapest first: versions against ONNX Runtime's limits, names and structure (cycles,
    undefined inputs, duplicates), tensor data sizes, then onnx.checker (on a data-free skeleton
    when the model is big, so no 2 GB serialisation). `checker=False` stops before onnx.checker
    when the rules it does not cover (unique node names, typed I/O) hold. `names_unique`: the
    caller has made every graph's node names unique (the loader renames repeats first).
    """
    where = _where(path)
    if not model.HasField("graph"):
        _fail(where, "model has no graph")
    if model.ir_version <= 0:
        _fail(where, "model has no IR version")
    max_ir, max_opsets = ort_limits()
    if model.ir_version > max(max_ir, 3) or model.ir_version > onnx.IR_VERSION:
        _fail(
            where,
            f"IR version {model.ir_version} is newer than ONNX Runtime supports (at most {max_ir}); "
            f"re-export with an older IR version",
        )
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
            _fail(
                where,
                f"opset {opset.version} of domain {opset.domain or 'ai.onnx'!r} is newer than "
                f"ONNX Runtime supports (at most {limit})",
            )
        if opset.version < 1:
            _fail(
                where, f"opset version {opset.version} of domain {opset.domain or 'ai.onnx'!r} is not valid"
            )
        if domain == "" and opset.version < ORT_MIN_OPSET:
            _fail(
                where,
                f"opset {opset.version} of domain 'ai.onnx' is older than ONNX Runtime supports (at least "
                f"{ORT_MIN_OPSET}); convert it with onnx.version_converter",
            )
    if not seen_domains:
        _fail(where, "model imports no opset")
    if not model.graph.output:
        _fail(where, "the main graph has no outputs (ONNX Runtime cannot load it)")
    walked = walked or walk(model.graph)  # the loader's, when it has walked already
    data_bytes, float_bytes = _check_tensor_sizes(model, where, in_memory, walked)
    found = Validated(data_bytes, float_bytes, len(walked[0]) > 1)
    if not checker and not _breaks_rules_checker_skips(model.graph, walked[0], names_unique):
        return found
    target = model if data_bytes < CHECK_IN_FULL_LIMIT and not skeleton else checker_skeleton(model)
    if _passes_checker(target) and not _breaks_rules_checker_skips(model.graph, walked[0], names_unique):
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
                copy = onnx.ModelProto()
                copy.CopyFrom(target)
                ir.sort_graphs(copy)
                target = copy
                continue
            _fail(where, f"invalid ONNX model: {message}")
        except Exception as exc:  # the checker's own failures are ours to state plainly
            _fail(where, f"invalid ONNX model: {_one_line(str(exc)) or type(exc).__name__}")


def check_after_failure(model: onnx.ModelProto, path=None) -> None:
    """Checks too slow to run on every model, run when a stage failed, to tell a bad input (one
    ModelError line) from a bug of ours: text that is not UTF-8 (protobuf hands it over as
    bytes), and a call of a model-local function that does not match the function."""
    where = _where(path)
    bad = _bad_text(model, "model")
    if bad is not None:
        _fail(where, f"{bad[0]} is not valid UTF-8 text ({bad[1][:40]!r})")
    functions = {(f.domain, f.name): f for f in model.functions}
    graphs, _ = walk(model.graph)
    for owner in (*graphs, *model.functions):
        for node in owner.node:
            function = functions.get((node.domain, node.op_type))
            if function is not None:
                _check_call(where, node, function)


def _bad_text(message, label: str):
    """(field path, bytes) of the first string field that is not UTF-8, or None. Reads only
    string and message fields (never tensor bytes)."""
    for field in message.DESCRIPTOR.fields:
        repeated = getattr(field, "is_repeated", None)
        repeated = field.label == field.LABEL_REPEATED if repeated is None else repeated
        if field.type == field.TYPE_STRING:
            values = getattr(message, field.name) if repeated else [getattr(message, field.name)]
            for value in values:
                if not isinstance(value, str):
                    return f"{label}.{field.name}", bytes(value)
        elif field.type == field.TYPE_MESSAGE:
            if repeated:
                children = getattr(message, field.name)
            else:
                children = [getattr(message, field.name)] if message.HasField(field.name) else []
            for child in children:
                found = _bad_text(child, f"{label}.{field.name}")
                if found is not None:
                    return found
    return None


def _check_call(where: str, node: onnx.NodeProto, function: onnx.FunctionProto) -> None:
    """A call passes no more inputs and outputs than the function declares, and every input its
    body reads (the inliner asserts on the first and leaves an empty name for the second)."""
    for kind, given, declared in (
        ("inputs", node.input, function.input),
        ("outputs", node.output, function.output),
    ):
        if len(given) > len(declared):
            _fail(
                where,
                f"node {node.name or node.op_type!r} calls function {function.name!r} with {len(given)} "
                f"{kind}; it declares {len(declared)}",
            )
    read = {name for body_node in function.node for name in body_node.input}
    for i, formal in enumerate(function.input):
        if formal in read and (i >= len(node.input) or not node.input[i]):
            _fail(
                where,
                f"node {node.name or node.op_type!r} calls function {function.name!r} without its "
                f"input {formal!r}, which the function reads",
            )
