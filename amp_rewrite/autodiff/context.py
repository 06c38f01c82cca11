"""What a gradient rule sees: `GradContext` (the forward node, its output gradients, which inputs
need a gradient, type/shape facts and an emitter) and the `GradientRule` record the registry
holds. A rule returns one gradient name, or None ("zero": the builder propagates it without
emitting anything), per input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from amp_rewrite.autodiff.emitter import Emitter
from amp_rewrite.autodiff.graphinfo import GraphIndex, TypeInfo
from amp_rewrite.errors import GradientError


@dataclass(frozen=True)
class GradientRule:
    fn: Callable[[GradContext], Sequence[str | None]]
    differentiable: tuple[int, ...] | None  # input slots that can carry a gradient; None: all

    def carries(self, slot: int) -> bool:
        return self.differentiable is None or slot in self.differentiable


class GradContext:
    """What a rule may see and do for one forward node."""

    def __init__(
        self,
        node,
        output_grads,
        needs,
        emit: Emitter,
        info: TypeInfo,
        index: GraphIndex,
        inputs=None,
        differentiate=None,
    ):
        self.node = node
        self.inputs = list(node.input) if inputs is None else inputs  # then outer-scope captures (If)
        self.output_grads = output_grads
        self._needs = needs
        self.emit = emit
        self.info = info
        self.index = index
        self.opset = emit.opset
        self._attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        self._differentiate = differentiate  # the builder, for a body differentiated as a graph of its own

    # -- the node ------------------------------------------------------------------------------
    def x(self, i: int) -> str:
        """Name of input i, or '' when it is absent (past the node's inputs: its bodies' captures)."""
        return self.inputs[i] if i < len(self.inputs) else ""

    def y(self, i: int = 0) -> str:
        return self.node.output[i] if i < len(self.node.output) else ""

    def dy(self, i: int = 0) -> str | None:
        """Gradient of output i, or None when it is zero (nothing downstream reaches the loss)."""
        return self.output_grads[i] if i < len(self.output_grads) else None

    def dy_or_zeros(self, i: int) -> str:
        return self.dy(i) or self.emit.zeros_like(self.y(i), self.dtype(self.y(i)))

    def needs(self, i: int) -> bool:
        return i < len(self._needs) and self._needs[i]

    def attr(self, name: str, default=None):
        value = self._attrs.get(name, default)
        return value.decode() if isinstance(value, bytes) else value

    def ensure_output(self, i: int, base: str) -> str:
        """Give the forward node its optional output i (MaxPool Indices, LayerNorm Mean...)."""
        while len(self.node.output) <= i:
            self.node.output.append("")
        if not self.node.output[i]:
            self.node.output[i] = self.emit.fresh(f"{self.node.name or self.node.op_type}/{base}")
        return self.node.output[i]

    def differentiate(self, model: onnx.ModelProto, wanted: list[str], seeds: dict, grad_names: dict) -> None:
        """Append to `model` (a body made a graph of its own) the gradients of `wanted`, seeded by
        `seeds` (output -> its gradient) and named `grad_names`, with names apart from this graph's."""
        self._differentiate(model, wanted, seeds, self.emit.names, grad_names)

    # -- facts ---------------------------------------------------------------------------------
    def dtype(self, name: str) -> int:
        return self.info.elem.get(name, onnx.TensorProto.FLOAT)

    def dims(self, name: str) -> list | None:
        return self.info.dims.get(name)

    def rank(self, name: str) -> int:
        dims = self.dims(name)
        if dims is None:
            raise GradientError(
                f"the gradient of {self.node.op_type} node '{self.node.name}' needs the rank of "
                f"'{name}', which shape inference could not find; declare shapes on the graph inputs"
            )
        return len(dims)

    def constant(self, name: str) -> np.ndarray | None:
        return self.index.constant(name) if name else None

    def constant_ints(self, name: str, what: str) -> list[int]:
        value = self.constant(name)
        if value is None:
            raise self.error(f"its {what} input '{name}' must be a constant")
        return [int(v) for v in np.asarray(value).reshape(-1)]

    def const(self, value, like: str) -> str:
        """A constant with the element type of tensor `like`."""
        return self.emit.const(value, self.dtype(like))

    def error(self, why: str) -> GradientError:
        return GradientError(f"cannot differentiate {self.node.op_type} node '{self.node.name}': {why}")
