"""Built-in losses, emitted in standard ONNX ops under the `loss/` prefix.

Standard ops only (GatherElements, ReduceLogSumExp, Mul, Reduce*), because ONNX Runtime's inference build has
no loss-gradient kernels: the gradient builder differentiates these like any other nodes. The
`loss/` prefix lets the AMP rewrite keep the loss in float32, where it is computed and scaled.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import TensorProto, helper

from amp_rewrite.autodiff.emitter import Emitter
from amp_rewrite.errors import TrainingError
from amp_rewrite.training import chunked_loss

LOSS_OUTPUT = "loss"
LABELS_INPUT = "labels"
TARGETS_INPUT = "targets"
BUILTIN_LOSSES = ("cross_entropy", "mse")


@dataclasses.dataclass(frozen=True)
class CrossEntropy:
    """torch.nn.functional.cross_entropy's conventions: labels equal to `ignore_index` count for
    nothing (the mean is over the other labels), `label_smoothing` mixes the one-hot target with
    the uniform distribution. `loss="cross_entropy"` is `CrossEntropy()`.

    A batch whose labels are all ignored is refused before the step (torch returns nan, which a
    trainer would skip or, in float32, train on): there is nothing to learn from it."""

    ignore_index: int = -100
    label_smoothing: float = 0.0

    def __post_init__(self):
        if not isinstance(self.ignore_index, (int, np.integer)) or isinstance(self.ignore_index, bool):
            raise TrainingError(f"ignore_index must be an integer, got {self.ignore_index!r}")
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise TrainingError(f"label_smoothing must be in [0, 1], got {self.label_smoothing!r}")

    def __str__(self) -> str:
        return "cross_entropy"


def resolve_loss(loss):
    """The loss as attach_loss takes it: "cross_entropy" is CrossEntropy(); anything else as given."""
    return CrossEntropy() if loss == "cross_entropy" else loss


def check_labels(labels: np.ndarray, classes: int | None, loss: CrossEntropy) -> None:
    """Refuse, in one line, labels outside [0, classes) other than the ignore index, and a batch
    with no counted label (before the step: the graph would count them as zero loss)."""
    counted = labels[labels != loss.ignore_index]
    bad = counted[(counted < 0) | (counted >= classes)] if classes else counted[counted < 0]
    if bad.size:
        values = np.unique(bad)
        shown = ", ".join(str(v) for v in values[:5]) + (", ..." if values.size > 5 else "")
        span = f"[0, {classes})" if classes else "0 and up"
        raise TrainingError(
            f"labels: {bad.size} of this batch's labels are outside {span} "
            f"(values {shown}); the ignore index is {loss.ignore_index}"
        )
    if labels.size and not counted.size:
        raise TrainingError(
            f"labels: every label of this batch is the ignore index {loss.ignore_index}: "
            "nothing to learn from (torch's cross_entropy gives nan)"
        )


def classes_of(model: onnx.ModelProto) -> int | None:
    """The number of classes: the first output's last dim, if fixed."""
    dims = model.graph.output[0].type.tensor_type.shape.dim
    return dims[-1].dim_value if dims and dims[-1].HasField("dim_value") else None


def attach_loss(model: onnx.ModelProto, loss, emitter: Emitter) -> tuple[str, list[str]]:
    """Make the model's only output a float32 scalar loss; returns the loss tensor's name and the
    loss tensors that are constants for the gradient (the labels).

    Built-in losses read the first model output and add a `labels` or `targets` feed; any other
    string names a model output that already is the scalar loss.
    """
    graph = model.graph
    loss = resolve_loss(loss)
    if isinstance(loss, CrossEntropy):
        loss_name, label = _cross_entropy(graph, emitter, loss)
        return _attach(graph, loss_name, extra_input=_labels_input(graph)), [label]
    if loss == "mse":
        targets = _targets_input(model)  # before the loss nodes read it
        return _attach(graph, _mean_squared_error(graph, emitter), extra_input=targets), [TARGETS_INPUT]
    outputs = {o.name: o for o in graph.output}
    if loss not in outputs:
        raise TrainingError(
            f"loss {loss!r} is neither a built-in ({', '.join(BUILTIN_LOSSES)}) nor a model output "
            f"(outputs: {', '.join(outputs) or 'none'})"
        )
    _check_scalar_float(outputs[loss])
    return _attach(graph, loss, extra_input=None), []


