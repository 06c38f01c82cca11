"""Facts about ONNX that every stage shares: element types, domains, opsets, graph walks.

One table of each, so the loader, the colouring, the materialiser, the report, autodiff and the
trainer agree on what `float16` means and how big a `double` is. Nothing here imports the rest of
the package but `errors`.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

DEFAULT_DOMAINS = ("", "ai.onnx")
FLOAT = TensorProto.FLOAT

# Precision names as the CLI, the API and the op lists spell them -> element type.
ELEM = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16, "float32": TensorProto.FLOAT}
LOW_ELEM = {name: elem for name, elem in ELEM.items() if name != "float32"}
# Suffix of tensors made by our casts and duplicated constants.
TAG = {TensorProto.FLOAT16: "fp16", TensorProto.BFLOAT16: "bf16", TensorProto.FLOAT: "fp32"}
# Precision name -> the schema's type string, and every schema type string -> element type.
TYPE_STRING = {"float16": "tensor(float16)", "bfloat16": "tensor(bfloat16)", "float32": "tensor(float)"}
TYPE_OF_STRING = {f"tensor({name.lower()})": value for name, value in TensorProto.DataType.items() if value}

ELEMENT_SIZE = {
    t: np.dtype(helper.tensor_dtype_to_np_dtype(t)).itemsize
    for t in (
        TensorProto.FLOAT,
        TensorProto.DOUBLE,
        TensorProto.FLOAT16,
        TensorProto.BFLOAT16,
        TensorProto.INT8,
        TensorProto.UINT8,
        TensorProto.INT16,
        TensorProto.UINT16,
        TensorProto.INT32,
        TensorProto.UINT32,
        TensorProto.INT64,
        TensorProto.UINT64,
        TensorProto.BOOL,
        TensorProto.COMPLEX64,
        TensorProto.COMPLEX128,
    )
}
FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE})
KNOWN_TYPES = frozenset(TensorProto.DataType.values()) - {TensorProto.UNDEFINED}
# The typed field that holds a tensor's values when it has no raw_data (int32_data otherwise).
TYPED_FIELD = {
    TensorProto.FLOAT: "float_data",
    TensorProto.DOUBLE: "double_data",
    TensorProto.INT64: "int64_data",
    TensorProto.UINT64: "uint64_data",
    TensorProto.UINT32: "uint64_data",
    TensorProto.COMPLEX64: "float_data",
    TensorProto.COMPLEX128: "double_data",
}


def np_dtype(elem: int) -> np.dtype:
    """The numpy dtype of an ONNX element type (bfloat16 through ml_dtypes)."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem))


# --- opsets --------------------------------------------------------------------------------------


def constant_tensor(node: onnx.NodeProto) -> onnx.TensorProto | None:
    """A Constant node's value as a TensorProto (value_float(s) and value_int(s) made into one);
    None for the kinds that hold no tensor (sparse, strings)."""
    for attr in node.attribute:
        if attr.name == "value":
            return attr.t
        if attr.name in ("value_float", "value_floats"):
            return numpy_helper.from_array(
                np.array(list(attr.floats) if attr.name == "value_floats" else attr.f, np.float32)
            )
        if attr.name in ("value_int", "value_ints"):
            return numpy_helper.from_array(
                np.array(list(attr.ints) if attr.name == "value_ints" else attr.i, np.int64)
            )
    return None


def opsets(model: onnx.ModelProto) -> dict[str, int]:
    """Domain -> opset version imported by the model (the default domain under '')."""
    return {
        ("" if entry.domain in DEFAULT_DOMAINS else entry.domain): entry.version
        for entry in model.opset_import
    }


def default_opset(model: onnx.ModelProto) -> int | None:
    """The model's ai.onnx opset, or None when it imports none."""
    return opsets(model).get("")


# --- walks ---------------------------------------------------------------------------------------


def walk(graph: onnx.GraphProto, sparse: list | None = None) -> tuple[list, list]:
    """(every graph, main first; every tensor attribute): one walk over the node attributes,
    which costs about a microsecond a node. `sparse`, when given, also gets the sparse tensor
    attributes (SparseTensorProtos) on the way (the loader's external-data check needs them)."""
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
                if sparse is not None and attr.type in _SPARSE_ATTRIBUTES:
                    sparse.extend(
                        [attr.sparse_tensor] if attr.HasField("sparse_tensor") else attr.sparse_tensors
                    )
    return graphs, tensors


_SPARSE_ATTRIBUTES = (onnx.AttributeProto.SPARSE_TENSOR, onnx.AttributeProto.SPARSE_TENSORS)


def all_graphs(graph: onnx.GraphProto) -> list:
    """`graph` and every subgraph in it, parents first."""
    return walk(graph)[0]


def all_tensors(graph: onnx.GraphProto, walked=None):
    """Every TensorProto in a graph and its subgraphs: initializers and tensor attributes.
    `walked`: `walk(graph)` when the caller has it already."""
    graphs, attribute_tensors = walked or walk(graph)
    for g in graphs:
        yield from g.initializer
    yield from attribute_tensors


def subgraphs(node: onnx.NodeProto) -> list:
    """The graphs a node holds in its attributes (If branches, Loop/Scan bodies)."""
    found = []
    for attr in node.attribute:
        if attr.HasField("g"):
            found.append(attr.g)
        found.extend(attr.graphs)
    return found


def reads(node: onnx.NodeProto) -> list[str]:
    """Tensors a node reads, including what its subgraph bodies read (outer-scope values among
    them): a node with an If branch depends on what that branch reads."""
    names = [i for i in node.input if i]
    for body in subgraphs(node):
        for inner in body.node:
            names.extend(reads(inner))
    return names


def names_in(graph: onnx.GraphProto) -> set[str]:
    """Every tensor and node name in a graph and its subgraphs, so new names never collide with the model's."""
    names = {i.name for i in graph.input} | {o.name for o in graph.output}
    names |= {i.name for i in graph.initializer} | {v.name for v in graph.value_info}
    for n in graph.node:
        names.update(n.input)
        names.update(n.output)
        names.add(n.name)
        for body in subgraphs(n):
            names |= names_in(body)
    return names
