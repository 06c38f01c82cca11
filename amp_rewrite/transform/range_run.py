"""The float32 range run that gives cost placement's extra low ops their measured evidence
(`analysis.evidence.settle`): the largest values of chosen tensors on one synthesised sample, run on
the CPU, and the work budget above which nothing is run. Here, not in `analysis`, because it runs
ONNX Runtime (`runtime`), which analysis may not import."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from amp_rewrite import ir
from amp_rewrite.analysis import evidence
from amp_rewrite.io.samples import synthesise
from amp_rewrite.onnx_facts import reads
from amp_rewrite.runtime import open_session, session_options
from amp_rewrite.runtime import ort as ort_module
from amp_rewrite.transform import numpy_run

# Above these, cost placement's extra low ops are not measured on synthesised inputs (evidence.settle)
RANGE_CHECK_NODES, RANGE_CHECK_BYTES = (
    20_000,
    256 << 20,
)  # a run costs about its bytes: GPT-2 (474 MiB) 20 s loaded


def over_budget(scopes, model_bytes: int, lazy: bool) -> str | None:
    """Why no range run is made (a lazily loaded model, or one over the budget), or None."""
    nodes = sum(len(scope.io) for scope in scopes)
    if lazy or nodes > RANGE_CHECK_NODES or model_bytes > RANGE_CHECK_BYTES:
        return (
            f"over the work budget of {RANGE_CHECK_NODES} nodes and {RANGE_CHECK_BYTES >> 20} MiB "
            f"({nodes} nodes, {model_bytes >> 20} MiB)"
        )
    return None


def largest_values(model, names, types: dict, *, dims=None) -> dict | None:
    """{name: largest |value|} of main-graph tensors `names` in one float32 run (numpy where it
    runs every op, `numpy_run`, else ONNX Runtime on the CPU) on one
    synthesised sample of the part of `model` that computes them (their cone: the run costs what
    it needs, often the embeddings only): inf where a value is not finite, a mask sentinel
    (float32's largest) left out as the constant scan reads it; absent where the tensor is not the
    main graph's (a body's). None when the run fails."""
    producers = ir.producer_nodes(model.graph.node)
    inputs = {v.name for v in model.graph.input}
    given = [x for x in names if x in inputs and x not in producers]  # measured on the samples themselves
    wanted = [x for x in names if x in producers and types.get(x) == onnx.TensorProto.FLOAT]
    cone, seen, stack = set(), set(given), list(wanted)
    while stack:  # every tensor and node the wanted ones depend on: one visit each
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        node = producers.get(x)
        if node is not None and id(node) not in cone:
            cone.add(id(node))
            stack.extend(reads(node))
    nodes = [node for node in model.graph.node if id(node) in cone]
    initializers = [t for t in model.graph.initializer if t.name in seen]
    inputs = [v for v in model.graph.input if v.name in seen]
    try:
        reading = _reading(nodes, inputs)
        named = {x for node in reading for x in node.input} | {v.name for v in inputs}
        sampled = _part(model, reading, inputs, [t for t in initializers if t.name in named], [])
        feeds = synthesise(sampled, dims=dims)[0]
        arrays = None if model.functions else []
        if wanted and arrays is not None:
            arrays = numpy_run.run_nodes(nodes, initializers, numpy_run.opset_of(model), feeds, wanted)
        if arrays is None:  # an op numpy_run does not run: ONNX Runtime's session
            outputs = [helper.make_tensor_value_info(x, onnx.TensorProto.FLOAT, None) for x in wanted]
            quiet = session_options(log_severity_level=4)  # a failed run is said in the report, not by ORT
            runs = ort_module().RunOptions()
            runs.log_severity_level = 4
            part = _part(model, nodes, inputs, initializers, outputs)
            arrays = open_session(part, "cpu", options=quiet)[0].run(wanted, feeds, runs)
    except Exception:  # noqa: BLE001 - any failure: no evidence, said in the report
        return None
    found = {}
    for name, array in zip(wanted + given, [*arrays, *(feeds[x] for x in given)]):
        a = np.abs(np.asarray(array, dtype=np.float32)).reshape(-1)
        if not np.isfinite(a).all():
            found[name] = float("inf")
            continue
        a = a[a != evidence.SENTINEL]
        found[name] = float(a.max()) if a.size else 0.0
    return found


def _reading(nodes: list, inputs: list) -> list:
    """The nodes that read a graph input: all that synthesising the samples looks at (io.samples.needs)."""
    names = {v.name for v in inputs}
    return [node for node in nodes if any(x in names for x in node.input)]


def _part(model, nodes: list, inputs: list, initializers: list, outputs: list) -> onnx.ModelProto:
    """The part of `model` these nodes make, each proto copied once (make_graph and make_model
    would copy the graph twice: 90 ms at 9k nodes)."""
    part = onnx.ModelProto(ir_version=model.ir_version)
    part.opset_import.extend(model.opset_import)
    part.functions.extend(model.functions)
    graph = part.graph
    graph.name = "range_check"
    graph.node.extend(nodes)
    graph.input.extend(inputs)
    graph.output.extend(outputs)
    graph.initializer.extend(initializers)
    return part