def _attach(graph: onnx.GraphProto, loss_name: str, extra_input) -> str:
    if extra_input is not None and extra_input.name in {i.name for i in graph.input}:
        raise TrainingError(
            f"the model already has an input named {extra_input.name!r}, which the built-in loss feeds"
        )
    if extra_input is not None:
        graph.input.append(extra_input)
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info(loss_name, TensorProto.FLOAT, []))
    return loss_name


def _cross_entropy(graph: onnx.GraphProto, e: Emitter, loss: CrossEntropy) -> tuple[str, str]:
    """-mean over the counted samples of log softmax(logits)[label], classes on the last axis.
    A language-model head's logits (MatMul with many classes) are computed in the loss, a chunk of
    rows at a time (`chunked_loss`)."""
    logits = graph.output[0].name
    counted = e.op(
        "Not",
        [e.op("Equal", [LABELS_INPUT, e.const(loss.ignore_index, np.int64, "ignore_index")], "ignored")],
        "counted",
    )
    label = e.op("Where", [counted, LABELS_INPUT, e.const(0, np.int64, "zero_label")], "counted_label")
    weight = e.op("Cast", [counted], "counted_weight", to=TensorProto.FLOAT)

    def log_likelihood(e: Emitter, logits: str, label: str, axis: int) -> str:
        return _log_likelihood(e, logits, label, loss.label_smoothing, axis)

    head = chunked_loss.find_head(graph, logits, e.opset)
    if head is not None:
        total = chunked_loss.chunked_total(e, head, label, weight, log_likelihood)
        chunked_loss.drop_head(graph, head)
    else:
        axis = (
            len(graph.output[0].type.tensor_type.shape.dim) - 1
        )  # the class axis (onnx.reference wants it >= 0)
        per_sample = e.axes_op("Squeeze", log_likelihood(e, logits, label, axis), [-1], "log_likelihood")
        total = e.reduce(
            "ReduceSum",
            e.op("Mul", [per_sample, weight], "counted_log_likelihood"),
            None,
            keepdims=0,
            hint="total_log_likelihood",
        )
    count = e.reduce("ReduceSum", weight, None, keepdims=0, hint="count")
    mean = e.op("Div", [total, count], "mean_log_likelihood")
    return e.op("Neg", [mean], LOSS_OUTPUT), label


def _log_likelihood(e: Emitter, logits: str, label: str, smooth: float, axis: int) -> str:
    """log softmax(logits)[label] per row, [.., 1], as logits[label] - logsumexp(logits): a gather
    and a reduction, so no logits-sized tensor but the logits themselves is kept for the backward,
    and no one-hot is made (the gradient is softmax x dY plus a scatter at the labels: 0.5 GB less
    at a BERT's 16x128x30522 logits). With label smoothing s the target is one-hot x (1 - s) +
    s / classes, as torch: (1 - s) logits[label] + s / classes x sum(logits) - logsumexp(logits)."""
    last = e.const([-1], np.int64, "last_axis")
    picked = e.op(
        "GatherElements", [logits, e.op("Unsqueeze", [label, last], "label_index")], "picked", axis=axis
    )
    log_sum_exp = e.reduce("ReduceLogSumExp", logits, [-1], keepdims=1, hint="log_sum_exp")
    if smooth:
        classes = e.op(
            "Cast",
            [
                e.op(
                    "Gather",
                    [e.op("Shape", [logits], "logits_shape"), e.const(-1, np.int64, "last")],
                    "depth",
                )
            ],
            "classes",
            to=TensorProto.FLOAT,
        )
        spread = e.op(
            "Mul",
            [
                e.reduce("ReduceSum", logits, [-1], keepdims=1, hint="logits_sum"),
                e.op("Div", [e.const(smooth), classes], "uniform"),
            ],
            "spread",
        )
        picked = e.op(
            "Add", [e.op("Mul", [picked, e.const(1.0 - smooth)], "picked_share"), spread], "smoothed_picked"
        )
    return e.op("Sub", [picked, log_sum_exp], "log_likelihood_kept")


