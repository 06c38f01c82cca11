"""The CPU step graph's one rewrite, made while the step graph is built (engine.step_graph_for), so
the graph that runs is `Trainer.step_graph.model`: a cross-entropy's log-sum-exp by LogSoftmax."""

from __future__ import annotations

import onnx
from onnx import helper, numpy_helper

from amp_rewrite import ir
from amp_rewrite.autodiff.emitter import Emitter
from amp_rewrite.autodiff.graphinfo import node_inputs
from amp_rewrite.onnx_facts import default_opset, names_in


def log_sum_exp_by_log_softmax(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with each ReduceLogSumExp over the last axis (the cross-entropy's) computed as
    x[..., :1] - LogSoftmax(x)[..., :1]; the model itself when it has none. ONNX Runtime's CPU
    kernel for ReduceLogSumExp is scalar: on [2048, 30522] (a BERT's LM head at batch 16) it takes
    430-570 ms at one thread where LogSoftmax, vectorised, takes 72-76 ms, and is further from
    float64 (8e-5 vs 1e-5). The output keeps its name, so the backward still reads x and it; its
    Exp(x - lse) (the gradient's softmax) becomes Softmax(x), one vectorised pass instead of two."""
    graph = model.graph
    constants = {t.name: t for t in graph.initializer}
    found = [n for n, node in enumerate(graph.node) if _log_sum_exp_axis(constants, node) == -1]
    if not found:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = list(out.graph.node)
    e = Emitter([], out.graph.initializer, default_opset(out), names_in(out.graph), scope="lse")
    outputs = {o.name for o in graph.output}
    replaced = _softmax_for_exp_of_difference(nodes, [nodes[n] for n in found], outputs)
    for n in found:
        node, e.nodes = nodes[n], []
        e.scope = f"{node.name or 'lse'}/by_log_softmax"
        x, first = node.input[0], (e.ints([0]), e.ints([1]), e.ints([-1]))
        log_softmax = e.op("LogSoftmax", [x], axis=-1)
        keepdims = next((a.i for a in node.attribute if a.name == "keepdims"), 1)
        pair = [e.op("Slice", [x, *first]), e.op("Slice", [log_softmax, *first])]
        if keepdims:
            e.op("Sub", pair, [node.output[0]])
        else:
            e.op("Squeeze", [e.op("Sub", pair), e.ints([-1])], [node.output[0]])
        replaced[n] = e.nodes
    kept = [new for n, node in enumerate(nodes) for new in replaced.get(n, [node])]
    copies = [onnx.NodeProto() for _ in kept]
    for copy, node in zip(copies, kept):
        copy.CopyFrom(node)
    del out.graph.node[:]
    out.graph.node.extend(copies)
    return out


def _softmax_for_exp_of_difference(nodes: list, log_sum_exps: list, outputs: set) -> dict[int, list]:
    """{node index: its replacement}: Exp(Sub(x, lse)) read from a kept-dims log-sum-exp of x over
    the last axis becomes one Softmax(x) writing the Exp's output (the Sub, read only there, goes)."""
    readers = ir.readers(node_inputs(node) for node in nodes)
    replaced: dict[int, list] = {}
    for lse in log_sum_exps:
        if not next((a.i for a in lse.attribute if a.name == "keepdims"), 1):
            continue
        for s in readers.get(lse.output[0], ()):
            sub = nodes[s]
            after = readers.get(sub.output[0], [])
            if sub.op_type != "Sub" or list(sub.input) != [lse.input[0], lse.output[0]] or len(after) != 1:
                continue
            exp = nodes[after[0]]
            if exp.op_type == "Exp" and sub.output[0] not in outputs:
                softmax = helper.make_node(
                    "Softmax", [lse.input[0]], list(exp.output), name=exp.name, axis=-1
                )
                replaced[s], replaced[after[0]] = [], [softmax]
    return replaced


def _log_sum_exp_axis(constants: dict, node: onnx.NodeProto) -> int | None:
    """The one axis a ReduceLogSumExp node reduces, when it is written as a constant (else None)."""
    if node.op_type != "ReduceLogSumExp" or node.domain not in ("", "ai.onnx"):
        return None
    axes = next((list(a.ints) for a in node.attribute if a.name == "axes"), None)
    if axes is None and len(node.input) > 1 and node.input[1] in constants:
        axes = numpy_helper.to_array(constants[node.input[1]]).reshape(-1).tolist()
    return axes[0] if axes is not None and len(axes) == 1 else None
