"""GELU written out in elementwise ops, fused into one node before differentiation.

Exporters write GELU as ops: TorchScript's `x * (1 + Erf(x / sqrt2)) * 0.5` (Div, Erf, Add, Mul,
Mul) and the tanh approximation `0.5 x (1 + Tanh(sqrt(2/pi) (x + 0.044715 x^3)))`. Differentiated
node by node, the backward keeps every intermediate of the pattern alive until it runs (four
[tokens, 4 * hidden] tensors per BERT layer where torch keeps one). One com.microsoft `Gelu` (or
`FastGelu`) node instead has a gradient that reads x alone (`rules/elementwise.gelu_grad`, written
in standard ops), runs as one kernel in ONNX Runtime's CPU and CUDA providers, and is on the AMP
lists. Only exact patterns fuse: constants equal to the formula's within float32 rounding, every
intermediate read once and by nothing else, so the model computes the same function.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper

from amp_rewrite.autodiff.graphinfo import GraphIndex

MS = "com.microsoft"
FUSED_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)  # the kernels' types


def fuse_gelu(model: onnx.ModelProto, elem: dict[str, int]) -> int:
    """Replace each GELU pattern of the main graph whose input's type (`elem`) a kernel has by one
    com.microsoft Gelu/FastGelu node writing the pattern's output; returns how many, in place."""
    graph = model.graph
    index = GraphIndex.of(graph)
    outputs = {o.name for o in graph.output}
    match = _Matcher(graph.node, index, outputs)
    fused: dict[int, onnx.NodeProto] = {}  # the pattern's last node -> the fused node
    dropped: set[int] = set()
    for n, node in enumerate(graph.node):
        if node.domain not in ("", "ai.onnx") or node.op_type not in ("Erf", "Tanh"):
            continue
        found = match.erf(n) if node.op_type == "Erf" else match.tanh(n)
        if found is None or elem.get(found[0]) not in FUSED_TYPES:
            continue
        x, members = found
        if dropped.intersection(members):
            continue
        last = graph.node[members[-1]]
        op = "Gelu" if node.op_type == "Erf" else "FastGelu"
        fused[members[-1]] = helper.make_node(op, [x], [last.output[0]], name=last.name, domain=MS)
        dropped.update(members)
    if not fused:
        return 0
    dropped.update(_constants_only_read_by(dropped, graph.node, index))
    nodes = [fused.get(n, node) for n, node in enumerate(graph.node) if n in fused or n not in dropped]
    kept = [onnx.NodeProto() for _ in nodes]
    for copy, node in zip(kept, nodes):
        copy.CopyFrom(node)
    del graph.node[:]
    graph.node.extend(kept)
    if all(o.domain != MS for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS, 1))
    return len(fused)


