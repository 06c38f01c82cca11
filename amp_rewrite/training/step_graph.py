"""Assemble one training step as one ONNX graph: forward, loss, backward, unscale, finite check,
gated optimizer update and loss-scale update.

Inputs are the batch feeds plus every piece of state (float32 master weights, optimizer slots,
step count, loss scale, good-step counter) and the learning rate; outputs are the loss, the
skipped flag and the next value of every state input. The caller binds each state output back to
its input, so state never leaves the device. A skipped step passes the old state through bit for
bit: per tensor, the update is one `If(all_finite)` and a skipped step computes none of it (the
split step's: CPU and data parallel); flat (CUDA's one session), the state is rows of one buffer
and `Where(all_finite, new, old)` keeps the old values without a host round trip (flat_update.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from amp_rewrite.autodiff.emitter import Emitter
from amp_rewrite.errors import TrainingError
from amp_rewrite.onnx_facts import default_opset, names_in
from amp_rewrite.report.regions import declare as declare_regions
from amp_rewrite.training.chunked_loss import order_chunks
from amp_rewrite.training.flat_update import emit_flat_update, flat_state_info, group_low_gradients
from amp_rewrite.training.loss_scale import (
    GOOD_STEPS_STATE,
    INVERSE_SCALE,
    SCALE_STATE,
    SKIPPED_OUTPUT,
    FixedLossScale,
    emit_all_finite,
    emit_scale_update,
    initial_scale_state,
)
from amp_rewrite.training.losses import attach_loss
from amp_rewrite.training.optimizers import (
    LR_INPUT,
    STEP_STATE,
    Optimizer,
    emit_clip_by_global_norm,
    emit_step_count,
    zero_slots,
)

UNSCALED_PREFIX = "scale/unscaled/"  # + weight name: the unscaled gradient (data-parallel split point)
# The loss, its backward (autodiff names it grad/<forward node>/...), the seed, loss scaling,
# finite check and optimizer stay float32: the loss is scaled and gradients unscaled in float32.
FLOAT32_REGIONS = (r"loss/.*", r"grad/loss/.*", r"grad/seed.*", r"scale/.*", r"opt/.*")
# The step's parts, declared in its metadata for the report's picture (report.regions): the first
# prefix a node's name starts with decides.
PARTS = (
    ("grad/", "backward"),
    ("opt/", "optimizer"),
    ("scale/", "loss scale"),
    ("loss/", "loss"),
    ("", "forward"),
)


@dataclasses.dataclass(frozen=True)
class StepGraph:
    """A step model and what the runner needs to drive it."""

    model: onnx.ModelProto
    loss_output: str
    weights: tuple[str, ...]
    batch_inputs: tuple[str, ...]
    next_state: dict[str, str]  # state input -> output holding its next value
    initial_state: dict[str, np.ndarray]
    gradients: dict[str, str] = dataclasses.field(default_factory=dict)  # weight -> its (scaled) gradient
    report: object = None  # the mixed-precision rewrite's report (None in float32)
    flat: bool = False  # the update over flat buffers, gated by Where (flat_update.py), not an If


def build_step_graph(
    model: onnx.ModelProto,
    loss: str,
    optimizer: Optimizer,
    loss_scale,
    trainable: list[str] | None = None,
    gradient_builder=None,
    recompute=None,
    flat_update: bool = False,
) -> StepGraph:
    """The float32 step graph for `model` trained on `loss` with `optimizer` and a loss-scale policy;
    `recompute` is passed to the gradient builder (see `amp_rewrite.autodiff.recompute`).
    `flat_update`: the update over flat buffers gated by Where (CUDA's one-session step,
    flat_update.py), else a chain per weight in one `If` (the split step's, CPU and data parallel)."""
    forward = onnx.ModelProto()
    forward.CopyFrom(model)
    opset = default_opset(forward)
    if opset is None:
        raise TrainingError("the model imports no default-domain (ai.onnx) opset")
    taken = names_in(forward.graph)
    _reject_existing_loss_scaling(taken)
    loss_emitter = Emitter(forward.graph.node, forward.graph.initializer, opset, taken, scope="loss")
    loss_name, loss_constants = attach_loss(forward, loss, loss_emitter)

    build = gradient_builder or _autodiff_builder()
    extra = {} if recompute is None else {"recompute": recompute}
    with_grads = build(
        forward,
        loss_name,
        list(trainable) if trainable else None,
        grad_output=SCALE_STATE,
        stop_gradients=loss_constants,
        **extra,
    )
    order_chunks(with_grads)  # a chunked loss's chunks one after another (no-op otherwise)
    grads = _gradient_outputs(with_grads, loss_name)
    if not grads:
        raise TrainingError(_unreachable(forward, loss, loss_name, trainable, loss_constants))
    weights = tuple(grads)
    initial_weights = _take_initializers_as_inputs(with_grads, weights)

    graph = with_grads.graph
    nodes: list = []
    initializers: list = []
    emitter = Emitter(nodes, initializers, opset, names_in(graph), scope="scale")
    shapes = {w: initial_weights[w].shape for w in weights} if flat_update else None
    state_inputs, next_state = _emit_update(emitter, optimizer, loss_scale, loss_name, grads, shapes)

    graph.node.extend(nodes)
    graph.initializer.extend(initializers)
    if flat_update:
        graph.value_info.append(flat_state_info(optimizer, shapes))
    _ensure_scale_input(graph)
    graph.input.extend(
        _value_infos(state_inputs, initial_weights, optimizer, exclude={i.name for i in graph.input})
    )
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info(loss_name, TensorProto.FLOAT, []))
    graph.output.append(helper.make_tensor_value_info(SKIPPED_OUTPUT, TensorProto.BOOL, []))
    inputs_by_name = {i.name: i for i in graph.input}
    for state, out in next_state.items():
        value = onnx.ValueInfoProto()
        value.CopyFrom(inputs_by_name[state])
        value.name = out
        graph.output.append(value)

    initial_state = {w: initial_weights[w] for w in weights}
    for w in weights:
        for slot, array in zero_slots(optimizer, initial_weights[w]).items():
            initial_state[slot_name(w, slot)] = array
    initial_state[STEP_STATE] = np.array(0, np.int64)
    initial_state.update(initial_scale_state(loss_scale))
    non_batch = set(next_state) | {LR_INPUT}
    batch_inputs = tuple(i.name for i in graph.input if i.name not in non_batch)
    declare_regions(with_grads, PARTS)
    onnx.checker.check_model(with_grads)
    return StepGraph(
        with_grads, loss_name, weights, batch_inputs, next_state, initial_state, grads, flat=flat_update
    )


