"""Type groups read from operator schemas.

A node's inputs and outputs that share a type parameter in its schema (`T` of Add ties A, B and C)
must share one element type, so they are coloured together: that set is a *type group*. A formal
parameter with a fixed type (Resize's `scales: tensor(float)`) is a group of its own that admits
nothing else. Schemas come from `onnx.defs` at the model's opset; ONNX Runtime's com.microsoft ops from
`op_lists/schemas_contrib.json` (its registry, written by `tools/gen_contrib_schemas.py`), so
they are the same whatever ONNX Runtime is installed; other domains (and ONNX Runtime's own ops
in the default domain) from ONNX Runtime's schema registry, which is safe to read in-process
(unlike its kernel registry). Whether a group may become float16 or bfloat16 is
its allowed type list: no op-specific exceptions anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache, lru_cache

import onnx.defs

from amp_rewrite.analysis.oplists import shipped_table
from amp_rewrite.onnx_facts import DEFAULT_DOMAINS


@dataclass(frozen=True)
class Formal:
    """One formal input or output: its type parameter, and whether it repeats (variadic)."""

    type_param: str
    variadic: bool
    name: str = ""  # the schema's name for it (Resize's `roi`)


@dataclass(frozen=True, eq=False)  # hashed by identity: `signature` returns one object per version
class Signature:
    """What the colouring needs of one schema version."""

    domain: str
    op_type: str
    since_version: int
    inputs: tuple[Formal, ...]
    outputs: tuple[Formal, ...]
    allowed: dict  # type_param -> frozenset of type strings
    probe: bool = False  # types are tied beyond the type parameters: ask the schema (see `rejects`)
    containers: bool = False  # a parameter admits sequences/optionals and another tensors
    container_params: frozenset = frozenset()  # the parameters whose types are sequences/optionals only
    maybe_containers: frozenset = frozenset()  # the parameters that admit them (Identity's V too)

    def admits(self, type_param: str, type_string: str) -> bool:
        """Tied groups (see `tie`) are named `T1+T2`: each parameter must admit the type (a
        sequence or optional parameter, as its element type: `seq(tensor(float16))`)."""
        return all(_admits(self.allowed.get(p, ()), type_string) for p in type_param.split("+"))

    def is_container(self, type_param: str) -> bool:
        return any(p in self.container_params for p in type_param.split("+"))


def _admits(allowed, type_string: str) -> bool:
    return type_string in allowed or any(f"{wrap}({type_string})" in allowed for wrap in ("seq", "optional"))


@dataclass(frozen=True)
class TypeGroup:
    """The input and output slots of one node that share a type parameter."""

    type_param: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    # its type is set by an attribute (Cast's `to`) or by the op, never by an input: a field set
    # once, not a property (every colouring asks it of every vertex, 100k times at 100k nodes)
    output_only: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "output_only", not self.inputs)


def _formal(param, fixed_prefix: str) -> Formal:
    type_str = getattr(param, "type_str", None) or param.typeStr
    option = param.option
    variadic = int(option) == 2  # FormalParameterOption.Variadic in both registries
    # A fixed type ("tensor(float)") is a group of its own, named after the parameter.
    if type_str.startswith(("tensor(", "seq(", "optional(", "map(", "sparse_tensor(")):
        type_str = f"{type_str}@{fixed_prefix}{param.name}"
    return Formal(type_str, variadic, param.name)


def _signature_of(schema, domain: str, op_type: str) -> Signature:
    allowed = {c.type_param_str: frozenset(c.allowed_type_strs) for c in schema.type_constraints}
    inputs = tuple(_formal(p, "in:") for p in schema.inputs)
    outputs = tuple(_formal(p, "out:") for p in schema.outputs)
    for formal in inputs + outputs:
        if "@" in formal.type_param:
            allowed[formal.type_param] = frozenset([formal.type_param.split("@", 1)[0]])
    input_params = {f.type_param for f in inputs}
    # An output type no input shares (BitCast's `to`), or a function body whose own ops must
    # accept the types: only the schema's inference can tell whether a type choice is valid.
    has_body = bool(
        getattr(schema, "has_function", False) or getattr(schema, "has_context_dependent_function", False)
    )
    # Tensor attributes may have to match an input's type (TreeEnsemble's `nodes_splits`).
    tensor_attrs = any(int(a.type) in _TENSOR_ATTRIBUTE_TYPES for a in schema.attributes.values())
    probe = has_body or tensor_attrs or any(f.type_param not in input_params for f in outputs)
    container_params = {p for p, types in allowed.items() if any(t.startswith(_CONTAINERS) for t in types)}
    containers = bool(container_params) and len(allowed) > len(container_params)
    # parameters that are sequences/optionals whatever the node (SequenceInsert's S), not Identity's V
    only_containers = {p for p in container_params if all(t.startswith(_CONTAINERS) for t in allowed[p])}
    return Signature(
        domain,
        op_type,
        schema.since_version,
        inputs,
        outputs,
        allowed,
        probe,
        containers,
        frozenset(only_containers),
        frozenset(container_params),
    )


_CONTAINERS = ("seq(", "optional(", "map(", "sparse_tensor(")
_TENSOR_ATTRIBUTE_TYPES = {int(onnx.AttributeProto.TENSOR), int(onnx.AttributeProto.TENSORS)}


@dataclass(frozen=True)
class _DataFormal:
    """A formal parameter read from the contrib schema file, shaped as the registries' own."""

    name: str
    typeStr: str  # noqa: N815 - the registries' spelling, read by `_formal`
    option: int


