"""Which low-precision nodes of a step graph the session's provider cannot run.

ONNX Runtime accepts some float16 nodes at session creation and refuses them only when they run:
the CPU provider has ScatterND/ScatterElements with reduction='add' (the gradients of Gather and
MaxPool) only in float32. So before the first step every distinct (op, attributes, types, ranks)
signature of a low-precision node is run once in a one-node session on CPU (cached for the
process), and on CUDA read from the provider's kernel table (`analysis.kernels.table`,
`op_lists/kernels_cuda.json`). What is refused stays float32 (`force_fp32`).
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from amp_rewrite.analysis.elemtypes import tensor_types
from amp_rewrite.onnx_facts import all_graphs, default_opset

LOW = {TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16"}
# a run failure that says the kernel lacks the type (anything else: the probe's inputs were unfit)
REFUSALS = ("not supported", "NOT_IMPLEMENTED", "Could not find an implementation", "not implemented")


def refused_nodes(model: onnx.ModelProto) -> dict[str, str]:
    """{node name: reason} for each node (If/Loop/Scan bodies too: ORT runs them only when the
    step runs) with a low-precision tensor ONNX Runtime's CPU provider refuses. (CUDA's refusals
    are the rewrite's own check, `provider="cuda"`, read from its kernel table.)"""
    types, shapes = tensor_types(model, shape_inference=True)
    opset = default_opset(model) or 13
    refused = {}
    for node in (node for graph in all_graphs(model.graph) for node in graph.node):
        ins = tuple(types.get(n, 0) if n else 0 for n in node.input)
        outs = tuple(types.get(n, 0) if n else 0 for n in node.output)
        low = {t for t in (*ins, *outs) if t in LOW}
        if not low or node.op_type in ("Cast", "Constant"):
            continue
        ranks = tuple(_rank(shapes.get(n)) for n in node.input)
        attributes = tuple(a.SerializeToString() for a in node.attribute)
        reason = _cpu_refuses(node.domain, node.op_type, opset, attributes, ins, outs, ranks)
        if reason:
            refused[node.name or node.output[0]] = reason
    return refused


def refused_in(model: onnx.ModelProto, target: str) -> dict[str, str]:
    """{node name: reason} for the nodes of a float32 `model` the CPU provider would refuse in
    `target`: each node is probed with its float32 slots that admit `target` (by the op's schema)
    in `target`, before any rewrite, so the rewrite keeps them float32 at once. (CUDA needs no
    probe: its kernel table is the rewrite's own `provider="cuda"` check.)"""
    low = next(t for t, name in LOW.items() if name == target)
    types, shapes = tensor_types(model, shape_inference=True)
    opset = default_opset(model) or 13
    refused = {}
    for node in (node for graph in all_graphs(model.graph) for node in graph.node):
        if node.op_type in ("Cast", "Constant") or any(a.type in _GRAPHS for a in node.attribute):
            continue
        ins = tuple(types.get(n, 0) if n else 0 for n in node.input)
        outs = tuple(types.get(n, 0) if n else 0 for n in node.output)
        swapped = _in_target(node, opset, ins, outs, low, target)
        if swapped is None:
            continue
        ranks = tuple(_rank(shapes.get(n)) for n in node.input)
        attributes = tuple(a.SerializeToString() for a in node.attribute)
        reason = _cpu_refuses(node.domain, node.op_type, opset, attributes, *swapped, ranks)
        if reason:
            refused[node.name or node.output[0]] = reason
    return refused


_GRAPHS = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


