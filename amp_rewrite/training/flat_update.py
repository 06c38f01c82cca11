"""The update over flat buffers, CUDA's step: a constant number of kernels for any number of weights.

A per-tensor update launches a chain of kernels per weight (AdamW: 13, plus the unscale's Mul and
the finite check's ReduceSum): about 1,200 nodes on a small BERT, and most of a CUDA step's time
(issue 38). Here the gradients, the weights and each optimizer slot are flattened (a Reshape to
their size: an alias in ONNX Runtime, no kernel) and concatenated into one buffer per kind, all in one
order; the unscale, the finite check (one ReduceSum), a global-norm clip and the optimizer's chain
run once over those buffers, and `Where(all_finite, new, old)` keeps the old values on a skipped
step, bit for bit, without the `If` whose condition ONNX Runtime reads on the host (a sync every
step). One Split per kind and a Reshape per tensor give each state output its shape back: the
step's inputs and outputs, and so the Trainer's state and checkpoints, are the per-tensor step's.

Every op of an update is elementwise with scalar operands, so each element goes through the
per-tensor update's operations in the same order: the same values (a global-norm clip's sum of
squares is taken in another order, within float32 rounding). The split step (CPU, data parallel)
keeps the per-tensor update (step_graph.py): its host update runs each chain from cache, block by
block, where concatenating and splitting would add two passes over the state.

The price is memory at the update: the Concats, the chain's intermediates, the Where and the
Split's outputs are each as large as all the weights together, where the per-tensor chain's were
as large as one weight (not yet measured on a GPU).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from amp_rewrite.analysis.elemtypes import tensor_types
from amp_rewrite.autodiff.emitter import Emitter
from amp_rewrite.onnx_facts import default_opset, names_in
from amp_rewrite.training.loss_scale import INVERSE_SCALE, SCALE_STATE, FixedLossScale, emit_all_finite
from amp_rewrite.training.optimizers import (
    STEP_STATE,
    Optimizer,
    emit_clip_by_global_norm,
    emit_step_count,
)

FLAT_GRADIENTS = "scale/flat_gradients"  # every weight's (scaled) gradient, flat, in the weights' order
STATE_BUFFERS = "opt/flat_state_"  # + kind: the old weights and slots, flat (Concat outputs)
GATED_BUFFERS = "opt/gated_"  # + kind: the next weights and slots, flat, before their Split
_LOW = (TensorProto.FLOAT16, TensorProto.BFLOAT16)
SPLIT_SINCE = 13  # Split's sizes are an input from opset 13, an attribute before


def emit_flat_update(
    e: Emitter,
    optimizer: Optimizer,
    loss_scale,
    loss_name: str,
    grads: dict[str, str],
    shapes: dict[str, tuple],
    slot_name,
) -> tuple[str, dict[str, str]]:
    """(all_finite, next_state) for the weights, their slots (`slot_name(weight, slot)`) and the
    step count; `shapes` gives each weight's shape, in the order of `grads`."""
    weights = list(grads)
    sizes = [int(np.prod(shapes[w], dtype=np.int64)) for w in weights]
    inverse_scale = e.op("Reciprocal", [SCALE_STATE], out=INVERSE_SCALE)
    flat_grads = concat_flat(e, [grads[w] for w in weights], sizes, out=FLAT_GRADIENTS)
    if loss_scale == FixedLossScale(1.0):  # g * 1 is g, bit for bit: no pass over the gradients
        unscaled = flat_grads
    else:
        unscaled = e.op("Mul", [flat_grads, inverse_scale], "flat_unscaled")
    all_finite = emit_all_finite(e, [loss_name, unscaled])

    o = e.scoped("opt")
    if optimizer.max_grad_norm is not None:
        (unscaled,) = emit_clip_by_global_norm(o, [unscaled], optimizer.max_grad_norm)
    next_step, step_float, lr = emit_step_count(o, optimizer)
    kinds = {None: weights, **{s: [slot_name(w, s) for w in weights] for s in optimizer.slots}}
    old = {
        kind: concat_flat(o, states, sizes, out=o.fresh(f"{STATE_BUFFERS}{kind or 'weights'}"))
        for kind, states in kinds.items()
    }
    new_weights, new_slots = optimizer.emit_update(
        o.scoped("opt/flat"), old[None], unscaled, {s: old[s] for s in optimizer.slots}, lr, step_float
    )
    new = {None: new_weights, **new_slots}
    next_state = {}
    for kind, states in kinds.items():
        kept = o.op(
            "Where", [all_finite, new[kind], old[kind]], out=o.fresh(f"{GATED_BUFFERS}{kind or 'weights'}")
        )
        for weight, state, part in zip(weights, states, split_flat(o, kept, sizes)):
            next_state[state] = o.op("Reshape", [part, o.ints(shapes[weight])], out=f"{state}/next")
    next_state[STEP_STATE] = o.op("Where", [all_finite, next_step, STEP_STATE], out=f"{STEP_STATE}/next")
    return all_finite, next_state


