"""Loop and Scan carried values, coloured as TensorFlow colours its while loops.

A carried value runs v_initial -> body input -> body output -> result (a Scan's state likewise).
TF colours the Enter/Merge/Switch/NextIteration/Exit ops that carry it as clear ops and forces
the two ends of the back edge to one colour. Here each carried value is one clear vertex (group
`V[k]`: the node's input and output slot) that also *makes* the body's input and *reads* the
body's output (`ColouringGraph.carried_in`/`carried_out`; edges in `graph._add_edges`, costs in
placement, types in the materialiser), so all four take its colour and the body casts nothing it
carries whose colour matches. Scan inputs and outputs, and If, keep their declared types.
"""

from __future__ import annotations

from typing import NamedTuple

from amp_rewrite import onnx_facts
from amp_rewrite.analysis import schemas
from amp_rewrite.onnx_facts import FLOAT

CARRYING = ("Loop", "Scan")


class Carried(NamedTuple):
    """One loop-carried value: the node's input and output slots, the body's input and output."""

    node_input: int
    node_output: int
    body_input: int
    body_output: int


def carried_slots(op_type: str, sig, node, inputs, outputs, body=None) -> tuple:
    """`_slots`, less the values the body declares as sequences or optionals: those keep the boundary."""
    found = _slots(op_type, sig, node, inputs, outputs)
    if body is None:
        return found
    return tuple(
        c
        for c in found
        if c.body_input < len(body.input)
        and c.body_output < len(body.output)
        and body.input[c.body_input].type.HasField("tensor_type")
        and body.output[c.body_output].type.HasField("tensor_type")
    )


def _slots(op_type: str, sig, node, inputs, outputs) -> tuple:
    """The loop-carried values of a Loop (v_initial -> body input -> body output -> v_final) or a
    Scan (state likewise); () for Scan-8, whose first input is sequence_lens."""
    if op_type == "Loop":
        return tuple(Carried(2 + k, k, 2 + k, 1 + k) for k in range(min(len(inputs) - 2, len(outputs))))
    if sig.since_version < 9:
        return ()
    scanned = next((a.i for a in node.attribute if a.name == "num_scan_inputs"), 0)
    return tuple(Carried(k, k, k, k) for k in range(min(len(inputs) - scanned, len(outputs))))


def carrying_template(sig, template, carried, target: str, kernel) -> list:
    """A Loop's or Scan's groups with one group per carried value (`V[k]`: its node input and
    output), coloured like a clear op; the rest (scan inputs and outputs) keep the boundary."""
    in_carried = {c.node_input for c in carried}
    out_carried = {c.node_output for c in carried}
    target_string = onnx_facts.TYPE_STRING[target]
    fixed = (
        None
        if sig.admits("V", target_string)
        else f"schema {sig.op_type}-{sig.since_version} does not allow {target} for V"
    )
    if fixed is None and kernel is not None:
        fixed = kernel("V")
    out = [
        (schemas.TypeGroup(f"V[{k}]", (c.node_input,), (c.node_output,)), fixed, None)
        for k, c in enumerate(carried)
    ]
    for group, group_fixed, late in template:
        rest = schemas.TypeGroup(
            group.type_param,
            tuple(i for i in group.inputs if i not in in_carried),
            tuple(i for i in group.outputs if i not in out_carried),
        )
        if rest.inputs or rest.outputs:
            out.append((rest, group_fixed, late))
    return out


def bind_carried(cg, body: int, c: Carried, v: int) -> None:
    """The carried value's vertex `v` is the producer of the body's input and the reader of its
    output: their types follow its colour (edges in _add_edges, casts in the materialiser)."""
    graph = cg.scopes[body].graph
    if c.body_input < len(graph.input) and cg.types.get(graph.input[c.body_input].name) == FLOAT:
        cg.carried_in[(body, graph.input[c.body_input].name)] = v
    if c.body_output < len(graph.output) and cg.types.get(graph.output[c.body_output].name) == FLOAT:
        cg.carried_out[(body, c.body_output)] = v
