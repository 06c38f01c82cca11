"""An independent reading of op_lists/kernels_cuda.json for tests: every node of a rewritten model
that reads or writes the target type must have a CUDA kernel with that type at its opset.

Independent of amp_rewrite.kernels on purpose: it looks at the *output model's* tensor types
(onnx shape inference), not at the colouring's decisions.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx
from onnx import TensorProto

TABLE = Path(__file__).resolve().parents[1] / "op_lists" / "kernels_cuda.json"
ELEM = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}


def _table() -> dict:
    return json.loads(TABLE.read_text())["kernels"]


def _graphs(graph):
    yield graph
    for n in graph.node:
        for a in n.attribute:
            if a.HasField("g"):
                yield from _graphs(a.g)
            for g in a.graphs:
                yield from _graphs(g)


def uncovered_low_nodes(model: onnx.ModelProto, target: str = "float16") -> list[str]:
    """'op name (opset N)' for each node touching `target` tensors without a CUDA kernel for it."""
    kernels = _table()
    opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {}
    for g in _graphs(inferred.graph):
        for v in [*g.input, *g.output, *g.value_info]:
            types[v.name] = v.type.tensor_type.elem_type
        for t in g.initializer:
            types[t.name] = t.data_type
        for n in g.node:
            if n.op_type == "Constant":
                types.update({o: a.t.data_type for o in n.output for a in n.attribute if a.name == "value"})
    bad = []
    for g in _graphs(inferred.graph):
        for n in g.node:
            if n.op_type == "Constant" or not any(
                types.get(x) == ELEM[target] for x in [*n.input, *n.output] if x
            ):
                continue
            domain = "" if n.domain == "ai.onnx" else n.domain
            opset = opsets.get(domain)
            rows = [
                r
                for r in kernels.get(f"{domain}:{n.op_type}", [])
                if r[0] <= opset and (r[1] is None or opset <= r[1])
            ]
            if not any(target in allowed for r in rows for allowed in r[2].values()):
                bad.append(f"{n.op_type} {n.name!r} (opset {opset})")
    return bad
