"""Say what precision a step really runs in: the count of low-precision nodes of the step graph
after the nodes its provider refuses were kept float32 (`kernels.refused_nodes`).

bfloat16 on ONNX Runtime's CPU provider keeps nearly every node float32 (the provider lacks the
kernels), so a "bfloat16" run there is a float32 run: the line says so, with the fix.
"""

from __future__ import annotations

import logging

import onnx

from amp_rewrite.analysis.elemtypes import tensor_types
from amp_rewrite.training.cpu_refusals import LOW

log = logging.getLogger("amp_rewrite.training")


def low_precision_nodes(model: onnx.ModelProto) -> int:
    """Compute nodes (If/Loop/Scan bodies included) with a float16/bfloat16 input or output (Casts
    not counted)."""
    types, _ = tensor_types(model, shape_inference=False)
    return sum(
        1
        for node in _nodes(model.graph)
        if node.op_type not in ("Cast", "Constant", "If", "Loop", "Scan")
        and any(types.get(n) in LOW for n in (*node.input, *node.output) if n)
    )


def _nodes(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for body in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
                yield from _nodes(body)


def announce(model: onnx.ModelProto, precision: str, device: str, say) -> int:
    """One line with the count; a warning naming the fix when a low precision runs no node."""
    if precision == "float32":
        return 0
    count = low_precision_nodes(model)
    say(
        f"amp-rewrite: {count} of {sum(1 for _ in _nodes(model.graph))} step-graph nodes run in {precision} "
        f"on {device}"
    )
    if count == 0:
        fix = (
            "use precision='float16', or a CUDA machine" if precision == "bfloat16" else "use a CUDA machine"
        )
        log.warning(
            f"precision={precision!r} runs no node in {precision} on {device} (its provider lacks the "
            f"kernels): this trains in float32; {fix}"
        )
    return count
