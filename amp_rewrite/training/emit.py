"""A tiny node emitter for the training subgraphs (loss, loss scale, optimizer).

Every node and tensor it makes carries a prefix (`loss/`, `amp/`, `opt/`) so the AMP rewrite can
pin the whole region to float32 with one regex per prefix, and so a reader of the step graph sees
at a glance which part of training a node belongs to.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


class Emitter:
    """Appends uniquely named nodes and constants under one name prefix to a node list."""

    def __init__(self, prefix: str, nodes: list, initializers: list, opset: int, taken: set[str]):
        self.prefix = prefix
        self.nodes = nodes
        self.initializers = initializers
        self.opset = opset
        self._taken = taken

    def scoped(self, prefix: str) -> "Emitter":
        """An emitter writing to the same graph under another prefix."""
        return Emitter(prefix, self.nodes, self.initializers, self.opset, self._taken)

    def reserve(self, names) -> None:
        """Mark names (e.g. inputs declared later) as used."""
        self._taken.update(names)

    def fresh(self, hint: str) -> str:
        """A tensor/node name not used anywhere in the graph yet."""
        base = f"{self.prefix}{hint}"
        name, k = base, 1
        while name in self._taken:
            name, k = f"{base}_{k}", k + 1
        self._taken.add(name)
        return name

    def op(self, op_type: str, inputs: list[str], hint: str | None = None, outputs: int = 1, out: str | None = None,
           **attrs):
        """Emit one node; returns its output name (or names when `outputs` > 1). `out` fixes the name."""
        names = [out] if out else [self.fresh(f"{hint or op_type.lower()}") for _ in range(outputs)]
        self._taken.update(names)
        node_name = self.fresh(f"{op_type}:{names[0].removeprefix(self.prefix)}")
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=node_name, **attrs))
        return names[0] if outputs == 1 else names

    def const(self, value, dtype=np.float32, hint: str = "const") -> str:
        """A constant initializer (scalar or array) of the given dtype."""
        name = self.fresh(hint)
        self.initializers.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def reduce(self, op_type: str, x: str, axes: list[int] | None, keepdims: int, hint: str | None = None) -> str:
        """ReduceX over `axes` (None: all axes), with axes as attribute or input per the opset."""
        axes_as_input = op_type == "ReduceSum" and self.opset >= 13 or self.opset >= 18
        if axes is None:
            return self.op(op_type, [x], hint, keepdims=keepdims)
        if axes_as_input:
            return self.op(op_type, [x, self.const(axes, np.int64, "axes")], hint, keepdims=keepdims)
        return self.op(op_type, [x], hint, axes=axes, keepdims=keepdims)

    def where(self, condition: str, if_true: str, if_false: str, hint: str) -> str:
        return self.op("Where", [condition, if_true, if_false], hint)


def taken_names(graph: onnx.GraphProto) -> set[str]:
    """Every tensor and node name in a graph, so emitted names never collide with the model's."""
    names = {i.name for i in graph.input} | {o.name for o in graph.output}
    names |= {i.name for i in graph.initializer} | {v.name for v in graph.value_info}
    for n in graph.node:
        names.update(n.input)
        names.update(n.output)
        names.add(n.name)
    return names


def opset_of(model: onnx.ModelProto) -> int:
    """The default-domain opset version the model imports."""
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
