"""Data-free stand-ins for big models: what shape inference and onnx.checker see, and sizes.

Both serialise what they get, so above a few hundred MB of weights they see a skeleton whose big
initializers are typed graph inputs; sizes are counted from tensor data without serialising
(upb's ByteSize() serialises, doubling memory).
"""

from __future__ import annotations

import math

import numpy as np
import onnx

from amp_rewrite.onnx_facts import ELEMENT_SIZE, all_tensors

# Initializers larger than this are shown to shape inference as typed inputs, not data.
INFERENCE_DATA_LIMIT = 1024
# Above this many bytes of tensor data, onnx.checker runs on a data-free skeleton (it serialises).
CHECK_IN_FULL_LIMIT = 256 * 2**20


def checker_skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its big initializers as typed graph inputs (for the checker at any size)."""
    skeleton = inference_skeleton(model)
    skeleton.ir_version = model.ir_version
    skeleton.metadata_props.extend(model.metadata_props)
    return skeleton


def inference_skeleton(model: onnx.ModelProto, dims=None) -> onnx.ModelProto:
    """The model with large initializers shown as typed inputs: cheap to shape-infer at any size.
    `dims` (name -> size) sizes the inputs' symbolic dims of those names, on the skeleton's own
    copies of the inputs (the model keeps its declarations), so inference gives concrete sizes."""
    skeleton = onnx.ModelProto()
    skeleton.ir_version = max(model.ir_version, 4)
    skeleton.opset_import.extend(model.opset_import)
    skeleton.functions.extend(model.functions)
    graph = skeleton.graph
    source = model.graph
    graph.name = source.name
    graph.node.extend(source.node)
    graph.input.extend(source.input)
    if dims:
        _size_dims(graph.input, dims)
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


def _size_dims(values, dims) -> None:
    """Give the symbolic dims named in `dims` their sizes (dim_value replaces dim_param: a oneof)."""
    for value in values:
        for d in value.type.tensor_type.shape.dim:
            if d.dim_param in dims:
                d.dim_value = dims[d.dim_param]


def _tensor_type(elem_type: int, dims) -> onnx.TypeProto:
    """onnx's make_tensor_type_proto without its per-call checks: this runs once per weight."""
    proto = onnx.TypeProto()
    proto.tensor_type.elem_type = elem_type
    shape = proto.tensor_type.shape
    shape.SetInParent()  # a scalar has a shape with no dims, not no shape
    for d in dims:
        shape.dim.add().dim_value = d
    return proto


def data_size(model: onnx.ModelProto) -> int:
    """Bytes of tensor data in the model (without serialising it)."""
    total = 0
    for tensor in all_tensors(model.graph):
        if tensor.HasField("raw_data"):  # upb copies the bytes to count them (56 ms per 100 MB)
            total += len(tensor.raw_data)  # ByteSize() would serialise the whole tensor
        else:
            size = ELEMENT_SIZE.get(tensor.data_type, 8)
            total += size * (int(np.prod(tensor.dims, dtype=np.int64)) if tensor.dims else 1)
    return total


def byte_size(model: onnx.ModelProto, data: int | None = None) -> int:
    """The model's serialised size: exact while small; above CHECK_IN_FULL_LIMIT of tensor data,
    tensor data plus an estimate for the rest (upb's ByteSize() serialises, doubling memory).
    `data`, when the caller knows it, saves a walk over every tensor."""
    data = data_size(model) if data is None else data
    if data < CHECK_IN_FULL_LIMIT:
        return _serialised_size(model)
    return data + 64 * (len(model.graph.node) + len(model.graph.initializer))  # subgraphs: small, left out


def _serialised_size(model: onnx.ModelProto) -> int:
    """model.ByteSize(), exactly, summed over the main graph's nodes and initializers one by one:
    upb serialises to size, and 50 MB at once costs 70 ms, its tensors one at a time 7 ms."""
    graph = model.graph
    rest = onnx.GraphProto()
    for field, value in graph.ListFields():
        if field.name not in ("node", "initializer"):
            _set(rest, field, value)
    inner = rest.ByteSize() + sum(_framed(x.ByteSize()) for x in (*graph.node, *graph.initializer))
    outer = onnx.ModelProto()
    for field, value in model.ListFields():
        if field.name != "graph":
            _set(outer, field, value)
    return outer.ByteSize() + _framed(inner)


def _framed(size: int) -> int:
    """A length-delimited field of GraphProto or ModelProto numbered below 16: tag, length, bytes."""
    return 1 + max(1, (size.bit_length() + 6) // 7) + size


def _set(message, field, value) -> None:
    repeated = field.is_repeated if hasattr(field, "is_repeated") else field.label == field.LABEL_REPEATED
    if repeated:
        getattr(message, field.name).extend(value)
    elif field.type == field.TYPE_MESSAGE:
        getattr(message, field.name).CopyFrom(value)
    else:
        setattr(message, field.name, value)


def checker_target(
    model: onnx.ModelProto, data: int | None = None, *, skeleton: bool = False
) -> onnx.ModelProto:
    """What onnx.checker should see: the model, or above CHECK_IN_FULL_LIMIT (or with weights
    left on disk) its data-free skeleton."""
    data = data_size(model) if data is None else data
    return model if data < CHECK_IN_FULL_LIMIT and not skeleton else checker_skeleton(model)
