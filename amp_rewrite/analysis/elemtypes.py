"""Element types of every tensor from the schemas alone, in one pass over the nodes.

Shape inference is slow on big graphs (it serialises, infers shapes we do not need and reads
every value_info back; docs/benchmarks.md has the figure); the colouring needs only element types, and the schemas' type
groups give them: tensors in one group share a type, a fixed or single-choice parameter names
its type, and a `to`/`dtype` attribute or a Constant's value sets an output-only one. When that
leaves a node output unknown (a control-flow output, an op without a schema), the caller falls
back to ONNX shape inference.
"""

from __future__ import annotations

import logging

import onnx
from onnx import TensorProto

from amp_rewrite import onnx_facts
from amp_rewrite.analysis import schemas
from amp_rewrite.errors import UsageError
from amp_rewrite.io.skeleton import inference_skeleton
from amp_rewrite.ir import read_scopes
from amp_rewrite.onnx_facts import TYPE_OF_STRING, all_graphs


def _attribute_type(node: onnx.NodeProto) -> int | None:
    for attr in node.attribute:
        if attr.name in ("to", "dtype") and attr.type == onnx.AttributeProto.INT:
            return attr.i
        if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR:
            return attr.t.data_type
    if node.op_type == "Constant":  # value_float(s), value_int(s)
        for attr in node.attribute:
            if attr.name.startswith("value_float"):
                return TensorProto.FLOAT
            if attr.name.startswith("value_int"):
                return TensorProto.INT64
    return None


def _single_choice(sig: schemas.Signature, type_param: str) -> int | None:
    allowed = sig.allowed.get(type_param, ())
    if len(allowed) == 1:
        return TYPE_OF_STRING.get(next(iter(allowed)))
    return None


def propagate(model: onnx.ModelProto, types: dict, scopes=None) -> bool:
    """Fill `types` (name -> element type) in node order; True when every node output is typed.
    `scopes`: `ir.read_scopes(model.graph)` when the caller has it already."""
    opsets = onnx_facts.opsets(model)
    templates: dict = {}  # (domain, op type, #inputs, #outputs) -> its groups, or None without a schema
    complete = True
    for scope in scopes if scopes is not None else read_scopes(model.graph):  # parents first
        for n, (inputs, outputs) in enumerate(scope.io):  # node fields as read_scopes read them
            shape_key = (scope.domains[n], scope.op_types[n], len(inputs), len(outputs))
            if shape_key not in templates:
                templates[shape_key] = _template(*shape_key, opsets)
            template = templates[shape_key]
            for group, single_choice in template or ():
                names = []  # group_names and first_type, inlined: this runs for every group of every node
                for i in group.inputs:
                    if inputs[i]:
                        names.append(inputs[i])
                for i in group.outputs:
                    if outputs[i]:
                        names.append(outputs[i])
                known = None
                for x in names:
                    if x in types:
                        known = types[x]
                        break
                if known is None:
                    known = single_choice
                if known is None and group.output_only:
                    known = _attribute_type(scope.graph.node[n])
                if known is None:
                    continue
                for x in names:
                    if x not in types:
                        types[x] = known
            if complete:  # a loop, not all() over a generator: one per node
                for x in outputs:
                    if x and x not in types:
                        complete = False
                        break
    return complete


def _template(node_domain: str, op_type: str, n_inputs: int, n_outputs: int, opsets: dict):
    """[(type group, the type its parameter allows when it allows one)] of a kind of node, or None
    when no schema is known: worked out once per op type and slot counts, not once per node."""
    domain = "" if node_domain in onnx_facts.DEFAULT_DOMAINS else node_domain
    sig = schemas.signature(domain, op_type, opsets[domain]) if domain in opsets else None
    if sig is None:
        return None
    return [
        (group, _single_choice(sig, group.type_param))
        for group in schemas.type_groups(sig, n_inputs, n_outputs)
    ]


def _collect_value_infos(
    graph: onnx.GraphProto, types: dict, shapes: dict, graphs=None, *, replace: bool = False
) -> None:
    """Declared types and shapes of `graph` and its subgraphs (`graphs`, when the caller has them).
    `replace`: these shapes win over ones already read (inferred with sized dims over declared)."""
    for g in graphs if graphs is not None else all_graphs(graph):
        for value in (*g.input, *g.output, *g.value_info):
            if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type:
                types.setdefault(value.name, value.type.tensor_type.elem_type)
                if value.type.tensor_type.HasField("shape"):
                    if replace:
                        shapes[value.name] = value.type.tensor_type.shape
                    else:
                        shapes.setdefault(value.name, value.type.tensor_type.shape)
        for tensor in g.initializer:
            types.setdefault(tensor.name, tensor.data_type)