@dataclass(frozen=True)
class _DataConstraint:
    type_param_str: str
    allowed_type_strs: tuple


@dataclass(frozen=True)
class _DataAttribute:
    type: int


@dataclass(frozen=True)
class _DataSchema:
    """One version of a contrib op's schema from `schemas_contrib.json`."""

    since_version: int
    inputs: tuple
    outputs: tuple
    type_constraints: tuple
    attributes: dict = field(default_factory=dict)


def _data_schema(row: dict) -> _DataSchema:
    return _DataSchema(
        row["since"],
        tuple(_DataFormal(*f) for f in row["inputs"]),
        tuple(_DataFormal(*f) for f in row["outputs"]),
        tuple(_DataConstraint(p, tuple(t)) for p, t in row["types"].items()),
        {name: _DataAttribute(kind) for name, kind in row["attributes"].items()},
    )


@lru_cache(maxsize=1)
def _contrib_schemas() -> dict:
    """(com.microsoft, op_type) -> schema versions, oldest first, from the shipped data file."""
    table = shipped_table("schemas_contrib.json")
    domain = table["domain"]
    return {(domain, op): [_data_schema(r) for r in rows] for op, rows in table["schemas"].items()}


@lru_cache(maxsize=1)
def _onnxruntime_schemas() -> dict:
    """(domain, op_type) -> schemas sorted by version, from ONNX Runtime's registry."""
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

        schemas = ort_state.get_all_operator_schema()
    except Exception:  # an ORT build without the schema API: such ops stay float32
        return {}
    table: dict = {}
    for schema in schemas:
        table.setdefault((schema.domain, schema.name), []).append(schema)
    for versions in table.values():
        versions.sort(key=lambda s: s.since_version)
    return table


@cache
def signature(domain: str, op_type: str, opset: int) -> Signature | None:
    """The schema of `op_type` in force at `opset`, or None if no registry knows it."""
    domain = "" if domain in DEFAULT_DOMAINS else domain
    try:
        schema = onnx.defs.get_schema(op_type, opset, domain)
        return _signature_of(schema, domain, op_type)
    except onnx.defs.SchemaError:
        pass
    registry = _contrib_schemas() if (domain, op_type) in _contrib_schemas() else _onnxruntime_schemas()
    candidates = [s for s in registry.get((domain, op_type), []) if s.since_version <= opset]
    if not candidates:
        return None
    return _signature_of(candidates[-1], domain, op_type)


