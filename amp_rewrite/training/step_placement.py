"""Where ONNX Runtime's CUDA provider would run each node of a step graph, read without a GPU.

A CUDA step is fast only when every node runs on the device and nothing waits for the host. Three
things break that, and each is read here from data, not from a run:
- a node whose op has no CUDA kernel for its types at the step's opset
  (`op_lists/kernels_cuda.json`): ONNX Runtime places it on the CPU provider;
- shape arithmetic: the CUDA provider's `GetCpuPreferredNodes` moves to the CPU the nodes that
  compute a tensor a CUDA kernel reads from host memory (Reshape's shape, Slice's starts...),
  when all their inputs are host tensors already (Shape's output, initializers, graph inputs);
- a host sync: a CPU node reading a device tensor, a data-dependent output shape (NonZero), a
  control-flow condition (If). Host-memory slots: `op_lists/cuda_host_memory.json`.
The update nodes (optimizer, finite check, loss scale: `opt/`, `scale/`, an If's branches too, and
the Casts only they read) are counted by what they cost: the kernels over the weights' elements
(O(1) in the number of weights when the update runs over flat buffers, flat_update.py), apart
from the nodes on the scalars and the Reshapes (aliases, no kernel); `update_memory` estimates
the most memory the update's own tensors hold at once.
Used by `tools/step_report.py` and by `step_graph.apply_precision` on CUDA.
"""

from __future__ import annotations

import dataclasses
import math

import onnx
from onnx import TensorProto

from amp_rewrite.analysis import kernels as analysis_kernels
from amp_rewrite.analysis.elemtypes import tensor_types
from amp_rewrite.analysis.oplists import shipped_table
from amp_rewrite.onnx_facts import all_graphs, default_opset

UPDATE_PREFIXES = ("opt/", "scale/")  # the step's optimizer update, finite check and loss scale
ALIASES = ("Reshape",)  # ONNX Runtime's kernel aliases its input: no copy, no launch
_LOW = (TensorProto.FLOAT16, TensorProto.BFLOAT16)
FOLDED = ("Constant",)
_BYTES = {
    TensorProto.FLOAT16: 2,
    TensorProto.BFLOAT16: 2,
    TensorProto.BOOL: 1,
    TensorProto.INT64: 8,
}  # ONNX Runtime turns them into initializers when it loads the graph


@dataclasses.dataclass(frozen=True)
class Placement:
    """Per-node findings ({node name: reason}) and the node count, over every (sub)graph."""

    nodes: int
    no_kernel: dict[str, str]
    on_cpu: dict[str, str]
    host_syncs: dict[str, str]
    update_nodes: int  # update/finite-check nodes over the weights' elements: their kernels
    update_scalars: int = 0  # update/finite-check nodes on the scalars (the rate, the scale's state)
    update_aliases: int = 0  # their Reshapes (flat buffers <-> tensors): no kernel

    def summary(self) -> str:
        return (
            f"step-report: {self.nodes} nodes, {len(self.no_kernel)} without a CUDA kernel, "
            f"{len(self.host_syncs)} host syncs, {self.update_nodes} update nodes"
        )


def place(model: onnx.ModelProto) -> Placement:
    """The CUDA provider's placement of `model` as far as its kernel table and host-memory slots tell."""
    types, shapes = tensor_types(model, shape_inference=True)
    opset = default_opset(model) or 13
    graphs = all_graphs(model.graph)
    nodes = [node for graph in graphs for node in graph.node]
    no_kernel = {}
    for node in (n for n in nodes if n.op_type not in FOLDED):
        reason = missing_kernel(node, opset, types)
        if reason:
            no_kernel[_name(node)] = reason
    on_cpu = dict(no_kernel)
    on_cpu.update(_shape_logic(model.graph, types, set(no_kernel)))
    syncs = _host_syncs(nodes, on_cpu, _host_tensors(model.graph, nodes, on_cpu))
    update = [node for node in model.graph.node if _name(node).startswith(UPDATE_PREFIXES)]
    update += _casts_into(model.graph, update)
    update = [inner for node in update for inner in _with_branches(node)]  # an If's: the update it gates
    aliases = [node for node in update if node.op_type in ALIASES]
    sizes = _sizes(model.graph, shapes)
    on_scalars = _on_scalars(update, sizes)
    scalars = [node for node in update if node.op_type not in ALIASES and id(node) in on_scalars]
    over_weights = len(update) - len(aliases) - len(scalars)
    return Placement(len(nodes), no_kernel, on_cpu, syncs, over_weights, len(scalars), len(aliases))


