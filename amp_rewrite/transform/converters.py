"""Whole-model conversions by ONNX's own tools, made before colouring: `--opset` by
onnx.version_converter (`pipeline.take_working_copy`) and model-local functions inlined by
onnx.inliner (`pipeline.inline_local_functions`)."""

from __future__ import annotations

import onnx


def convert_opset(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """`model` converted to default-domain `opset` by onnx.version_converter (a new model), its IR
    version raised only as far as that opset needs; one UsageError line when it cannot."""
    from onnx import helper, version_converter

    from amp_rewrite.errors import UsageError

    if model.graph.initializer and any(
        t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer
    ):
        raise UsageError(
            f"--opset {opset}: a model with weights left on disk cannot be converted; "
            "convert it with onnx.version_converter first"
        )
    try:
        converted = version_converter.convert_version(model, opset)
    except Exception as exc:  # noqa: BLE001 - the converter's refusal, said in one line
        lines = [x for x in str(exc).strip().splitlines() if x.strip()]
        raise UsageError(
            f"--opset {opset}: onnx.version_converter cannot convert this model "
            f"({(lines[-1] if lines else type(exc).__name__)[:200]})"
        ) from None
    needed = helper.find_min_ir_version_for([helper.make_opsetid("", opset)])
    converted.ir_version = max(model.ir_version, needed)
    return converted


def inline_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its model-local functions inlined (onnx.inliner), so every op is coloured."""
    import onnx.inliner

    inlined = onnx.inliner.inline_local_functions(model)
    del inlined.functions[:]
    return inlined
