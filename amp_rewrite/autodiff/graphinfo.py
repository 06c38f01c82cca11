"""What the builder knows about the forward graph: producers, consumers, types and ranks.

Everything is indexed once (one pass over nodes), so every later question is a dict hit and the
builder stays linear in graph size.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from amp_rewrite import ir
from amp_rewrite.errors import GradientError
from amp_rewrite.onnx_facts import FLOAT_TYPES, default_opset

Dims = list  # one entry per axis: int (static), str (symbolic) or None (unknown)


@dataclass
class GraphIndex:
    """Producer and consumers of every tensor name, plus constant values where they are known."""

    producer: dict[str, int] = field(default_factory=dict)
    consumers: dict[str, list[tuple[int, int]]] = field(default_factory=lambda: defaultdict(list))
    constants: dict[str, onnx.TensorProto] = field(default_factory=dict)
    inputs: list[list[str]] = field(
        default_factory=list
    )  # per node: its inputs, then what its bodies capture

    @classmethod
    def of(cls, graph: onnx.GraphProto) -> GraphIndex:
        index = cls(producer=ir.producers(node.output for node in graph.node))
        for init in graph.initializer:
            index.constants[init.name] = init
        for n, node in enumerate(graph.node):
            index.inputs.append(node_inputs(node) + _quantized_through(node, graph, index.producer))
            for slot, name in enumerate(index.inputs[n]):
                if name:
                    index.consumers[name].append((n, slot))
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                for attr in node.attribute:
                    if attr.name == "value":
                        index.constants[node.output[0]] = attr.t
        return index

    def constant(self, name: str) -> np.ndarray | None:
        """The value of an initializer or Constant output, or None when it is computed at run time."""
        tensor = self.constants.get(name)
        return None if tensor is None else numpy_helper.to_array(tensor)


def node_inputs(node: onnx.NodeProto) -> list[str]:
    """The node's inputs, then the outer-scope tensors its subgraphs read (an If branch reads its
    weights and activations that way), so a gradient can flow into them like into an input."""
    bodies = [a.g for a in node.attribute if a.HasField("g")] + [g for a in node.attribute for g in a.graphs]
    if not bodies:
        return list(node.input)
    captured: dict[str, None] = {}
    for body in bodies:
        captured.update(dict.fromkeys(ir.captures(body)))
    return [*node.input, *(name for name in captured if name not in node.input)]


def _quantized_through(node: onnx.NodeProto, graph: onnx.GraphProto, producer: dict[str, int]) -> list[str]:
    """A DequantizeLinear reading a QuantizeLinear's integer output also reads, past its own
    inputs, that QuantizeLinear's x, scale and zero point: the straight-through estimator's
    gradient (rules/quantize.py) flows to x over the integer tensor no gradient can cross."""
    if node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx") or not node.input:
        return []
    n = producer.get(node.input[0])
    if n is None or graph.node[n].op_type != "QuantizeLinear" or graph.node[n].domain not in ("", "ai.onnx"):
        return []
    quantize = [*graph.node[n].input, "", ""][:3]
    return [""] * (3 - len(node.input)) + quantize  # from slot 3: x, scale, zero point


@dataclass
class TypeInfo:
    """Element type and dims per tensor name, from ONNX shape inference and the graph's declarations."""

    elem: dict[str, int] = field(default_factory=dict)
    dims: dict[str, Dims | None] = field(default_factory=dict)

    @classmethod
    def of(cls, model: onnx.ModelProto) -> TypeInfo:
        info = cls()
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
        except Exception:  # noqa: BLE001 - models over 2 GB or with unknown domains: use declarations
            inferred = model
        graph = inferred.graph
        for value in [*graph.input, *graph.value_info, *graph.output]:
            info._add_value(value)
        for init in model.graph.initializer:
            info.elem[init.name] = init.data_type
            info.dims[init.name] = list(init.dims)
        info._fill_ranks(model.graph, GraphIndex.of(model.graph))
        return info

    def _fill_ranks(self, graph: onnx.GraphProto, index: GraphIndex) -> None:
        """Ranks (dims unknown) where shape inference gave up: a Reshape to a shape tensor of static
        length (computed shapes, as exporters and the opset converter write them), and the ops
        whose output rank is their input's or the inputs' broadcast rank. One pass in graph order."""
        for node in graph.node:
            if not node.output or not node.output[0] or node.output[0] in self.dims:
                continue
            if node.op_type == "Concat" and _concat_length(node, self.dims) is not None:
                self.dims[node.output[0]] = [_concat_length(node, self.dims)]  # a shape tensor's length
                continue
            rank = _output_rank(node, self.dims, index)
            if rank is not None:
                self.dims[node.output[0]] = [None] * rank

    def _add_value(self, value: onnx.ValueInfoProto) -> None:
        if not value.type.HasField("tensor_type"):
            return
        tensor_type = value.type.tensor_type
        if tensor_type.elem_type:
            self.elem[value.name] = tensor_type.elem_type
        if tensor_type.HasField("shape"):
            self.dims[value.name] = [_dim(d) for d in tensor_type.shape.dim]

    def copy_from(self, name: str, like: str) -> None:
        """Declare that `name` has the type and shape of `like` (a gradient has its tensor's shape)."""
        if like in self.elem:
            self.elem[name] = self.elem[like]
        if like in self.dims:
            self.dims[name] = self.dims[like]

    def is_float(self, name: str) -> bool:
        """Unknown types count as float, so a missing rule is reported rather than skipped."""
        return self.elem.get(name, TensorProto.FLOAT) in FLOAT_TYPES


