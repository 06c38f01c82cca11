"""Run a large model in ONNX Runtime as a chain of sessions over consecutive pieces of its graph.

ONNX Runtime's session creation grows faster than the node count (the synthetic stacks,
CPU, float16 rewrite: 1k nodes 0.3 s, 10k nodes 10-37 s; its cast insertion and graph passes
revisit the whole graph), while the checks' runs are cheap. Cut into pieces of at most
SEGMENT_NODES nodes in the graph's (topological) order, each piece its own session, setup is
linear: each piece, with one intra-op thread (a thread pool per session costs more to start than
the checks' few runs gain from it) and ORT's basic optimisations (its extended fusions cost a
fifth more setup, measured), reads the tensors earlier pieces made (kept only until their last reader) and
its own weights. Fusions across a cut are lost; the numbers of every node are otherwise ORT's own.

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

SEGMENT_NODES = 100  # measured (10k-node float16 stack, CPU): 100 < 200 < 400 nodes a piece, in setup time


@dataclass(frozen=True)
class _Output:
    name: str


@dataclass
class _Piece:
    session: object
    inputs: list  # names fed from earlier pieces or the graph inputs
    outputs: list  # names this piece makes that later pieces, or the caller, read


_GRAPH, _GRAPHS = onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS


def _reads(node: onnx.NodeProto) -> list:
    """Inputs of `node`, and every name its subgraphs read (outer-scope values included)."""
    names = list(node.input)
    for attr in node.attribute:
        if attr.type == _GRAPH or attr.type == _GRAPHS:
            for graph in [attr.g] if attr.type == _GRAPH else attr.graphs:
                for inner in graph.node:
                    names.extend(_reads(inner))
    return names


def plan(model: onnx.ModelProto, size: int = SEGMENT_NODES):
    """[(nodes, inputs, weights, outputs)] per piece, or None when the model should run whole."""
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
    wanted = {o.name for o in graph.output}
    fed = graph_inputs - initializers  # an output that is a fed input comes from the feeds
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

    def __init__(self, pieces: list, outputs: list, provider_used: str):
        self.pieces = pieces
        self._outputs = outputs
        self._provider = provider_used
        last: dict = {}
        for index, piece in enumerate(pieces):
            for name in piece.inputs:
                last[name] = index
        self._last_read = last

    def get_outputs(self) -> list:
        return [_Output(n) for n in self._outputs]

    def get_providers(self) -> list:
        return [self._provider]

    def run(self, outputs, feeds: dict) -> list:
        wanted = list(outputs) if outputs is not None else list(self._outputs)
        keep = set(wanted)
        live = dict(feeds)
        for index, piece in enumerate(self.pieces):
            got = piece.session.run(piece.outputs, {n: live[n] for n in piece.inputs})
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
    cache: dict | None = None,
    **session_kwargs,
):
    """(session, ORT provider used) on `device` ("cuda" or "cpu", as `Deployment.device` resolved
    it): ORT's session, or a SegmentedSession for a model over `size` nodes.
    A piece's outputs are declared untyped (ORT infers them); the types it reports type the next
    pieces' inputs, so no type inference over the whole model runs here. `cache` (a dict the
    caller keeps: piece index -> (digest of its bytes, session, provider)) reuses the session of a
    piece whose bytes are those the last call opened at its place, else frees it first (one model's
    sessions held): the accuracy fallback's candidates share their pieces before the first node a
    pin changed."""
    pieces = plan(model, size)
    if pieces is None:
        return open_session(model, device, **session_kwargs)
    by_name = {i.name: i for i in model.graph.initializer}
    typed = {v.name: v for v in model.graph.input}
    asked = session_kwargs.pop("options", None)
    options = asked or session_options(intra_op_num_threads=1, graph_optimization_level=_basic())
    sessions, used = [], None
    with Progress(len(pieces), f"{label}: session setup", progress) as bar:
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
            data = _serialised(piece)
            key = hashlib.sha256(data).digest() if cache is not None and isinstance(data, bytes) else None
            last = cache.pop(index, None) if cache is not None else None  # freed unless reused
            if last is not None and key is not None and last[0] == key:
                session, used = last[1], last[2]
            else:
                last = None
                session, used = open_session(data, device, options=options, **session_kwargs)
            if key is not None:
                cache[index] = (key, session, used)
            for out in session.get_outputs():
                elem = _TENSOR_TYPES.get(out.type)
                if elem is None:  # a sequence or map crossing a cut: run the model whole
                    return open_session(model, device, options=asked, **session_kwargs)
                typed[out.name] = helper.make_tensor_value_info(out.name, elem, None)
            sessions.append(_Piece(session, inputs, outputs))
            bar.step()
    for stale in [i for i in cache or () if i >= len(pieces)]:  # the last call had more pieces
        del cache[stale]
    return SegmentedSession(sessions, [o.name for o in model.graph.output], used), used


def _serialised(piece: onnx.ModelProto):
    """The piece's bytes (no size probe first: a piece is small), or itself when over protobuf's
    2 GB (the session factory then writes its weights as external data)."""
    try:
        return piece.SerializeToString()
    except ValueError:
        return piece


def _basic():
    return ort_module().GraphOptimizationLevel.ORT_ENABLE_BASIC


_TENSOR_TYPES = {
    f"tensor({name.lower()})": value for name, value in onnx.TensorProto.DataType.items() if value
}


def _same(used: str) -> str:
    """Every piece on the provider the first one got (CUDA did not load: CPU for all)."""
    from amp_rewrite.checks.sessions import CUDA

    return "cuda" if used == CUDA else "cpu"
