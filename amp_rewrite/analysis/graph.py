"""The colouring graph: vertices are type groups of float32 tensors, edges producer -> reader.

A vertex is one type group (see schemas.py) of one node whose tensors are float32; an edge joins
the group that produces a tensor to each group that reads it, across subgraph boundaries too
(a tensor captured from an outer scope links the outer producer to the inner reader). Graph
inputs, initializers and Constant nodes are not vertices: they are sources whose type the
materialiser chooses freely. Everything is built in one pass over the nodes; lookups are dicts.
The edges are per-vertex lists of successors and predecessors (a networkx DiGraph of the same
edges is built only when asked for, `ColouringGraph.graph`: its per-edge dicts cost 0.3 s at
100k nodes, and no pass of the rewrite needs them).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import networkx as nx
import onnx

from amp_rewrite import onnx_facts
from amp_rewrite.analysis import loops, schemas
from amp_rewrite.analysis.oplists import OpLists
from amp_rewrite.analysis.optemplates import (
    describe_op,
    first_type,
    group_names,
    kernel_of,
    make_template,
    sequence_tensors,
    tie_containers_of,
)
from amp_rewrite.ir import Found, Scope, read_scopes, record_uses, resolve
from amp_rewrite.onnx_facts import FLOAT, LOW_ELEM


@dataclass(slots=True)
class Vertex:
    scope: int
    node: int
    name: str  # the node's name and op type, kept for reports after nodes move
    op_type: str
    group: schemas.TypeGroup
    op_list: str | None  # allow / deny / infer / clear, or None when in no list
    list_reason: str
    blocked: str | None  # why it may never be low precision, or None
    forced: str | None = None  # a deny root by measurement (calibration), with the deciding value
    relaxed: str | None = None  # a deny op relaxed to infer (pointwise exhaustion or calibration): why


@dataclass
class ColouringGraph:
    target: str
    scopes: list[Scope]
    vertices: list[Vertex]
    succ: list  # per vertex: the vertices reading what it writes, in first-use order (a reader may repeat)
    pred: list  # per vertex: the vertices it reads from, likewise
    reads: list  # [scope][node] -> the vertex of each input slot (or None); None for a node without vertices
    writes: list  # [scope][node] -> the vertex of each output slot, likewise
    uses: dict  # (def scope, name) -> [Use]; graph outputs use node -1
    types: dict  # tensor name -> element type
    shapes: dict  # tensor name -> TensorShapeProto when known
    notes: list  # (node label, text) for ops that could not be classified
    borrowed: dict = field(
        default_factory=dict
    )  # main-graph initializer -> the caller's tensor (io.working_copy)
    has_constant_nodes: bool = (
        False  # some graph holds a Constant node (else the constant scan skips the nodes)
    )
    unsorted: bool = False  # some node reads a tensor made later in its graph: sort on output
    constant_nodes: set = field(default_factory=set)  # (scope, node) of Constant nodes: sources, not vertices
    tied_tensors: list = field(
        default_factory=list
    )  # (scope, name) of tensors no Cast may split: sequences (ties.py)
    carried_in: dict = field(
        default_factory=dict
    )  # (body scope, body input name) -> its Loop/Scan's carried vertex
    carried_out: dict = field(default_factory=dict)  # (body scope, body output slot) -> its carried vertex
    siblings: set = field(default_factory=set)  # vertices of nodes with more than one (paint: one region)
    # (def scope, name) -> largest |value| of a float32 constant whose values are all finite: what
    # the constant scan (transform.weights) read, so a big table's reach is known without a reread
    constant_reach: dict = field(default_factory=dict)

    _graph: nx.DiGraph | None = field(default=None, repr=False)
    elements: dict | None = field(default=None, repr=False)  # tensor -> elements (placement.sizes)
    vertex_elements: list | None = field(default=None, repr=False)  # per vertex: its tensors' elements

    @property
    def graph(self) -> nx.DiGraph:
        """The edges as a networkx DiGraph (vertices 0..n-1), built on first use."""
        if self._graph is None:
            self._graph = nx.DiGraph()
            self._graph.add_nodes_from(range(len(self.vertices)))
            self._graph.add_edges_from((a, b) for a, readers in enumerate(self.succ) for b in readers)
        return self._graph

    def node(self, scope: int, index: int) -> onnx.NodeProto:
        return self.scopes[scope].graph.node[index]

    def input_vertex(self, scope: int, node: int, slot: int) -> int | None:
        """The vertex reading input `slot` of a node, or None (graph outputs are node -1)."""
        row = self.reads[scope][node] if node >= 0 else None
        return row[slot] if row else None

    def resolve(self, scope: int, name: str) -> Found | None:
        """Where a tensor visible from `scope` is defined, or None if undefined."""
        return resolve(self.scopes, scope, name)


def _label(node: onnx.NodeProto, s: int, n: int) -> str:
    return f"{node.op_type} '{node.name}'" if node.name else f"{node.op_type} (graph {s} #{n})"


def _keep_fp32_matcher(patterns):
    compiled = [re.compile(p) for p in patterns]
    exact = set(patterns)
    return lambda name: name in exact or any(p.fullmatch(name) for p in compiled)


def build(
    model: onnx.ModelProto,
    op_lists: OpLists,
    *,
    types: dict,
    shapes: dict | None = None,
    keep_fp32_nodes=(),
    force_fp32=None,
    borrowed=None,
    scopes=None,
    kernel_check=None,
    relax=None,
) -> ColouringGraph:
    """Build the colouring graph of `model` for `op_lists.target`.

    `force_fp32` maps node names (the first output's name for unnamed nodes) to a reason; those
    nodes become deny roots, so float32 spreads from them as from a deny op. `borrowed` maps
    main-graph initializers held without their bytes to the tensors that hold them. `scopes`:
    `read_scopes(model.graph)` when the caller has it already. `kernel_check`
    (`kernels.check_for`): groups the deployment provider has no target-type kernel for are blocked.
    `relax` maps node keys of deny ops calibration measured far inside the range to a reason: they
    are infer ops instead (checks.calibrate.CalibrationResult.relaxed).
    """
    force_fp32 = dict(force_fp32 or {})
    target = op_lists.target
    opsets = onnx_facts.opsets(model)
    scopes = scopes if scopes is not None else read_scopes(model.graph)
    cg = ColouringGraph(
        target,
        scopes,
        [],
        [],
        [],
        [[None] * len(scope.io) for scope in scopes],
        [[None] * len(scope.io) for scope in scopes],
        {},
        types,
        shapes or {},
        [],
        dict(borrowed or {}),
    )
    cg.uses, cg.unsorted = record_uses(scopes)
    keep_fp32_nodes = list(keep_fp32_nodes)
    keep = _keep_fp32_matcher(keep_fp32_nodes)
    owners = {scope.owner for scope in scopes[1:]}
    body_of = {
        scope.owner: i for i, scope in enumerate(scopes) if scope.owner is not None
    }  # Loop/Scan: one body
    local_functions = {(f.domain, f.name) for f in model.functions}

    op_info: dict = {}  # (domain, op type) -> (signature, list entry, why it is skipped)
    templates: dict = {}  # (domain, op type, #inputs, #outputs) -> its groups with their fixed reasons
    vertices = cg.vertices
    maybe = []  # groups that hold a sequence or a tensor, as the value is: (sig, group, scope, inputs, outputs)
    refusals: dict = {}  # schemas.rejects' answers for nodes without attributes (_rejects)
    # each vertex's elements, from the names at hand here (cost placement's estimate would walk them again)
    elements = cg.elements = {n: math.prod(t.dims[:]) for sc in scopes for n, t in sc.initializers.items()}
    elements_get, shapes_get, sizes = elements.get, cg.shapes.get, []
    for s, scope in enumerate(scopes):
        reads, writes, nodes = cg.reads[s], cg.writes[s], scope.graph.node
        for n, key in enumerate(
            zip(scope.domains, scope.op_types)
        ):  # as read_scopes read them: one read a node
            info = op_info.get(key)
            if info is None:
                info = op_info[key] = describe_op(*key, opsets, local_functions, op_lists)
            sig, entry, skip = info
            if skip is not None:
                if skip:  # Constant nodes are skipped silently: they are sources, not vertices
                    cg.notes.append((_label(nodes[n], s, n), skip))
                else:
                    cg.constant_nodes.add((s, n))
                continue
            inputs, outputs = scope.io[n]
            name = scope.names[n]
            kept = keep(name) if keep_fp32_nodes and name else False
            holds_body = bool(owners) and (s, n) in owners
            in_types = None
            forced = force_fp32.get(name or (outputs[0] if outputs else "")) if force_fp32 else None
            shape_key = (key, len(inputs), len(outputs))
            template = templates.get(shape_key)
            if template is None:
                groups = schemas.type_groups(sig, len(inputs), len(outputs))
                template = templates[shape_key] = make_template(
                    sig, entry, groups, target, kernel_of(kernel_check, sig, opsets, cg.notes)
                )
            if sig.probe and entry is not None and not holds_body:
                in_types = [types.get(x) if x else 0 for x in inputs]
                groups = tuple(group for group, _, _ in template)
                float_params = {
                    g.type_param
                    for g in groups
                    if first_type(group_names(inputs, outputs, g), types) == FLOAT
                }
                tied = schemas.tie(sig, nodes[n], opsets, in_types, groups, float_params, LOW_ELEM[target])
                if tied is not groups:
                    template = make_template(
                        sig, entry, tied, target, kernel_of(kernel_check, sig, opsets, cg.notes)
                    )
            if sig.containers and entry is not None and not holds_body:
                template = tie_containers_of(
                    sig,
                    entry,
                    template,
                    inputs,
                    outputs,
                    types,
                    target,
                    kernel_of(kernel_check, sig, opsets, cg.notes),
                )
            carried = ()
            if holds_body and entry is not None and sig.domain == "" and key[1] in loops.CARRYING:
                carried = loops.carried_slots(
                    key[1], sig, nodes[n], inputs, outputs, scopes[body_of[(s, n)]].graph
                )
                if carried:
                    template = loops.carrying_template(
                        sig, template, carried, target, kernel_of(kernel_check, sig, opsets, cg.notes)
                    )
            op_list = (
                "deny" if forced is not None else (entry.list if entry else None)
            )  # forced: measured unsafe
            list_reason = entry.reason if entry else ""
            relaxed = None
            if relax and op_list == "deny" and forced is None:
                relaxed = relax.get(name or (outputs[0] if outputs else ""))
                if relaxed is not None:  # now an infer op: the provider must have its kernel
                    op_list, list_reason = "infer", relaxed
                    template = make_template(
                        sig,
                        entry,
                        tuple(group for group, _, _ in template),
                        target,
                        kernel_of(kernel_check, sig, opsets, cg.notes),
                        check_deny=True,
                    )
            for group, fixed, late in template:
                names = []  # group_names and first_type, inlined: this runs for every group of every node
                for i in group.inputs:
                    if inputs[i]:
                        names.append(inputs[i])
                for i in group.outputs:
                    if outputs[i]:
                        names.append(outputs[i])
                for x in names:
                    if x in types:
                        break
                else:
                    continue
                if types[x] != FLOAT:
                    continue
                for x in names:  # the schema ties them: fill types inference could not give
                    if x not in types:
                        types[x] = FLOAT
                blocked = fixed
                if blocked is None:
                    if kept:
                        blocked = "kept float32 by the user (keep_fp32_nodes)"
                    elif holds_body and not group.type_param.startswith("V["):
                        blocked = (
                            f"{key[1]} boundary keeps the declared types of its bodies (inside is coloured)"
                        )
                    else:
                        blocked = late
                if blocked is None and sig.probe:
                    if in_types is None:
                        in_types = [types.get(x) if x else 0 for x in inputs]
                    refused = _rejects(refusals, sig, nodes[n], opsets, in_types, group, LOW_ELEM[target])
                    if refused:
                        blocked = f"schema {key[1]}-{sig.since_version} inference refuses {target}: {refused}"
                if blocked is None and kernel_check is not None and op_list != "deny":
                    if f"{sig.domain}:{key[1]}" in kernel_check.by_attributes:  # its attributes matter
                        blocked = kernel_check.refuses(
                            sig.domain, key[1], opsets[sig.domain], nodes[n], group.type_param
                        )
                v = len(vertices)
                vertices.append(
                    Vertex(s, n, name, key[1], group, op_list, list_reason, blocked, forced, relaxed)
                )
                total = 0  # placement.elements, inlined: known dims, 1 for a symbolic or unknown one
                for x in names:
                    size = elements_get(x)
                    if size is None:
                        shape = shapes_get(x)  # often unknown: 1, without a generator
                        size = elements[x] = (
                            1
                            if shape is None
                            else math.prod(d.dim_value if d.dim_value > 0 else 1 for d in shape.dim)
                        )
                    total += size
                sizes.append(total)
                if sig.maybe_containers:
                    if sig.is_container(group.type_param):
                        cg.tied_tensors.extend(sequence_tensors(sig, group, s, inputs, outputs))
                    else:  # Identity's V: a sequence or a tensor, as its values are
                        maybe.append((sig, group, s, inputs, outputs))
                if reads[n] is None:
                    reads[n], writes[n] = [None] * len(inputs), [None] * len(outputs)
                    first = v
                else:  # the node's vertices are made one after another
                    cg.siblings.update(range(first, v + 1))
                for i in group.inputs:
                    reads[n][i] = v
                for i in group.outputs:
                    writes[n][i] = v
                if carried and group.type_param.startswith("V["):
                    loops.bind_carried(cg, body_of[(s, n)], carried[int(group.type_param[2:-1])], v)
    cg.has_constant_nodes = any(op_type == "Constant" for _, op_type in op_info)
    if maybe:  # a value a sequence-only slot reads or writes is a sequence wherever it is read
        known = {name for _, name in cg.tied_tensors}
        for sig, group, s, inputs, outputs in maybe:
            cg.tied_tensors.extend(
                t
                for t in sequence_tensors(sig, group, s, inputs, outputs, sig.maybe_containers)
                if t[1] in known
            )
    cg.vertex_elements = sizes
    _add_edges(cg)
    return cg


def _rejects(memo: dict, sig, node, opsets: dict, in_types: list, group, low: int) -> str | None:
    """`schemas.rejects`, asked once per kind of node: what it probes is the op, its attributes
    but subgraphs, the input types and which outputs are named, so their answer is that kind's (a
    LayerNormalization's at every layer: it builds and serialises a stripped node per call, 8.8k
    calls at 100k nodes). A node holding a subgraph is asked each time (its bytes are the body's)."""
    attributes = []
    for a in node.attribute:
        if a.type in _GRAPH_ATTRIBUTES:
            return schemas.rejects(sig, node, opsets, in_types, group, low)
        attributes.append(a.SerializeToString())
    key = (sig.domain, node.op_type, node.domain, tuple(in_types), group, tuple(map(bool, node.output)))
    key += tuple(attributes)
    if key not in memo:
        memo[key] = schemas.rejects(sig, node, opsets, in_types, group, low)
    return memo[key]


_GRAPH_ATTRIBUTES = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


def _add_edges(cg: ColouringGraph) -> None:
    """Producer group -> reader group, for every tensor made by a node, in any graph: appended to
    both ends' lists. A pair joined by two uses (Mul(x, x), or two tensors) is listed twice: the
    passes only ask what is next to a vertex, so a repeat costs less than a check per edge."""
    succ = cg.succ = [[] for _ in cg.vertices]
    pred = cg.pred = [[] for _ in cg.vertices]
    reads, writes = cg.reads, cg.writes
    defs = [scope.defs for scope in cg.scopes]  # looked up once, not per tensor
    for (s, name), uses in cg.uses.items():
        kind, n, slot = defs[s][name]
        if kind != "node":
            continue
        row = writes[s][n]
        producer = row[slot] if row else None
        if producer is None:
            continue
        readers = succ[producer]
        for use_scope, reader_node, use_slot in uses:  # cg.input_vertex, inlined: runs once per use
            row = reads[use_scope][reader_node] if reader_node >= 0 else None
            if row:
                reader = row[use_slot]
                if reader is not None:
                    readers.append(reader)
                    pred[reader].append(producer)
    for (body, name), v in cg.carried_in.items():  # a carried value -> what the body reads of it
        for use in cg.uses.get((body, name), ()):
            reader = cg.input_vertex(*use) if use.node >= 0 else cg.carried_out.get((use.scope, use.slot))
            if reader is not None:
                succ[v].append(reader)
                pred[reader].append(v)
    for (body, slot), v in cg.carried_out.items():  # what the body hands on -> the carried value
        found = cg.resolve(body, cg.scopes[body].graph.output[slot].name)
        if found is not None and found.definition.kind == "node":
            row = writes[found.scope][found.definition.node]
            producer = row[found.definition.slot] if row else None
            if producer is not None:
                succ[producer].append(v)
                pred[v].append(producer)
