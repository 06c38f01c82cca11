"""The constant scan stage: one read of the float32 constants' values for the range check and
for the conversion.

Reading a weight's values copies them out of the protobuf (upb gives no view of its bytes):
hundreds of megabytes on a big model. The colouring needs every value checked against the target's range
before it starts, and the materialiser needs most of the same values converted after it ends.
So one pass does both, about a megabyte at a time: one min/max over the chunk (tensor by tensor
only inside a chunk over the limit) and one conversion of the whole chunk. The materialiser
takes each converted tensor once (`Scan.take`); what it never takes is dropped with the scan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx

from amp_rewrite.analysis.graph import ColouringGraph
from amp_rewrite.io import tensordata
from amp_rewrite.io.tensordata import cast_values
from amp_rewrite.onnx_facts import (
    DEFAULT_DOMAINS,
    FLOAT,
    LOW_ELEM,
    constant_tensor,
)

LIMITS = {"float16": float(np.finfo(np.float16).max), "bfloat16": float(np.finfo(np.float32).max)}
# float32's largest value, as exporters write attention masks (finfo(float32).min): "as large as the
# type allows". A constant whose values beyond the target's range are all this takes the target's
# largest value there (+-65504), its meaning in that type, instead of keeping its readers float32:
# not inf, so 0 x mask stays 0 (a masked-out (1 - m) * finfo.min would be NaN) and a fully masked
# Softmax row stays finite. Any other out-of-range value still keeps its readers float32.
SENTINEL = float(np.finfo(np.float32).max)
EXTERNAL = onnx.TensorProto.EXTERNAL  # tensordata.is_external's test, inlined in the scan
CHUNK_BYTES = 1 << 20  # float32 values read, checked and converted at once
CAST_OPSET = 13  # the first default-domain opset whose Cast takes bfloat16


@dataclass
class Scan:
    """What one read of the float32 constants found, keyed by (defining scope, tensor name)."""

    out_of_range: dict = field(default_factory=dict)  # -> largest finite |value| the target cannot hold
    converted: dict = field(default_factory=dict)  # -> (bytes in the target type, values clamped)
    deferred: dict = field(
        default_factory=dict
    )  # weights left on disk -> (tensordata conversion mode, values clamped)
    sentinels: dict = field(default_factory=dict)  # -> how many +-SENTINEL values became the target's largest
    reach: dict = field(default_factory=dict)  # -> largest |value|, where every value is finite

    def take(self, key) -> tuple | None:
        """The converted bytes of `key`, once, or None."""
        return self.converted.pop(key, None)


def value_holder(borrowed: dict, scope: int, name: str, tensor: onnx.TensorProto) -> onnx.TensorProto:
    """The tensor holding the values of initializer `name` (`tensor`): the caller's for a borrowed
    main-graph initializer (the working copy holds it without bytes, see io.working_copy), else
    `tensor` itself."""
    return borrowed.get(name, tensor) if scope == 0 else tensor


def is_constant(node: onnx.NodeProto) -> bool:
    return node.op_type == "Constant" and node.domain in DEFAULT_DOMAINS


def float_constants(scopes, borrowed: dict, constant_nodes: bool = True):
    """(def scope, name), TensorProto of every float32 initializer (as `read_scopes` read them) and
    Constant node value (`constant_nodes=False`: the caller knows there is no Constant node, so
    nodes are not read)."""
    for s, scope in enumerate(scopes):
        for name, tensor in scope.initializers.items():
            if tensor.data_type == FLOAT:
                yield (s, name), value_holder(borrowed, s, name, tensor)
        for node in scope.graph.node if constant_nodes else ():
            if is_constant(node) and node.output:
                tensor = constant_tensor(node)
                if tensor is not None and tensor.data_type == FLOAT:
                    yield (s, node.output[0]), tensor


def largest_finite(array: np.ndarray) -> float:
    """The largest finite |value| (inf and nan are representable: only finite values overflow)."""
    if not array.size:
        return 0.0
    low, high = float(array.min()), float(array.max())  # min and max: no |x| temporary array
    if math.isfinite(low) and math.isfinite(high):
        return max(high, -low)
    finite = array[np.isfinite(array)]
    return float(np.abs(finite).max()) if finite.size else 0.0


def convert(array: np.ndarray, elem: int, limit: float, clamp: bool) -> tuple[np.ndarray, int]:
    """Flat float32 `array` as `elem`, and how many finite values beyond `limit` `clamp` clipped."""
    clamped = 0
    if clamp:
        over = np.isfinite(array) & (np.abs(array) > limit)
        clamped = int(over.sum())
        if clamped:
            array = np.clip(array, -limit, limit)
    return cast_values(array.reshape(-1), elem), clamped


def scan(
    scopes,
    borrowed: dict,
    target: str,
    *,
    clamp: bool = False,
    convert_to: int | None = None,
    constant_nodes: bool = True,
) -> Scan:
    """Check every float32 constant against `target`'s range (not with `clamp`: clipped instead),
    and with `convert_to` (an element type) convert every one that fits, ahead of need.
    `constant_nodes=False` when the graphs hold no Constant node (no walk over the nodes). Bytes per
    tensor, not views of the chunk: a view would keep its whole chunk alive."""
    result = Scan()
    if clamp and convert_to is None:
        return result
    limit = LIMITS[target]
    chunk, size = [], 0
    for key, tensor in float_constants(scopes, borrowed, constant_nodes):
        # on disk (lazy_weights): checked in pieces, converted when saved
        if tensor.data_location == EXTERNAL:
            _scan_on_disk(key, tensor, limit, clamp, convert_to is not None, result)
            continue
        # little-endian float32: tensor_bytes' common case (raw data) read here, no call per weight
        data = tensor.raw_data if tensor.HasField("raw_data") else tensordata.tensor_bytes(tensor)
        chunk.append((key, data))
        size += len(data)
        if size >= CHUNK_BYTES:
            _scan_chunk(chunk, limit, clamp, convert_to, result)
            chunk, size = [], 0
    if chunk:
        _scan_chunk(chunk, limit, clamp, convert_to, result)
    return result


def _scan_on_disk(key, tensor, limit: float, clamp: bool, converting: bool, result: Scan) -> None:
    """A weight left on disk, read `tensordata.CHUNK_BYTES` at a time: the same range check as
    `_scan_chunk`, and, instead of converting it ahead, the conversion its save will do
    (`Scan.deferred`): memory stays one piece, whatever the weight's size."""
    largest, sentinels, clamped, only_sentinels = 0.0, 0, 0, True
    reach: float | None = 0.0  # None once a value is not finite
    for data in tensordata.chunks(tensor):
        part = np.frombuffer(data, "<f4")
        big = largest_finite(part)
        if reach is not None and part.size:
            low, high = float(part.min()), float(part.max())
            reach = max(reach, high, -low) if math.isfinite(low) and math.isfinite(high) else None
        if big <= limit:
            continue
        beyond = np.abs(part[np.isfinite(part)])
        beyond = beyond[beyond > limit]
        largest, clamped, sentinels = (
            max(largest, big),
            clamped + int(beyond.size),
            sentinels + int(beyond.size),
        )
        only_sentinels = only_sentinels and bool(np.all(beyond == SENTINEL))
    if reach is not None:
        result.reach[key] = reach
    if largest > limit and not clamp:
        if not only_sentinels:
            result.out_of_range[key] = largest
            return
        result.sentinels[key] = sentinels
    if converting:
        mode = "clip" if clamp else ("saturate" if key in result.sentinels else "cast")
        result.deferred[key] = (mode, clamped if clamp else 0)