def formal_at(formals: tuple[Formal, ...], index: int) -> Formal | None:
    if index < len(formals):
        return formals[index]
    if formals and formals[-1].variadic:
        return formals[-1]
    return None


@cache
def type_groups(sig: Signature, n_inputs: int, n_outputs: int) -> tuple[TypeGroup, ...]:
    """Group a node's input and output slots by the type parameter of their formal parameter."""
    inputs: dict[str, list[int]] = {}
    outputs: dict[str, list[int]] = {}
    for i in range(n_inputs):
        formal = formal_at(sig.inputs, i)
        if formal is not None:
            inputs.setdefault(formal.type_param, []).append(i)
    for i in range(n_outputs):
        formal = formal_at(sig.outputs, i)
        if formal is not None:
            outputs.setdefault(formal.type_param, []).append(i)
    params = list(dict.fromkeys([*inputs, *outputs]))
    return tuple(TypeGroup(p, tuple(inputs.get(p, ())), tuple(outputs.get(p, ()))) for p in params)


# --- probing a type choice with the schema's own inference --------------------------------------------


@lru_cache(maxsize=4096)
def _probe(domain: str, op_type: str, opsets: tuple, node_bytes: bytes, in_types: tuple) -> tuple:
    """Output element types ONNX inference gives `node` with inputs of `in_types`, or an error."""
    import onnx
    import onnx.inliner
    from onnx import helper

    node = onnx.NodeProto.FromString(node_bytes)
    names = [f"in{i}" if t else "" for i, t in enumerate(in_types)]
    outs = [f"out{i}" if o else "" for i, o in enumerate(node.output)]
    del node.input[:]
    node.input.extend(names)
    del node.output[:]
    node.output.extend(outs)
    opset_map = dict(opsets)
    functions = []
    nodes = [node]
    if domain == "":
        schema = onnx.defs.get_schema(op_type, opset_map[""], "")
        given = {a.name for a in node.attribute}
        for name, attr in schema.attributes.items():  # the body may refer to defaults
            default = attr.default_value
            if name not in given and default is not None and default.type:
                node.attribute.append(onnx.AttributeProto.FromString(default.SerializeToString()))
                node.attribute[-1].name = name
        body = _function_body(schema, node, in_types, opset_map[""])
        if body is not None:
            body.domain, body.name = "amp.probe", op_type
            functions.append(body)
            call = onnx.NodeProto()
            call.CopyFrom(node)
            call.domain = "amp.probe"
            nodes = [call]
            opset_map.update({i.domain: i.version for i in body.opset_import if i.domain not in opset_map})
            opset_map["amp.probe"] = 1
    inputs = [helper.make_tensor_value_info(n, t, None) for n, t in zip(names, in_types) if n]
    graph = helper.make_graph(
        nodes, "probe", inputs, [helper.make_value_info(o, onnx.TypeProto()) for o in outs if o]
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid(d, v) for d, v in opset_map.items()],
        ir_version=10,
        functions=functions,
    )
    try:
        if functions:
            model = onnx.inliner.inline_local_functions(model)
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, check_type=True)
    except Exception as exc:  # noqa: BLE001 - any refusal of the schema is the answer
        lines = [x for x in str(exc).strip().splitlines() if x.strip()]
        return None, (lines[-1] if lines else type(exc).__name__)[:200]
    by_name = {v.name: v.type for v in inferred.graph.output}
    by_name.update({v.name: v.type for v in inferred.graph.value_info})
    return tuple(by_name[o].SerializeToString() if o in by_name else b"" for o in outs), None


def _function_body(schema, node, in_types, opset: int):
    """The schema's function body for `node` at `opset` (a copy), or None."""
    import onnx
    from onnx import helper

    try:
        if schema.has_context_dependent_function:
            types = [helper.make_tensor_type_proto(t, None).SerializeToString() for t in in_types if t]
            data = schema.get_context_dependent_function_with_opset_version(
                opset, node.SerializeToString(), types
            )
        elif schema.has_function:
            data = schema.get_function_with_opset_version(opset).SerializeToString()
        else:
            return None
    except Exception:  # no body at this opset: the node's own inference is all there is
        return None
    return onnx.FunctionProto.FromString(data) if data else None


