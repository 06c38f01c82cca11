"""Constants are free: initializers and Constant nodes are converted in place when only
low-precision groups read them, duplicated when both kinds do (no runtime Cast on weights).
"""

from __future__ import annotations

import math

import onnx
from onnx import TensorProto, helper

from amp_rewrite.io import tensordata
from amp_rewrite.onnx_facts import ELEMENT_SIZE, FLOAT, TAG, constant_tensor
from amp_rewrite.transform import weights
from amp_rewrite.transform.state import Materialisation, needed_types, set_input


def place_constant(m: Materialisation, s, name, d, uses) -> None:
    needs = needed_types(m, uses)
    kinds = set(needs)
    if m.low not in kinds:
        return
    main_output = None
    for u, need in zip(uses, needs):  # a loop, not next() over a generator: once per constant
        if u.scope == 0 and u.node < 0:
            main_output = need
            break
    primary = main_output if main_output is not None else (FLOAT if FLOAT in kinds else m.low)
    other = m.low if primary == FLOAT else FLOAT
    other_name = m.names.new(f"{name}_{TAG[other]}") if other in kinds else None
    if primary == m.low:
        m.low_names.add((s, name))
        if other_name:  # copy the float32 values before converting them in place
            convert_constant(m, s, name, d, other_name, in_place=False, elem=FLOAT)
        convert_constant(m, s, name, d, name, in_place=True)
    else:
        convert_constant(m, s, name, d, other_name, in_place=False)
        m.low_names.add((s, other_name))
    if other_name:
        for use, need in zip(uses, needs):
            if need == other:
                set_input(m, use, other_name)


def converted_bytes(
    m: Materialisation, key, source: onnx.TensorProto, elem: int, initializer: bool = False
) -> bytes:
    """`source`'s values as `elem`: converted ahead by the scan (weights.py) or now. An
    `initializer`'s values are read from the tensor holding them (`weights.value_holder`), looked
    up only when converting now (not per weight: the scan converted nearly all ahead)."""
    ahead = m.constants.take(key) if elem == m.low else None
    if ahead is None:
        if initializer:
            source = weights.value_holder(m.cg.borrowed, key[0], key[1], source)
        array, clamped = weights.convert(
            tensordata.float_values(source), elem, weights.LIMITS[m.cg.target], m.clamp
        )
        ahead = array.tobytes(), clamped
    m.result.clamped_values += ahead[1]
    return ahead[0]


def size_change(data: bytes, elem: int, in_place: bool) -> int:
    """Weight bytes added by `data` (`elem` values): in place, less the float32 values it replaces."""
    return len(data) - (4 * (len(data) // ELEMENT_SIZE[elem]) if in_place else 0)


def convert_constant(
    m: Materialisation, s, name, d, new_name, *, in_place: bool, elem: int | None = None
) -> None:
    """Write `name` converted to `elem` (default: the target) under `new_name`."""
    elem = elem or m.low
    scope = m.cg.scopes[s]
    if d.kind == "initializer":
        tensor = scope.initializers[name]  # as read_scopes read them
        if tensordata.is_external(tensor) and (elem == FLOAT or (s, name) in m.constants.deferred):
            _defer(m, s, name, tensor, new_name, in_place, elem)
            return
        data = converted_bytes(m, (s, name), tensor, elem, initializer=True)
        m.result.weight_bytes_delta += size_change(data, elem, in_place)
        if in_place:
            _swap_data(m, s, name, tensor, elem, data)
        else:
            scope.graph.initializer.add(name=new_name, data_type=elem, dims=tensor.dims, raw_data=data)
            m.result.duplicated_constants += 1
        return
    node = m.cg.node(s, d.node)
    tensor = constant_tensor(node)
    data = converted_bytes(m, (s, name), tensor, elem)
    m.result.weight_bytes_delta += size_change(data, elem, in_place)
    converted = onnx.TensorProto(data_type=elem, dims=tensor.dims, raw_data=data)
    if in_place:
        del node.attribute[:]
        node.attribute.append(helper.make_attribute("value", converted))
        m.result.converted_constants += 1
    else:
        copy = helper.make_node(
            "Constant", [], [new_name], name=m.names.new(f"amp/{new_name}"), value=converted
        )
        m.after.setdefault((s, d.node), []).append(copy)
        m.result.duplicated_constants += 1


def convert_initializer(m: Materialisation, s, name, d) -> None:
    """`convert_constant(m, s, name, d, name, in_place=True)` of an initializer: its common case
    (converted ahead by the scan) without the general path's calls per weight (58k at 100k nodes)."""
    tensor = m.cg.scopes[s].initializers[name]
    ahead = None if tensor.data_location == TensorProto.EXTERNAL else m.constants.take((s, name))
    if ahead is None:
        convert_constant(m, s, name, d, name, in_place=True)
        return
    data, clamped = ahead
    m.result.clamped_values += clamped
    m.result.weight_bytes_delta += size_change(data, m.low, True)
    _swap_data(m, s, name, tensor, m.low, data)


def _swap_data(m: Materialisation, s, name, tensor, elem: int, data: bytes) -> None:
    """Converted in place: swap the data, keep everything else (doc string, metadata)."""
    tensor.ClearField("float_data")
    tensor.data_type = elem
    tensor.raw_data = data
    tensor.data_location = TensorProto.DEFAULT  # it may have been left on disk
    tensor.ClearField("external_data")  # (`del [:]` makes the container first: 5x the cost)
    if s == 0:
        m.replaced.add(name)
    m.result.converted_constants += 1


def _defer(m: Materialisation, s, name, tensor, new_name, in_place: bool, elem: int) -> None:
    """A weight left on disk (lazy_weights) is not read here: it takes `elem` with the conversion
    the scan chose, done piece by piece when it is saved (io.tensordata); a float32 copy refers
    to the same bytes. Memory stays flat whatever the model's size."""
    mode, clamped = m.constants.deferred.pop((s, name)) if elem != FLOAT else ("keep", 0)
    count = math.prod(tensor.dims)
    m.result.clamped_values += clamped
    m.result.weight_bytes_delta += count * ELEMENT_SIZE[elem] - (4 * count if in_place else 0)
    if in_place:
        tensordata.defer_conversion(tensor, tensor, elem, mode)
        if s == 0:
            m.replaced.add(name)
        m.result.converted_constants += 1
    else:
        tensordata.defer_conversion(tensor, m.cg.scopes[s].graph.initializer.add(name=new_name), elem, mode)
        m.result.duplicated_constants += 1