def update_memory(model: onnx.ModelProto, weights: list[str]) -> tuple[int, int]:
    """(peak, weights): the most bytes the update's own tensors over the weights (its Concats,
    chain, Where, Splits) hold at once, and the float32 weights' bytes. An estimate: the nodes run
    in graph order, each tensor freed after its last reader; a Reshape shares its input's buffer,
    and one that writes a state output copies into it (the state's own memory, not counted)."""
    types, shapes = tensor_types(model, shape_inference=True)
    sizes = _sizes(model.graph, shapes)
    update = [node for node in model.graph.node if _name(node).startswith(UPDATE_PREFIXES)]
    update += _casts_into(model.graph, update)
    chosen = {id(node) for node in update}
    outputs = {o.name for o in model.graph.output}
    base, held = {}, {}  # tensor -> the buffer it lives in; buffer -> its bytes
    for node in (n for n in model.graph.node if id(n) in chosen):
        for name in (o for o in node.output if o and o not in outputs and sizes.get(o, 1) > 1):
            if node.op_type in ALIASES:
                if node.input[0] in base:
                    base[name] = base[node.input[0]]
                continue
            base[name] = name
            held[name] = sizes[name] * _BYTES.get(types.get(name), 4)
    born, last = {}, {}
    for k, node in enumerate(model.graph.node):
        born.update((o, k) for o in node.output if o in held)
        last.update((base[n], k) for n in node.input if n in base)
    spans = [(born[b], last.get(b, born[b]), size) for b, size in held.items()]
    peak = max((sum(s for b, e, s in spans if b <= k <= e) for k, _, _ in spans), default=0)
    inputs = {i.name: i for i in model.graph.input}
    dims = [[d.dim_value for d in inputs[w].type.tensor_type.shape.dim] for w in weights]
    return peak, 4 * sum(math.prod(shape) for shape in dims)


def low_without_kernel(model: onnx.ModelProto) -> dict[str, str]:
    """{node: reason} for the float16/bfloat16 nodes the CUDA kernel table has no kernel for: the
    step builder keeps them float32 (a named fallback), so no low node leaves the device."""
    types, _ = tensor_types(model, shape_inference=True)
    opset = default_opset(model) or 13
    found = {}
    for node in (n for graph in all_graphs(model.graph) for n in graph.node if n.op_type not in FOLDED):
        if any(types.get(n) in _LOW for n in (*node.input, *node.output) if n):
            reason = missing_kernel(node, opset, types)
            if reason:
                found[_name(node)] = f"kept float32 on CUDA: {reason}"
    return found


def missing_kernel(node: onnx.NodeProto, opset: int, types: dict) -> str | None:
    """Why the CUDA kernel table has no kernel for `node` at `opset` with its element types, or None."""
    domain = "" if node.domain == "ai.onnx" else node.domain
    rows = analysis_kernels.table("cuda").get(f"{domain}:{node.op_type}", ())
    row = next((r for r in rows if r[0] <= opset and (r[1] is None or opset <= r[1])), None)
    if row is None:
        return f"no CUDA kernel for {node.op_type} at opset {opset}"
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
    except onnx.defs.SchemaError:
        return None
    for formals, names in ((schema.inputs, node.input), (schema.outputs, node.output)):
        for k, name in enumerate(names):
            elem = types.get(name, 0) if name else 0
            if not elem or not formals:
                continue
            param = formals[min(k, len(formals) - 1)].type_str
            allowed = row[2].get(param)
            type_name = TensorProto.DataType.Name(elem).lower()
            if allowed is not None and type_name not in allowed:
                return f"no {type_name} CUDA kernel for {node.op_type} ({param}) at opset {opset}"
    return None


def _host_memory() -> dict:
    return shipped_table("cuda_host_memory.json")


def _shape_logic(graph: onnx.GraphProto, types: dict, forced: set) -> dict[str, str]:
    """GetCpuPreferredNodes over the top graph: the producers (transitively) of tensors read from
    host memory, in topological order, go to CPU when every input is a host tensor, an initializer
    or a graph input, none float16/bfloat16, and none is a host-memory slot of the node itself."""
    table = _host_memory()
    cpu_in, cpu_out = table["cpu_inputs"], table["cpu_outputs"]
    producer = {out: node for node in graph.node for out in node.output if out}
    candidates: set[int] = set()
    stack = [
        producer[node.input[k]]
        for node in graph.node
        for k in cpu_in.get(node.op_type, ())
        if k < len(node.input) and node.input[k] in producer
    ]
    while stack:
        node = stack.pop()
        if id(node) in candidates:
            continue
        candidates.add(id(node))
        stack.extend(producer[n] for n in node.input if n in producer)
    free = {i.name for i in graph.initializer} | {i.name for i in graph.input} | _constants(graph)
    host = {
        out for node in graph.node for k in cpu_out.get(node.op_type, ()) for out in node.output[k : k + 1]
    }
    placed = {}
    for node in graph.node:  # step graphs are stored in topological order
        if id(node) not in candidates or _name(node) in forced or node.op_type in cpu_out:
            continue
        own = set(cpu_in.get(node.op_type, ()))
        ok = all(
            (n in host or n in free) and types.get(n) not in _LOW and k not in own
            for k, n in enumerate(node.input)
            if n
        )
        if ok and any(n in host for n in node.input):
            placed[_name(node)] = (
                f"{node.op_type} computes a shape from host tensors: ONNX Runtime runs it on CPU"
            )
            host.update(o for o in node.output if o)
    return placed


