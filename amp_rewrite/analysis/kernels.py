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

Which table: `Deployment.kernels` ("cuda", "cpu", or None for no check), passed in by options.
"""

from __future__ import annotations

import functools

from amp_rewrite.analysis.oplists import shipped_table

_NAMES = {"cuda": "CUDA", "cpu": "CPU"}
REASON_PREFIX = "no {target} kernel on "


@functools.cache
def table(provider: str) -> dict:
    """'domain:op' -> [(since, until or None, {type param: frozenset of types})], newest first."""
    raw = shipped_table(f"kernels_{provider}.json")["kernels"]
    return {
        key: [(since, until, {p: frozenset(t) for p, t in types.items()}) for since, until, types in rows]
        for key, rows in raw.items()
    }


def is_kernel_reason(text: str | None) -> bool:
    return bool(text) and text.startswith(("no float16 kernel on ", "no bfloat16 kernel on "))


class KernelCheck:
    """`blocked(domain, op, opset, type_param)` -> (reason or None, note or None) for one
    provider and target; answers are cached per op kind by graph.build's templates."""

    def __init__(self, provider: str, target: str):
        self.provider, self.target = provider, target
        self.kernels = table(provider)
        self._noted: set = set()

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


def newer_opset_advice(cg, check: KernelCheck, opsets: dict) -> list[str]:
    """One line per op type whose nodes stay float32 only because the provider has no target-type
    kernel at the model's opset, naming the first newer opset whose kernel runs them ("18 Clip
    nodes stay float32 at opset 11: --opset 12 runs them in float16"). One pass over the vertices."""
    import onnx.defs

    from amp_rewrite.analysis import schemas

    latest = onnx.defs.onnx_opset_version()
    blocked: dict = {}  # op type -> set of nodes
    for vertex in cg.vertices:
        if is_kernel_reason(vertex.blocked) and cg.scopes[vertex.scope].domains[vertex.node] in (
            "",
            "ai.onnx",
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
