"""Type groups read from operator schemas.

A node's inputs and outputs that share a type parameter in its schema (`T` of Add ties A, B and C)
must share one element type, so they are coloured together: that set is a *type group*. A formal
parameter with a fixed type (Resize's `scales: tensor(float)`) is a group of its own that admits
nothing else. Schemas come from `onnx.defs` at the model's opset, and for other domains (and ONNX
Runtime's own ops in the default domain) from ONNX Runtime's schema registry, which is safe to
read in-process (unlike its kernel registry). Whether a group may become float16 or bfloat16 is
its allowed type list: no op-specific exceptions anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import onnx.defs

DEFAULT_DOMAINS = ("", "ai.onnx")
TYPE_STRING = {
    "float16": "tensor(float16)",
    "bfloat16": "tensor(bfloat16)",
    "float32": "tensor(float)",
}


@dataclass(frozen=True)
class Formal:
    """One formal input or output: its type parameter, and whether it repeats (variadic)."""

    type_param: str
    variadic: bool


@dataclass(frozen=True, eq=False)  # hashed by identity: `signature` returns one object per version
class Signature:
    """What the colouring needs of one schema version."""

    domain: str
    op_type: str
    since_version: int
    inputs: tuple[Formal, ...]
    outputs: tuple[Formal, ...]
    allowed: dict  # type_param -> frozenset of type strings

    def admits(self, type_param: str, type_string: str) -> bool:
        return type_string in self.allowed.get(type_param, ())


@dataclass(frozen=True)
class TypeGroup:
    """The input and output slots of one node that share a type parameter."""

    type_param: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]

    @property
    def output_only(self) -> bool:
        """Its type is set by an attribute (Cast's `to`) or by the op, never by an input."""
        return not self.inputs


def _formal(param, fixed_prefix: str) -> Formal:
    type_str = getattr(param, "type_str", None) or getattr(param, "typeStr")
    option = getattr(param, "option")
    variadic = int(option) == 2  # FormalParameterOption.Variadic in both registries
    # A fixed type ("tensor(float)") is a group of its own, named after the parameter.
    if type_str.startswith(("tensor(", "seq(", "optional(", "map(", "sparse_tensor(")):
        type_str = f"{type_str}@{fixed_prefix}{param.name}"
    return Formal(type_str, variadic)


def _signature_of(schema, domain: str, op_type: str) -> Signature:
    allowed = {c.type_param_str: frozenset(c.allowed_type_strs) for c in schema.type_constraints}
    inputs = tuple(_formal(p, "in:") for p in schema.inputs)
    outputs = tuple(_formal(p, "out:") for p in schema.outputs)
    for formal in inputs + outputs:
        if "@" in formal.type_param:
            allowed[formal.type_param] = frozenset([formal.type_param.split("@", 1)[0]])
    return Signature(domain, op_type, schema.since_version, inputs, outputs, allowed)


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


@lru_cache(maxsize=None)
def signature(domain: str, op_type: str, opset: int) -> Signature | None:
    """The schema of `op_type` in force at `opset`, or None if no registry knows it."""
    domain = "" if domain in DEFAULT_DOMAINS else domain
    try:
        schema = onnx.defs.get_schema(op_type, opset, domain)
        return _signature_of(schema, domain, op_type)
    except onnx.defs.SchemaError:
        pass
    candidates = [s for s in _onnxruntime_schemas().get((domain, op_type), []) if s.since_version <= opset]
    if not candidates:
        return None
    return _signature_of(candidates[-1], domain, op_type)


def _formal_at(formals: tuple[Formal, ...], index: int) -> Formal | None:
    if index < len(formals):
        return formals[index]
    if formals and formals[-1].variadic:
        return formals[-1]
    return None


@lru_cache(maxsize=None)
def type_groups(sig: Signature, n_inputs: int, n_outputs: int) -> tuple[TypeGroup, ...]:
    """Group a node's input and output slots by the type parameter of their formal parameter."""
    inputs: dict[str, list[int]] = {}
    outputs: dict[str, list[int]] = {}
    for i in range(n_inputs):
        formal = _formal_at(sig.inputs, i)
        if formal is not None:
            inputs.setdefault(formal.type_param, []).append(i)
    for i in range(n_outputs):
        formal = _formal_at(sig.outputs, i)
        if formal is not None:
            outputs.setdefault(formal.type_param, []).append(i)
    params = list(dict.fromkeys([*inputs, *outputs]))
    return tuple(TypeGroup(p, tuple(inputs.get(p, ())), tuple(outputs.get(p, ()))) for p in params)


def model_opsets(model) -> dict[str, int]:
    """Domain -> opset version imported by the model (default domain under '')."""
    opsets = {}
    for entry in model.opset_import:
        opsets["" if entry.domain in DEFAULT_DOMAINS else entry.domain] = entry.version
    return opsets