def _mean_squared_error(graph: onnx.GraphProto, e: Emitter) -> str:
    """mean of (prediction - target)^2 over every element, like torch's MSELoss."""
    prediction = graph.output[0].name
    error = e.op("Sub", [prediction, TARGETS_INPUT], "error")
    squared = e.op("Mul", [error, error], "squared_error")
    return e.reduce("ReduceMean", squared, None, keepdims=0, hint=LOSS_OUTPUT)


def _labels_input(graph: onnx.GraphProto):
    """labels: int64 class indices, the logits' shape without the class axis."""
    first = graph.output[0]
    _check_float(first, "cross_entropy")
    dims = list(first.type.tensor_type.shape.dim)[:-1]
    return helper.make_tensor_value_info(
        LABELS_INPUT, TensorProto.INT64, [_dim(d, i) for i, d in enumerate(dims)]
    )


def _targets_input(model: onnx.ModelProto):
    """targets: float32, the prediction's shape as the graph computes it. A declared output shape
    with free dims is checked against shape inference (declaration left out), which wins where they
    disagree: ddddocr declares [1, seqlen] and computes [T, 1, C]. Fully fixed declarations stand."""
    first = model.graph.output[0]
    _check_float(first, "mse")
    tensor = first.type.tensor_type
    declared = list(tensor.shape.dim) if tensor.HasField("shape") else None
    dims = None if declared is None else [_dim(d, i) for i, d in enumerate(declared)]
    if declared is None or not all(d.HasField("dim_value") for d in declared):
        computed = _computed_dims(model, first)
        if computed is not None and (dims is None or _disagree(dims, computed)):
            dims = [d if d is not None else f"loss_dim_{i}" for i, d in enumerate(computed)]
    return helper.make_tensor_value_info(TARGETS_INPUT, TensorProto.FLOAT, dims)


def _computed_dims(model: onnx.ModelProto, output: onnx.ValueInfoProto) -> list | None:
    """The output's dims (None where unknown) by shape inference and rank propagation, without its declaration."""
    from amp_rewrite.autodiff.graphinfo import TypeInfo

    declared = onnx.TypeProto()
    declared.CopyFrom(output.type)
    output.type.tensor_type.ClearField("shape")
    try:
        return TypeInfo.of(model).dims.get(output.name)
    finally:
        output.type.CopyFrom(declared)


def _disagree(declared: list, computed: list) -> bool:
    return len(declared) != len(computed) or any(
        isinstance(a, int) and isinstance(b, int) and a != b for a, b in zip(declared, computed)
    )


def _dim(d, index: int):
    if d.HasField("dim_value"):
        return d.dim_value
    return d.dim_param or f"loss_dim_{index}"


def _check_float(value, loss: str) -> None:
    if value.type.tensor_type.elem_type != TensorProto.FLOAT:
        raise TrainingError(f"loss {loss!r} needs a float32 first model output, {value.name!r} is not")


def _check_scalar_float(value) -> None:
    t = value.type.tensor_type
    if t.elem_type != TensorProto.FLOAT:
        raise TrainingError(f"loss output {value.name!r} must be float32")
    if t.HasField("shape") and any(not d.HasField("dim_value") or d.dim_value != 1 for d in t.shape.dim):
        raise TrainingError(f"loss output {value.name!r} must be a scalar")
