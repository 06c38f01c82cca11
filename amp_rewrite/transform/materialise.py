"""Materialise a precision plan: retype tensors, convert constants, insert the casts.

Rules, all decided per tensor in one pass over its uses:
- a tensor made by a node has the type of its producing group; a use that needs the other type
  reads a Cast, one per (tensor, type, graph it is used in), placed right after the producer or at
  the top of the using graph;
- a use of a tensor that an existing Cast made, needing the type the Cast read, reads the Cast's
  input instead: no Cast chains;
- initializers and Constant nodes are free: converted in place when only low-precision groups
  read them, duplicated when both kinds do (no runtime Cast on weights);
- main-graph inputs and outputs keep their names; those not in `low_io` (all, with keep_io_types
  and no low_precision_io) keep float32 too: an output made in the other type is renamed at its
  producer and a Cast writes the original name;
- the model's own Casts that convert nothing in the result (to = their input's type, or back from
  an exact widening) are removed, their readers reading what they read (noop_casts.py).
"""

from __future__ import annotations

import onnx
from onnx import helper

from amp_rewrite.analysis.graph import ColouringGraph
from amp_rewrite.io import restore_borrowed
from amp_rewrite.onnx_facts import DEFAULT_DOMAINS, FLOAT
from amp_rewrite.plan import Plan
from amp_rewrite.transform.casts import place_casts
from amp_rewrite.transform.constants import convert_initializer, place_constant
from amp_rewrite.transform.noop_casts import fold_noop_casts
from amp_rewrite.transform.retype import retarget_attribute_typed_outputs, retype_io_and_value_info
from amp_rewrite.transform.splice import emit_nodes
from amp_rewrite.transform.state import Materialisation, Materialised, source_elem
from amp_rewrite.transform.weights import CAST_OPSET, Scan

__all__ = ["Materialised", "materialise"]


def _run(m: Materialisation, fold_casts: bool = True) -> Materialised:
    cg = m.cg
    types_get, scopes = cg.types.get, cg.scopes
    writes, reads, low_vertices = m.writes, m.reads, m.low_vertices
    for key, uses in cg.uses.items():
        s, name = key
        if types_get(name) != FLOAT:
            continue
        d = scopes[s].defs[name]
        if d[0] == "node":  # the common case, inlined: a vertex's output every reader reads as made
            row = writes[s][d[1]]
            vertex = row[d[2]] if row else None
            if vertex is not None:
                made_low = vertex in low_vertices
                for use_scope, n, slot in uses:  # needed_types' test per use, without its list
                    if n < 0:
                        break  # a graph output: place_casts decides
                    row = reads[use_scope][n]
                    if (bool(row) and row[slot] in low_vertices) != made_low:
                        break
                else:
                    if made_low:
                        m.low_names.add(key)  # as place_casts would: no Cast
                    continue
        elif d[0] == "initializer":  # a weight all readers read in one type: place_constant's
            low = None  # common case, without its per-use lists (58k weights at 100k nodes)
            for use_scope, n, slot in uses:
                if n < 0:
                    break  # a graph output: place_constant decides
                row = reads[use_scope][n]
                reader_low = bool(row) and row[slot] in low_vertices
                if low is None:
                    low = reader_low
                elif reader_low != low:
                    break
            else:
                if low:
                    m.low_names.add(key)
                    convert_initializer(m, s, name, d)
                continue  # read in float32 only: it stays as it is
        src = source_elem(m, s, name, d)
        if src is None:
            place_constant(m, s, name, d, uses)
        else:
            place_casts(m, s, name, d, src, uses)
    retarget_attribute_typed_outputs(m)
    retype_io_and_value_info(m)
    if fold_casts:
        fold_noop_casts(m)
    emit_nodes(m)
    restore_borrowed(m.cg.scopes[0].graph, m.cg.borrowed, m.replaced)
    m.constants.converted.clear()  # what stays float32 was converted for nothing: free it
    return m.result


def materialise(
    model: onnx.ModelProto,
    cg: ColouringGraph,
    plan: Plan,
    constants: Scan,
    *,
    low_io: frozenset = frozenset(),
    clamp: bool = False,
    fold_casts: bool = True,
) -> Materialised:
    """Apply `plan` to `model` (the proto `cg` was built from) in place; `constants` is the scan.
    `fold_casts`: the model's own Casts that convert nothing in the result are removed (noop_casts)."""
    result = _run(Materialisation.start(model, cg, plan, constants, low_io, clamp), fold_casts)
    if (result.casts or result.duplicated_constants) and not any(
        o.domain in DEFAULT_DOMAINS for o in model.opset_import
    ):
        # e.g. a model of ai.onnx.ml ops only: our Cast/Constant nodes need the default domain
        model.opset_import.append(helper.make_opsetid("", CAST_OPSET))
    return result
