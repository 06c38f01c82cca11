"""The gradient graph builder, after TensorFlow's `gradients_util`.

1. Mark the tensors that lie on a differentiable path from a source (`wrt`) to the loss.
2. Count, per tensor, how many gradient contributions it will receive.
3. Visit ops in reverse order once every output gradient is complete, calling the op's rule.
4. Aggregate several contributions with one Sum (or pairwise Adds as they arrive).

The forward graph is kept as it is (a rule may only give a node one of its optional outputs; a GELU
written out in ops becomes one node first, `gelu_fusion`, so its backward keeps x alone), and
the backward nodes, named `grad/...`, are appended after it, so the node list stays topological.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper

from amp_rewrite.autodiff.branches import lift_branch_weights
from amp_rewrite.autodiff.context import GradContext
from amp_rewrite.autodiff.contrib import decompose_contrib_ops
from amp_rewrite.autodiff.emitter import Emitter
from amp_rewrite.autodiff.gelu_fusion import fuse_gelu
from amp_rewrite.autodiff.graphinfo import GraphIndex, TypeInfo, model_opset
from amp_rewrite.autodiff.registry import lookup
from amp_rewrite.autodiff.scatter_sums import fold as fold_scatter_sums
from amp_rewrite.errors import GradientError

MIN_OPSET = 13
UNCONNECTED = ("none", "zeros")
AGGREGATION = ("sum", "pairwise")


def build_gradient_graph(
    model: onnx.ModelProto,
    loss: str,
    wrt: Sequence[str] | None = None,
    *,
    stop_gradients: Sequence[str] = (),
    grad_output: str | None = None,
    unconnected: str = "none",
    aggregation: str = "sum",
    recompute=None,
) -> onnx.ModelProto:
    """Return a copy of `model` that also outputs `<name>_grad` = d loss / d name for each wrt tensor.

    wrt: tensors to differentiate against; default every float initializer the loss depends on.
    stop_gradients: tensors treated as constants (no gradient flows through them).
    grad_output: name of a graph input that seeds d loss (e.g. the loss scale); default ones.
    unconnected: "none" drops the output of a wrt tensor the loss does not depend on, "zeros" emits zeros.
    aggregation: "sum" adds a tensor's contributions with one Sum; "pairwise" adds them as they
    arrive, which frees each contribution earlier.
    recompute: segments whose activations the backward recomputes instead of keeping: a list of
    node-name regexes, "auto" (about sqrt(n) checkpoints) or a byte budget (see `recompute.py`).
    """
    if unconnected not in UNCONNECTED:
        raise GradientError(f"unconnected must be one of {UNCONNECTED}, not {unconnected!r}")
    if aggregation not in AGGREGATION:
        raise GradientError(f"aggregation must be one of {AGGREGATION}, not {aggregation!r}")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    decompose_contrib_ops(out)  # ORT's fused transformer ops as the standard ops they compute
    lift_branch_weights(out)  # weights inside If branches become initializers: trainable, differentiable
    builder = _Builder(out, loss, wrt, set(stop_gradients), grad_output, unconnected, aggregation)
    builder.run()
    if recompute is not None:
        from amp_rewrite.autodiff.recompute import apply

        apply(builder, recompute)
    fold_scatter_sums(out.graph)
    return out


class _Builder:
    def __init__(
        self,
        model,
        loss,
        wrt,
        stops,
        grad_output,
        unconnected,
        aggregation,
        *,
        seeds: dict[str, str] | None = None,
        taken=None,
        grad_names: dict[str, str] | None = None,
    ):
        """seeds: {tensor: its incoming gradient} instead of a loss (the vector-Jacobian product an
        If branch's backward needs); taken: names already used around this graph (a subgraph's
        scopes); grad_names: the gradient outputs' names when not `<name>_grad`."""
        self.model = model
        self.seeds = seeds
        self.grad_names = grad_names or {}
        self.produced: set[str] = set()
        self.graph = model.graph
        self.loss = loss
        self.stops = stops
        self.grad_output = grad_output
        self.unconnected = unconnected
        self.aggregation = aggregation
        self.opset = model_opset(model)
        if self.opset < MIN_OPSET:
            raise GradientError(
                f"autodiff needs opset {MIN_OPSET} or newer; the model has opset {self.opset}"
            )
        self.info = TypeInfo.of(model)  # before fusing: ONNX's shape inference knows no com.microsoft op
        fuse_gelu(model, self.info.elem)  # a GELU written out in ops: one node, its gradient reads x only
        self.index = GraphIndex.of(self.graph)
        self.graph_inputs = {v.name for v in self.graph.input}
        self.nodes = self.graph.node
        self.forward_count = len(self.nodes)
        self.emitted_by: dict[int, tuple[int, int]] = {}  # forward node -> its backward nodes (range)
        self.rules = [lookup(node) for node in self.nodes]
        if not seeds:
            self._check_loss()
        self.wrt = self._default_wrt() if wrt is None else list(dict.fromkeys(wrt))
        self._check_wrt()
        self.emit = Emitter.for_graph(self.graph, self.opset, taken)

    # -- checks --------------------------------------------------------------------------------
    def _known(self, name: str) -> bool:
        return name in self.index.producer or name in self.graph_inputs or name in self.index.constants

    def _check_loss(self) -> None:
        if not self._known(self.loss):
            raise GradientError(f"loss tensor '{self.loss}' is not in the graph")
        if not self.info.is_float(self.loss):
            raise GradientError(f"loss tensor '{self.loss}' is not a floating-point tensor")

    def _check_wrt(self) -> None:
        for name in self.wrt:
            if not self._known(name):
                raise GradientError(f"wrt tensor '{name}' is not in the graph")
            if not self.info.is_float(name):
                raise GradientError(f"wrt tensor '{name}' is not a floating-point tensor")
            if f"{name}_grad" in self.index.producer or f"{name}_grad" in self.index.consumers:
                raise GradientError(f"the graph already has a tensor named '{name}_grad'")

    def _default_wrt(self) -> list[str]:
        relevant = self._reaches_loss()
        return [i.name for i in self.graph.initializer if i.name in relevant and self.info.is_float(i.name)]

    # -- reachability --------------------------------------------------------------------------
    def _carries(self, n: int, slot: int) -> bool:
        """Whether input `slot` of node n can carry a gradient at all."""
        name = self.index.inputs[n][slot]
        if not name or name in self.stops or not self.info.is_float(name):
            return False
        rule = self.rules[n]
        return rule is None or rule.carries(slot)

    def _reaches_loss(self) -> set[str]:
        """Tensors the loss depends on through differentiable edges."""
        seen, stack = set(), list(self.seeds or [self.loss])
        while stack:
            name = stack.pop()
            if name in seen or name in self.stops:
                continue
            seen.add(name)
            n = self.index.producer.get(name)
            if n is not None:
                stack.extend(name for s, name in enumerate(self.index.inputs[n]) if self._carries(n, s))
        return seen

    def _reached_from_sources(self) -> set[str]:
        """Tensors that depend on a wrt tensor through differentiable edges."""
        seen, stack = set(), [w for w in self.wrt if w not in self.stops]
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            for n, slot in self.index.consumers.get(name, ()):
                if self._carries(n, slot):
                    stack.extend(
                        o for o in self.nodes[n].output if o and self.info.is_float(o) and o not in self.stops
                    )
        return seen

    # -- the walk ------------------------------------------------------------------------------
    def run(self) -> None:
        on_path = self._reaches_loss() & self._reached_from_sources()
        self.on_path = on_path
        path_nodes = sorted({self.index.producer[t] for t in on_path if t in self.index.producer})
        self._check_rules(path_nodes)
        # pending contributions per tensor, pending output gradients per node
        self.pending = {t: 0 for t in on_path}
        for n in path_nodes:
            for slot, name in enumerate(self.index.inputs[n]):
                if name in on_path and self._carries(n, slot):
                    self.pending[name] += 1
        self.node_pending = {n: sum(1 for o in self.nodes[n].output if o in on_path) for n in path_nodes}
        self.partial: dict[str, list[str]] = {t: [] for t in on_path}
        self.done: dict[str, str | None] = {}
        self.ready: deque[int] = deque()
        seeds = {t: g for t, g in (self.seeds or {self.loss: None}).items() if t in on_path}
        for name in seeds:  # every seed counted before any flows, so none finishes early
            self.pending[name] += 1
        for name, seed in seeds.items():
            self._contribute(name, seed or self._seed())
        while self.ready:
            self._visit(self.ready.popleft())
        stuck = [t for t in on_path if t not in self.done]
        if stuck:
            raise GradientError(f"gradient never completed for '{stuck[0]}' (is the graph cyclic?)")
        self._add_outputs()

    def _check_rules(self, path_nodes: list[int]) -> None:
        for n in path_nodes:
            if self.rules[n] is None:
                node = self.nodes[n]
                domain = f"{node.domain}::" if node.domain else ""
                raise GradientError(
                    f"no gradient rule for op {domain}{node.op_type} (node '{node.name}'): mark its inputs "
                    f"stop-gradient (stop_gradients=[...]) or add a rule with "
                    f"@register_gradient('{node.op_type}'{', domain=' + repr(node.domain) if node.domain else ''})"
                )

    def _seed(self) -> str:
        elem = self.info.elem.get(self.loss, onnx.TensorProto.FLOAT)
        self.emit.scope = "grad/seed"
        if self.grad_output:
            if self.grad_output not in self.graph_inputs:
                dims = self.info.dims.get(self.loss)
                self.graph.input.append(helper.make_tensor_value_info(self.grad_output, elem, dims))
            return self.grad_output
        dims = self.info.dims.get(self.loss)
        if dims is not None and all(isinstance(d, int) for d in dims):
            return self.emit.const(np.ones(dims), elem)
        return self.emit.ones_of_shape(self.emit.shape(self.loss), elem)

    def _visit(self, n: int) -> None:
        node = self.nodes[n]
        output_grads = [self.done.get(o) if o in self.on_path else None for o in node.output]
        inputs = self.index.inputs[n]
        needs = [bool(name) and name in self.on_path and self._carries(n, s) for s, name in enumerate(inputs)]
        grads: list[str | None] = []
        if any(output_grads):
            self.emit.scope = f"grad/{node.name or node.op_type + str(n)}"
            ctx = GradContext(
                node, output_grads, needs, self.emit, self.info, self.index, inputs, _differentiate_body
            )
            start = len(self.emit.new_nodes)
            grads = list(self.rules[n].fn(ctx) or ())
            self.emitted_by[n] = (start, len(self.emit.new_nodes))
        for slot, name in enumerate(inputs):
            if needs[slot]:
                self._contribute(name, grads[slot] if slot < len(grads) else None)

    def _contribute(self, name: str, grad: str | None) -> None:
        if grad is not None:
            self.info.copy_from(grad, name)
            parts = self.partial[name]
            self.emit.scope = f"grad/accumulate/{name}"
            last = self.pending[name] == 1
            if self.aggregation == "pairwise" and parts:
                out = [self._final_name(name)] if last and name in self.wrt else 1
                parts[:] = [self.emit.op("Add", [parts[0], grad], out)]
            else:
                parts.append(grad)
        self.pending[name] -= 1
        if self.pending[name] == 0:
            self._finish(name)

    def _grad_name(self, name: str) -> str:
        return self.grad_names.get(name) or f"{name}_grad"

    def _final_name(self, name: str) -> str:
        final = self._grad_name(name)
        self.produced.add(final)
        return final if name in self.grad_names else self.emit.claim(final)

    def _finish(self, name: str) -> None:
        parts = self.partial.pop(name)
        self.emit.scope = f"grad/accumulate/{name}"
        if name in self.wrt:
            final = self._grad_name(name)
            if not parts:
                self._zeros(name)
            elif final not in self.produced:  # pairwise aggregation may have written it already
                op = "Sum" if len(parts) > 1 else "Identity"
                self.emit.op(op, parts, [self._final_name(name)])
            grad = final
        elif not parts:
            grad = None
        elif len(parts) == 1:
            grad = parts[0]
        else:
            grad = self.emit.op("Sum", parts)
        if grad is not None:
            self.info.copy_from(grad, name)
        self.done[name] = grad
        n = self.index.producer.get(name)
        if n is not None and n in self.node_pending:
            self.node_pending[n] -= 1
            if self.node_pending[n] == 0:
                self.ready.append(n)

    def _zeros(self, name: str) -> None:
        """`<name>_grad` as zeros shaped like name: a source the loss does not (or only trivially) reach."""
        elem = self.info.elem.get(name, onnx.TensorProto.FLOAT)
        self.emit.op(
            "ConstantOfShape",
            [self.emit.shape(name)],
            [self._final_name(name)],
            value=helper.make_tensor("value", elem, [1], [0]),
        )

    def _add_outputs(self) -> None:
        self.emit.scope = "grad/unconnected"
        for name in self.wrt:
            if name not in self.done:
                if self.unconnected == "none":
                    continue
                self._zeros(name)
            elem = self.info.elem.get(name, onnx.TensorProto.FLOAT)
            self.graph.output.append(
                helper.make_tensor_value_info(self._grad_name(name), elem, self.info.dims.get(name))
            )
        self.graph.node.extend(self.emit.new_nodes)


def _differentiate_body(model, wanted, seeds, taken, grad_names) -> None:
    """`GradContext.differentiate`: the builder run on an If branch made a model of its own."""
    _Builder(
        model, None, wanted, set(), None, "zeros", "sum", seeds=seeds, taken=taken, grad_names=grad_names
    ).run()