SAME_RANK = frozenset(
    {
        "Abs",
        "Neg",
        "Exp",
        "Log",
        "Sqrt",
        "Reciprocal",
        "Relu",
        "LeakyRelu",
        "Sigmoid",
        "Tanh",
        "HardSigmoid",
        "HardSwish",
        "Elu",
        "Selu",
        "Softplus",
        "Erf",
        "Gelu",
        "Clip",
        "Cast",
        "Identity",
        "Dropout",
        "Softmax",
        "LogSoftmax",
        "Transpose",
        "BatchNormalization",
        "LayerNormalization",
        "InstanceNormalization",
        "Floor",
        "Ceil",
        "Round",
        "Sign",
        "Conv",
        "ConvTranspose",
        "MaxPool",
        "AveragePool",
        "GlobalAveragePool",
        "GlobalMaxPool",
        "Resize",
        "Pad",
        "Slice",
        "Tile",
        "Mish",
        "Swish",
    }
)
BROADCAST = frozenset(
    {
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Pow",
        "Max",
        "Min",
        "Where",
        "PRelu",
        "Equal",
        "Less",
        "Greater",
        "And",
        "Or",
    }
)


def _concat_length(node: onnx.NodeProto, dims: dict) -> int | None:
    """The length of a Concat of 1-D tensors of static lengths (how exporters build shapes)."""
    lengths = [dims.get(n) for n in node.input if n]
    if lengths and all(d is not None and len(d) == 1 and isinstance(d[0], int) for d in lengths):
        return sum(d[0] for d in lengths)
    return None


def _output_rank(node: onnx.NodeProto, dims: dict, index: GraphIndex) -> int | None:
    ranks = [len(dims[n]) if dims.get(n) is not None else None for n in node.input if n]
    if node.op_type == "Reshape" and len(node.input) > 1:
        shape = dims.get(node.input[1])
        return shape[0] if shape and len(shape) == 1 and isinstance(shape[0], int) else None
    if node.op_type == "Concat":
        return next((r for r in ranks if r is not None), None)
    if node.op_type in ("Squeeze", "Unsqueeze") and ranks and ranks[0] is not None:
        axes = index.constant(node.input[1]) if len(node.input) > 1 and node.input[1] else None
        if axes is None:
            axes = next((a.ints for a in node.attribute if a.name == "axes"), None)
        if axes is None:
            return None
        return ranks[0] + (len(axes) if node.op_type == "Unsqueeze" else -len(axes))
    if not ranks or None in ranks:
        return None
    if node.op_type in SAME_RANK:
        return ranks[0]
    if node.op_type in BROADCAST or (node.op_type == "MatMul" and min(ranks) >= 2):
        return max(ranks)
    keepdims = next((a.i for a in node.attribute if a.name == "keepdims"), 1)
    if node.op_type.startswith("Reduce") and keepdims:
        return ranks[0]
    return None


def _dim(d: onnx.TensorShapeProto.Dimension):
    if d.HasField("dim_value"):
        return d.dim_value
    if d.HasField("dim_param"):
        return d.dim_param
    return None


def model_opset(model: onnx.ModelProto) -> int:
    opset = default_opset(model)
    if opset is None:
        raise GradientError("the model imports no default-domain opset")
    return opset
