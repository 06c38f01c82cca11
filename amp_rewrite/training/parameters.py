"""Which float constants of a model are its parameters (what a fine-tune trains by default).

Exporters store more than parameters as float constants: causal masks, epsilons, scale factors,
RoPE frequencies, shape arithmetic. Training those breaks the step (a mask of -inf has no finite
gradient), so the default is read from where a constant is used, as a framework's `parameters()`
would list it: the weight of a MatMul/Gemm/Conv/ConvTranspose whose other operand carries data,
the table of a Gather, a normalisation's scale and bias, a tensor (not a scalar) that an Add
applies to data as a bias (or position table), a vector a Mul applies as a gain, and one
concatenated to data (a class token). A constant reaches its slot directly or through layout ops
(Transpose, Reshape, ...); the op facts are in `op_lists/parameters.yaml`. Never: non-finite values, scalars, mask-like tensors (two distinct
values over two or more axes, or values of 1e4 and beyond). `select` applies the user's regexes.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import onnx
from onnx import numpy_helper

from amp_rewrite import ir
from amp_rewrite.analysis.oplists import shipped_table
from amp_rewrite.errors import TrainingError

FLOAT = onnx.TensorProto.FLOAT
# The op facts (weight and normalisation slots, layout and shape-only ops) are data.
_SLOTS = shipped_table("parameters.yaml")
LAYOUT_OPS = frozenset(_SLOTS["layout"])
SHAPE_ONLY_OPS = frozenset(_SLOTS["shape_only"])
NORM_SLOTS = {op: tuple(slots) for op, slots in _SLOTS["norm_slots"].items()}
WEIGHT_SLOTS = {op: tuple(slots) for op, slots in _SLOTS["weight_slots"].items()}
QUANTIZED_READERS = frozenset(_SLOTS["quantized_readers"])
MASK_MAGNITUDE = 1e4


@dataclasses.dataclass(frozen=True)
class Parameters:
    """The default split of a model's float constants into parameters and frozen constants."""

    names: tuple[str, ...]  # in graph order
    frozen: tuple[str, ...]
    left_out: str = ""  # one line: weights found but not trainable here, and why ("" when none)


def find(graph: onnx.GraphProto) -> Parameters:
    """The parameters of `graph` (initializers and Constant nodes), by how they are used."""
    constants = _float_constants(graph)
    data: set[str] = {i.name for i in graph.input} - {t.name for t in graph.initializer}
    nodes = list(_walk(graph, data))  # If/Loop/Scan bodies too: their weights are lifted to the main graph
    producer = ir.producer_nodes(nodes)
    found, quantized = set(), set()
    for node in nodes:
        for slot in _parameter_slots(node, data):
            source = _constant_source(node.input[slot], producer, constants)
            if source is not None and _is_parameter(constants[source], node.op_type):
                found.add(source)
            elif source is None:
                quantized.update(_quantized_source(node.input[slot], producer, data))
    quantized.update(_integer_weights(graph, data))
    names = tuple(n for n in constants if n in found)
    return Parameters(names, tuple(n for n in constants if n not in found), _left_out(quantized))


def select(params: Parameters, available: list[str], trainable=None, frozen=None) -> list[str]:
    """The names to train: `trainable` regexes (full match) over every float constant, else the
    default parameters; minus those matching a `frozen` regex. An unmatched pattern is an error."""
    chosen = list(params.names)
    if trainable is not None:
        chosen = _matching(_patterns("trainable", trainable), available, "trainable")
    if frozen is not None:
        patterns = _patterns("frozen", frozen)
        _matching(patterns, available, "frozen")
        chosen = [n for n in chosen if not any(p.fullmatch(n) for p in patterns)]
    if not chosen:
        raise TrainingError("nothing to train: no float constant is selected (see trainable=/frozen=)")
    return chosen


def summary(names: list[str], sizes: dict[str, int], frozen: int) -> str:
    """ "24 tensors, 1.2 M parameters; 12 constants frozen" """
    count = sum(sizes.get(n, 0) for n in names)
    amount = (
        f"{count / 1e6:.1f} M" if count >= 1e5 else f"{count / 1e3:.1f} k" if count >= 1e3 else str(count)
    )
    return f"training {len(names)} tensors, {amount} parameters; {frozen} constants frozen"


def _patterns(what: str, patterns) -> list[re.Pattern]:
    if isinstance(patterns, str):
        patterns = [patterns]
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error as error:
            raise TrainingError(f"{what}: {pattern!r} is not a valid regular expression ({error})") from None
    return compiled


def _matching(patterns: list[re.Pattern], names: list[str], what: str) -> list[str]:
    for pattern in patterns:
        if not any(pattern.fullmatch(n) for n in names):
            raise TrainingError(f"{what}: {pattern.pattern!r} matches no float constant of the model")
    return [n for n in names if any(p.fullmatch(n) for p in patterns)]