# Above this many nodes, shape inference runs only when the schemas alone
# leave a type unknown: shapes then come from the model's own value_info (FLOPs "where known").
SHAPE_INFERENCE_NODE_LIMIT = 20_000


def sizes_dims(model: onnx.ModelProto) -> bool:
    """Whether `tensor_types` feeds `dims` to shape inference: only where it always runs (up to
    SHAPE_INFERENCE_NODE_LIMIT nodes), so the report can say plainly whether sizes used them."""
    return len(model.graph.node) <= SHAPE_INFERENCE_NODE_LIMIT


def symbolic_dims(graph: onnx.GraphProto) -> list:
    """Names of the symbolic dims of the graph's inputs, in order of first use."""
    return list(
        dict.fromkeys(
            d.dim_param for value in graph.input for d in value.type.tensor_type.shape.dim if d.dim_param
        )
    )


def check_dims(graph: onnx.GraphProto, dims) -> None:
    """A size for a dim no input has is a typo, not a no-op: one line naming the dims there are."""
    known = symbolic_dims(graph)
    unknown = [name for name in dims if name not in known]
    if unknown:
        have = (
            f"its inputs' symbolic dims are {', '.join(known)}"
            if known
            else "its inputs have no symbolic dims"
        )
        raise UsageError(
            f"dim {', '.join(map(repr, unknown))}: not a symbolic dim of the model's inputs ({have})"
        )


def tensor_types(model: onnx.ModelProto, *, shape_inference: bool | None = None, scopes=None, dims=None):
    """Element type and shape (when known) of every named tensor: (types, shapes).

    Types come from the declarations and the schemas (`elemtypes.propagate`); ONNX shape
    inference, on a skeleton so models of any size work, adds shapes and any type the schemas
    could not give. `shape_inference=None` runs it for models up to SHAPE_INFERENCE_NODE_LIMIT
    nodes, and beyond only when a type is missing. `scopes`: `ir.read_scopes(model.graph)`
    when the caller has it already. `dims` (name -> size, `sizes_dims` models only): the inputs'
    symbolic dims of those names are sized for inference, so shapes are concrete (sizes only; the
    model's declarations are not touched).
    """
    types: dict[str, int] = {}
    shapes: dict[str, object] = {}
    _collect_value_infos(model.graph, types, shapes, [scope.graph for scope in scopes] if scopes else None)
    complete = propagate(model, types, scopes)
    if shape_inference is None:
        shape_inference = not complete or len(model.graph.node) <= SHAPE_INFERENCE_NODE_LIMIT
    if not shape_inference:
        return types, shapes
    dims = dims if dims and sizes_dims(model) else None
    try:
        inferred = onnx.shape_inference.infer_shapes(inference_skeleton(model, dims), strict_mode=False)
    except Exception:
        return types, shapes
    _collect_value_infos(inferred.graph, types, shapes, replace=bool(dims))
    contrib = _contrib_shapes(inferred)
    if contrib is not None:
        _collect_value_infos(contrib.graph, types, shapes)
    return types, shapes


def _contrib_shapes(inferred: onnx.ModelProto) -> onnx.ModelProto | None:
    """ONNX Runtime's symbolic shape inference over a model with com.microsoft ops, whose shapes
    onnx's inference does not know (every size after a fused SkipLayerNormalization would count 1
    in cost placement); None without such ops, without sympy (its optional dependency), or when
    it fails. Its passes are run here, not through `SymbolicShapeInference.infer_shapes`, which
    saves the model into the working directory when some shape stays unknown: what it found is
    kept, and nothing is written."""
    if not any(node.domain == "com.microsoft" for node in inferred.graph.node):
        return None
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
    except ImportError:
        return None
    previous = logging.root.manager.disable  # (runtime.tools_quiet is above analysis's layer)
    logging.disable(logging.WARNING)
    try:
        inference = SymbolicShapeInference(2**31 - 1, True, False, 0)
        inference._preprocess(inferred)
        while inference.run_:
            inference._infer_impl()
        inference._update_output_from_vi()
        return inference.out_mp_
    except Exception:  # noqa: BLE001 - any failure: the shapes onnx's inference gave
        return None
    finally:
        logging.disable(previous)
