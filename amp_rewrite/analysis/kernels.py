"""Which ops the deployment provider can run in the target type: ONNX Runtime's kernel registry.

A node coloured float16 that the provider has no float16 kernel for (at the model's opset) is
placed on another provider by ONNX Runtime (CUDA -> CPU, with a device copy each side), or given
casts around it: either costs more than keeping it float32. So such a group is blocked here.
The facts are data: `op_lists/kernels_<provider>.json`, made by `tools/gen_kernel_tables.py`
from ONNX Runtime's registered kernels.

Per group (op, opset, type parameter):
- the op has no kernel row covering the opset, or the row lists the parameter without the
  target type: blocked, "no float16 kernel on CUDA at opset N";
- the row declares no types, or not this parameter: unknown, no change, one report note.

Per node, attributes too: a kernel registered for the type may refuse some attribute values when
it runs (the CPU provider's ScatterElements with reduction="add" in float16).
`op_lists/kernel_attributes.yaml` says which, with ORT's message; such a group is blocked, "no
float16 kernel on CPU for ScatterElements reduction='add'".

Which table: `Deployment.kernels` ("cuda", "cpu", or None for no check), passed in by options.
"""

from __future__ import annotations

import functools

import onnx
from onnx import helper

from amp_rewrite.analysis.oplists import shipped_table

_NAMES = {"cuda": "CUDA", "cpu": "CPU"}
REASON_PREFIX = "no {target} kernel on "
REFUSED_WHEN_RUN = "ONNX Runtime refuses it when it runs"  # an attribute rule's reason says so


@functools.cache
def table(provider: str) -> dict:
    """'domain:op' -> [(since, until or None, {type param: frozenset of types})], newest first."""
    raw = shipped_table(f"kernels_{provider}.json")["kernels"]
    return {
        key: [(since, until, {p: frozenset(t) for p, t in types.items()}) for since, until, types in rows]
        for key, rows in raw.items()
    }


@functools.cache
def attribute_rules(provider: str) -> dict:
    """'domain:op' -> [(attribute, values refused, type param, types refused, reason)]."""
    raw = shipped_table("kernel_attributes.yaml").get(provider) or {}
    return {
        (op if ":" in op else f":{op}"): [
            (r["attribute"], frozenset(r["values"]), r["param"], frozenset(r["types"]), r["reason"])
            for r in rules
        ]
        for op, rules in raw.items()
    }


def _attribute_value(node, name: str, schema_default):
    """A node's attribute `name` as a Python value (strings decoded), else the schema's default."""
    found = next((a for a in node.attribute if a.name == name), None)
    if found is None:
        return schema_default
    value = helper.get_attribute_value(found)
    return value.decode() if isinstance(value, bytes) else value


@functools.cache
def _default(domain: str, op_type: str, opset: int, name: str):
    try:
        attribute = onnx.defs.get_schema(op_type, opset, domain).attributes[name].default_value
    except (onnx.defs.SchemaError, KeyError):
        return None
    if attribute.type == onnx.AttributeProto.UNDEFINED:
        return None
    value = helper.get_attribute_value(attribute)
    return value.decode() if isinstance(value, bytes) else value


def provider_name(provider: str | None) -> str | None:
    """ORT's short name of a kernel table's provider ("cuda" -> "CUDA"), None for no check."""
    return None if provider is None else _NAMES[provider]


def is_kernel_reason(text: str | None) -> bool:
    return bool(text) and text.startswith(("no float16 kernel on ", "no bfloat16 kernel on "))


