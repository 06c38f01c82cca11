"""Make an exported model trainable as it comes: inline model-local functions (dynamo exports),
convert opsets below 13 (autodiff's floor) to 16 with onnx.version_converter, lift weights stored
inside If branches to the main graph, and promote float
Constant nodes that hold parameters to initializers (PaddlePaddle stores every weight that way).
"""

from __future__ import annotations

import logging

import onnx
from onnx import helper

from amp_rewrite.autodiff.branches import lift_branch_weights
from amp_rewrite.errors import TrainingError
from amp_rewrite.training import parameters

MIN_OPSET = 13
# Older models are converted to 16, not 13: the MaxPool gradient of overlapping windows (YOLO's
# SPP pools) needs ScatterElements' reduction="add", new in opset 16.
CONVERT_TO = 16
log = logging.getLogger("amp_rewrite.training")


def prepare(model: onnx.ModelProto, say=log.info) -> tuple[onnx.ModelProto, parameters.Parameters]:
    """A trainable copy of `model` and its default parameters (now all initializers)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    if out.functions:
        out = onnx.inliner.inline_local_functions(out)
    out = _convert_opset(out, say)
    lift_branch_weights(out)  # weights stored inside If branches become initializers the branches read
    found = parameters.find(out.graph)
    if found.left_out:
        say(f"amp-rewrite: {found.left_out}")
    _promote_constants(out.graph, set(found.names))
    return out, found


def default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), MIN_OPSET)


def _convert_opset(model: onnx.ModelProto, say) -> onnx.ModelProto:
    opset = default_opset(model)
    if opset >= MIN_OPSET:
        return model
    try:
        converted = onnx.version_converter.convert_version(model, CONVERT_TO)
    except Exception as error:  # the converter raises RuntimeError/IndexError/... per adapter
        raise TrainingError(
            f"cannot convert opset {opset} to {CONVERT_TO} for autodiff: "
            f"{_blocking_op(model, opset)}{_first_line(error)}"
        ) from None
    converted.ir_version = max(model.ir_version, min(converted.ir_version, 8))
    say(f"amp-rewrite: converted the model from opset {opset} to {CONVERT_TO} (autodiff needs {MIN_OPSET}+)")
    return converted


def _blocking_op(model: onnx.ModelProto, opset: int) -> str:
    """'op X (node 'n') blocked it: ' for the first node that does not convert on its own, else ''."""
    types = {v.name: v.type for v in (*model.graph.input, *model.graph.value_info, *model.graph.output)}
    types.update(
        {t.name: helper.make_tensor_type_proto(t.data_type, list(t.dims)) for t in model.graph.initializer}
    )
    tried = set()
    for node in model.graph.node:
        if node.op_type in tried or node.domain not in ("", "ai.onnx"):
            continue
        tried.add(node.op_type)
        inputs = [
            helper.make_value_info(
                n, types.get(n, helper.make_tensor_type_proto(onnx.TensorProto.FLOAT, None))
            )
            for n in node.input
            if n
        ]
        outputs = [
            helper.make_value_info(
                n, types.get(n, helper.make_tensor_type_proto(onnx.TensorProto.FLOAT, None))
            )
            for n in node.output
            if n
        ]
        single = helper.make_model(
            helper.make_graph([node], "probe", inputs, outputs),
            opset_imports=[helper.make_opsetid("", opset)],
            ir_version=model.ir_version,
        )
        try:
            onnx.version_converter.convert_version(single, CONVERT_TO)
        except Exception:  # noqa: BLE001 - this node is the one that blocks
            return f"op {node.op_type} (node {node.name!r}) blocked it: "
    return ""


def _first_line(error: Exception) -> str:
    """The converter's message without its source location and assertion text."""
    text = str(error).strip().splitlines()
    line = text[-1] if text else type(error).__name__
    return line.split(" failed: ", 1)[-1]


def _promote_constants(graph: onnx.GraphProto, names: set[str]) -> None:
    """Constant nodes producing a parameter become initializers of the same name."""
    kept = []
    for node in graph.node:
        if node.op_type == "Constant" and node.output[0] in names:
            tensor = onnx.TensorProto()
            tensor.CopyFrom(next(a.t for a in node.attribute if a.name == "value"))
            tensor.name = node.output[0]
            graph.initializer.append(tensor)
        else:
            kept.append(node)
    if len(kept) != len(graph.node):
        del graph.node[:]
        graph.node.extend(kept)
