"""`--annotate`: each node's colour and one-line reason written into the rewritten model, where
Netron shows them when the node is clicked.

A node without a doc string gets one ("amp-rewrite: float16. MatMul 'm1' in float16: allow
list"); a node whose exporter already wrote a doc string keeps it and gets two metadata_props
entries instead (`amp-rewrite.precision`, `amp-rewrite.reason`). Inserted Casts say so. Nodes are
found by (graph, name): unnamed nodes are left as they are. Nothing else in the model changes.
"""

from __future__ import annotations

import onnx

from amp_rewrite.ir import collect_scopes

PRECISION_KEY = "amp-rewrite.precision"
REASON_KEY = "amp-rewrite.reason"


def _write(node: onnx.NodeProto, precision: str, reason: str) -> None:
    if not node.doc_string:
        node.doc_string = f"amp-rewrite: {precision}. {reason}"
        return
    node.metadata_props.add(key=PRECISION_KEY, value=precision)
    node.metadata_props.add(key=REASON_KEY, value=reason)


def _by_name(graph: onnx.GraphProto) -> dict:
    """Name -> node for names used once in the graph (a repeated name cannot say which node)."""
    found: dict = {}
    for node in graph.node:
        if node.name:
            found[node.name] = None if node.name in found else node
    return found


def annotate(model: onnx.ModelProto, report) -> int:
    """Annotate `model` (the rewrite `report` describes) in place; returns how many nodes got a note."""
    scopes = [_by_name(scope.graph) for scope in collect_scopes(model.graph)]
    done = 0
    for entry in report.nodes:
        node = scopes[entry["scope"]].get(entry["name"]) if entry["scope"] < len(scopes) else None
        if node is not None:
            _write(node, entry["precision"], entry["because"])
            done += 1
    for scope, name, tensor, to, _ in report.casts:
        node = scopes[scope].get(name) if scope < len(scopes) else None
        if node is not None:
            to_name = onnx.TensorProto.DataType.Name(to).lower()
            _write(
                node,
                to_name,
                f"Cast inserted by amp-rewrite: '{tensor}' to {to_name} for the readers that need it",
            )
            done += 1
    return done


def read(node: onnx.NodeProto) -> tuple[str, str] | None:
    """(precision, reason) that `annotate` wrote on `node`, or None."""
    props = {p.key: p.value for p in node.metadata_props}
    if PRECISION_KEY in props:
        return props[PRECISION_KEY], props.get(REASON_KEY, "")
    prefix = "amp-rewrite: "
    if node.doc_string.startswith(prefix):
        precision, _, reason = node.doc_string[len(prefix) :].partition(". ")
        return precision, reason
    return None