def _unreachable(forward: onnx.ModelProto, loss: str, loss_name: str, trainable, stops) -> str:
    """The error for a loss no trainable tensor reaches, naming the ops that cut the path."""
    from amp_rewrite.autodiff.reach import cut_nodes

    sources = list(trainable) if trainable else [t.name for t in forward.graph.initializer]
    cuts = cut_nodes(forward, loss_name, sources, stops)
    if not cuts:
        return f"the loss {loss!r} depends on no float initializer: nothing to train"
    more = f" (and {len(cuts) - 5} more)" if len(cuts) > 5 else ""
    return (
        f"the loss {loss!r} reaches the weights only through ops that pass no gradient: "
        f"{'; '.join(cuts[:5])}{more}"
    )


def slot_name(weight: str, slot: str) -> str:
    return f"opt/{weight}/{slot}"


def _emit_update(
    e: Emitter, optimizer: Optimizer, loss_scale, loss_name: str, grads: dict[str, str], flat=None
):
    """Unscale, finite check, the gated update, then the scale update. Per tensor (flat=None): one
    `If` on the flag, its then-branch clipping and updating every weight and slot and counting the
    step, its else-branch passing the old values through. Flat ({weight: shape}): over the rows of
    one buffer, gated by Where (flat_update.py). Returns (state inputs, next_state)."""
    e.reserve([SCALE_STATE, GOOD_STEPS_STATE, STEP_STATE, LR_INPUT])
    e.reserve(slot_name(w, s) for w in grads for s in optimizer.slots)
    if flat is not None:
        all_finite, next_state = emit_flat_update(e, optimizer, loss_scale, loss_name, grads, flat, slot_name)
    else:
        all_finite, next_state = _emit_per_tensor(e, optimizer, loss_scale, loss_name, grads)
    next_scale, next_good_steps = emit_scale_update(e, loss_scale, all_finite)
    next_state[SCALE_STATE] = e.op("Identity", [next_scale], out=f"{SCALE_STATE}/next")
    next_state[GOOD_STEPS_STATE] = e.op("Identity", [next_good_steps], out=f"{GOOD_STEPS_STATE}/next")
    return list(next_state), next_state


