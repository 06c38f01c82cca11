"""The graph emitter of autodiff and training: unique names, shared constants and opset-aware
forms of common ops.

Rules and the training step never build NodeProtos by hand; they call `Emitter.op` and the helpers below, which pick the
right form for the model's opset (ReduceMean takes axes as an input from opset 18, Shape has
start/end from 15) so every rule is valid at every supported opset.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from amp_rewrite.naming import UniqueNames
from amp_rewrite.onnx_facts import names_in

# Ops whose `axes` moved from attribute to input, with the opset where that happened.
AXES_INPUT_SINCE = {
    "ReduceSum": 13,
    "ReduceMean": 18,
    "ReduceMax": 18,
    "ReduceMin": 18,
    "ReduceProd": 18,
    "ReduceL1": 18,
    "ReduceL2": 18,
    "ReduceLogSum": 18,
    "ReduceLogSumExp": 18,
    "ReduceSumSquare": 18,
    "Squeeze": 13,
    "Unsqueeze": 13,
}


class Emitter:
    """Appends uniquely named nodes and constants to a graph: the one emitter of autodiff (the
    backward region, `grad/...`) and of training (`loss/`, `scale/`, `opt/`).

    Every node and tensor it makes is named under `scope` (`<scope>/<op type>`), so the AMP
    rewrite can pin a whole region with one regex and a reader of the graph sees which part of
    training a node belongs to. Constants of equal value and type are shared.
    """

    def __init__(
        self, nodes, initializers, opset: int, taken: Iterable[str] | UniqueNames, scope: str = "grad"
    ):
        self.nodes = nodes  # where new nodes are appended (a list, or a graph's node field)
        self.initializers = initializers  # where new constants are appended
        self.opset = opset
        self.names = taken if isinstance(taken, UniqueNames) else UniqueNames(taken)
        self.taken = self.names.taken  # the same set: exact names claimed below count too
        self.scope = scope.rstrip("/")
        self._constants: dict[tuple, str] = {}

    @classmethod
    def for_graph(
        cls, graph: onnx.GraphProto, opset: int, taken: Iterable[str] | None = None, scope: str = "grad"
    ):
        """New nodes collected in `new_nodes` (appended to the graph by the caller), constants
        straight into `graph`; `taken` defaults to every name in the graph."""
        return cls([], graph.initializer, opset, names_in(graph) if taken is None else taken, scope)

    def body(self, scope: str | None = None) -> Emitter:
        """An emitter for a subgraph body (a Scan the backward runs): its own node list, names
        and constants shared with this graph (the body reads constants from the outer scope)."""
        other = Emitter([], self.initializers, self.opset, self.names, scope or self.scope)
        other._constants = self._constants
        return other

    @property
    def new_nodes(self):
        return self.nodes

    def scoped(self, scope: str) -> Emitter:
        """An emitter writing to the same graph, names and constants under another scope."""
        other = Emitter(self.nodes, self.initializers, self.opset, self.names, scope)
        other._constants = self._constants
        return other

    # -- names ---------------------------------------------------------------------------------
    def fresh(self, base: str) -> str:
        """A name not used by any tensor or node so far: base, then base_1, base_2..."""
        return self.names.new(base)

    def claim(self, name: str) -> str:
        """Reserve an exact name (a graph output such as `W_grad`)."""
        if name in self.taken:
            raise ValueError(name)
        self.taken.add(name)
        return name

    def reserve(self, names: Iterable[str]) -> None:
        """Mark names (e.g. inputs declared later) as used."""
        self.taken.update(names)

    # -- nodes ---------------------------------------------------------------------------------
    def op(
        self,
        op_type: str,
        inputs: Sequence[str | None],
        outputs: int | str | Sequence[str] = 1,
        *,
        out: str | None = None,
        **attrs,
    ):
        """Emit one node; returns its output name, or a list of names when it has several.

        `outputs`: how many, their exact names, or (a str) a hint naming the one output
        `<scope>/<hint>`; `out`: the one output's exact name."""
        if out is not None:
            outputs = [self.claim(out) if out not in self.taken else out]
        elif isinstance(outputs, str):
            outputs = [self.fresh(f"{self.scope}/{outputs}")]
        elif isinstance(outputs, int):
            outputs = [self.fresh(f"{self.scope}/{op_type}_out") for _ in range(outputs)]
        attrs = {k: v for k, v in attrs.items() if v is not None}
        node = helper.make_node(
            op_type,
            [name or "" for name in inputs],
            list(outputs),
            name=self.fresh(f"{self.scope}/{op_type}"),
            **attrs,
        )
        self.nodes.append(node)
        return outputs[0] if len(outputs) == 1 else list(outputs)

    def where(self, condition: str, if_true: str, if_false: str, hint: str | None = None) -> str:
        return self.op("Where", [condition, if_true, if_false], hint or 1)

    # -- constants -----------------------------------------------------------------------------
    def const(self, value, dtype=TensorProto.FLOAT, hint: str | None = None) -> str:
        """A constant initializer of an ONNX element type (or numpy dtype), shared by every caller
        that needs the same value."""
        elem_type = dtype if isinstance(dtype, int) else helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        array = np.asarray(value, dtype=helper.tensor_dtype_to_np_dtype(elem_type))
        key = (elem_type, array.shape, array.tobytes())
        if key not in self._constants:
            name = self.fresh(f"{self.scope}/{hint or 'const'}")
            tensor = numpy_helper.from_array(array, name)
            if tensor.data_type != elem_type:  # float16 vs bfloat16 share a numpy dtype in ml_dtypes
                tensor = helper.make_tensor(name, elem_type, array.shape, array.flatten().tolist())
            self.initializers.append(tensor)
            self._constants[key] = name
        return self._constants[key]

    def ints(self, values: Sequence[int]) -> str:
        return self.const(np.asarray(list(values), dtype=np.int64), TensorProto.INT64)

    def scalar(self, value: float, elem_type: int) -> str:
        return self.const(np.asarray(value), elem_type)

    # -- opset-aware helpers -------------------------------------------------------------------
    def axes_op(
        self, op_type: str, x: str, axes: Sequence[int] | str | None, hint: str | None = None, **attrs
    ) -> str:
        """Reduce/Squeeze/Unsqueeze with `axes` as attribute or input, whichever the opset wants
        (None: all axes). `axes` may be a name of a runtime tensor only where the opset takes
        axes as an input."""
        outputs = hint or 1
        if axes is None:
            return self.op(op_type, [x], outputs, **attrs)
        if self.opset >= AXES_INPUT_SINCE.get(op_type, 1):
            axes_input = axes if isinstance(axes, str) else self.ints(axes)
            return self.op(op_type, [x, axes_input], outputs, **attrs)
        if isinstance(axes, str):
            raise ValueError(f"{op_type} at opset {self.opset} needs constant axes")
        return self.op(op_type, [x], outputs, axes=list(axes), **attrs)

    def reduce(
        self, op_type: str, x: str, axes: Sequence[int] | None, keepdims: int, hint: str | None = None
    ) -> str:
        """ReduceX over `axes` (None: all axes)."""
        return self.axes_op(op_type, x, axes, hint, keepdims=keepdims)

    def reduce_sum(self, x: str, axes: Sequence[int] | str, keepdims: bool = True) -> str:
        """Sum over axes; an empty runtime axes tensor means 'nothing to sum', never 'sum all'."""
        return self.axes_op("ReduceSum", x, axes, keepdims=int(keepdims), noop_with_empty_axes=1)

    def reduce_mean(self, x: str, axes: Sequence[int], keepdims: bool = True) -> str:
        return self.axes_op("ReduceMean", x, list(axes), keepdims=int(keepdims))

    def unsqueeze(self, x: str, axes: Sequence[int] | str) -> str:
        return self.axes_op("Unsqueeze", x, axes)

    def shape(self, x: str, start: int = 0, end: int | None = None) -> str:
        """Shape(x)[start:end] as int64, using Shape's start/end attributes where the opset has them."""
        if start == 0 and end is None:
            return self.op("Shape", [x])
        if self.opset >= 15:
            return self.op("Shape", [x], start=start, end=end)
        full = self.op("Shape", [x])
        stop = np.iinfo(np.int64).max if end is None else end
        return self.op("Slice", [full, self.ints([start]), self.ints([stop]), self.ints([0])])

    def dim(self, x: str, axis: int) -> str:
        """One dimension of x as a 1-element int64 tensor."""
        return self.shape(x, axis, axis + 1 if axis != -1 else None)

    def reshape_like(self, g: str, like: str) -> str:
        return self.op("Reshape", [g, self.shape(like)])

    def zeros_like(self, x: str, elem_type: int) -> str:
        value = helper.make_tensor("value", elem_type, [1], [0])
        return self.op("ConstantOfShape", [self.shape(x)], value=value)

    def ones_of_shape(self, shape: str, elem_type: int) -> str:
        value = helper.make_tensor("value", elem_type, [1], [1])
        return self.op("ConstantOfShape", [shape], value=value)

    def cast(self, x: str, to: int) -> str:
        return self.op("Cast", [x], to=to)

    def transpose_last_two(self, x: str, rank: int) -> str:
        perm = list(range(rank - 2)) + [rank - 1, rank - 2]
        return self.op("Transpose", [x], perm=perm)
