"""The working copy of a caller's model: copied without its big weights' bytes, which it borrows.

The rewrite changes the model it works on in place; a model the caller passed in memory must stay
untouched, and copying it is mostly copying weights that are about to be replaced by their
converted bytes anyway.
"""

from __future__ import annotations

import math

import onnx
from onnx import TensorProto

from amp_rewrite.io.skeleton import INFERENCE_DATA_LIMIT

_DATA_FIELDS = {
    "raw_data",
    "float_data",
    "int32_data",
    "string_data",
    "int64_data",
    "double_data",
    "uint64_data",
}
_TENSOR_RARE_META = [
    f for f in TensorProto.DESCRIPTOR.fields if f.name not in _DATA_FIELDS | {"name", "data_type", "dims"}
]


def _is_repeated(field) -> bool:
    repeated = getattr(field, "is_repeated", None)  # protobuf >= 5.29; `label` is gone in 7
    return repeated if repeated is not None else field.label == field.LABEL_REPEATED


# The rare fields sorted by kind once, not asked of the descriptor per weight (17k at 100k nodes)
_RARE_REPEATED = tuple(f.name for f in _TENSOR_RARE_META if _is_repeated(f))
_RARE_MESSAGES = tuple(f.name for f in _TENSOR_RARE_META if not _is_repeated(f) and f.message_type)
_RARE_SCALARS = tuple(f.name for f in _TENSOR_RARE_META if not _is_repeated(f) and not f.message_type)


def working_copy(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict]:
    """A copy of `model` to rewrite in place, and {name: tensor} of what it borrows.

    Copying a model is mostly copying its weights, and most of them are about to be replaced by
    their converted bytes. So each main-graph initializer of raw data that
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
            _copy_rare_meta(copy, tensor)
            borrowed[tensor.name] = tensor
        else:
            work.graph.initializer.add().CopyFrom(tensor)
    return work, borrowed


def restore_borrowed(graph: onnx.GraphProto, borrowed: dict, replaced: set) -> None:
    """Give every borrowed initializer that was not replaced by converted bytes its own data
    (no walk over the initializers when all were: the common case of a big model)."""
    if borrowed.keys() <= replaced:
        return
    for tensor in graph.initializer:
        source = borrowed.get(tensor.name)
        if source is not None and tensor.name not in replaced:
            tensor.CopyFrom(source)


def _copy_rare_meta(copy: TensorProto, tensor: TensorProto) -> None:
    """`tensor`'s rarely set metadata (doc string, location, segment, external data, metadata
    props) into `copy`: `_copy_fields` over `_TENSOR_RARE_META`, with the kinds known ahead."""
    for name in _RARE_SCALARS:
        value = getattr(tensor, name)
        if value:
            setattr(copy, name, value)
    for name in _RARE_REPEATED:
        value = getattr(tensor, name)
        if len(value):
            getattr(copy, name).extend(value)
    for name in _RARE_MESSAGES:
        if tensor.HasField(name):
            getattr(copy, name).CopyFrom(getattr(tensor, name))


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