def _emit_per_tensor(e: Emitter, optimizer: Optimizer, loss_scale, loss_name: str, grads: dict[str, str]):
    """A chain per weight, in one `If(all_finite)`: (all_finite, next_state)."""
    inverse_scale = e.op("Reciprocal", [SCALE_STATE], out=INVERSE_SCALE)
    if loss_scale == FixedLossScale(1.0):  # g * 1 is g, bit for bit: no pass over the gradients
        unscaled = [e.op("Identity", [g], out=UNSCALED_PREFIX + w) for w, g in grads.items()]
    else:
        unscaled = [e.op("Mul", [g, inverse_scale], out=UNSCALED_PREFIX + w) for w, g in grads.items()]
    all_finite = emit_all_finite(e, [loss_name, *unscaled])

    body = e.body("opt")  # its own node list; constants stay in the outer graph
    if optimizer.max_grad_norm is not None:
        unscaled = emit_clip_by_global_norm(body, unscaled, optimizer.max_grad_norm)
    next_step, step_float, lr = emit_step_count(body, optimizer)
    updated = {}
    for (weight, _), grad in zip(grads.items(), unscaled):
        slots = {s: slot_name(weight, s) for s in optimizer.slots}
        new_weight, new_slots = optimizer.emit_update(
            body.scoped(f"opt/{weight}/"), weight, grad, slots, lr, step_float
        )
        updated[weight] = new_weight
        updated.update({slots[slot]: new_value for slot, new_value in new_slots.items()})
    updated[STEP_STATE] = next_step
    return all_finite, _emit_gated(e, all_finite, updated, body.nodes)


def _emit_gated(e: Emitter, all_finite: str, updated: dict[str, str], update_nodes: list) -> dict[str, str]:
    """`If(all_finite)`: the update nodes on a finite step, the old values (bit for bit) on a
    skipped one. A skipped step computes no update at all, and no tensor goes through a `Where`."""
    produced = {out for node in update_nodes for out in node.output}
    then_outputs = []
    for state, new in updated.items():
        if new not in produced:  # a branch output must be made in the branch
            new = _append(update_nodes, "Identity", [new], e.fresh(f"{state}/updated"), e)
        then_outputs.append(new)
    kept_nodes = []
    kept_outputs = [
        _append(kept_nodes, "Identity", [state], e.fresh(f"{state}/kept"), e) for state in updated
    ]
    types = [TensorProto.INT64 if state == STEP_STATE else TensorProto.FLOAT for state in updated]
    then_branch = helper.make_graph(
        update_nodes,
        "opt/update",
        [],
        [helper.make_tensor_value_info(n, t, None) for n, t in zip(then_outputs, types)],
    )
    else_branch = helper.make_graph(
        kept_nodes,
        "opt/skip",
        [],
        [helper.make_tensor_value_info(n, t, None) for n, t in zip(kept_outputs, types)],
    )
    outputs = [e.claim(f"{state}/next") for state in updated]
    e.nodes.append(
        helper.make_node(
            "If",
            [all_finite],
            outputs,
            name=e.fresh("opt/If"),
            then_branch=then_branch,
            else_branch=else_branch,
        )
    )
    return dict(zip(updated, outputs))


def _append(nodes: list, op_type: str, inputs: list[str], output: str, e: Emitter) -> str:
    nodes.append(helper.make_node(op_type, inputs, [output], name=e.fresh(f"{output}/{op_type}")))
    return output


def _gradient_outputs(model: onnx.ModelProto, loss_name: str) -> dict[str, str]:
    """weight -> gradient tensor, read from the `<weight>_grad` outputs of the gradient model."""
    initializers = {i.name for i in model.graph.initializer}
    grads = {}
    for output in model.graph.output:
        weight = output.name.removesuffix("_grad")
        if output.name != loss_name and output.name.endswith("_grad") and weight in initializers:
            grads[weight] = output.name
    return grads


