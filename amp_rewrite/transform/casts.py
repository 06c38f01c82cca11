"""Cast placement: each tensor made by a node has its producer's type; a use that needs the other
type reads one Cast per (tensor, type, graph it is used in), right after the producer or at the
top of the using graph; a use of an existing Cast's output that needs the Cast's input type reads
that input (no Cast chains); a main-graph output keeps its name (renamed at its producer).
"""

from __future__ import annotations

import onnx

from amp_rewrite.onnx_facts import FLOAT, TAG
from amp_rewrite.transform.state import Materialisation, needed_types, set_input, source_elem


def place_casts(m: Materialisation, s, name, d, src, uses) -> None:
    if src == m.low:
        m.low_names.add((s, name))
    needs = needed_types(m, uses)
    if needs.count(src) == len(needs):  # the common case: every reader takes the producer's type
        return
    rename_for_output = (s, name) in m.main_outputs and any(
        u.scope == 0 and u.node < 0 and need != src for u, need in zip(uses, needs)
    )
    if rename_for_output and d.kind == "node":
        # Main-graph output needs the other type: producer writes a new name, a Cast the old.
        new = m.names.new(f"{name}_{TAG[src]}")
        m.renamed[(s, name)] = new
        m.cg.node(s, d.node).output[d.slot] = new
        if src == m.low:
            m.low_names.discard((s, name))
            m.low_names.add((s, new))
        out_elem = next(need for u, need in zip(uses, needs) if u.scope == 0 and u.node < 0)
        add_cast(m, s, d, new, name, out_elem, after=True)
        m.result.cast_uses[name] = [u for u, need in zip(uses, needs) if need != src]
        for use, need in zip(uses, needs):
            if need == src:
                set_input(m, use, new)
        return
    for use, need in zip(uses, needs):
        if need != src:
            out = cast_of(m, s, name, d, need, use.scope)
            set_input(m, use, out)
            m.result.cast_uses.setdefault(out, []).append(use)


def cast_of(m: Materialisation, s, name, d, elem, use_scope) -> str:
    """The name holding `name` as `elem` in graph `use_scope`, adding one Cast if needed."""
    key = (s, name, elem, use_scope)
    if key in m.casts:
        return m.casts[key]
    reuse = cast_input_of_type(m, s, d, elem)
    if reuse is not None:
        m.casts[key] = reuse
        return reuse
    out = m.names.new(f"{name}_{TAG[elem]}")
    source = cast_origin(m, s, d) or name  # Cast(int -> float) then -> float16: cast the int once
    add_cast(m, use_scope, d if use_scope == s else None, source, out, elem, after=use_scope == s)
    if elem == m.low:
        m.low_names.add((use_scope, out))
    m.casts[key] = out
    return out


def cast_input_of_type(m: Materialisation, s, d, elem) -> str | None:
    """If `d` is made by a Cast whose own input already has type `elem`, that input."""
    if d.kind != "node":
        return None
    node = m.cg.node(s, d.node)
    if node.op_type != "Cast" or not node.input or not node.input[0]:
        return None
    source = node.input[0]
    found = m.cg.resolve(s, source)
    if found is None or (found.scope, source) in m.renamed:
        return None
    if m.cg.types.get(source) == elem and m.cg.types.get(source) != FLOAT:
        return source  # e.g. Cast(fp16 -> fp32) feeding a now-float16 consumer
    if m.cg.types.get(source) == FLOAT:
        if source_elem(m, found.scope, source, found.definition) == elem:
            return source
    return None


def cast_origin(m: Materialisation, s, d) -> str | None:
    """The input of the existing Cast that made `d`, when that input is not a float32 tensor we
    retype (an int, bool or double): casting it directly avoids a Cast of a Cast."""
    if d.kind != "node":
        return None
    node = m.cg.node(s, d.node)
    if node.op_type != "Cast" or not node.input or not node.input[0]:
        return None
    source_type = m.cg.types.get(node.input[0])
    return node.input[0] if source_type is not None and source_type != FLOAT else None


def add_cast(m: Materialisation, scope, d, source, out, elem, *, after: bool) -> None:
    name = m.names.new(f"amp/Cast_{out}")
    # helper.make_node's bytes without its per-call checks: this runs once per cast (docs/benchmarks.md)
    cast = onnx.NodeProto(
        op_type="Cast",
        input=[source],
        output=[out],
        name=name,
        attribute=[onnx.AttributeProto(name="to", type=onnx.AttributeProto.INT, i=elem)],
    )
    if after and d is not None and d.kind == "node":
        m.after.setdefault((scope, d.node), []).append(cast)
    else:
        m.top.setdefault(scope, []).append(cast)
    m.result.casts.append((scope, name, source, elem, out))