def _reach(chunk: list, bounds: list, whole: np.ndarray, result: Scan) -> float:
    """Each tensor's largest |value| into `result.reach` (where all are finite), from one min and one
    max per tensor (reduceat: the pass the whole chunk's min/max was); the chunk's largest finite."""
    filled = [(key, start) for (key, _), start, end in zip(chunk, bounds, bounds[1:]) if end > start]
    if not filled:
        return 0.0
    starts = [start for _, start in filled]
    lows, highs = np.minimum.reduceat(whole, starts), np.maximum.reduceat(whole, starts)
    finite = np.isfinite(lows) & np.isfinite(highs)
    reach = np.maximum(highs, -lows)
    result.reach.update(  # tolist(): Python bools, not a numpy scalar per tensor
        (key, float(r)) for (key, _), r, f in zip(filled, reach.tolist(), finite.tolist()) if f
    )
    return float(reach.max()) if finite.all() else largest_finite(whole)


def _scan_chunk(chunk: list, limit: float, clamp: bool, convert_to: int | None, result: Scan) -> None:
    """One chunk of (key, float32 bytes): joined into one array, checked, converted, split."""
    whole = np.frombuffer(b"".join(data for _, data in chunk), "<f4")
    bounds = np.cumsum([0] + [len(data) // 4 for _, data in chunk]).tolist()
    sentinels = False
    largest = _reach(chunk, bounds, whole, result)
    if not clamp and largest > limit:  # rare: name the tensors over the limit
        for (key, _), start, end in zip(chunk, bounds, bounds[1:]):
            part = whole[start:end]
            if (largest := largest_finite(part)) > limit:
                beyond = np.abs(part[np.isfinite(part)])
                beyond = beyond[beyond > limit]
                if np.all(beyond == SENTINEL):
                    result.sentinels[key] = sentinels = int(beyond.size)
                else:
                    result.out_of_range[key] = largest
    if convert_to is None:
        return
    over = np.isfinite(whole) & (np.abs(whole) > limit) if clamp else None
    if over is not None and over.any():
        whole = np.clip(whole, -limit, limit)
    else:
        over = None
    if sentinels:  # exactly +-SENTINEL -> +-limit; inf and everything else as they are
        whole = np.where(np.abs(whole) == SENTINEL, np.copysign(np.float32(limit), whole), whole)
    with np.errstate(over="ignore"):  # values beyond the range are in out_of_range: never used
        low = cast_values(whole, convert_to)
    for (key, _), start, end in zip(chunk, bounds, bounds[1:]):
        if key not in result.out_of_range:
            result.converted[key] = (
                low[start:end].tobytes(),
                int(over[start:end].sum()) if over is not None else 0,
            )


def scan_constants(cg: ColouringGraph, clamp: bool) -> Scan:
    """The stage: scan the colouring graph's constants and keep the readers of any constant the
    target cannot hold float32 (the report says which). Converted ahead only when something can
    be low precision."""
    may_go_low = any(v.op_list == "allow" and v.blocked is None for v in cg.vertices)
    found = scan(
        cg.scopes,
        cg.borrowed,
        cg.target,
        clamp=clamp,
        convert_to=LOW_ELEM[cg.target] if may_go_low else None,
        constant_nodes=cg.has_constant_nodes,
    )
    cg.constant_reach = found.reach  # a big table's reach, for cost placement's range evidence
    for key, count in found.sentinels.items():
        said = (
            f"its {count} value(s) +-{SENTINEL:.4g} (float32's largest, a mask sentinel) become "
            f"+-{LIMITS[cg.target]:g}, {cg.target}'s largest"
        )
        cg.notes.append((f"constant {key[1]!r}", said))
    for key, value in found.out_of_range.items():
        for s, n, slot in cg.uses.get(key, ()):
            v = cg.input_vertex(s, n, slot)
            if v is not None and cg.vertices[v].blocked is None:
                cg.vertices[v].blocked = (
                    f"constant {key[1]!r} holds {value:.4g}, outside the {cg.target} range "
                    f"(use clamp to allow)"
                )
    return found
