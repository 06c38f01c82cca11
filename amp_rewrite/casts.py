"""Materialise a precision plan: retype tensors, convert constants, insert the casts.

Rules, all decided per tensor in one pass over its uses:
- a tensor made by a node has the type of its producing group; a use that needs the other type
  reads a Cast, one per (tensor, type, graph it is used in), placed right after the producer or at
  the top of the using graph;
- a use of a tensor that an existing Cast made, needing the type the Cast read, reads the Cast's
  input instead: no Cast chains;
- initializers and Constant nodes are free: converted in place when only low-precision groups
  read them, duplicated when both kinds do (no runtime Cast on weights);
- main-graph inputs and outputs keep their names; with keep_io_types they keep float32 too: an
  output made in low precision is renamed at its producer and a Cast writes the original name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx
from onnx import TensorProto, helper

from amp_rewrite import model as model_io, tensordata, weights
from amp_rewrite.graph import FLOAT, ColouringGraph
from amp_rewrite.naming import UniqueNames
from amp_rewrite.paint import LOW, Plan

ELEM = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16, "float32": TensorProto.FLOAT}
TAG = {TensorProto.FLOAT16: "fp16", TensorProto.BFLOAT16: "bf16", TensorProto.FLOAT: "fp32"}
CAST_OPSET = weights.CAST_OPSET


@dataclass
class Materialised:
    casts: list = field(default_factory=list)  # (scope, cast node name, tensor, to)
    converted_constants: int = 0
    duplicated_constants: int = 0
    clamped_values: int = 0
    weight_bytes_delta: int = 0  # float weight bytes after minus before


def _names_in_use(cg: ColouringGraph) -> set:
    """Every tensor and node name of every graph, from what read_scopes read (defs, node names)."""
    taken = set()
    for scope in cg.scopes:
        taken.update(scope.defs)
        taken.update([v.name for v in scope.graph.output])
        taken.update(scope.names)
    return taken


class _Materialiser:
    def __init__(self, model, cg: ColouringGraph, plan: Plan, keep_io_types: bool, clamp: bool):
        self.model = model
        self.cg = cg
        self.keep_io = keep_io_types
        self.clamp = clamp
        self.low = ELEM[cg.target]
        self.io_elem = FLOAT if keep_io_types else self.low  # what main-graph inputs and outputs hold
        self.low_vertices = {v for v, colour in plan.colour.items() if colour == LOW}  # read per use
        self.reads, self.writes = cg.reads, cg.writes
        self.main_outputs = {(0, value.name) for value in cg.scopes[0].graph.output}
        self.names = UniqueNames(_names_in_use(cg))
        self.result = Materialised()
        self.casts = {}  # (def scope, name, elem, use scope) -> cast output name
        self.after = {}  # (scope, node index) -> nodes to emit right after it
        self.top = {}  # scope -> nodes to emit first
        self.renamed = {}  # (def scope, name) -> new producer output name
        self.low_names = set()  # (scope, name) whose final type is low precision
        self._initializers = {}
        self.replaced = set()  # borrowed main-graph initializers given converted bytes in place

    # --- what each tensor is and what each use needs -------------------------------------------

    def source_elem(self, s: int, name: str, d) -> int | None:
        """Element type a defined float32 tensor will have, or None for free constants."""
        kind, n, slot = d
        if kind == "initializer":
            return None
        if kind == "input":
            return self.io_elem if s == 0 else FLOAT
        row = self.writes[s][n]
        vertex = row[slot] if row else None
        if vertex is not None:  # a vertex: not a Constant, which is a source (and the common case)
            return self.low if vertex in self.low_vertices else FLOAT
        return None if weights.is_constant(self.cg.node(s, n)) else FLOAT

    def needs(self, uses) -> list[int]:
        """The element type each use reads: one call per tensor, not one per use (500k at 100k nodes)."""
        reads, low_vertices, low = self.reads, self.low_vertices, self.low
        out = []
        for s, n, slot in uses:
            if n < 0:  # a graph output
                out.append(self.io_elem if s == 0 else FLOAT)
            else:
                row = reads[s][n]  # cg.input_vertex, inlined
                out.append(low if row and row[slot] in low_vertices else FLOAT)
        return out

    # --- the pass ----------------------------------------------------------------------------------

    def run(self) -> Materialised:
        cg = self.cg
        for (s, name), uses in cg.uses.items():
            if cg.types.get(name) != FLOAT:
                continue
            d = cg.scopes[s].defs[name]
            src = self.source_elem(s, name, d)
            if src is None:
                self.place_constant(s, name, d, uses)
            else:
                self.place_casts(s, name, d, src, uses)
        self.retarget_attribute_typed_outputs()
        self.retype_io_and_value_info()
        self.emit_nodes()
        model_io.restore_borrowed(self.cg.scopes[0].graph, self.cg.borrowed, self.replaced)
        self.cg.constants.converted.clear()  # what stays float32 was converted for nothing: free it
        return self.result

    def place_casts(self, s, name, d, src, uses) -> None:
        if src == self.low:
            self.low_names.add((s, name))
        needs = self.needs(uses)
        if needs.count(src) == len(needs):  # the common case: every reader takes the producer's type
            return
        rename_for_output = (s, name) in self.main_outputs and any(
            u[0] == 0 and u[1] < 0 and need != src for u, need in zip(uses, needs))
        if rename_for_output and d[0] == "node":
            # Main-graph output needs the other type: producer writes a new name, a Cast the old.
            new = self.names.new(f"{name}_{TAG[src]}")
            self.renamed[(s, name)] = new
            self.cg.node(s, d[1]).output[d[2]] = new
            if src == self.low:
                self.low_names.discard((s, name))
                self.low_names.add((s, new))
            out_elem = next(need for u, need in zip(uses, needs) if u[0] == 0 and u[1] < 0)
            self.add_cast(s, d, new, name, out_elem, after=True)
            for use, need in zip(uses, needs):
                if need == src:
                    self.set_input(use, new)
            return
        for use, need in zip(uses, needs):
            if need != src:
                self.set_input(use, self.cast_of(s, name, d, need, use[0]))

    def cast_of(self, s, name, d, elem, use_scope) -> str:
        """The name holding `name` as `elem` in graph `use_scope`, adding one Cast if needed."""
        key = (s, name, elem, use_scope)
        if key in self.casts:
            return self.casts[key]
        reuse = self.cast_input_of_type(s, d, elem)
        if reuse is not None:
            self.casts[key] = reuse
            return reuse
        out = self.names.new(f"{name}_{TAG[elem]}")
        source = self.cast_origin(s, d) or name  # Cast(int -> float) then -> float16: cast the int once
        self.add_cast(use_scope, d if use_scope == s else None, source, out, elem, after=use_scope == s)
        if elem == self.low:
            self.low_names.add((use_scope, out))
        self.casts[key] = out
        return out

    def cast_input_of_type(self, s, d, elem) -> str | None:
        """If `d` is made by a Cast whose own input already has type `elem`, that input."""
        if d[0] != "node":
            return None
        node = self.cg.node(s, d[1])
        if node.op_type != "Cast" or not node.input or not node.input[0]:
            return None
        source = node.input[0]
        found = self.cg.resolve(s, source)
        if found is None or (found[0], source) in self.renamed:
            return None
        if self.cg.types.get(source) == elem and self.cg.types.get(source) != FLOAT:
            return source  # e.g. Cast(fp16 -> fp32) feeding a now-float16 consumer
        if self.cg.types.get(source) == FLOAT:
            source_elem = self.source_elem(found[0], source, found[1])
            if source_elem == elem:
                return source
        return None

    def cast_origin(self, s, d) -> str | None:
        """The input of the existing Cast that made `d`, when that input is not a float32 tensor we
        retype (an int, bool or double): casting it directly avoids a Cast of a Cast."""
        if d[0] != "node":
            return None
        node = self.cg.node(s, d[1])
        if node.op_type != "Cast" or not node.input or not node.input[0]:
            return None
        source_type = self.cg.types.get(node.input[0])
        return node.input[0] if source_type is not None and source_type != FLOAT else None

    def add_cast(self, scope, d, source, out, elem, *, after: bool) -> None:
        name = self.names.new(f"amp/Cast_{out}")
        # helper.make_node's bytes, without its checks: a third of the time, 20k times at 100k nodes
        cast = onnx.NodeProto(op_type="Cast", input=[source], output=[out], name=name,
                              attribute=[onnx.AttributeProto(name="to", type=onnx.AttributeProto.INT, i=elem)])
        if after and d is not None and d[0] == "node":
            self.after.setdefault((scope, d[1]), []).append(cast)
        else:
            self.top.setdefault(scope, []).append(cast)
        self.result.casts.append((scope, name, source, elem))

    def set_input(self, use, new_name) -> None:
        s, n, slot = use
        if n < 0:
            self.cg.scopes[s].graph.output[slot].name = new_name
        else:
            self.cg.node(s, n).input[slot] = new_name

    # --- constants -----------------------------------------------------------------------------------

    def place_constant(self, s, name, d, uses) -> None:
        needs = self.needs(uses)
        kinds = set(needs)
        if self.low not in kinds:
            return
        main_output = next((need for u, need in zip(uses, needs) if u[0] == 0 and u[1] < 0), None)
        primary = main_output if main_output is not None else (FLOAT if FLOAT in kinds else self.low)
        other = self.low if primary == FLOAT else FLOAT
        other_name = self.names.new(f"{name}_{TAG[other]}") if other in kinds else None
        if primary == self.low:
            self.low_names.add((s, name))
            if other_name:  # copy the float32 values before converting them in place
                self.convert_constant(s, name, d, other_name, in_place=False, elem=FLOAT)
            self.convert_constant(s, name, d, name, in_place=True)
        else:
            self.convert_constant(s, name, d, other_name, in_place=False)
            self.low_names.add((s, other_name))
        if other_name:
            for use, need in zip(uses, needs):
                if need == other:
                    self.set_input(use, other_name)

    def converted_bytes(self, key, source: onnx.TensorProto, elem: int) -> bytes:
        """`source`'s values as `elem`: converted ahead by the scan (weights.py) or now."""
        ahead = self.cg.constants.take(key) if elem == self.low else None
        if ahead is None:
            array, clamped = weights.convert(tensordata.float_values(source), elem, weights.LIMITS[self.cg.target],
                                             self.clamp)
            ahead = array.tobytes(), clamped
        self.result.clamped_values += ahead[1]
        return ahead[0]

    @staticmethod
    def size_change(data: bytes, elem: int, in_place: bool) -> int:
        """Weight bytes added by `data` (`elem` values): in place, less the float32 values it replaces."""
        return len(data) - (4 * (len(data) // model_io.ELEMENT_SIZE[elem]) if in_place else 0)

    def convert_constant(self, s, name, d, new_name, *, in_place: bool, elem: int | None = None) -> None:
        """Write `name` converted to `elem` (default: the target) under `new_name`."""
        elem = elem or self.low
        scope = self.cg.scopes[s]
        if d[0] == "initializer":
            tensor = self.initializers(s)[name]
            data = self.converted_bytes((s, name), weights.value_holder(self.cg.borrowed, s, tensor), elem)
            self.result.weight_bytes_delta += self.size_change(data, elem, in_place)
            if in_place:  # swap the data, keep everything else (doc string, metadata)
                tensor.ClearField("float_data")
                tensor.data_type = elem
                tensor.raw_data = data
                tensor.data_location = TensorProto.DEFAULT  # it may have been left on disk
                del tensor.external_data[:]
                if s == 0:
                    self.replaced.add(name)
                self.result.converted_constants += 1
            else:
                scope.graph.initializer.add(name=new_name, data_type=elem, dims=tensor.dims, raw_data=data)
                self.result.duplicated_constants += 1
            return
        node = self.cg.node(s, d[1])
        tensor = weights.constant_tensor(node)
        data = self.converted_bytes((s, name), tensor, elem)
        self.result.weight_bytes_delta += self.size_change(data, elem, in_place)
        converted = onnx.TensorProto(data_type=elem, dims=tensor.dims, raw_data=data)
        if in_place:
            del node.attribute[:]
            node.attribute.append(helper.make_attribute("value", converted))
            self.result.converted_constants += 1
        else:
            copy = helper.make_node("Constant", [], [new_name], name=self.names.new(f"amp/{new_name}"), value=converted)
            self.after.setdefault((s, d[1]), []).append(copy)
            self.result.duplicated_constants += 1

    # --- types and order ---------------------------------------------------------------------------

    def retarget_attribute_typed_outputs(self) -> None:
        for v, vertex in enumerate(self.cg.vertices):
            if vertex.group.output_only and v in self.low_vertices:
                node = self.cg.node(vertex.scope, vertex.node)
                for attr in node.attribute:
                    if attr.name in ("to", "dtype"):
                        attr.i = self.low

    def retype_io_and_value_info(self) -> None:
        main = self.cg.scopes[0].graph
        if not self.keep_io:
            for value in (*main.input, *main.output):
                if value.type.tensor_type.elem_type == FLOAT:
                    value.type.tensor_type.elem_type = self.low
        for s, scope in enumerate(self.cg.scopes):
            for value in scope.graph.value_info:
                found = self.cg.resolve(s, value.name)
                if found is not None and (found[0], value.name) in self.low_names:
                    value.type.tensor_type.elem_type = self.low

    def initializers(self, s: int) -> dict:
        """Name -> initializer of graph `s`, read once per graph."""
        if s not in self._initializers:
            self._initializers[s] = {t.name: t for t in self.cg.scopes[s].graph.initializer}
        return self._initializers[s]

    def emit_nodes(self) -> None:
        points: dict = {}  # scope -> indices of the nodes that get nodes right after them
        for s, n in self.after:
            points.setdefault(s, []).append(n)
        # Children first: re-adding a parent's nodes copies them, subgraphs included.
        for s in reversed(range(len(self.cg.scopes))):
            scope = self.cg.scopes[s]
            if s not in self.top and s not in points:
                continue
            old = list(scope.graph.node)
            nodes = list(self.top.get(s, []))
            start = 0
            for n in sorted(points.get(s, ())):  # spliced: one step per insertion point, not per node
                nodes.extend(old[start:n + 1])
                nodes.extend(self.after[(s, n)])
                start = n + 1
            nodes.extend(old[start:])
            del scope.graph.node[:]
            scope.graph.node.extend(nodes)


def materialise(model: onnx.ModelProto, cg: ColouringGraph, plan: Plan, *, keep_io_types: bool = True,
                clamp: bool = False) -> Materialised:
    """Apply `plan` to `model` (the proto `cg` was built from) in place."""
    result = _Materialiser(model, cg, plan, keep_io_types, clamp).run()
    if (result.casts or result.duplicated_constants) and not any(
            o.domain in ("", "ai.onnx") for o in model.opset_import):
        # e.g. a model of ai.onnx.ml ops only: our Cast/Constant nodes need the default domain
        model.opset_import.append(helper.make_opsetid("", CAST_OPSET))
    return result
