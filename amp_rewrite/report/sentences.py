"""Reasons in words: the chain of a vertex's reasons, and the one sentence a user reads.

Every vertex carries a Reason (step + the neighbour it came through); following `via` links gives
the chain, e.g. "Add 'a1' float32: downstream of deny through Reshape 'r1' from Softmax 'sm'
(deny list)". The wording is chosen by the reason's `Step`, never by matching strings.
"""

from __future__ import annotations

from amp_rewrite.analysis.graph import ColouringGraph
from amp_rewrite.plan import LOW, Plan, Step

MAX_CHAIN = 32


def _label(cg: ColouringGraph, v: int) -> str:
    vertex = cg.vertices[v]
    return (
        f"{vertex.op_type} '{vertex.name}'"
        if vertex.name
        else f"{vertex.op_type} (unnamed, scope {vertex.scope} #{vertex.node})"
    )


def chain(cg: ColouringGraph, plan: Plan, v: int) -> list[str]:
    """The reason of `v`, then of the vertex it came through, and so on to the root."""
    steps = []
    seen = set()
    while v is not None and v not in seen and len(steps) < MAX_CHAIN:
        seen.add(v)
        reason = plan.reason[v]
        steps.append(f"{_label(cg, v)}: {reason.text}")
        v = reason.via
    return steps


def explain(cg: ColouringGraph, plan: Plan, v: int) -> str:
    vertex = cg.vertices[v]
    colour = cg.target if plan.colour[v] == LOW else "float32"
    parts = chain(cg, plan, v)
    head = f"{_label(cg, v)} [{vertex.group.type_param.split('@')[0]}] {colour}: {plan.reason[v].text}"
    if len(parts) > 1:
        head += " <- " + " <- ".join(parts[1:])
    return head


def sentence(cg: ColouringGraph, plan: Plan, v: int) -> str:
    """One sentence a user can follow, e.g. "Add 'a' kept float32: infer op downstream of deny op
    ReduceMean 'ln/ReduceMean' through Reshape 'r1'"."""
    vertex = cg.vertices[v]
    low = plan.colour[v] == LOW
    verb = f"in {cg.target}" if low else "kept float32"
    path = [v]
    seen = {v}
    while plan.reason[path[-1]].via is not None and len(path) < MAX_CHAIN:
        nxt = plan.reason[path[-1]].via
        if nxt in seen:
            break
        seen.add(nxt)
        path.append(nxt)
    reason = plan.reason[v]
    step = reason.step
    kind = f"{vertex.op_list} op" if vertex.op_list else "op"
    through = ""
    if len(path) > 2:
        through = " through " + ", ".join(_label(cg, w) for w in path[1:-1])
    root = _label(cg, path[-1])
    root_reason = plan.reason[path[-1]]
    if step is Step.DENY_LIST:
        text = f"deny list ({vertex.list_reason})" if vertex.list_reason else "deny list"
    elif step is Step.ALLOW_LIST:
        text = f"allow list ({vertex.list_reason})" if vertex.list_reason else "allow list"
    elif step is Step.DOWNSTREAM_OF_DENY:
        why = "" if root_reason.step is Step.DENY_LIST else f" ({root_reason.text})"
        text = f"{kind} downstream of deny op {root}{through}{why}"
    elif step is Step.BETWEEN_ALLOW:
        text = f"{kind} between allow ops, reached from {root}{through}"
    elif step is Step.CLEAR_NEXT_TO_LOW:
        text = f"clear op next to low-precision {root}{through}"
    elif step is Step.INFER_AFTER_ALLOW:
        text = f"infer op fed by low-precision {root}{through}"
    elif step is Step.TIED and reason.via is not None and reason.via != v:
        text = f"{reason.detail}: {_label(cg, reason.via)}"
    elif step is Step.ALL_CONSUMERS_LOW:
        text = f"every consumer is low precision (e.g. {root})"
    else:
        text = reason.text
    if vertex.relaxed:
        text += f"; a deny-list op relaxed to infer: {vertex.relaxed}"
    return f"{_label(cg, v)} {verb}: {text}"


def removed(cg: ColouringGraph, v: int, detail: str) -> str:
    """The sentence of a node removed after colouring (`Step.REMOVED_NO_OP`): the model's own Cast
    that converts nothing in the result, e.g. "Cast 'c' removed: converts nothing: its input 's' is
    float16 already"."""
    return f"{_label(cg, v)} removed: {detail}"