def _in_target(node: onnx.NodeProto, opset: int, ins, outs, low: int, target: str):
    """(ins, outs) with the float32 slots whose type parameter admits `low` set to it; None when
    no slot changes or the op has no ONNX schema."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
    except onnx.defs.SchemaError:
        return None
    admits = {c.type_param_str for c in schema.type_constraints if f"tensor({target})" in c.allowed_type_strs}
    changed = False

    def swap(formals, elems):
        nonlocal changed
        out = []
        for k, elem in enumerate(elems):
            formal = formals[min(k, len(formals) - 1)] if formals else None
            if elem == TensorProto.FLOAT and formal is not None and formal.type_str in admits:
                elem, changed = low, True
            out.append(elem)
        return tuple(out)

    swapped = swap(schema.inputs, ins), swap(schema.outputs, outs)
    return swapped if changed else None


def _rank(shape) -> int | None:
    """The rank of a TensorShapeProto or sequence of dims; None when unknown."""
    dims = getattr(shape, "dim", shape)
    try:
        return len(dims)
    except TypeError:
        return None


# ranks tried for the inputs whose rank shape inference left unknown (a gradient's ScatterND
# needs data, indices and updates of matching ranks: all-1 is a shape error, not a refusal)
GUESSED_RANKS = (1, 2, 3)
MAX_GUESSES = 27


def _cpu_refuses(domain, op_type, opset, attributes, ins, outs, ranks) -> str | None:
    """The first refusal among probes of the node with its unknown ranks guessed; a probe that
    runs (or fails for another reason on every guess) says None."""
    unknown = [k for k, (t, r) in enumerate(zip(ins, ranks)) if t and r is None]
    guesses = itertools.islice(itertools.product(GUESSED_RANKS, repeat=len(unknown)), MAX_GUESSES)
    for guess in guesses:
        filled = list(ranks)
        for k, r in zip(unknown, guess):
            filled[k] = r
        verdict = _probe(
            domain, op_type, opset, attributes, ins, outs, tuple(1 if r is None else r for r in filled)
        )
        if verdict != UNFIT:
            return verdict
    return None


UNFIT = "unfit"  # the probe's inputs did not fit the op (a shape error): try other ranks


@functools.lru_cache(maxsize=4096)
def _probe(domain, op_type, opset, attributes, ins, outs, ranks) -> str | None:
    """Run one node with ones-shaped zero inputs: the first line of a type refusal, UNFIT when
    it failed otherwise, None when it ran."""
    node = onnx.NodeProto()
    node.op_type, node.domain = op_type, domain
    node.input.extend(f"i{k}" if t else "" for k, t in enumerate(ins))
    node.output.extend(f"o{k}" if t else "" for k, t in enumerate(outs))
    for blob in attributes:
        node.attribute.add().ParseFromString(blob)
    inputs = [
        helper.make_tensor_value_info(f"i{k}", t, [1] * r) for k, (t, r) in enumerate(zip(ins, ranks)) if t
    ]
    outputs = [helper.make_tensor_value_info(f"o{k}", t, None) for k, t in enumerate(outs) if t]
    imports = [helper.make_opsetid("", opset)] + (
        [helper.make_opsetid(domain, 1)] if domain not in ("", "ai.onnx") else []
    )
    model = helper.make_model(
        helper.make_graph([node], "probe", inputs, outputs), opset_imports=imports, ir_version=8
    )
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        feeds = {
            v.name: np.zeros([1] * r, helper.tensor_dtype_to_np_dtype(t))
            for v, t, r in zip(inputs, [t for t in ins if t], [r for t, r in zip(ins, ranks) if t])
        }
        session.run(None, feeds)
    except Exception as error:  # noqa: BLE001 - ORT's errors are untyped
        text = str(error)
        if any(marker in text for marker in REFUSALS):
            return f"ONNX Runtime's CPU provider refuses {op_type} in {_low_names(ins, outs)}: {_short(text)}"
        return UNFIT
    return None


def _low_names(ins, outs) -> str:
    return "/".join(sorted({LOW[t] for t in (*ins, *outs) if t in LOW}))


def _short(text: str) -> str:
    line = next((part for part in text.splitlines() if part.strip()), text)
    marker = line.find("Status Message: ")
    return (line[marker + 16 :] if marker >= 0 else line)[:200]