def concat_flat(
    e: Emitter, tensors: list[str], sizes: list[int], hint: str = "flat", out: str | None = None
) -> str:
    """The tensors (of `sizes` elements) flattened and concatenated, in their order (one tensor:
    flattened only). The sizes are written out, so shape inference knows every flat buffer's."""
    flat = [e.op("Reshape", [t, e.ints([size])], "flattened") for t, size in zip(tensors, sizes)]
    if len(flat) == 1:
        return e.op("Identity", flat, out=out) if out else flat[0]
    return e.op("Concat", flat, hint, out=out, axis=0)


def split_flat(e: Emitter, flat: str, sizes: list[int]) -> list[str]:
    """`flat` cut into pieces of `sizes` elements, in order."""
    if len(sizes) == 1:
        return [flat]
    if e.opset >= SPLIT_SINCE:
        return e.op("Split", [flat, e.ints(sizes)], len(sizes), axis=0)
    return e.op("Split", [flat], len(sizes), axis=0, split=sizes)


def group_low_gradients(model: onnx.ModelProto) -> onnx.ModelProto:
    """After the precision rewrite: the gradients computed low reach the float32 flat buffer through
    a Cast each (a kernel per weight). Those weights move to the front of every flat buffer, in
    their order (each buffer and Split alike: the update is elementwise, so the same values), and
    their gradients are concatenated low and cast once. The model unchanged when fewer than two are
    low or the flat update is not found as flat_update writes it; else changed in place."""
    graph = model.graph
    nodes = list(graph.node)
    producers = {out: node for node in nodes for out in node.output if out}
    concat = producers.get(FLAT_GRADIENTS)
    if concat is None or concat.op_type != "Concat":
        return model
    types, _ = tensor_types(model, shape_inference=False)
    readers: dict[str, int] = {}
    for node in nodes:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    low = {}  # position -> (its flattening Reshape, the Cast of a low gradient before it)
    for k, piece in enumerate(concat.input):
        reshape = producers.get(piece)
        cast = producers.get(reshape.input[0]) if reshape is not None else None
        if cast is not None and cast.op_type == "Cast" and readers.get(cast.output[0]) == 1:
            if types.get(cast.input[0]) in _LOW:
                low[k] = (reshape, cast)
    if low:  # one step has one low type; any other stays as it is
        dtype = types[next(iter(low.values()))[1].input[0]]
        low = {k: pair for k, pair in low.items() if types[pair[1].input[0]] == dtype}
    count = len(concat.input)
    state = [n for n in nodes if n.op_type == "Concat" and n.output[0].startswith(STATE_BUFFERS)]
    splits = [n for n in nodes if n.op_type == "Split" and n.input[0].startswith(GATED_BUFFERS)]
    if (
        len(low) < 2
        or any(len(n.input) != count for n in state)
        or any(len(n.output) != count for n in splits)
    ):
        return model
    order = [*low, *(k for k in range(count) if k not in low)]
    for node in state:
        node.input[:] = [node.input[k] for k in order]
    initializers = {t.name: t for t in graph.initializer}
    e = Emitter([], graph.initializer, default_opset(model), names_in(graph), scope="scale")
    for split in splits:
        split.output[:] = [split.output[k] for k in order]
        if len(split.input) > 1:
            sizes = numpy_helper.to_array(initializers[split.input[1]]).tolist()
            readers[split.input[1]] -= 1
            split.input[1] = e.ints([sizes[k] for k in order])
        else:
            attribute = next(a for a in split.attribute if a.name == "split")
            attribute.ints[:] = [attribute.ints[k] for k in order]
    unused = [t for t in graph.initializer if readers.get(t.name, 1) == 0]  # the sizes before
    for tensor in unused:
        graph.initializer.remove(tensor)
    for reshape, cast in low.values():  # the flattening reads the low gradient itself
        reshape.input[0] = cast.input[0]
    retyped = {reshape.output[0] for reshape, _ in low.values()}
    declared = [v for v in graph.value_info if v.name not in retyped]
    del graph.value_info[:]
    graph.value_info.extend(declared)
    flat_low = e.op("Concat", [concat.input[k] for k in low], "flat_low_gradients", axis=0)
    widened = e.op("Cast", [flat_low], "flat_low_gradients_fp32", to=TensorProto.FLOAT)
    concat.input[:] = [widened, *(concat.input[k] for k in order[len(low) :])]
    dropped = {id(cast) for _, cast in low.values()}
    at = nodes.index(concat)
    kept = [n for n in nodes[:at] if id(n) not in dropped] + e.nodes + nodes[at:]
    copies = [onnx.NodeProto() for _ in kept]
    for copy, node in zip(copies, kept):
        copy.CopyFrom(node)  # before the field lets go of them
    del graph.node[:]
    graph.node.extend(copies)
    return model