def rejects(sig: Signature, node, opsets: dict, in_types: list, group: TypeGroup, low: int) -> str | None:
    """Why the schema refuses `group` of `node` in element type `low`, or None if it accepts it.

    Runs ONNX type inference (and the op's function body, when it has one) once with the
    current types and once with the group's inputs in `low`: a refusal, or an output outside the
    group whose type changes, means the type parameters do not tell the whole story (BitCast's
    bit width, a function body whose ops do not admit the type). Inconclusive probes (unknown
    input types, inference that fails even in float32) accept. Cached per op, attributes and types.
    """
    if not sig.probe or any(t is None for t in in_types):
        return None
    stripped = type(node)()
    stripped.op_type, stripped.domain = node.op_type, node.domain
    stripped.attribute.extend(a for a in node.attribute if not a.HasField("g") and not a.graphs)
    stripped.output.extend("o" if o else "" for o in node.output)
    key = (sig.domain, node.op_type, tuple(sorted(opsets.items())), stripped.SerializeToString())
    base, error = _probe(*key, tuple(in_types))
    if error is not None:
        return None
    trial = list(in_types)
    for i in group.inputs:
        trial[i] = low
    got, error = _probe(*key, tuple(trial))
    if error is not None:
        return error
    for i, (a, b) in enumerate(zip(base, got)):
        if i not in group.outputs and a != b:
            return f"output {i} would change type"
    return None


def tie(
    sig: Signature, node, opsets: dict, in_types: list, groups: tuple, float_params: set, low: int
) -> tuple:
    """Merge the float groups a function body ties together into one group.

    Attention-23's body multiplies Q (T1) by V (T2): each alone in `low` is refused, all together
    accepted, so they are one unit of colouring. Groups are tied only when some alone is refused
    and all together are accepted; otherwise they are returned as they are (and `rejects` blocks).
    """
    candidates = [g for g in groups if g.inputs and g.type_param in float_params]
    if not sig.probe or len(candidates) < 2 or any(t is None for t in in_types):
        return groups
    if not any(rejects(sig, node, opsets, in_types, g, low) for g in candidates):
        return groups
    merged = TypeGroup(
        "+".join(g.type_param for g in candidates),
        tuple(sorted(i for g in candidates for i in g.inputs)),
        tuple(sorted(i for g in candidates for i in g.outputs)),
    )
    if rejects(sig, node, opsets, in_types, merged, low):
        return groups
    return (merged, *[g for g in groups if g not in candidates])


def tie_containers(sig: Signature, groups: tuple, float_groups: set) -> tuple:
    """A sequence op's float groups as one: SequenceInsert's sequence S and tensor T, SplitToSequence's
    T and S hold one element type (the schema ties them beyond the type parameters), so they are
    one unit of colouring, as TensorFlow colours a TensorList with its elements. `float_groups`:
    the groups of float32 tensors, and container groups whose sequences' type is not known yet.
    Other groups (SequenceAt's int position) are returned as they are."""
    tied = [g for g in groups if g in float_groups]
    if len(tied) < 2 or not any(g.type_param in sig.container_params for g in tied):
        return groups
    merged = TypeGroup(
        "+".join(g.type_param for g in tied),
        tuple(sorted(i for g in tied for i in g.inputs)),
        tuple(sorted(i for g in tied for i in g.outputs)),
    )
    return (merged, *[g for g in groups if g not in tied])


def container_slots(sig: Signature, group: TypeGroup, params=None) -> tuple[tuple, tuple]:
    """(input slots, output slots) of `group` whose parameter is one of `params` (default: the
    parameters that hold sequences/optionals only)."""
    params = sig.container_params if params is None else params
    return (
        tuple(i for i in group.inputs if (f := formal_at(sig.inputs, i)) and f.type_param in params),
        tuple(i for i in group.outputs if (f := formal_at(sig.outputs, i)) and f.type_param in params),
    )
