"""`--fuse`: ONNX Runtime's transformer optimizer first, then the colouring, so one command gives
the fastest graph: its fused ops (SkipLayerNormalization, BiasGelu, Attention, ...) run CUDA's fused
kernels, and their type groups come from ORT's own schemas (op_lists/schemas_contrib.json).

Only the optimizer's Python fusions run (`opt_level=0`): no session, the same graph on any
machine. The model types are the optimizer's own (`optimizer.MODEL_TYPES`); "auto" reads the
graph: a causal mask (Trilu) or a past key/value input is "gpt2", an image input (4-D float)
"vit", anything else "bert" (BERT's fusions are the encoder's: LayerNorm, GELU, attention).
"""

from __future__ import annotations

import os
import sys

import onnx
from onnx import helper

from amp_rewrite.errors import UsageError
from amp_rewrite.runtime import tools_quiet

CONTRIB = "com.microsoft"


def model_types() -> tuple:
    """The model types ORT's optimizer knows, or () when onnxruntime.transformers is missing."""
    optimizer = optimizer_module()
    return ("auto", *optimizer.MODEL_TYPES) if optimizer is not None else ()


def detect(model: onnx.ModelProto) -> str:
    """ "vit", "gpt2" or "bert", from the graph (see the module's docstring)."""
    graph = model.graph
    if any("past" in value.name for value in graph.input) or any(n.op_type == "Trilu" for n in graph.node):
        return "gpt2"
    for value in graph.input:
        tensor = value.type.tensor_type
        if tensor.elem_type == onnx.TensorProto.FLOAT and len(tensor.shape.dim) == 4:
            return "vit"
    return "bert"


def fused(model: onnx.ModelProto, model_type: str) -> tuple[onnx.ModelProto, str]:
    """(a fused copy of `model`, a note saying what was fused). The input is never changed."""
    optimizer = optimizer_module()
    if optimizer is None:
        raise UsageError("--fuse needs onnxruntime.transformers (part of the onnxruntime package)")
    chosen = detect(model) if model_type == "auto" else model_type
    if chosen not in optimizer.MODEL_TYPES:
        raise UsageError(
            f"--fuse {model_type}: not a model type of ONNX Runtime's transformer optimizer "
            f"(choose auto or one of {', '.join(optimizer.MODEL_TYPES)})"
        )
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # the optimizer edits the proto it is given
    with tools_quiet():
        result = optimizer.optimize_model(copy, model_type=chosen, opt_level=0)
        counts = result.get_fused_operator_statistics()
    out = result.model
    out.ir_version = model.ir_version  # the source's IR version: ORT refuses newer ones
    if any(n.domain == CONTRIB for n in out.graph.node) and not any(
        o.domain == CONTRIB for o in out.opset_import
    ):
        out.opset_import.append(helper.make_opsetid(CONTRIB, 1))
    found = ", ".join(f"{op} x{n}" for op, n in sorted(counts.items()) if n)
    how = f"{model_type} -> {chosen}" if model_type == "auto" else chosen
    note = f"fused by ONNX Runtime's transformer optimizer ({how}): {found or 'nothing it knows'}"
    return out, note


def optimizer_module():
    """onnxruntime.transformers.optimizer, or None when it cannot be imported."""
    try:
        import onnxruntime.transformers as package

        # its modules import each other as top-level modules from its own folder, which its
        # __init__ puts on sys.path once per process (a test restoring sys.path drops it)
        folder = os.path.dirname(package.__file__)
        if folder not in sys.path:
            sys.path.append(folder)
        from onnxruntime.transformers import optimizer
    except ImportError:
        return None
    return optimizer
