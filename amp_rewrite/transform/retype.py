"""Retyping: Casts (and other attribute-typed outputs) painted low get the target in their `to`
attribute; main-graph I/O in `low_io` (all of it without keep_io_types) and value_info follow
their tensors' new types.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from amp_rewrite.io.tensordata import cast_values
from amp_rewrite.onnx_facts import FLOAT
from amp_rewrite.transform.state import Materialisation, source_elem


def retarget_attribute_typed_outputs(m: Materialisation) -> None:
    for v, vertex in enumerate(m.cg.vertices):
        if vertex.group.output_only and v in m.low_vertices:
            node = m.cg.node(vertex.scope, vertex.node)
            for attr in node.attribute:
                if attr.name in ("to", "dtype"):
                    attr.i = m.low
            if node.op_type == "ConstantOfShape":  # its fill in the target (paint.fill_fits checked it)
                _refill(node, m.low)


def _refill(node, elem: int) -> None:
    """ConstantOfShape's `value` (0.0 float32 when absent) as one `elem` value."""
    found = next((a for a in node.attribute if a.name == "value"), None)
    fill = numpy_helper.to_array(found.t).reshape(-1) if found is not None else np.zeros(1, np.float32)
    data = cast_values(fill.astype(np.float32), elem).tobytes()
    value = TensorProto(data_type=elem, dims=[1], raw_data=data)
    if found is None:
        node.attribute.append(helper.make_attribute("value", value))
    else:
        found.t.CopyFrom(value)


def retype_io_and_value_info(m: Materialisation) -> None:
    main = m.cg.scopes[0].graph
    lowered = [v for v in main.input if v.name in m.low_io] + [main.output[i] for i in sorted(m.low_outputs)]
    for value in lowered:
        if value.type.tensor_type.elem_type == FLOAT:
            value.type.tensor_type.elem_type = m.low
    for (s, name), v in m.cg.carried_in.items():  # a body's carried input and output: their Loop's colour
        if v in m.low_vertices:
            for value in m.cg.scopes[s].graph.input:
                if value.name == name and value.type.tensor_type.elem_type == FLOAT:
                    value.type.tensor_type.elem_type = m.low
    for (s, slot), v in m.cg.carried_out.items():
        value = m.cg.scopes[s].graph.output[slot]
        if v in m.low_vertices and value.type.tensor_type.elem_type == FLOAT:
            value.type.tensor_type.elem_type = m.low
    for s, scope in enumerate(m.cg.scopes):
        for value in scope.graph.value_info:
            found = m.cg.resolve(s, value.name)
            if found is not None and _ends_low(m, found, value.name):
                _element(value.type).elem_type = m.low


def _element(type_proto):
    """The tensor type a value declares: its own, or its sequence's or optional's elements'."""
    while not type_proto.HasField("tensor_type"):
        kind = type_proto.WhichOneof("value")
        if kind == "sequence_type":
            type_proto = type_proto.sequence_type.elem_type
        elif kind == "optional_type":
            type_proto = type_proto.optional_type.elem_type
        else:
            return type_proto.tensor_type
    return type_proto.tensor_type


def _ends_low(m: Materialisation, found, name: str) -> bool:
    """Whether a tensor's final type is the target: `low_names` holds the read tensors; a tensor
    nobody reads (an LSTM's or GRU's unused Y_h) has its producer's type all the same."""
    if (found.scope, name) in m.low_names:
        return True
    return (
        (found.scope, name) not in m.cg.uses
        and m.cg.types.get(name) == FLOAT
        and source_elem(m, found.scope, name, found.definition) == m.low
    )
