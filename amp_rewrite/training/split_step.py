"""Split one step graph into a gradient graph and an apply graph, for data-parallel training.

Data parallelism needs a cut between backward and update: every rank computes its gradients,
the gradients are summed across ranks, then every rank applies the same update. The cut is at
the unscaled gradients and the finite flag, which the one-graph step already names
(`scale/unscaled/<weight>`, `scale/skipped`). The gradient graph is everything those depend on; the
apply graph is everything the next state depends on, reading the (reduced) gradients and the
(global) skip flag as inputs. Each node goes to exactly one side, so the pair computes what the
one graph computes, bit for bit when nothing is reduced in between.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from amp_rewrite import ir
from amp_rewrite.onnx_facts import reads
from amp_rewrite.training.loss_scale import SCALE_STATE
from amp_rewrite.training.step_graph import INVERSE_SCALE, SKIPPED_OUTPUT, UNSCALED_PREFIX, StepGraph

REPLICA_SHARE = "scale/replica_share"
REPLICA_SEED = "scale/replica_seed"


@dataclasses.dataclass(frozen=True)
class SplitStep:
    """The two halves of a step. `grads`: weight -> its unscaled gradient (an output of
    `gradient`, an input of `apply`)."""

    gradient: onnx.ModelProto
    apply: onnx.ModelProto
    grads: dict[str, str]


def split_step_graph(step: StepGraph, loss_share: float = 1.0) -> SplitStep:
    """Cut `step` at its unscaled gradients and skip flag. `loss_share` multiplies the backward
    seed (the loss scale), i.e. the loss is pre-scaled by it before backward: 1/N for a mean loss
    over N ranks, so that the sum of the ranks' gradients is the gradient of the global mean."""
    if step.flat:  # our own bug: the Trainer builds the split step per tensor
        raise RuntimeError("a step with a flat update has no per-weight gradients to split at")
    graph = step.model.graph
    grads = {w: UNSCALED_PREFIX + w for w in step.weights}
    producers = ir.producers(n.output for n in graph.node)
    missing = [g for g in [*grads.values(), SKIPPED_OUTPUT] if g not in producers]
    if missing:
        raise RuntimeError(
            f"step graph has no tensor {missing[0]!r} to split at"
        )  # our own bug, not the user's
    gradient_nodes = _ancestors(
        graph, producers, [step.loss_output, *grads.values(), SKIPPED_OUTPUT], stop=set()
    )
    apply_nodes = _ancestors(
        graph, producers, list(step.next_state.values()), stop={*grads.values(), SKIPPED_OUTPUT}
    )
    if gradient_nodes & apply_nodes:
        shared = graph.node[min(gradient_nodes & apply_nodes)].name
        raise RuntimeError(f"step graph node {shared!r} is needed on both sides of the split")

    declared = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
    weight_shapes = {w: declared[w] for w in step.weights}  # state inputs are declared with full shapes
    grad_infos = [
        helper.make_tensor_value_info(grads[w], TensorProto.FLOAT, list(weight_shapes[w]))
        for w in step.weights
    ]
    skipped_info = helper.make_tensor_value_info(SKIPPED_OUTPUT, TensorProto.BOOL, [])
    loss_info = next(o for o in graph.output if o.name == step.loss_output)
    gradient = _part(
        step.model, gradient_nodes, extra_inputs=[], outputs=[loss_info, *grad_infos, skipped_info]
    )
    if loss_share != 1.0:
        _prescale_seed(gradient.graph, loss_share)
    _write_outputs_directly(gradient.graph, set(grads.values()))
    next_infos = [o for o in graph.output if o.name in set(step.next_state.values())]
    apply = _part(step.model, apply_nodes, extra_inputs=[*grad_infos, skipped_info], outputs=next_infos)
    for part in (gradient, apply):
        onnx.checker.check_model(part)
    return SplitStep(gradient, apply, grads)


def _ancestors(
    graph: onnx.GraphProto, producers: dict[str, int], targets: list[str], stop: set[str]
) -> set[int]:
    """Indices of the nodes `targets` depend on, not looking past the tensors in `stop`."""
    seen: set[int] = set()
    pending = [t for t in targets if t not in stop]
    while pending:
        index = producers.get(pending.pop())
        if index is None or index in seen:
            continue
        seen.add(index)
        pending.extend(name for name in reads(graph.node[index]) if name not in stop)
    return seen


def _part(model: onnx.ModelProto, nodes: set[int], extra_inputs: list, outputs: list) -> onnx.ModelProto:
    """A model of the chosen nodes (in their order), the graph inputs and initializers they read."""
    graph = model.graph
    chosen = [graph.node[i] for i in sorted(nodes)]
    read = {name for n in chosen for name in reads(n)}
    read |= {o.name for o in outputs}  # an output may be an input passed through
    part = helper.make_graph(
        chosen,
        graph.name,
        [i for i in graph.input if i.name in read] + extra_inputs,
        outputs,
        [t for t in graph.initializer if t.name in read],
        value_info=[v for v in graph.value_info if v.name in read],
    )
    result = helper.make_model(part, opset_imports=model.opset_import, ir_version=model.ir_version)
    for function in model.functions:
        result.functions.append(function)
    return result


def _write_outputs_directly(graph: onnx.GraphProto, outputs: set[str]) -> None:
    """Drop each `Identity` copying a tensor into one of `outputs` (the unscaled gradients at a
    loss scale of 1): its producer writes the output instead (a chain of them, all). Inside one graph ONNX Runtime removes
    such an Identity itself; into a graph output it copies, a pass over every weight's gradient
    (1.2 of the MLP's 42 ms). Only where the copied tensor has that one reader and is no output."""
    nodes = list(graph.node)
    producers = ir.producers(node.output for node in nodes)  # tensor -> node index
    readers: dict[str, int] = {}
    for node in nodes:
        for name in reads(node):
            readers[name] = readers.get(name, 0) + 1
    kept_outputs = {o.name for o in graph.output}
    dropped: set[int] = set()
    for name in outputs:
        index = producers.get(name)
        while index is not None and nodes[index].op_type == "Identity":  # a chain of them, too
            source = nodes[index].input[0]
            producer = producers.get(source)
            if producer is None or readers.get(source) != 1 or source in kept_outputs:
                break
            outputs_of = nodes[producer].output
            outputs_of[list(outputs_of).index(source)] = name
            dropped.add(index)
            index = producers[name] = producer
    if dropped:
        kept = [onnx.NodeProto() for i in range(len(nodes)) if i not in dropped]
        for copy, i in zip(kept, (i for i in range(len(nodes)) if i not in dropped)):
            copy.CopyFrom(nodes[i])  # before the field lets go of them
        del graph.node[:]
        graph.node.extend(kept)


def _prescale_seed(graph: onnx.GraphProto, share: float) -> None:
    """Seed backward with scale * share; unscaling still divides by the scale alone."""
    for node in graph.node:
        if INVERSE_SCALE not in node.output:
            node.input[:] = [REPLICA_SEED if name == SCALE_STATE else name for name in node.input]
    graph.initializer.append(numpy_helper.from_array(np.array(share, np.float32), REPLICA_SHARE))
    graph.node.insert(
        0,
        helper.make_node("Mul", [SCALE_STATE, REPLICA_SHARE], [REPLICA_SEED], name="scale/Mul:replica_seed"),
    )
