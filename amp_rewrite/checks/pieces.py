"""Run a large model in ONNX Runtime as a chain of sessions over consecutive pieces of its graph.

ONNX Runtime's session creation grows faster than the node count (the synthetic stacks,
CPU, float16 rewrite: 1k nodes 0.3 s, 10k nodes 10-37 s; its cast insertion and graph passes
revisit the whole graph), while the checks' runs are cheap. Cut into pieces of at most
SEGMENT_NODES nodes in the graph's (topological) order, each piece its own session, setup is
linear: each piece, with one intra-op thread (a thread pool per session costs more to start than
the checks' few runs gain from it) and no graph optimisations (ORT's per-node setup is the cost
left: float32 pieces about 7 ms a hundred nodes with them off, 8.5 with the basic ones; float16
pieces about 17 ms either way, measured on the 100k stack; float16 costs more because ORT's CPU
provider has few float16 kernels: it looks each node up, inlines a function body (Softmax) and
inserts Casts to compute in float32), reads the tensors earlier pieces made (kept only until their
last reader) and its own weights. Every node computes as ORT's kernel for
it does; what ORT would fuse runs unfused, and a float16 tensor crossing a cut is stored as the
model says (one session keeps it float32 between ops it computes in float32).

`open_checked(model, device)` returns ORT's session for small models and a `SegmentedSession`
with the same `run` / `get_outputs` / `get_providers` for large ones, with a progress line for
the setup. A graph the cut cannot describe (a sequence or map crossing it, nodes out of order)
runs whole.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import onnx
from onnx import helper

from amp_rewrite.progress import Progress
from amp_rewrite.runtime import open_session, session_options
from amp_rewrite.runtime import ort as ort_module
from amp_rewrite.runtime import run as run_session

SEGMENT_NODES = 100  # measured (10k-node float16 stack, CPU): 100 < 200 < 400 nodes a piece, in setup time


@dataclass(frozen=True)
class _Output:
    name: str
    type: str  # as ORT names it: "tensor(float)"


@dataclass
class _Piece:
    session: object
    inputs: list  # names fed from earlier pieces or the graph inputs
    outputs: list  # names this piece makes that later pieces, or the caller, read


_GRAPH, _GRAPHS = onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS
_WITH_GRAPHS = frozenset({"If", "Loop", "Scan", "SequenceMap"})  # ONNX's ops with graph attributes


def _reads(node: onnx.NodeProto) -> list:
    """Inputs of `node`, and every name its subgraphs read (outer-scope values included). Only
    ONNX's control-flow ops and other domains' ops (a contrib beam search) can hold a subgraph:
    the others' attributes are not walked (protobuf access is the cost of planning)."""
    names = list(node.input)
    if node.op_type not in _WITH_GRAPHS and node.domain in ("", "ai.onnx"):
        return names
    for attr in node.attribute:
        if attr.type == _GRAPH or attr.type == _GRAPHS:
            for graph in [attr.g] if attr.type == _GRAPH else attr.graphs:
                for inner in graph.node:
                    names.extend(_reads(inner))
    return names