def _host_tensors(graph: onnx.GraphProto, nodes: list, on_cpu: dict) -> set[str]:
    """Tensors living in host memory: CPU nodes' outputs and the host-memory outputs of CUDA kernels."""
    cpu_out = _host_memory()["cpu_outputs"]
    host = {i.name for i in graph.initializer} | _constants(graph)
    for node in nodes:
        if _name(node) in on_cpu:
            host.update(o for o in node.output if o)
        for k in cpu_out.get(node.op_type, ()):
            host.update(node.output[k : k + 1])
    return host


def _host_syncs(nodes: list, on_cpu: dict, host: set[str]) -> dict[str, str]:
    """Nodes that make the stream wait for the host: a CPU node reading a device tensor, an output
    whose shape depends on the data, a control-flow condition read on the host."""
    table = _host_memory()
    dependent, cpu_in = set(table["data_dependent_shape"]), table["cpu_inputs"]
    syncs = {}
    for node in nodes:
        name = _name(node)
        if node.op_type in dependent:
            syncs[name] = f"{node.op_type}'s output shape depends on the data: its size is copied to the host"
        elif name in on_cpu and any(n and n not in host for n in node.input):
            syncs[name] = f"{node.op_type} runs on CPU and reads a device tensor"
        elif node.op_type in ("If", "Loop") and any(
            node.input[k] not in host for k in cpu_in[node.op_type] if k < len(node.input) and node.input[k]
        ):
            syncs[name] = f"{node.op_type} reads its condition from the device on the host"
    return syncs


def _casts_into(graph: onnx.GraphProto, update: list) -> list:
    """The Casts (the precision rewrite's, a low gradient to float32) read only by update nodes:
    kernels of the update too."""
    chosen = {id(node) for node in update}
    inside = {name for node in update for name in node.input}
    outside = {name for node in graph.node if id(node) not in chosen for name in node.input}
    outside |= {o.name for o in graph.output}
    return [
        node
        for node in graph.node
        if node.op_type == "Cast"
        and id(node) not in chosen
        and node.output[0] in inside
        and node.output[0] not in outside
    ]


def _with_branches(node: onnx.NodeProto) -> list:
    """The node and every node of its subgraphs."""
    inner = [g for a in node.attribute for g in ([a.g] if a.HasField("g") else list(a.graphs))]
    return [node, *(n for g in inner for child in g.node for n in _with_branches(child))]


def _on_scalars(update: list, sizes: dict) -> set[int]:
    """The nodes (ids) on the scalars: a rate, a bias correction, the loss-scale state machine, a
    column of per-row factors (flat_update.py). Each reads only tensors of one element or built
    by such nodes, and writes no more elements than it reads: a launch, but no pass over the
    weights (a reduction of the gradients to one element is one; so is an Expand of a scalar)."""
    small = {name for name, size in sizes.items() if size == 1}
    found = set()
    for node in update:  # in graph order: a column comes after the scalars it gathers
        inputs = [n for n in node.input if n]
        outputs = [n for n in node.output if n]
        if not (inputs or outputs) or not all(n in small for n in inputs):
            continue
        written = [sizes.get(n) for n in outputs]
        if None in written or sum(written) > max(sum(sizes[n] for n in inputs), 1):
            continue
        found.add(id(node))
        small.update(outputs)
    return found


def _sizes(graph: onnx.GraphProto, shapes: dict) -> dict[str, int]:
    """Element counts where the shape is known: inferred or declared, and the initializers'."""
    sizes = {t.name: math.prod(t.dims) for t in graph.initializer}
    for name, shape in shapes.items():
        if all(d.HasField("dim_value") for d in shape.dim):
            sizes[name] = math.prod(d.dim_value for d in shape.dim)
    return sizes


def _constants(graph: onnx.GraphProto) -> set[str]:
    return {o for node in graph.node if node.op_type in FOLDED for o in node.output}


def _name(node: onnx.NodeProto) -> str:
    return node.name or (node.output[0] if node.output else node.op_type)