def _float_constants(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    constants = {t.name: t for t in graph.initializer if t.data_type == FLOAT}
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for attr in node.attribute:
                if attr.name == "value" and attr.t.data_type == FLOAT:
                    constants[node.output[0]] = attr.t
    return constants


def _walk(graph: onnx.GraphProto, data: set[str]):
    """Every node, a subgraph's nodes before the node that holds them, in topological order, while
    `data` grows by the tensors whose values depend on a graph input's values (not only its shape;
    a body's own inputs, Loop/Scan's iteration values, count as data)."""
    for node in graph.node:
        bodies = [a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH]
        bodies += [g for a in node.attribute if a.type == onnx.AttributeProto.GRAPHS for g in a.graphs]
        for body in bodies:
            data.update(i.name for i in body.input)
            yield from _walk(body, data)
        reads_data = any(n in data for n in node.input) or any(
            o.name in data for b in bodies for o in b.output
        )
        if node.op_type not in SHAPE_ONLY_OPS and reads_data:
            data.update(o for o in node.output if o)
        yield node


def _parameter_slots(node: onnx.NodeProto, data: set[str]) -> tuple[int, ...]:
    """The input slots of `node` that hold a parameter when fed a constant (only slots the node
    has and fills: optional inputs may be absent or named "")."""
    return tuple(s for s in _candidate_slots(node, data) if s < len(node.input) and node.input[s])


def _candidate_slots(node: onnx.NodeProto, data: set[str]) -> tuple[int, ...]:
    op, inputs = node.op_type, node.input
    if op in ("MatMul", "Gemm"):
        slots = tuple(s for s in (0, 1) if len(inputs) > 1 - s and inputs[1 - s] in data)
        return slots + ((2,) if op == "Gemm" and slots and len(inputs) > 2 else ())
    if op in WEIGHT_SLOTS:
        return WEIGHT_SLOTS[op] if inputs and inputs[0] in data else ()
    if op == "Gather":
        return (0,) if inputs and inputs[0] not in data else ()  # an embedding table
    if op in NORM_SLOTS:
        return NORM_SLOTS[op]
    if op in ("Add", "Mul") and len(inputs) == 2:
        return tuple(s for s in (0, 1) if inputs[1 - s] in data)
    if op == "Concat" and any(n in data for n in inputs):  # a learned token (ViT's class token)
        return tuple(s for s, n in enumerate(inputs) if n not in data)
    return ()


def _constant_source(name: str, producer: dict, constants: dict) -> str | None:
    """The float constant feeding `name` directly or through layout ops, if any."""
    for _ in range(8):
        if name in constants:
            return name
        node = producer.get(name)
        if node is None or node.op_type not in LAYOUT_OPS or not node.input or not node.input[0]:
            return None
        name = node.input[0]
    return None


def _quantized_source(name: str, producer: dict, data: set[str]) -> tuple[str, ...]:
    """The integer weight behind a DequantizeLinear on the way to a parameter slot, if any (not
    an activation's QuantizeLinear output: that is data, trained through by the STE)."""
    for _ in range(8):
        node = producer.get(name)
        if node is None or not node.input or not node.input[0]:
            return ()
        if node.op_type in QUANTIZED_READERS:
            return () if node.input[0] in data else (node.input[0],)
        if node.op_type not in LAYOUT_OPS:
            return ()
        name = node.input[0]
    return ()


def _integer_weights(graph: onnx.GraphProto, data: set[str]) -> set[str]:
    """Constant weights of the integer ops (ConvInteger, MatMulInteger, DynamicQuantizeLSTM, ...)."""
    slots = {op: tuple(s) for op, s in _SLOTS["integer_weight_slots"].items()}
    return {
        node.input[s]
        for node in graph.node
        for s in slots.get(node.op_type, ())
        if s < len(node.input) and node.input[s] and node.input[s] not in data
    }


def _left_out(quantized: set[str]) -> str:
    """The one line naming weights that stay frozen because training them is not supported."""
    if not quantized:
        return ""
    names = sorted(quantized)
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return (
        f"left out {len(names)} quantized weights ({', '.join(names[:3])}{more}): integer weights cannot be "
        "trained; fine-tune the float model and quantize after"
    )


def _is_parameter(tensor: onnx.TensorProto, op_type: str) -> bool:
    """Finite and not a scalar; an Add/Concat operand not mask-like; a Mul gain a vector along
    one axis (a [1,1,T,D] RoPE cos/sin table varies along two and is data, not a gain)."""
    dims = list(tensor.dims)
    if int(np.prod(dims)) <= 1:
        return False
    values = numpy_helper.to_array(tensor)
    if not np.isfinite(values).all():
        return False
    varying = sum(d > 1 for d in dims)
    if op_type == "Mul" and varying > 1:
        return False
    if op_type not in ("Add", "Mul", "Concat"):
        return True  # a matrix, table or normalisation scale/bias
    if float(np.abs(values).max()) >= MASK_MAGNITUDE:
        return False
    return not (varying >= 2 and np.unique(values).size <= 2)