def plan(model: onnx.ModelProto, size: int = SEGMENT_NODES, expose=()):
    """[(nodes, inputs, weights, outputs)] per piece, or None when the model should run whole;
    `expose`: main-graph tensors the caller also reads, as if they were graph outputs."""
    graph = model.graph
    nodes = list(graph.node)
    if len(nodes) <= size:
        return None
    starts = range(0, len(nodes), size)
    reads = [_reads(n) for n in nodes]  # each node's names read once: protobuf access is the cost
    writes = [[x for x in n.output if x] for n in nodes]
    initializers = {i.name for i in graph.initializer}
    graph_inputs = {v.name for v in graph.input}
    made_in = {x: i // size for i, made in enumerate(writes) for x in made}
    last_read: dict = {}
    used_by = []
    for index, start in enumerate(starts):
        used = list(dict.fromkeys(x for names in reads[start : start + size] for x in names if x))
        outer = [
            x
            for x in used
            if made_in.get(x, -1) != index and x not in initializers and (x in made_in or x in graph_inputs)
        ]
        if any(made_in.get(x, -1) > index for x in outer):
            return None  # not in topological order
        for x in outer:
            last_read[x] = index
        used_by.append((used, outer))
    fed = graph_inputs - initializers  # an output that is a fed input comes from the feeds
    wanted = {o.name for o in graph.output} | {x for x in expose if x in made_in or x in fed}
    if any(x not in made_in and x not in fed for x in wanted):
        return None  # an output that is a weight: rare, run whole
    out = []
    for index, (start, (used, outer)) in enumerate(zip(starts, used_by)):
        outputs = [
            x
            for made in writes[start : start + size]
            for x in made
            if x in wanted or last_read.get(x, -1) > index
        ]
        out.append((nodes[start : start + size], outer, [x for x in used if x in initializers], outputs))
    return out


class SegmentedSession:
    """ORT sessions over consecutive pieces of one graph, run as one model."""

    def __init__(self, pieces: list, outputs: list, provider_used: str, types: dict):
        self.pieces = pieces
        self._outputs = outputs
        self._types = types
        self._provider = provider_used
        last: dict = {}
        for index, piece in enumerate(pieces):
            for name in piece.inputs:
                last[name] = index
        self._last_read = last

    def get_outputs(self) -> list:
        return [_Output(n, self._types[n]) for n in self._outputs]

    def get_providers(self) -> list:
        return [self._provider]

    def run(self, outputs, feeds: dict) -> list:
        wanted = list(outputs) if outputs is not None else list(self._outputs)
        keep = set(wanted)
        live = dict(feeds)
        for index, piece in enumerate(self.pieces):
            got = run_session(piece.session, piece.outputs, {n: live[n] for n in piece.inputs})
            live.update(zip(piece.outputs, got))
            for name in piece.inputs:
                if self._last_read[name] == index and name not in keep:
                    live.pop(name, None)
        return [live[n] for n in wanted]


def open_checked(
    model: onnx.ModelProto,
    device: str = "cpu",
    *,
    progress=None,
    label: str = "session",
    size: int = SEGMENT_NODES,
    expose=(),
    cache: dict | None = None,
    **session_kwargs,
):
    """(session, ORT provider used) on `device` ("cuda" or "cpu", as `Deployment.device` resolved
    it): ORT's session, or a SegmentedSession for a model over `size` nodes. `expose`: main-graph
    tensors to output after the graph's outputs (no copy of the model for them when in pieces).
    A piece's outputs are declared untyped (ORT infers them); the types it reports type the next
    pieces' inputs, so no type inference over the whole model runs here. `cache` (a dict the
    caller keeps: piece index -> (digest of its bytes, session, provider)) reuses the session of a
    piece whose bytes are those the last call opened at its place, else frees it first (one model's
    sessions held): the accuracy fallback's candidates share their pieces before the first node a
    pin changed."""
    count = len(model.graph.node)
    with Progress(-(-count // size), f"{label}: session setup", progress if count > size else False) as bar:
        pieces = plan(model, size, expose)  # drawn under the bar: a second at 100k nodes
        if pieces is None:
            return open_session(with_outputs(model, expose) if expose else model, device, **session_kwargs)
        return _open_pieces(model, pieces, device, bar, expose, cache, session_kwargs)


def _open_pieces(model: onnx.ModelProto, pieces: list, device: str, bar, expose, cache, session_kwargs):
    by_name = {i.name: i for i in model.graph.initializer}
    typed = {v.name: v for v in model.graph.input}
    asked = session_kwargs.pop("options", None)
    options = asked or session_options(intra_op_num_threads=1, graph_optimization_level=_unoptimised())
    sessions, used, types = [], None, {}
    for index, (nodes, inputs, weights, outputs) in enumerate(pieces):
        graph = helper.make_graph(
            nodes,
            f"{model.graph.name or 'graph'}_{index}",
            [typed[n] for n in inputs],
            [helper.make_value_info(n, onnx.TypeProto()) for n in outputs],
            [by_name[n] for n in weights],
        )
        piece = helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
        piece.functions.extend(model.functions)
        session, used = _reused_or_opened(_serialised(piece), index, cache, device, options, session_kwargs)
        for out in session.get_outputs():
            elem = _TENSOR_TYPES.get(out.type)
            if elem is None:  # a sequence or map crossing a cut: run the model whole
                whole = with_outputs(model, expose) if expose else model
                return open_session(whole, device, options=asked, **session_kwargs)
            typed[out.name] = helper.make_tensor_value_info(out.name, elem, None)
            types[out.name] = out.type
        sessions.append(_Piece(session, inputs, outputs))
        bar.step()
    for stale in [i for i in cache or () if i >= len(pieces)]:  # the last call had more pieces
        del cache[stale]
    for value in model.graph.input:
        elem = value.type.tensor_type.elem_type if value.type.HasField("tensor_type") else 0
        types.setdefault(value.name, _TYPE_NAMES.get(elem, ""))
    outputs = list(dict.fromkeys([o.name for o in model.graph.output] + [x for x in expose if x in types]))
    return SegmentedSession(sessions, outputs, used, types), used


def _reused_or_opened(data, index: int, cache, device: str, options, session_kwargs):
    """The session of the piece at `index`: the cached one when `data` are the bytes it was opened
    from, else a new one (the cached one is dropped first, so one model's sessions are held)."""
    key = hashlib.sha256(data).digest() if cache is not None and isinstance(data, bytes) else None
    last = cache.pop(index, None) if cache is not None else None
    if last is not None and key is not None and last[0] == key:
        session, used = last[1], last[2]
    else:
        last = None
        session, used = open_session(data, device, options=options, **session_kwargs)
    if key is not None:
        cache[index] = (key, session, used)
    return session, used


def with_outputs(model: onnx.ModelProto, names) -> onnx.ModelProto:
    """A copy of `model` whose graph also outputs the main-graph tensors `names`, declared untyped:
    ONNX Runtime infers their types (no type inference over the whole model here)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    present = {o.name for o in copy.graph.output}
    made = {o for n in copy.graph.node for o in n.output} | {v.name for v in copy.graph.input}
    for name in names:
        if name not in present and name in made:
            copy.graph.output.append(helper.make_value_info(name, onnx.TypeProto()))
            present.add(name)
    return copy


def _serialised(piece: onnx.ModelProto):
    """The piece's bytes (no size probe first: a piece is small), or itself when over protobuf's
    2 GB (the session factory then writes its weights as external data)."""
    try:
        return piece.SerializeToString()
    except ValueError:
        return piece


def _unoptimised():
    return ort_module().GraphOptimizationLevel.ORT_DISABLE_ALL


_TENSOR_TYPES = {
    f"tensor({name.lower()})": value for name, value in onnx.TensorProto.DataType.items() if value
}
_TYPE_NAMES = {value: name for name, value in _TENSOR_TYPES.items()}
