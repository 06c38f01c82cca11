"""The materialiser's shared state: what each tensor is and what each use needs.

`Materialisation` is built once per rewrite; the jobs (casts.py, constants.py, retype.py,
noop_casts.py, splice.py) read and extend it, and materialise.py runs them in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

from amp_rewrite.analysis.graph import ColouringGraph
from amp_rewrite.naming import UniqueNames
from amp_rewrite.onnx_facts import ELEM, FLOAT
from amp_rewrite.plan import LOW, Plan
from amp_rewrite.transform.weights import Scan, is_constant


@dataclass
class Materialised:
    """What materialising did, for the report."""

    casts: list = field(default_factory=list)  # (scope, cast node name, tensor, to, output)
    cast_uses: dict = field(default_factory=dict)  # Cast output -> the uses reading it (the report's picture)
    # the model's own Casts removed as converting nothing (noop_casts.py):
    # (scope, node index, node name, its output, the tensor its readers read instead or None, why)
    removed_casts: list = field(default_factory=list)
    converted_constants: int = 0
    duplicated_constants: int = 0
    clamped_values: int = 0
    weight_bytes_delta: int = 0  # float weight bytes after minus before


@dataclass
class Materialisation:
    model: onnx.ModelProto
    cg: ColouringGraph
    constants: Scan  # the constant scan: converted bytes to take, once each
    low_io: frozenset  # names of the main graph's inputs and outputs that hold the target type
    low_outputs: frozenset  # their positions among the main graph's outputs (output names change)
    clamp: bool
    low: int  # the target element type
    low_vertices: set  # vertices painted low precision (read per use)
    reads: list
    writes: list
    main_outputs: set
    names: UniqueNames
    result: Materialised = field(default_factory=Materialised)
    casts: dict = field(default_factory=dict)  # (def scope, name, elem, use scope) -> cast output name
    after: dict = field(default_factory=dict)  # (scope, node index) -> nodes to emit right after it
    top: dict = field(default_factory=dict)  # scope -> nodes to emit first
    removed: dict = field(default_factory=dict)  # scope -> indices of the model's nodes not emitted
    renamed: dict = field(default_factory=dict)  # (def scope, name) -> new producer output name
    low_names: set = field(default_factory=set)  # (scope, name) whose final type is low precision
    replaced: set = field(
        default_factory=set
    )  # borrowed main-graph initializers given converted bytes in place

    @classmethod
    def start(cls, model, cg: ColouringGraph, plan: Plan, constants: Scan, low_io: frozenset, clamp: bool):
        low_outputs = frozenset(
            i for i, value in enumerate(cg.scopes[0].graph.output) if value.name in low_io
        )
        return cls(
            model,
            cg,
            constants,
            low_io,
            low_outputs,
            clamp,
            ELEM[cg.target],
            {v for v, colour in plan.colour.items() if colour == LOW},
            cg.reads,
            cg.writes,
            {(0, value.name) for value in cg.scopes[0].graph.output},
            UniqueNames(_names_in_use(cg)),
        )


def _names_in_use(cg: ColouringGraph) -> set:
    """Every tensor and node name of every graph, from what read_scopes read (defs, node names)."""
    taken = set()
    for scope in cg.scopes:
        taken.update(scope.defs)
        taken.update([v.name for v in scope.graph.output])
        taken.update(scope.names)
    return taken


def source_elem(m: Materialisation, s: int, name: str, d) -> int | None:
    """Element type a defined float32 tensor will have, or None for free constants."""
    kind, n, slot = d
    if kind == "initializer":
        return None
    if kind == "input":
        if s > 0:  # a loop-carried body input has its Loop's carried colour
            carried = m.cg.carried_in.get((s, name))
            return m.low if carried is not None and carried in m.low_vertices else FLOAT
        return m.low if name in m.low_io else FLOAT
    row = m.writes[s][n]
    vertex = row[slot] if row else None
    if vertex is not None:  # a vertex: not a Constant, which is a source (and the common case)
        return m.low if vertex in m.low_vertices else FLOAT
    return None if is_constant(m.cg.node(s, n)) else FLOAT


def needed_types(m: Materialisation, uses) -> list[int]:
    """The element type each use reads: one call per tensor, not one per use (uses outnumber tensors)."""
    reads, low_vertices, low = m.reads, m.low_vertices, m.low
    out = []
    for s, n, slot in uses:
        if n < 0:  # a graph output; a body's carried output has its Loop's carried colour
            carried = m.cg.carried_out.get((s, slot)) if s > 0 else None
            out.append(low if (slot in m.low_outputs if s == 0 else carried in low_vertices) else FLOAT)
        else:
            row = reads[s][n]  # cg.input_vertex, inlined
            out.append(low if row and row[slot] in low_vertices else FLOAT)
    return out


def set_input(m: Materialisation, use, new_name) -> None:
    s, n, slot = use
    if n < 0:
        m.cg.scopes[s].graph.output[slot].name = new_name
    else:
        m.cg.node(s, n).input[slot] = new_name
