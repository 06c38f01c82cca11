"""Power-of-two scaling under calibration: a linear region whose measured values pass the target's
limit computes on its inputs times 2^-k, and one Mul by 2^k after it restores its outputs.

Without scaling, `--calibrate` keeps the producer and the readers of every over-limit tensor
float32. But MatMul, Gemm, Conv and ConvTranspose (and the ops around them that commute with a
positive factor: bias Adds, Relu, reshapes, pooling; `op_lists/scaling.yaml`) satisfy
f(2^-k x) = 2^-k f(x), and multiplying by a power of two is exact in binary floating point, so the
region can stay low precision on scaled values and nothing else changes meaning.

A region is a connected set of such ops joined by over-limit tensors, holding at least one compute
op; k is the smallest that brings the largest value measured in it (its outputs and the tensors
entering it) under the calibration limit (the target's largest value / safety). This stage runs
before colouring and only rewrites the float32 graph:
- every float tensor entering the region at a scaled slot is multiplied by 2^-k (a Mul; a constant
  bias gets a scaled copy instead);
- every region output read outside it (another node, a subgraph, a graph output) is written under
  a new name and a Mul by 2^k writes the original name, so the rest of the graph is unchanged;
- the region's nodes are exempt from calibration's deny roots, and the scale Muls on over-limit
  tensors are deny roots (they compute in float32), with the region named in their reason.
Only the main graph is scaled (calibration measures only it). Every pass here is one sweep over
the main graph, and none runs without calibration.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import networkx as nx
import numpy as np
import onnx
from onnx import numpy_helper

from amp_rewrite import ir
from amp_rewrite.analysis.oplists import DEFAULT_DOMAINS, shipped_table
from amp_rewrite.naming import UniqueNames
from amp_rewrite.onnx_facts import FLOAT, all_graphs, names_in
from amp_rewrite.transform.weights import LIMITS


@dataclass(frozen=True)
class Ops:
    compute: frozenset
    product: frozenset
    homogeneous: frozenset


@functools.cache
def scalable_ops() -> Ops:
    """The op table of `op_lists/scaling.yaml`."""
    data = shipped_table("scaling.yaml")
    return Ops(*(frozenset(data[k]) for k in ("compute", "product", "homogeneous")))


@dataclass
class Region:
    name: str  # key of its first node
    nodes: list  # keys (name, or first output) of its nodes in the result, in graph order
    k: int
    max_abs: float  # the largest calibrated |value| in it
    tensor: str  # where that was measured
    entries: list = field(default_factory=list)  # tensors multiplied by 2^-k on the way in
    biases: list = field(default_factory=list)  # constants given a scaled copy
    exits: list = field(default_factory=list)  # tensors multiplied by 2^k on the way out

    def to_dict(self) -> dict:
        return {
            "region": self.name,
            "nodes": self.nodes,
            "k": self.k,
            "max_abs": self.max_abs,
            "tensor": self.tensor,
            "entries": self.entries,
            "biases": self.biases,
            "exits": self.exits,
        }

    def sentence(self) -> str:
        return (
            f"power-of-two scaling: region {self.name!r} computes on values x 2^-{self.k} "
            f"(calibrated max {self.max_abs:.4g} at {self.tensor!r})"
        )


@dataclass
class Scaling:
    """What scaling did: the regions, the node keys calibration must not force float32 (they
    compute on scaled values), and the scale Muls that must be float32 (node key -> reason)."""

    regions: list = field(default_factory=list)
    exempt: frozenset = frozenset()
    forced: dict = field(default_factory=dict)
    threshold: float = 0.0
    inserted: list = field(default_factory=list)  # names of the scale Muls (they shift node indices)
    scaled_tensors: dict = field(
        default_factory=dict
    )  # tensor keeping its name but holding values x 2^-k -> k

    def to_dict(self) -> dict:
        return {
            "threshold": self.threshold,
            "regions": [r.to_dict() for r in self.regions],
            "exempt": sorted(self.exempt),  # calibration's keys (an unnamed node's may have changed)
            "scale_nodes": [{"node": k, "reason": v} for k, v in self.forced.items()],
            "inserted": self.inserted,
            "scaled_tensors": self.scaled_tensors,
        }


def _key(node: onnx.NodeProto) -> str:
    return node.name or (node.output[0] if node.output else "")


def scaled_slots(node, types: dict, constants: set, ops: Ops) -> tuple | None:
    """The input slots of `node` that carry scaled values, or None if it cannot run on them."""
    if node.domain not in DEFAULT_DOMAINS or not node.output:
        return None
    if any(name and types.get(name) != FLOAT for name in node.output[:1]):
        return None
    floats = [i for i, name in enumerate(node.input) if name and types.get(name) == FLOAT]
    if node.op_type in ops.product:
        if len(node.input) < 2 or not {0, 1} <= set(floats):
            return None
        weights = [i for i in (0, 1) if node.input[i] in constants]
        if len(weights) != 1:  # both activations: degree two; both constants: nothing to scale
            return None
        return tuple(i for i in floats if i != weights[0])
    if node.op_type in ops.homogeneous and floats:
        return tuple(floats)
    return None


def find_regions(graph: onnx.GraphProto, culprits: dict, types: dict, constants: set, ops: Ops):
    """(node indices of each region, scaled slots per candidate node): scalable nodes joined by
    over-limit tensors (`culprits`: name -> max |value|), each region holding a compute op.
    Two sweeps over the nodes, one union per joining tensor."""
    joined = nx.utils.UnionFind()
    slots: dict = {}
    producer: dict = {}
    for i, node in enumerate(graph.node):
        if not (
            any(name in culprits for name in node.output) or any(name in culprits for name in node.input)
        ):
            continue
        s = scaled_slots(node, types, constants, ops)
        if s is None:
            continue
        slots[i] = s
        joined[i]  # noqa: B018 - a region of its own until joined
        for name in node.output:
            if name in culprits:
                producer[name] = i
    first_reader: dict = {}  # readers of a culprit made outside any region join through it
    for i, s in slots.items():
        for slot in s:
            name = graph.node[i].input[slot]
            if name in culprits:
                joined.union(producer[name] if name in producer else first_reader.setdefault(name, i), i)
    regions = [sorted(m) for m in joined.to_sets() if any(graph.node[i].op_type in ops.compute for i in m)]
    return sorted(regions), slots


def scale(
    model: onnx.ModelProto, calibration, types: dict, target: str, borrowed: dict | None = None
) -> Scaling:
    """Scale every linear region of `model`'s main graph over the calibrated limit, in place."""
    graph = model.graph
    threshold = LIMITS[target] / calibration.safety
    culprits = {r.name: r.max_abs for r in calibration.culprits(target)}
    result = Scaling(threshold=threshold)
    if not culprits:
        return result
    inputs = {v.name for v in graph.input}
    initializers = {t.name: t for t in graph.initializer if t.name not in inputs}
    constants = set(initializers) | {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    regions, slots = find_regions(graph, culprits, types, constants, scalable_ops())
    if not regions:
        return result
    measured = {name: r.max_abs for name, r in calibration.ranges.items()}
    _Rewriter(model, slots, types, threshold, initializers, borrowed or {}, culprits, measured, result).run(
        regions
    )
    return result


class _Rewriter:
    """Inserts the scale Muls and scaled constants for every region in one rebuild of the node list."""

    def __init__(self, model, slots, types, threshold, initializers, borrowed, culprits, measured, result):
        self.graph, self.slots, self.types, self.threshold = model.graph, slots, types, threshold
        self.initializers, self.borrowed, self.culprits, self.measured = (
            initializers,
            borrowed,
            culprits,
            measured,
        )
        self.result = result
        self.names = UniqueNames(set().union(*(names_in(g) for g in all_graphs(model.graph))))
        self.before: dict = {}  # node index -> nodes to emit before it
        self.after: dict = {}
        self.factors: dict = {}  # exponent -> initializer name
        self.copies: dict = {}  # (constant, k) -> its scaled copy
        self.exempt: set = set()
        self.readers = ir.readers(
            node.input for node in self.graph.node
        )  # main-graph tensor -> reading nodes
        self.outside = {o.name for o in self.graph.output}  # read outside the main graph's nodes
        for g in all_graphs(self.graph)[1:]:
            for node in g.node:
                self.outside.update(node.input)

    def run(self, regions: list) -> None:
        dropped = set()
        for nodes in regions:
            dropped |= self._scale_region(nodes)
        self.result.exempt = frozenset(self.exempt)
        new_nodes = []
        for i, node in enumerate(self.graph.node):
            new_nodes += self.before.get(i, [])
            new_nodes.append(node)
            new_nodes += self.after.get(i, [])
        del self.graph.node[:]
        self.graph.node.extend(new_nodes)
        if dropped:  # constants only the regions read: their scaled copies replace them
            kept = [t for t in self.graph.initializer if t.name not in dropped]
            del self.graph.initializer[:]
            self.graph.initializer.extend(kept)

    def _scale_region(self, nodes: list) -> set:
        graph, members = self.graph, set(nodes)
        keys = [_key(graph.node[i]) for i in nodes]
        entering = {graph.node[i].input[s] for i in nodes for s in self.slots[i]}
        made = {o for i in nodes for o in graph.node[i].output if o}
        entering -= made
        seen = {name: self.measured.get(name, 0.0) for name in (made | entering)}
        tensor = max(seen, key=seen.get)
        k = max(1, math.ceil(math.log2(seen[tensor] / self.threshold)))
        region = Region(keys[0], keys, k, seen[tensor], tensor)
        self.exempt.update(keys)
        # outputs read outside the region: the producer writes a new name, a Mul by 2^k the original
        renamed = {}
        for i in nodes:
            node = graph.node[i]
            for slot, out in enumerate(node.output):
                if (
                    out
                    and self.types.get(out) == FLOAT
                    and (out in self.outside or any(r not in members for r in self.readers.get(out, [])))
                ):
                    renamed[out] = node.output[slot] = self.names.new(f"{out}_scaled")
                    self.after.setdefault(i, []).append(self._mul(renamed[out], k, out, region, up=True))
                    region.exits.append(out)
        for i in nodes:  # what stays inside holds scaled values under its own name (fallback compares them)
            for out in graph.node[i].output:
                if out and out not in renamed and self.types.get(out) == FLOAT:
                    self.result.scaled_tensors[out] = k
        dropped, entries = set(), {}
        for i in nodes:
            node = graph.node[i]
            for slot in self.slots[i]:
                name = node.input[slot]
                if name in renamed:
                    node.input[slot] = renamed[name]
                elif name in made:
                    continue
                elif name in self.initializers:
                    node.input[slot] = self._scaled_constant(name, k, region)
                    if all(r in members for r in self.readers.get(name, [])) and name not in self.outside:
                        dropped.add(name)
                else:
                    if name not in entries:
                        entries[name] = self.names.new(f"{name}_x2^-{k}")
                        self.before.setdefault(i, []).append(
                            self._mul(name, -k, entries[name], region, up=False)
                        )
                        region.entries.append(name)
                    node.input[slot] = entries[name]
        region.nodes = [
            _key(graph.node[i]) for i in nodes
        ]  # an unnamed exit's producer has a new first output
        self.result.regions.append(region)
        return dropped

    def _factor(self, exponent: int) -> str:
        if exponent not in self.factors:
            name = self.names.new(f"amp/scale_2^{exponent}")
            self.graph.initializer.append(numpy_helper.from_array(np.array(2.0**exponent, np.float32), name))
            self.factors[exponent] = name
        return self.factors[exponent]

    def _mul(self, source: str, exponent: int, out: str, region: Region, *, up: bool) -> onnx.NodeProto:
        name = self.names.new(f"amp/scale_{'up' if up else 'down'}/{out}")
        self.result.inserted.append(name)
        watched = out if up else source
        if watched in self.culprits:  # over the limit: this Mul must compute in float32
            role = f"restores {out!r}" if up else f"scales {source!r} down"
            self.result.forced[name] = (
                f"{region.sentence()}; this Mul {role} in float32 "
                f"({watched!r} reaches {self.culprits[watched]:.4g})"
            )
        return onnx.helper.make_node("Mul", [source, self._factor(exponent)], [out], name=name)

    def _scaled_constant(self, name: str, k: int, region: Region) -> str:
        if (name, k) not in self.copies:
            tensor = self.borrowed[name] if name in self.borrowed else self.initializers[name]
            value = numpy_helper.to_array(tensor).astype(np.float32) * np.float32(2.0**-k)
            self.copies[name, k] = self.names.new(f"{name}_x2^-{k}")
            self.graph.initializer.append(numpy_helper.from_array(value, self.copies[name, k]))
        if name not in region.biases:
            region.biases.append(name)
        return self.copies[name, k]


def add_to_report(report, scaling: Scaling) -> None:
    """The report's "scaling" section, and each scaled node's reason says its region and k (when
    the per-node entries are first built: a caller that never reads them never pays)."""
    report.sections["scaling"] = scaling.to_dict()
    region_of = {key: region for region in scaling.regions for key in region.nodes}
    make = report.make_nodes

    def make_nodes():
        entries = make()
        for entry in entries:
            region = region_of.get(entry["name"])
            if region is not None:
                entry["scaled"] = {"region": region.name, "k": region.k, "max_abs": region.max_abs}
                entry["because"] = f"{entry['because']}; {region.sentence()}"
        return entries

    report.make_nodes = make_nodes