def _take_initializers_as_inputs(model: onnx.ModelProto, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Remove the trainable initializers (they become state inputs); returns their float32 values."""
    wanted = set(names)
    values = {}
    kept = []
    for tensor in model.graph.initializer:
        if tensor.name in wanted:
            array = numpy_helper.to_array(tensor)
            if array.dtype != np.float32:
                raise TrainingError(
                    f"trainable weight {tensor.name!r} is {array.dtype}, master weights must be float32"
                )
            values[tensor.name] = np.array(array, np.float32)
        else:
            kept.append(tensor)
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    existing_inputs = [i for i in model.graph.input if i.name not in wanted]
    del model.graph.input[:]
    model.graph.input.extend(existing_inputs)
    return values


def _value_infos(state_inputs, weights: dict[str, np.ndarray], optimizer: Optimizer, exclude: set[str]):
    """Graph input declarations for the weights, optimizer slots, counters and learning rate."""
    infos = []
    shapes = {}
    for w, array in weights.items():
        shapes[w] = array.shape
        for slot in optimizer.slots:
            shapes[slot_name(w, slot)] = array.shape
    for name in [*state_inputs, LR_INPUT]:
        if name in exclude:
            continue
        if name in (STEP_STATE, GOOD_STEPS_STATE):
            infos.append(helper.make_tensor_value_info(name, TensorProto.INT64, []))
        else:
            infos.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shapes.get(name, ()))))
    return infos


def _ensure_scale_input(graph: onnx.GraphProto) -> None:
    """The gradient builder declares the loss-scale seed input; declare it if it did not."""
    if SCALE_STATE not in {i.name for i in graph.input}:
        graph.input.append(helper.make_tensor_value_info(SCALE_STATE, TensorProto.FLOAT, []))


def _reject_existing_loss_scaling(names: set[str]) -> None:
    """A model that already scales its loss would be scaled twice; say so instead."""
    clash = sorted(n for n in names if n.startswith(("scale/", "opt/")))
    if clash:
        raise TrainingError(
            f"model already has loss-scaling/optimizer tensors ({clash[0]!r}): train the plain model"
        )


def _autodiff_builder():
    try:
        from amp_rewrite.autodiff import build_gradient_graph
    except ImportError as error:
        raise TrainingError(f"the gradient builder (amp_rewrite.autodiff) is unavailable: {error}") from None
    return build_gradient_graph


def apply_precision(step: StepGraph, precision: str, device: str = "cpu", keep_float32=None) -> StepGraph:
    """The step graph's one mixed-precision rewrite, for the device it runs on: the training region
    pinned float32, recomputed copies coloured as their originals, and on CPU the nodes the
    provider refuses in `precision` (probed on the float32 graph first) kept float32; so are
    `keep_float32` ({node: reason}: what the Trainer's range guard found, training/range_guard.py)."""
    if precision == "float32":
        return step
    from amp_rewrite.api import rewrite
    from amp_rewrite.autodiff.recompute import copies, report_section
    from amp_rewrite.training.cpu_refusals import refused_in, refused_nodes
    from amp_rewrite.training.step_placement import low_without_kernel

    forced = refused_in(step.model, precision) if device == "cpu" else {}
    forced = {**forced, **(keep_float32 or {})}
    result = rewrite(step.model, precision_options(precision, forced, device, copies(step.model)))
    # CUDA: a low node the kernel table has no kernel for (the rewrite's own check should prevent
    # it) is kept float32 by name, rather than left for ONNX Runtime to run on CPU
    missed = refused_nodes(result.model) if device == "cpu" else low_without_kernel(result.model)
    if missed:  # a refusal the probe of the float32 graph did not foresee (none known): rewrite once more
        result = rewrite(
            step.model, precision_options(precision, forced | missed, device, copies(step.model))
        )
    section = report_section(step.model)
    if section:
        result.report.sections["recompute"] = section
    model = group_low_gradients(result.model) if step.flat else result.model  # one Cast, not one each
    return dataclasses.replace(step, model=model, report=result.report)


def precision_options(
    precision: str,
    force_fp32: dict[str, str] | None = None,
    device: str = "cpu",
    colour_as: dict[str, str] | None = None,
):
    """The rewrite options of a step graph on `device`: the training region pinned float32, the
    target's training lists (op_lists/training_<target>.yaml, where shipped) over its inference
    lists, `force_fp32` ({node: reason}) kept float32, `colour_as` ({node: node}) coloured alike.
    On CUDA the provider's kernel table applies; on CPU none does (ONNX Runtime's CPU provider runs
    a float16 node it has no kernel for in float32 between Casts of its own), only `force_fp32`."""
    from amp_rewrite.analysis.oplists import shipped_path
    from amp_rewrite.errors import OpListError
    from amp_rewrite.options import RewriteOptions

    try:
        training_lists = (shipped_path(f"training_{precision}.yaml"),)
    except OpListError:  # no training-only entries for this target
        training_lists = ()
    return RewriteOptions.of(
        target=precision,
        keep_io_types=True,
        keep_fp32_nodes=FLOAT32_REGIONS,
        force_fp32=force_fp32,
        op_lists=training_lists,
        colour_as=colour_as,
        provider="cuda" if device == "cuda" else "any",
        never_worse=False,  # a step trains in the precision asked for: its memory is what low saves
    )
