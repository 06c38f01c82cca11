"""Built-in losses, emitted in standard ONNX ops under the `loss/` prefix.

Standard ops only (LogSoftmax, OneHot, Mul, Reduce*), because ONNX Runtime's inference build has
no loss-gradient kernels: the gradient builder differentiates these like any other nodes. The
`loss/` prefix lets the AMP rewrite keep the loss in float32, where it is computed and scaled.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from amp_rewrite.errors import TrainingError
from amp_rewrite.autodiff.emitter import Emitter

LOSS_OUTPUT = "loss"
LABELS_INPUT = "labels"
TARGETS_INPUT = "targets"
BUILTIN_LOSSES = ("cross_entropy", "mse")


def attach_loss(model: onnx.ModelProto, loss: str, emitter: Emitter) -> tuple[str, list[str]]:
    """Make the model's only output a float32 scalar loss; returns the loss tensor's name and the
    loss tensors that are constants for the gradient (the one-hot labels).

    Built-in losses read the first model output and add a `labels` or `targets` feed; any other
    string names a model output that already is the scalar loss.
    """
    graph = model.graph
    if loss == "cross_entropy":
        loss_name, one_hot = _cross_entropy(graph, emitter)
        return _attach(graph, loss_name, extra_input=_labels_input(graph)), [one_hot]
    if loss == "mse":
        return _attach(graph, _mean_squared_error(graph, emitter), extra_input=_targets_input(graph)), [TARGETS_INPUT]
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
        raise TrainingError(f"the model already has an input named {extra_input.name!r}, which the built-in loss feeds")
    if extra_input is not None:
        graph.input.append(extra_input)
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info(loss_name, TensorProto.FLOAT, []))
    return loss_name


def _cross_entropy(graph: onnx.GraphProto, e: Emitter) -> tuple[str, str]:
    """mean over samples of -log softmax(logits)[label], classes on the last axis."""
    logits = graph.output[0].name
    log_probs = e.op("LogSoftmax", [logits], "log_probs", axis=-1)
    depth = e.op("Shape", [logits], "logits_shape")
    depth = e.op("Gather", [depth, e.const(-1, np.int64, "last")], "depth")
    on_off = e.const([0.0, 1.0], np.float32, "on_off")
    one_hot = e.op("OneHot", [LABELS_INPUT, depth, on_off], "one_hot", axis=-1)
    picked = e.op("Mul", [log_probs, one_hot], "picked")
    per_sample = e.reduce("ReduceSum", picked, [-1], keepdims=0, hint="log_likelihood")
    mean = e.reduce("ReduceMean", per_sample, None, keepdims=0, hint="mean_log_likelihood")
    return e.op("Neg", [mean], LOSS_OUTPUT), one_hot


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
    return helper.make_tensor_value_info(LABELS_INPUT, TensorProto.INT64, [_dim(d, i) for i, d in enumerate(dims)])


def _targets_input(graph: onnx.GraphProto):
    """targets: float32, the prediction's shape."""
    first = graph.output[0]
    _check_float(first, "mse")
    dims = list(first.type.tensor_type.shape.dim)
    return helper.make_tensor_value_info(TARGETS_INPUT, TensorProto.FLOAT, [_dim(d, i) for i, d in enumerate(dims)])


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
