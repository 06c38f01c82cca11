"""Per kind of node, once: an op's signature and list entry, and its type groups' blocked reasons.

What depends only on (op type, slot counts) is worked out here once and reused by every node of
that kind (`graph.build`): the schema lookup, the op-list entry, why a group may never be low
precision (no list, the schema, the provider's kernels, kernels that read float32), the ties of
sequence ops, and the small name/type lookups the colouring graph and placement share.
"""

from __future__ import annotations

from amp_rewrite import onnx_facts
from amp_rewrite.analysis import schemas
from amp_rewrite.analysis.oplists import OpLists, shipped_table
from amp_rewrite.onnx_facts import FLOAT


def describe_op(node_domain: str, op_type: str, opsets: dict, local_functions: set, op_lists: OpLists):
    """(signature, list entry, skip reason): looked up once per op type, not once per node."""
    domain = "" if node_domain in onnx_facts.DEFAULT_DOMAINS else node_domain
    if op_type == "Constant" and domain == "":
        return None, None, ""
    if (node_domain, op_type) in local_functions:
        return None, None, f"model-local function {op_type!r} stays float32"
    if domain not in opsets:
        return None, None, f"op domain {domain!r} is not imported by the model; stays float32"
    sig = schemas.signature(domain, op_type, opsets[domain])
    if sig is None:
        return (
            None,
            None,
            f"no schema for {domain or 'ai.onnx'}:{op_type} at opset {opsets[domain]}; stays float32",
        )
    return sig, op_lists.classify(domain, op_type), None


def group_names(inputs, outputs, group) -> list:
    """The named tensors of a group, inputs first. Plain loops: a comprehension is a function call
    in Python 3.11, and this runs for every group of every node."""
    names = []
    for i in group.inputs:
        if inputs[i]:
            names.append(inputs[i])
    for i in group.outputs:
        if outputs[i]:
            names.append(outputs[i])
    return names


def first_type(names, types: dict) -> int | None:
    """The element type of the first typed tensor among `names`: the type of their group."""
    for x in names:
        if x in types:
            return types[x]
    return None


def kernel_of(kernel_check, sig, opsets: dict, notes: list):
    """type param -> why the provider cannot run it in the target type (or None); None: no check."""
    if kernel_check is None:
        return None
    return kernel_check.for_op(sig.domain, sig.op_type, opsets[sig.domain], notes)


def make_template(sig, entry, groups, target: str, kernel=None, check_deny: bool = False) -> list:
    """(group, reason it is blocked whatever the node, reason after the user's) for each group:
    what depends only on the op type and slot counts, worked out once per kind of node. Deny ops
    skip the kernel check (they stay float32) unless `check_deny`: one relaxed to infer."""
    target_string = onnx_facts.TYPE_STRING[target]
    template = []
    for group in groups:
        fixed = late = None
        if entry is None:
            fixed = f"{sig.op_type} is in no op list"
        elif not sig.admits(group.type_param, target_string):
            fixed = (
                f"schema {sig.op_type}-{sig.since_version} does not allow {target} "
                f"for {group.type_param.split('@')[0]}"
            )
        elif sig.containers and not sig.is_container(group.type_param):
            late = f"schema {sig.op_type}-{sig.since_version} ties tensor types to sequence/optional elements"
        if fixed is None and kernel is not None and (check_deny or entry.list != "deny"):
            fixed = kernel(group.type_param)
        if fixed is None:
            fixed = _read_as_float32(sig, group)
        template.append((group, fixed, late))
    return template


def tie_containers_of(sig, entry, template, inputs, outputs, types, target, kernel) -> list:
    """A sequence op's template with its float tensor and sequence groups tied into one
    (schemas.tie_containers); a sequence not typed yet counts as float beside a float tensor."""
    groups = tuple(group for group, _, _ in template)
    float_groups = set()
    for g in groups:
        kind = first_type(group_names(inputs, outputs, g), types)
        if kind == FLOAT or (kind is None and g.type_param in sig.container_params):
            float_groups.add(g)
    tied = schemas.tie_containers(sig, groups, float_groups)
    return template if tied is groups else make_template(sig, entry, tied, target, kernel)


def sequence_tensors(sig, group, s: int, inputs, outputs, params=None):
    """(scope, name) of the group's sequence tensors: no Cast can convert one, so their producer
    and readers take one colour (ties.py)."""
    ins, outs = schemas.container_slots(sig, group, params)
    return [(s, inputs[i]) for i in ins if inputs[i]] + [(s, outputs[i]) for i in outs if outputs[i]]


def _read_as_float32(sig, group) -> str | None:
    """Why ONNX Runtime's kernels read one of the group's inputs as float32 whatever the schema
    allows (op_lists/kernel_float32_inputs.yaml: Resize's roi), or None."""
    inputs = shipped_table("kernel_float32_inputs.yaml").get(sig.op_type) if sig.domain == "" else None
    if not inputs:
        return None
    for i in group.inputs:
        formal = schemas.formal_at(sig.inputs, i)
        if formal is not None and formal.name in inputs:
            return inputs[formal.name]
    return None