class _Matcher:
    """Pattern walks over one graph's index; each returns (x, the pattern's node indices, last one
    writing the output) or None."""

    def __init__(self, nodes, index: GraphIndex, graph_outputs: set[str]):
        self.nodes, self.index, self.graph_outputs = nodes, index, graph_outputs

    def _node(self, name: str, *ops: str):
        n = self.index.producer.get(name)
        if n is None or self.nodes[n].op_type not in ops or self.nodes[n].domain not in ("", "ai.onnx"):
            return None
        return n

    def _only_reader(self, name: str):
        """The one node reading `name` (an intermediate nothing else sees), else None."""
        readers = self.index.consumers.get(name, ())
        if len(readers) != 1 or name in self.graph_outputs:
            return None
        return readers[0][0]

    def _split(self, n: int, value: float):
        """(the other input, the constant's slot) when node n is binary with one input the scalar `value`."""
        inputs = list(self.nodes[n].input)
        if len(inputs) != 2:
            return None
        for slot in (0, 1):
            constant = self.index.constant(inputs[slot])
            if constant is not None and constant.size == 1 and _equal(constant, value):
                return inputs[1 - slot], slot
        return None

    def _other(self, n: int, value: float):
        split = self._split(n, value)
        return None if split is None else split[0]

    def erf(self, n: int):
        """x * 0.5 * (1 + Erf(x / sqrt2)), x/sqrt2 as Div or as Mul by 1/sqrt2, any association."""
        scaled = self._node(self.nodes[n].input[0], "Div", "Mul")
        if scaled is None:
            return None
        if self.nodes[scaled].op_type == "Div":
            split = self._split(scaled, math.sqrt(2))
            x = split[0] if split and split[1] == 1 else None
        else:
            x = self._other(scaled, 1 / math.sqrt(2))
        if x is None or self._only_reader(self.nodes[scaled].output[0]) != n:
            return None
        return self._tail(x, [scaled, n])

    def tanh(self, n: int):
        """0.5 x (1 + Tanh(sqrt(2/pi) (x + 0.044715 x^3))), x^3 as Pow(x, 3) or x*x*x."""
        scaled = self._node(self.nodes[n].input[0], "Mul")
        inner = None if scaled is None else self._other(scaled, math.sqrt(2 / math.pi))
        add = None if inner is None else self._node(inner, "Add")
        if add is None or self._only_reader(inner) != scaled:
            return None
        for slot in (0, 1):
            x, cubic = self.nodes[add].input[slot], self.nodes[add].input[1 - slot]
            term = self._node(cubic, "Mul")
            cube_name = None if term is None else self._other(term, 0.044715)
            cube = None if cube_name is None else self._cube_of(x, cube_name)
            if cube is not None and self._only_reader(cubic) == add and self._only_reader(cube_name) == term:
                return self._tail(x, [*cube, term, add, scaled, n])
        return None

    def _cube_of(self, x: str, name: str):
        """The node indices computing x^3 as Pow(x, 3), Mul(Mul(x, x), x) or Mul(x, Mul(x, x))."""
        n = self._node(name, "Pow", "Mul")
        if n is None:
            return None
        node = self.nodes[n]
        if node.op_type == "Pow":
            return [n] if node.input[0] == x and self._other(n, 3.0) == x else None
        for slot in (0, 1):
            square = self._node(node.input[slot], "Mul")
            if (
                node.input[1 - slot] == x
                and square is not None
                and list(self.nodes[square].input) == [x, x]
                and self._only_reader(node.input[slot]) == n
            ):
                return [square, n]
        return None

    def _tail(self, x: str, members: list[int]):
        """From Phi's inner value v (Erf or Tanh output): Add(v, 1), then times x and 0.5 in any order."""
        head = members[-1]
        add = self._only_reader(self.nodes[head].output[0])
        if (
            add is None
            or self.nodes[add].op_type != "Add"
            or self._other(add, 1.0) != self.nodes[head].output[0]
        ):
            return None
        one_plus = self.nodes[add].output[0]
        first = self._only_reader(one_plus)
        if first is None or self.nodes[first].op_type != "Mul":
            return None
        other = [i for i in self.nodes[first].input if i != one_plus]
        if len(other) != 1:
            return None
        members = [*members, add, first]
        if other[0] == x:  # (x * (1 + v)) * 0.5
            last = self._only_reader(self.nodes[first].output[0])
            if last is None or self.nodes[last].op_type != "Mul":
                return None
            return (x, [*members, last]) if self._other(last, 0.5) == self.nodes[first].output[0] else None
        half = self._node(other[0], "Mul")
        if half is not None and self._other(half, 0.5) == x and self._only_reader(other[0]) == first:
            return x, [half, *members]  # (x * 0.5) * (1 + v): ends at `first`
        if self._other(first, 0.5) == one_plus:  # ((1 + v) * 0.5) * x
            last = self._only_reader(self.nodes[first].output[0])
            if last is not None and self.nodes[last].op_type == "Mul":
                if sorted(self.nodes[last].input) == sorted([x, self.nodes[first].output[0]]):
                    return x, [*members, last]
        return None


def _constants_only_read_by(members: set[int], nodes, index: GraphIndex) -> set[int]:
    """The Constant nodes whose every reader is among `members` (the formula's numbers)."""
    found = set()
    for n in members:
        for name in nodes[n].input:
            producer = index.producer.get(name)
            if (
                producer is not None
                and nodes[producer].op_type == "Constant"
                and all(reader in members for reader, _ in index.consumers[name])
            ):
                found.add(producer)
    return found


def _equal(constant: np.ndarray, value: float) -> bool:
    """A number equal to `value` within float32 rounding."""
    if constant.dtype.kind not in "fiu":
        return False
    return bool(np.isclose(float(constant.reshape(-1)[0]), value, rtol=2e-7, atol=0))
