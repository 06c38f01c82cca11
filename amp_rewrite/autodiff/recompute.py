"""Recompute (rematerialisation): trade compute for activation memory, after TF's `recompute_grad`.

Runs on a finished gradient graph. For each segment (a set of forward nodes, see `segments.py`):
- its *internal* tensors (produced and read only inside the segment) are recomputed by copies of
  the producing nodes (`<node>/recompute`), and every backward node reads the copies, so the
  forward tensors die at their last forward reader;
- the copies and the segment's own backward nodes read forward activations (the *checkpoints*)
  through `Add(t, z)`, where `z = Where(Equal(b, b), -0.0, NaN)` and `b = Cast(first element of
  g, bool)` with g the gradient of a segment output. z is always -0.0 (b == b for every b: NaN
  casts to true), and x + (-0.0) == x bit for bit for every x, -0.0, Inf and NaN included, so no
  value changes; but z depends on g at run time, so ONNX Runtime cannot constant-fold it, cannot
  merge a copy with its original (their inputs differ: CSE), and cannot run a copy before the
  backward reaches the segment;
- random ops are never re-drawn: Dropout's copy multiplies by the forward's mask (kept, 1 byte per
  element), other random ops' outputs are read from the forward.

The plan (segments, checkpoints, recomputed and kept tensors) is stored in the model's
metadata under `amp_rewrite.recompute` (`plan_of`).
"""

from __future__ import annotations

import functools
import json
from collections import defaultdict
from dataclasses import asdict, dataclass

import numpy as np
import onnx
from onnx import TensorProto

from amp_rewrite import ir
from amp_rewrite.autodiff import segments as select
from amp_rewrite.errors import GradientError
from amp_rewrite.onnx_facts import FLOAT_TYPES

PLAN_KEY = "amp_rewrite.recompute"
COPY_SUFFIX = "/recompute"


@dataclass(frozen=True)
class Segment:
    name: str
    nodes: tuple[str, ...]
    checkpoints: tuple[str, ...]  # forward activations read (through the dependency) by copies and backward
    recomputed: tuple[str, ...]  # forward tensors the backward now reads as copies
    kept: tuple[str, ...]  # internal tensors the backward still reads from the forward (masks, random values)


