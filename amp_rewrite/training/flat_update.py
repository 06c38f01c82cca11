"""The update over flat buffers, CUDA's step: a constant number of kernels for any number of weights.

A per-tensor update launches a chain of kernels per weight (AdamW: 13, plus the unscale's Mul and
the finite check's ReduceSum): about 1,200 nodes on a small BERT, and most of a CUDA step's time
(issue 38). Here every tensor is flattened (a Reshape to its size: an alias in ONNX Runtime, no
kernel) and one Concat lays them out as rows of one buffer: the weights, each optimizer slot, the
gradients, all in one order. The first op of most rows is a Mul by a step scalar (the unscale of
the gradients, AdamW's decay of the weights, Adam's betas on the moments): one Mul of the buffer
by a column of those scalars does them all, and one Split gives the chain its rows. The finite
check (one ReduceSum), a global-norm clip and the rest of the optimizer's chain run once over
the rows; one Concat stacks the next values, and `Where(all_finite, next, old)` keeps the old ones
on a skipped step, bit for bit, without the `If` whose condition ONNX Runtime reads on the host (a
sync every step). One Split and a Reshape per tensor give each state output its shape back: the
step's inputs and outputs, and so the Trainer's state and checkpoints, are the per-tensor step's.
AdamW's update is 18 kernels (20 with the float16 gradients' Concat and Cast, group_low_gradients).

Every op of an update is elementwise with scalar operands, so each element goes through the
per-tensor update's operations in the same order: the same values (a global-norm clip's sum of
squares is taken in another order, within float32 rounding; a row multiplied by 1, where no Mul
came first, is itself). The split step (CPU, data parallel) keeps the per-tensor update
(step_graph.py): its host update runs each chain from cache, block by block, where concatenating
and splitting would add passes over the state.

The price is memory at the update: the buffers are as large as all the weights (times the rows),
where the per-tensor chain's were as large as one weight. The old values for the Where are
gathered again at the gate rather than kept from the first Concat (one kernel more): the first
buffer and its scaled copy are freed before the chain, and at most 9 weights' worth is live, not
12 (AdamW, `step_placement.update_memory`; the per-kind buffers this replaced held 8).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

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

FLAT_STATE = "opt/flat_state"  # the weights, each slot and the (scaled) gradients: a row each, flat
OLD_STATE = "opt/old_state"  # the weights and slots again, read at the gate: the values a skip keeps
GATED = "opt/gated_flat"  # the rows' next values (the old ones on a skipped step), flat, before the Split
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
    kinds = [weights, *([slot_name(w, s) for w in weights] for s in optimizer.slots)]
    inverse_scale = e.op("Reciprocal", [SCALE_STATE], out=INVERSE_SCALE)
    # g * 1 is g, bit for bit: a fixed scale of 1 unscales nothing
    unscale = e.const(1.0) if loss_scale == FixedLossScale(1.0) else inverse_scale
    o = e.scoped("opt")
    next_step, step_float, lr = emit_step_count(o, optimizer)

    chain = o.body("opt/flat")  # the chain over a row per kind, emitted apart and placed below
    rows = [chain.fresh(f"opt/flat/{kind}") for kind in ("weights", *optimizer.slots)]
    gradient = e.fresh("scale/flat_unscaled")
    clipped = gradient
    if optimizer.max_grad_norm is not None:
        (clipped,) = emit_clip_by_global_norm(chain, [gradient], optimizer.max_grad_norm)
    new_weights, new_slots = optimizer.emit_update(
        chain, rows[0], clipped, dict(zip(optimizer.slots, rows[1:])), lr, step_float
    )
    new = [new_weights, *(new_slots[s] for s in optimizer.slots)]
    over_rows = _over_rows(chain.nodes, [*rows, gradient])
    factors, names = [], []
    for row in rows:  # a row's one reader, a Mul by a step scalar, joins the unscale's Mul
        reader = _scaled_once(chain, row, over_rows, new)
        factors.append(reader.input[1 - list(reader.input).index(row)] if reader else e.const(1.0))
        names.append(reader.output[0] if reader else row)
        if reader:
            chain.nodes.remove(reader)
    e.nodes.extend(n for n in chain.nodes if not over_rows.intersection(n.input))  # the step's scalars

    state = [name for kind in kinds for name in kind]
    flat_state = flatten(o, state, sizes * len(kinds))
    pieces = flat_state + flatten(e, [grads[w] for w in weights], sizes)
    table = o.op(
        "Reshape",
        [o.op("Concat", pieces, out=FLAT_STATE, axis=0), o.ints([len(kinds) + 1, sum(sizes)])],
        "flat_rows",
    )
    column = _column(o, [*factors, unscale])
    scaled = o.op("Mul", [table, column], "scaled_rows") if column else table
    split_flat(o, scaled, [1] * (len(kinds) + 1), names=[*names, gradient])
    all_finite = emit_all_finite(e, [loss_name, gradient])
    e.nodes.extend(n for n in chain.nodes if over_rows.intersection(n.input))

    # the old values gathered again at the gate, not kept from the first Concat: that buffer and
    # the scaled rows are freed before the chain, one more kernel for less memory held
    old = o.op("Concat", flat_state, out=OLD_STATE, axis=0)
    stacked = o.op("Concat", new, "next_rows", axis=0) if len(new) > 1 else new[0]
    next_rows = o.op("Reshape", [stacked, o.ints([len(new) * sum(sizes)])], "next_flat")
    kept = o.op("Where", [all_finite, next_rows, old], out=GATED)
    parts = split_flat(o, kept, sizes * len(kinds))
    next_state = {
        name: o.op("Reshape", [part, o.ints(shapes[weight])], out=f"{name}/next")
        for name, weight, part in zip(state, weights * len(kinds), parts)
    }
    next_state[STEP_STATE] = o.op("Where", [all_finite, next_step, STEP_STATE], out=f"{STEP_STATE}/next")
    return all_finite, next_state


def flat_state_info(optimizer: Optimizer, shapes: dict[str, tuple]) -> onnx.ValueInfoProto:
    """FLAT_STATE's type and size, declared: shape inference may not know every gradient's (a
    chunked loss's), and so neither the Concat's."""
    size = sum(int(np.prod(shape, dtype=np.int64)) for shape in shapes.values())
    rows = 2 + len(optimizer.slots)
    return helper.make_tensor_value_info(FLAT_STATE, TensorProto.FLOAT, [rows * size])


def _over_rows(nodes: list, rows: list[str]) -> set[str]:
    """The tensors `nodes` compute from the rows (over the weights' elements, or reduced from them)."""
    found = set(rows)
    for node in nodes:
        if found.intersection(node.input):
            found.update(node.output)
    return found


def _scaled_once(e: Emitter, row: str, over_rows: set[str], new: list[str]):
    """The node of `e` reading `row` if it is its only reader and a Mul by a scalar computed
    without the rows (a rate, a decay: the same for every element), else None."""
    readers = [n for n in e.nodes if row in n.input]
    if (
        row in new
        or len(readers) != 1
        or readers[0].op_type != "Mul"
        or list(readers[0].input).count(row) != 1
    ):
        return None
    other = readers[0].input[1 - list(readers[0].input).index(row)]
    constant = next((t for t in e.initializers if t.name == other), None)
    if other in over_rows or (constant is not None and int(np.prod(constant.dims)) != 1):
        return None
    return readers[0]


def _column(e: Emitter, factors: list[str]) -> str | None:
    """The scalars as a [rows, 1] column, one factor per row: a constant when every one is, None
    when every one is 1 (no Mul: SGD's weights under a fixed scale of 1)."""
    constants = {t.name: t for t in e.initializers}
    if all(f in constants for f in factors):
        values = [float(numpy_helper.to_array(constants[f])) for f in factors]
        if values == [1.0] * len(values):
            return None
        return e.const(np.array(values, np.float32).reshape(-1, 1), hint="row_factors")
    column = [e.op("Reshape", [f, e.ints([1, 1])], "row_factor") for f in factors]
    return e.op("Concat", column, "row_factors", axis=0)


def flatten(e: Emitter, tensors: list[str], sizes: list[int]) -> list[str]:
    """Each tensor (of `sizes` elements) as a vector: a Reshape, an alias in ONNX Runtime. The
    sizes are written out, so shape inference knows every flat buffer's."""
    return [e.op("Reshape", [t, e.ints([size])], "flattened") for t, size in zip(tensors, sizes)]


def split_flat(e: Emitter, flat: str, sizes: list[int], names: list[str] | None = None) -> list[str]:
    """`flat` cut along its first axis into pieces of `sizes`, in order (named `names`)."""
    outputs = names or len(sizes)
    if e.opset >= SPLIT_SINCE:
        parts = e.op("Split", [flat, e.ints(sizes)], outputs, axis=0)
    else:
        parts = e.op("Split", [flat], outputs, axis=0, split=sizes)
    return parts if isinstance(parts, list) else [parts]


def group_low_gradients(model: onnx.ModelProto) -> onnx.ModelProto:
    """After the precision rewrite: the gradients computed low reach the float32 flat buffer through
    a Cast each (a kernel per weight). Those weights move to the front of every row of the flat
    buffer, in their order (the Split back alike: the update is elementwise, so the same values),
    and their gradients are concatenated low and cast once. The model unchanged when fewer than two
    are low or the flat update is not found as emit_flat_update writes it; else changed in place."""
    graph = model.graph
    nodes = list(graph.node)
    producers = {out: node for node in nodes for out in node.output if out}
    concat = producers.get(FLAT_STATE)
    split = next((n for n in nodes if n.op_type == "Split" and n.input[0] == GATED), None)
    old = producers.get(OLD_STATE)
    if concat is None or concat.op_type != "Concat" or split is None or old is None:
        return model
    count = len(concat.input) - len(split.output)  # the weights: (kinds + 1) * count pieces
    if count < 2 or len(concat.input) % count or len(old.input) != len(split.output):
        return model
    types, _ = tensor_types(model, shape_inference=False)
    readers: dict[str, int] = {}
    for node in nodes:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    gradients = len(concat.input) - count  # the gradients' row comes last
    low = {}  # position -> (its flattening Reshape, the Cast of a low gradient before it)
    for k, piece in enumerate(concat.input[gradients:]):
        reshape = producers.get(piece)
        cast = producers.get(reshape.input[0]) if reshape is not None else None
        if cast is not None and cast.op_type == "Cast" and readers.get(cast.output[0]) == 1:
            if types.get(cast.input[0]) in _LOW:
                low[k] = (reshape, cast)
    if low:  # one step has one low type; any other stays as it is
        dtype = types[next(iter(low.values()))[1].input[0]]
        low = {k: pair for k, pair in low.items() if types[pair[1].input[0]] == dtype}
    if len(low) < 2:
        return model
    order = [*low, *(k for k in range(count) if k not in low)]
    moved = [row + k for row in range(0, len(concat.input), count) for k in order]
    initializers = {t.name: t for t in graph.initializer}
    e = Emitter([], graph.initializer, default_opset(model), names_in(graph), scope="scale")
    old.input[:] = [old.input[k] for k in moved[:gradients]]
    split.output[:] = [split.output[k] for k in moved[:gradients]]
    if len(split.input) > 1:
        sizes = numpy_helper.to_array(initializers[split.input[1]]).tolist()
        readers[split.input[1]] -= 1
        split.input[1] = e.ints([sizes[k] for k in moved[:gradients]])
    else:
        attribute = next(a for a in split.attribute if a.name == "split")
        attribute.ints[:] = [attribute.ints[k] for k in moved[:gradients]]
    unused = [t for t in graph.initializer if readers.get(t.name, 1) == 0]  # the sizes before
    for tensor in unused:
        graph.initializer.remove(tensor)
    for reshape, cast in low.values():  # the flattening reads the low gradient itself
        reshape.input[0] = cast.input[0]
    retyped = {reshape.output[0] for reshape, _ in low.values()}
    declared = [v for v in graph.value_info if v.name not in retyped]
    del graph.value_info[:]
    graph.value_info.extend(declared)
    pieces = list(concat.input)
    flat_low = e.op("Concat", [pieces[gradients + k] for k in low], "flat_low_gradients", axis=0)
    widened = e.op("Cast", [flat_low], "flat_low_gradients_fp32", to=TensorProto.FLOAT)
    rest = [pieces[k] for k in moved[gradients + len(low) :]]
    concat.input[:] = [pieces[k] for k in moved[:gradients]] + [widened, *rest]
    dropped = {id(cast) for _, cast in low.values()}
    at = nodes.index(concat)
    kept = [n for n in nodes[:at] if id(n) not in dropped] + e.nodes + nodes[at:]
    copies = [onnx.NodeProto() for _ in kept]
    for copy, node in zip(copies, kept):
        copy.CopyFrom(node)  # before the field lets go of them
    del graph.node[:]
    graph.node.extend(copies)
    return model
