"""Weights stored inside If branches become main-graph initializers, so they can be trained.

Exporters put a branch's own weights in the branch (as initializers or Constant nodes: a
voice-activity model keeps one network per sample rate in the two branches of an If). A gradient
and an optimizer work on main-graph tensors, so each float tensor a branch defines that way moves
to the main graph's initializers (renamed if the name is taken) and the branch reads it from the
outer scope, which computes the same thing.
"""

from __future__ import annotations

import onnx

from amp_rewrite.naming import UniqueNames
from amp_rewrite.onnx_facts import FLOAT_TYPES, names_in, subgraphs


def lift_branch_weights(model: onnx.ModelProto) -> list[str]:
    """Move float initializers and float Constant nodes of every If branch (nested ones too) to the
    main graph, in place; returns the lifted names."""
    graph = model.graph
    if not any(node.op_type == "If" for node in graph.node):
        return []
    names = UniqueNames(names_in(graph))
    # names a lifted tensor may not keep: the main graph's own (branch names are unique already)
    main = {t.name for t in graph.initializer} | {i.name for i in graph.input}
    main |= {o for node in graph.node for o in node.output}
    lifted: list[str] = []
    for node in graph.node:
        if node.op_type == "If":
            for branch in subgraphs(node):
                _lift(branch, _Target(graph, names, main, lifted))
    return lifted


class _Target:
    """Where lifted tensors go: the main graph, its names, and the list of what moved."""

    def __init__(self, graph, names, main, lifted):
        self.graph, self.names, self.main, self.lifted = graph, names, main, lifted

    def move(self, tensor: onnx.TensorProto, renamed: dict[str, str]) -> None:
        new = self.names.new(tensor.name) if tensor.name in self.main else tensor.name
        self.main.add(new)
        if new != tensor.name:
            renamed[tensor.name] = new
        moved = self.graph.initializer.add()
        moved.CopyFrom(tensor)
        moved.name = new
        self.lifted.append(new)


def _lift(branch: onnx.GraphProto, target: _Target) -> None:
    renamed: dict[str, str] = {}
    kept_inits = []
    for tensor in branch.initializer:
        if tensor.data_type in FLOAT_TYPES:
            target.move(tensor, renamed)
        else:
            kept_inits.append(tensor)
    if len(kept_inits) != len(branch.initializer):
        del branch.initializer[:]
        branch.initializer.extend(kept_inits)
    kept_nodes = []
    for node in branch.node:
        value = _constant_value(node)
        if value is not None and value.data_type in FLOAT_TYPES:
            value.name = node.output[0]
            target.move(value, renamed)
            continue
        if node.op_type == "If":
            for inner in subgraphs(node):
                _lift(inner, target)
        kept_nodes.append(node)
    if len(kept_nodes) != len(branch.node):
        copies = [onnx.NodeProto() for _ in kept_nodes]
        for copy, node in zip(copies, kept_nodes):
            copy.CopyFrom(node)
        del branch.node[:]
        branch.node.extend(copies)
    if renamed:
        _rename_reads(branch, renamed)


def _constant_value(node: onnx.NodeProto) -> onnx.TensorProto | None:
    if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
        return None
    value = next((a.t for a in node.attribute if a.name == "value"), None)
    if value is None:
        return None
    copy = onnx.TensorProto()
    copy.CopyFrom(value)
    return copy


def _rename_reads(graph: onnx.GraphProto, renamed: dict[str, str]) -> None:
    """Point every read of a renamed tensor (in nested subgraphs too) at its new name."""
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renamed:
                node.input[i] = renamed[name]
        for body in subgraphs(node):
            _rename_reads(body, renamed)
    for out in graph.output:
        if out.name in renamed:
            out.name = renamed[out.name]