@dataclass(frozen=True)
class RecomputePlan:
    segments: tuple[Segment, ...] = ()

    @property
    def checkpointed(self) -> tuple[str, ...]:
        """Every forward tensor kept for a segment's recomputation, in order."""
        return tuple(dict.fromkeys(t for s in self.segments for t in (*s.checkpoints, *s.kept)))

    def to_json(self) -> str:
        return json.dumps([asdict(s) for s in self.segments])

    @classmethod
    def from_json(cls, text: str) -> RecomputePlan:
        return cls(
            tuple(
                Segment(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
                for d in json.loads(text)
            )
        )


def plan_of(model: onnx.ModelProto) -> RecomputePlan | None:
    """The recompute plan a gradient graph was built with, or None."""
    for prop in model.metadata_props:
        if prop.key == PLAN_KEY:
            return RecomputePlan.from_json(prop.value)
    return None


def copies(model: onnx.ModelProto) -> dict[str, str]:
    """{copy node: its forward original} of the main graph: what a mixed-precision rewrite must
    colour alike (`RewriteOptions.colour_as`), so a copy computes what its original did."""
    if plan_of(model) is None:
        return {}
    names = {node.name for node in model.graph.node}
    return {
        node.name: node.name[: -len(COPY_SUFFIX)]
        for node in model.graph.node
        if node.name.endswith(COPY_SUFFIX) and node.name[: -len(COPY_SUFFIX)] in names
    }


def report_section(model: onnx.ModelProto) -> dict | None:
    """The recomputed segments for a rewrite report (names, nodes, recomputed tensors), or None."""
    plan = plan_of(model)
    if plan is None:
        return None
    return {
        "segments": [
            {
                "name": s.name,
                "nodes": len(s.nodes),
                "recomputed": list(s.recomputed),
                "checkpoints": list(s.checkpoints),
            }
            for s in plan.segments
        ]
    }


class Forward:
    """Producers, readers and data dependence of the forward nodes (the first `n` of the graph)."""

    def __init__(self, graph: onnx.GraphProto, n: int):
        self.nodes = list(graph.node[:n])
        self.producer = ir.producers(node.output for node in self.nodes)
        self.readers = ir.readers(node.input for node in self.nodes)
        initializers = {i.name for i in graph.initializer}
        self.data = {i.name for i in graph.input if i.name not in initializers}  # activations
        for node in self.nodes:
            if any(t in self.data for t in node.input if t):
                self.data.update(t for t in node.output if t)
        self.graph_outputs = {o.name for o in graph.output if o.name in self.producer}


def apply(builder, spec) -> RecomputePlan:
    """Recompute the segments `spec` names in the gradient graph `builder` has just finished.

    Reads the builder's graph, forward_count, loss, on_path, done (tensor -> gradient), info,
    index, emit and emitted_by (forward node -> range of its nodes among the backward ones).
    """
    graph = builder.graph
    fw = Forward(graph, builder.forward_count)
    loss_node = fw.producer.get(builder.loss, len(fw.nodes))
    backward = list(graph.node[builder.forward_count :])
    saved = {t for node in backward for t in node.input}
    groups = _groups(spec, fw, builder, loss_node, saved)
    position = ir.producers(node.output for node in backward)
    work = [_Work(key, nodes, fw, builder, loss_node, position) for key, nodes in groups]
    internal_of = {t: k for k, w in enumerate(work) for t in w.internal}
    for j, node in enumerate(backward):
        for slot, t in enumerate(node.input):
            k = internal_of.get(t)
            if k is not None and work[k].g is not None and j > work[k].g_position:
                work[k].reads.append((j, slot, t))
    for w in work:
        w.find_own_reads(backward, internal_of)
    blocks: dict[int, list] = defaultdict(list)
    for w in work:
        if w.reads:
            first, nodes = w.emit(backward)
            blocks[first].extend(nodes)
    order = []
    for j, node in enumerate(backward):
        order.extend(blocks.get(j, ()))
        order.append(node)
    holder = onnx.GraphProto()
    holder.node.extend(fw.nodes)
    holder.node.extend(order)
    del graph.node[:]
    graph.node.extend(holder.node)
    plan = RecomputePlan(tuple(w.record() for w in work))
    entry = builder.model.metadata_props.add()
    entry.key, entry.value = PLAN_KEY, plan.to_json()
    return plan


def _groups(spec, fw: Forward, builder, loss_node: int, saved: set[str]) -> list[tuple[str, list[int]]]:
    if isinstance(spec, (str, int, float)):
        loss_node = _loss_start(fw, builder, loss_node)
    if isinstance(spec, str):
        if spec != "auto":
            raise GradientError(
                f"recompute must be 'auto', a byte budget or a list of node-name patterns, not {spec!r}"
            )
        return select.auto_groups(fw, builder.on_path, saved, loss_node, builder.info, None)
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        if spec <= 0:
            raise GradientError(f"recompute budget must be a positive number of bytes, not {spec!r}")
        return select.auto_groups(fw, builder.on_path, saved, loss_node, builder.info, int(spec))
    try:
        patterns = list(spec)
    except TypeError:
        raise GradientError(
            f"recompute must be 'auto', a byte budget or a list of node-name patterns, not {spec!r}"
        ) from None
    return select.regex_groups(patterns, [node.name for node in fw.nodes])


def _loss_start(fw: Forward, builder, loss_node: int) -> int:
    """Where "auto" and a budget stop planning: the first forward node that reads a stop-gradient
    tensor (a built-in loss's labels or targets), if before the loss node. What follows compares
    the model's outputs with the targets and its backward starts at once: recomputing it saves
    nothing, and a chunked cross-entropy (training.chunked_loss) would compute its logits twice."""
    readers = [n for t in builder.stops for n in fw.readers.get(t, ())]
    return min([loss_node, *readers])


class _Work:
    """One segment being rewritten."""

    def __init__(self, key, nodes, fw: Forward, b, loss_node, position):
        self.key, self.fw, self.b = key, fw, b
        self.members = sorted(set(nodes))
        if loss_node in self.members:
            raise GradientError(
                f"recompute segment '{key}' contains the loss node '{fw.nodes[loss_node].name}'"
            )
        inside = set(self.members)
        produced = [t for n in self.members for t in fw.nodes[n].output if t]
        boundary = {
            t
            for t in produced
            if t in fw.graph_outputs or any(r not in inside for r in fw.readers.get(t, ()))
        }
        self.internal = [t for t in produced if t not in boundary]
        if not any(t in b.on_path for t in produced):
            raise GradientError(
                f"recompute segment '{key}' has no differentiable path from a weight to the loss "
                f"(nodes {fw.nodes[self.members[0]].name!r}...)"
            )
        # the dependency: the segment output gradient that is complete first, so it precedes every
        # backward node of the segment
        grads = [b.done[t] for t in boundary if b.done.get(t)]
        self.g = min(grads, key=lambda g: position.get(g, -1)) if grads else None
        self.g_position = position.get(self.g, -1)
        self.reads: list[tuple[int, int, str]] = []  # (backward index, slot, internal tensor)
        self.own_reads: list[tuple[int, int, str]] = []  # segment backward reading other activations
        self.copied: dict[str, str] = {}
        self.dep_of: dict[str, str] = {}
        self.kept: list[str] = []

    def is_activation(self, t: str) -> bool:
        return t in self.fw.data and self.b.info.elem.get(t) in FLOAT_TYPES

    def find_own_reads(self, backward, internal_of) -> None:
        if self.g is None:
            return
        for n in self.members:
            first, end = self.b.emitted_by.get(n, (0, 0))
            for j in range(max(first, self.g_position + 1), end):
                for slot, t in enumerate(backward[j].input):
                    if t and t not in internal_of and self.is_activation(t):
                        self.own_reads.append((j, slot, t))

    # -- which nodes are copied ------------------------------------------------------------------
    def _copyable(self, node) -> bool:
        if node.op_type == "Constant" or not node.input:
            return False
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            return False
        if node.op_type == "Dropout":  # its mask is kept: the copy reuses it
            return _dropout_mode(node, self.b.index) is not None
        return not _draws_random_values(node.op_type, node.domain, self.b.opset)

    def _to_copy(self) -> list[int]:
        internal = set(self.internal)
        chosen, refused = set(), set()
        stack = [t for _, _, t in self.reads]
        while stack:
            n = self.fw.producer[stack.pop()]
            if n in chosen or n in refused:
                continue
            node = self.fw.nodes[n]
            if not self._copyable(node):
                refused.add(n)
                continue
            chosen.add(n)
            stack.extend(t for t in node.input if t in internal)
        return sorted(chosen)

    # -- emission --------------------------------------------------------------------------------
    def emit(self, backward) -> tuple[int, list]:
        e = self.b.emit
        e.scope = f"recompute/{self.key.rstrip('/')}"
        start = len(e.new_nodes)
        self._zero: dict[int, str] = {}
        for n in self._to_copy():
            self._copy(self.fw.nodes[n])
        for j, slot, t in self.reads:
            if t in self.copied:
                backward[j].input[slot] = self.copied[t]
            elif t not in self.kept:
                self.kept.append(t)
        for j, slot, t in self.own_reads:
            backward[j].input[slot] = self._dep(t)
        nodes = e.new_nodes[start:]
        del e.new_nodes[start:]
        first = min(j for j, _, _ in (*self.reads, *self.own_reads))
        return first, nodes

    def _zero_of(self, elem: int) -> str:
        """-0.0 of type elem, computed from the gradient g at run time."""
        if elem not in self._zero:
            e = self.b.emit
            if not self._zero:
                flat = e.op("Reshape", [self.g, e.ints([-1])])
                flag = e.cast(e.op("Slice", [flat, e.ints([0]), e.ints([1])]), TensorProto.BOOL)
                self._same = e.op("Equal", [flag, flag])
            self._zero[elem] = e.op("Where", [self._same, e.const(-0.0, elem), e.const(np.nan, elem)])
        return self._zero[elem]

    def _dep(self, t: str) -> str:
        if t not in self.dep_of:
            self.dep_of[t] = self.b.emit.op("Add", [t, self._zero_of(self.b.info.elem[t])])
        return self.dep_of[t]

    def _input(self, t: str) -> str:
        if t in self.copied:
            return self.copied[t]
        return self._dep(t) if t and self.is_activation(t) else t

    def _copy(self, node) -> None:
        e = self.b.emit
        inputs = [self._input(t) for t in node.input]
        if not any(t in self.copied or t in self.dep_of for t in node.input if t):
            return  # nothing ties it to the backward: its outputs stay forward tensors
        if node.op_type == "Dropout":
            self.copied[node.output[0]] = self._copy_dropout(node, inputs)
            return
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = e.fresh(f"{node.name or node.op_type}{COPY_SUFFIX}")
        del copy.input[:]
        copy.input.extend(inputs)
        del copy.output[:]
        for t in node.output:
            copy.output.append(e.fresh(f"{t}{COPY_SUFFIX}") if t else "")
            if t:
                self.copied[t] = copy.output[-1]
                self.b.info.copy_from(copy.output[-1], t)
        e.new_nodes.append(copy)

    def _copy_dropout(self, node, inputs) -> str:
        """The forward's own mask, applied as ONNX Runtime's kernel does (bit for bit): x / (1 - ratio) * mask."""
        e, x = self.b.emit, inputs[0]
        if _dropout_mode(node, self.b.index) == "inference":
            return e.op("Identity", [x], [e.fresh(f"{node.output[0]}{COPY_SUFFIX}")])
        while len(node.output) < 2:
            node.output.append("")
        if not node.output[1]:
            node.output[1] = e.fresh(f"{node.name or 'Dropout'}/mask")
            self.b.info.elem[node.output[1]] = TensorProto.BOOL
        if node.output[1] not in self.kept:
            self.kept.append(node.output[1])
        elem = self.b.info.elem.get(node.input[0], TensorProto.FLOAT)
        ratio_name = node.input[1] if len(node.input) > 1 else ""
        ratio = self.b.index.constant(ratio_name) if ratio_name else np.float32(0.5)
        if ratio is not None:
            keep = e.const(np.float32(1) - np.float32(ratio), elem)
        else:
            r = ratio_name if self.b.info.elem.get(ratio_name) == elem else e.cast(ratio_name, elem)
            keep = e.op("Sub", [e.const(1, elem), r])
        scaled = e.op("Div", [x, keep])
        return e.op(
            "Mul", [scaled, e.cast(node.output[1], elem)], [e.fresh(f"{node.output[0]}{COPY_SUFFIX}")]
        )

    def record(self) -> Segment:
        names = tuple(self.fw.nodes[n].name for n in self.members)
        recomputed = tuple(dict.fromkeys(t for _, _, t in self.reads if t in self.copied))
        return Segment(self.key, names, tuple(self.dep_of), recomputed, tuple(self.kept))


def _dropout_mode(node, index) -> str | None:
    """'inference' (a copy of x), 'training' (mask * x * scale) or None (decided at run time)."""
    training = node.input[2] if len(node.input) > 2 else ""
    if not training:
        return "inference"
    value = index.constant(training)
    if value is None:
        return None
    return "training" if bool(np.asarray(value)) else "inference"


@functools.cache
def _draws_random_values(op_type: str, domain: str, opset: int) -> bool:
    """The op's schema says it is non-deterministic (RandomNormal(Like), RandomUniform(Like),
    Bernoulli, Multinomial...): a copy would draw new values, so its output is read from the forward."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, domain)
    except onnx.defs.SchemaError:
        return False
    return schema.node_determinism == onnx.defs.OpSchema.NodeDeterminism.NonDeterministic