class KernelCheck:
    """`blocked(domain, op, opset, type_param)` -> (reason or None, note or None) for one
    provider and target; answers are cached per op kind by graph.build's templates."""

    def __init__(self, provider: str, target: str):
        self.provider, self.target = provider, target
        self.kernels = table(provider)
        self.by_attributes = attribute_rules(provider)  # 'domain:op' -> rules: a node's attributes matter
        self._noted: set = set()

    def refuses(self, domain: str, op_type: str, opset: int, node, type_param: str) -> str | None:
        """Why the provider's kernel refuses `node` (its attributes) with `type_param` in the target
        type, or None. Read only for ops kernel_attributes.yaml names."""
        for attribute, values, param, types, why in self.by_attributes.get(f"{domain}:{op_type}", ()):
            if self.target not in types or param not in type_param.split("+"):
                continue
            value = _attribute_value(node, attribute, _default(domain, op_type, opset, attribute))
            if value in values:
                return (
                    f"no {self.target} kernel on {_NAMES[self.provider]} for {op_type} "
                    f"{attribute}={value!r}: {REFUSED_WHEN_RUN} ({why})"
                )
        return None

    def for_op(self, domain: str, op_type: str, opset: int, notes: list):
        """type param -> blocked reason or None; an unknown answer adds one note per op to `notes`."""

        def check(type_param: str):
            reason, note = self.blocked(domain, op_type, opset, type_param)
            if note and (domain, op_type) not in self._noted:
                self._noted.add((domain, op_type))
                notes.append((f"{domain + ':' if domain else ''}{op_type}", note))
            return reason

        return check

    def blocked(self, domain: str, op_type: str, opset: int, type_param: str):
        if "@" in type_param:  # a fixed-type slot (Resize scales): the schema decides, not kernels
            return None, None
        reason = f"no {self.target} kernel on {_NAMES[self.provider]} at opset {opset}"
        row = next(
            (
                r
                for r in self.kernels.get(f"{domain}:{op_type}", ())
                if r[0] <= opset and (r[1] is None or opset <= r[1])
            ),
            None,
        )
        if row is None:
            return reason, None
        types = row[2]
        params = type_param.split("+")  # a tied group (schemas.tie) needs every part the row declares
        declared = [p for p in params if p in types]
        if not declared:
            return None, (
                f"{_NAMES[self.provider]} kernel of {op_type} at opset {opset} declares no types for "
                f"{', '.join(params)}: its {self.target} support is unknown; colour unchanged"
            )
        sequence = f"seq(tensor({self.target}))"  # a sequence parameter runs the target as its element type
        if all(self.target in types[p] or sequence in types[p] for p in declared):
            return None, None
        return reason, None


def check_for(provider: str | None, target: str) -> KernelCheck | None:
    """The check graph.build applies for `provider`'s table ("cuda", "cpu"), or None for no check."""
    return None if provider is None else KernelCheck(provider, target)


def _schema_refuses(text: str | None, target: str) -> bool:
    """A group blocked because its schema at the model's opset does not allow the target
    (analysis.optemplates' reason)."""
    return bool(text) and text.startswith("schema ") and f"does not allow {target}" in text


def newer_opset_advice(cg, check: KernelCheck, opsets: dict) -> list[str]:
    """One line per op type whose nodes stay float32 only because the provider has no target-type
    kernel at the model's opset, or its schema there does not allow the target (Conv takes
    bfloat16 from opset 22), naming the first newer opset whose schema and kernel run them ("18 Clip
    nodes stay float32 at opset 11: --opset 12 runs them in float16"). One pass over the vertices."""
    from amp_rewrite.analysis import schemas

    latest = onnx.defs.onnx_opset_version()
    blocked: dict = {}  # op type -> set of nodes
    for vertex in cg.vertices:
        if (
            (is_kernel_reason(vertex.blocked) or _schema_refuses(vertex.blocked, check.target))
            and cg.scopes[vertex.scope].domains[vertex.node] in ("", "ai.onnx")
            and REFUSED_WHEN_RUN not in vertex.blocked  # an attribute's refusal: no opset lifts it
        ):
            blocked.setdefault(vertex.op_type, set()).add((vertex.scope, vertex.node))
    here = opsets.get("", 0)
    lines = []
    for op_type, nodes in blocked.items():
        for opset in range(here + 1, latest + 1):
            sig = schemas.signature("", op_type, opset)
            if sig is None:
                break
            params = {
                f.type_param
                for f in (*sig.inputs, *sig.outputs)
                if "@" not in f.type_param and sig.admits(f.type_param, f"tensor({check.target})")
            }
            if params and all(check.blocked("", op_type, opset, p)[0] is None for p in params):
                lines.append(
                    f"{len(nodes)} {op_type} node{'s' if len(nodes) > 1 else ''} stay float32 at opset "
                    f"{here}: --opset {opset} runs them in {check.target}"
                )
                break
    return lines
