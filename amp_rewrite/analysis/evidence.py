"""Evidence for cost placement's extra low ops: their values must fit the target type.

TF's rule makes an infer or clear op low only between two allow ops; cost placement also makes
low the free ops whose bytes it saves, such as the `* 100 * 10` after a MatMul in
onnxconverter-common's own test model, whose values reach 274,000 (inf in float16). Each op cost
placement makes low that TF's rule keeps float32 (an *extra* op) needs evidence that every tensor
of its type group fits:
- a data-free bound (op_lists/range_bounds.yaml): constants, ops bounded by 1, ops that preserve,
  add, multiply or divide their inputs' reach; a value TF's rule holds low counts as one unit of
  "accepted" reach (it would be low under TF too). Bound: |x| <= abs + rel * accepted, enough when
  rel <= 1 and abs <= LIMIT / SAFETY;
- else its tensors measured on synthesised inputs (one float32 run, as ModelOpt AutoCast does by
  default, with AutoCast's default limit MEASURED_LIMIT), when the model is within the work budget;
- else it stays float32 (TF's colour), with the reason.
Pinned ops are blocked and the colouring is run again (the cut may move), until no extra op lacks
evidence: a few rounds, each one min cut. The bounds are one sweep over the nodes: linear.
"""

from __future__ import annotations

import time
from functools import cache

import numpy as np

from amp_rewrite.analysis.oplists import shipped_table
from amp_rewrite.io import tensordata
from amp_rewrite.onnx_facts import FLOAT, constant_tensor
from amp_rewrite.plan import Step

LIMIT = 65504.0  # float16's largest value (bfloat16 needs no check)
SENTINEL = float(np.finfo(np.float32).max)
SAFETY = 4.0  # a data-free bound must stay this far inside (as calibration's default safety)
MEASURED_LIMIT = 512.0  # AutoCast's data_max: synthesised inputs are not the real ones
MAX_ROUNDS = 8
MAX_CONSTANT = 4096  # elements: a larger constant is not read here (the constant scan read its reach)
ACCEPTED = (0.0, 1.0)
NEVER_FREE = (Step.DENY_LIST, Step.DOWNSTREAM_OF_DENY, Step.MEASURED, Step.TIED)  # float32 whatever the cut


@cache
def _rules() -> dict:
    table = shipped_table("range_bounds.yaml")
    kinds = ("unit", "preserving", "sum", "product", "quotient", "normalised")
    return {op: kind for kind in kinds for op in table[kind]}


def _normalised(cg, s: int, n: int, bounds: list):
    """A normalisation's output bound: sqrt(count - 1) x |scale| + |bias| (None: unknown), the
    count of the elements normalised over from its input's known shape and `axis` (default -1)."""
    node = cg.node(s, n)
    shape = cg.shapes.get(node.input[0])
    if shape is None or not bounds or any(b is None for b in bounds):
        return None
    dims = [d.dim_value for d in shape.dim]
    axis = next((a.i for a in node.attribute if a.name == "axis"), -1)
    normalised = dims[axis:] if -len(dims) <= axis < len(dims) else None
    if not normalised or any(d <= 0 for d in normalised):
        return None
    spread = float(np.sqrt(max(int(np.prod(normalised)) - 1, 0)))
    bias = bounds[1] if len(bounds) > 1 else (0.0, 0.0)
    return (spread * bounds[0][0] + bias[0], spread * bounds[0][1] + bias[1])


def _combine(kind: str, bounds: list, divisor_min):
    """The output bound of an op of `kind` from its float inputs' bounds (None: unknown)."""
    if kind == "unit":
        return (1.0, 0.0)
    if any(b is None for b in bounds) or not bounds:
        return None
    if kind == "preserving":
        return (max(b[0] for b in bounds), max(b[1] for b in bounds))
    if kind == "sum":
        return (sum(b[0] for b in bounds), sum(b[1] for b in bounds))
    if kind == "product":
        scaled = [b for b in bounds if b[1] > 0]
        if len(scaled) > 1:
            return None  # accepted x accepted: no bound
        absolute = float(np.prod([b[0] for b in bounds if b[1] == 0]))
        if not scaled:
            return (absolute, 0.0)
        return (scaled[0][0] * absolute, scaled[0][1] * absolute)
    if kind == "quotient":
        if divisor_min is None or divisor_min <= 0:
            return None
        return (bounds[0][0] / divisor_min, bounds[0][1] / divisor_min)
    return None


class Bounds:
    """Per tensor name: (abs, rel) or None, computed on demand: a tensor's bound needs its
    producer's inputs' bounds only up to the values TF's rule holds low (ACCEPTED), so the extras'
    bounds read a few nodes each, not a sweep over the whole model (1.5 s at 100k nodes)."""

    def __init__(self, cg, tf_low: set):
        self.cg, self.tf_low = cg, tf_low
        self.bound: dict = {}
        self.smallest: dict = {}  # constant name -> its smallest |value|
        self.given: dict = {}  # tensors that fit by the user's word (low_io): what `of` answers for them

    def of(self, s: int, name: str):
        """The bound of `name` as read in scope `s`: a node's output, a constant, or None."""
        if name in self.given:
            return self.given[name]
        stack = [(s, name)]
        while stack:  # depth first, each node's inputs before it: iterative (a long chain is deep)
            scope, x = stack[-1]
            if x in self.bound:
                stack.pop()
                continue
            pending = self._evaluate(scope, x)
            if pending:
                stack.extend(pending)
            else:
                stack.pop()
        return self.bound[name]

    def _evaluate(self, s: int, x: str) -> list:
        """Set the bound of `x` (and its producer's other outputs) if its inputs' are known; else
        the (scope, name) of the inputs still to evaluate."""
        cg = self.cg
        found = cg.resolve(s, x)
        if (
            found is None
            or found.definition[0] != "node"
            or cg.scopes[found.scope].op_types[found.definition[1]] == "Constant"
        ):
            self.bound[x] = self._constant(found, x)
            return []
        p, n = found.scope, found.definition[1]
        scope, row = cg.scopes[p], cg.writes[p][n]
        inputs, outputs = scope.io[n]
        if not row or row[list(outputs).index(x)] is None:
            self.bound[x] = None
            return []
        kind = _rules().get(scope.op_types[n]) if scope.domains[n] in ("", "ai.onnx") else None
        float_inputs = [y for y in inputs if y and cg.types.get(y) == FLOAT]
        if kind == "normalised":  # the data input's values do not matter: scale and bias do
            float_inputs = [y for y in inputs[1:3] if y and cg.types.get(y) == FLOAT]
        out = None
        # a bound that needs no input's but constants' (a unit or normalised op, an op of
        # constants: TorchScript's Identity of a shared LayerNorm weight) is worked out even where
        # TF's rule holds the op low: an absolute bound is more than one unit of "accepted" reach
        # (a residual Add of a LayerNorm and a MatMul is then bounded)
        absolute = kind in ("unit", "normalised") or (
            kind is not None and bool(float_inputs) and all(_is_constant(cg, p, y) for y in float_inputs)
        )
        if kind is not None and (
            absolute
            or not all(
                row[slot] in self.tf_low for slot, y in enumerate(outputs) if y and row[slot] is not None
            )
        ):
            pending = [(p, y) for y in float_inputs if y not in self.bound]
            if pending:  # (a graph is acyclic: each is evaluated once)
                return pending
            divisor = None
            if kind == "quotient" and len(float_inputs) == 2:
                divisor = self.smallest.get(float_inputs[1])
            if kind == "normalised":
                out = _normalised(cg, p, n, [self.bound[y] for y in float_inputs])
            else:
                out = _combine(kind, [self.bound[y] for y in float_inputs], divisor)
        for slot, y in enumerate(outputs):
            if y and row[slot] is not None:
                if row[slot] not in self.tf_low:
                    self.bound[y] = out
                else:
                    self.bound[y] = out if absolute and _bounded(out) and out[1] == 0 else ACCEPTED
        return []

    def _constant(self, found, name: str):
        """(largest |value|, 0) of a small float constant (its smallest |value| noted), else None."""
        if found is None:
            return None
        kind, n, _ = found.definition
        scope = self.cg.scopes[found.scope]
        tensor = None
        if kind == "initializer":
            tensor = (
                self.cg.borrowed.get(name, scope.initializers.get(name))
                if found.scope == 0
                else scope.initializers.get(name)
            )
        elif kind == "node" and scope.op_types[n] == "Constant":
            tensor = constant_tensor(scope.graph.node[n])
        if tensor is None or tensor.data_type != FLOAT:
            return None
        if int(np.prod(tensor.dims)) > MAX_CONSTANT:  # a table: the constant scan read its reach
            reach = self.cg.constant_reach.get((found.scope, name))
            return None if reach is None else (reach, 0.0)
        values = np.abs(tensordata.float_values(tensor))
        if not (values.size and np.isfinite(values).all()):
            return None
        self.smallest[name] = float(values.min())
        return (float(values.max()), 0.0)

    def sentinel(self, s: int, name: str) -> bool:
        """A constant all of whose values are float32's largest: a mask sentinel (transform.weights)."""
        b = self.of(s, name)
        return b is not None and b[0] == SENTINEL and self.smallest.get(name) == SENTINEL


def group_tensors(cg, v: int) -> list:
    """The named float tensors of vertex `v`'s type group (inputs, then outputs)."""
    vertex = cg.vertices[v]
    inputs, outputs = cg.scopes[vertex.scope].io[vertex.node]
    names = [inputs[i] for i in vertex.group.inputs if inputs[i]]
    names += [outputs[i] for i in vertex.group.outputs if outputs[i]]
    return names


def _is_constant(cg, s: int, name: str) -> bool:
    found = cg.resolve(s, name)
    if found is None:
        return False
    kind, n, _ = found.definition
    return kind == "initializer" or (kind == "node" and cg.scopes[found.scope].op_types[n] == "Constant")


def _bounded(b) -> bool:
    return b is not None and b[1] <= 1.0 and b[0] <= LIMIT / SAFETY


def settle(cg, colour, measure=None, skipped: str | None = None, low_io: frozenset = frozenset()):
    """(plan, note): cost placement's plan once every extra low op has evidence; the note says
    what was measured or why nothing was (None when no extra op needed it).

    `colour(placement)` runs the passes on `cg`; `measure(names)` -> {name: largest |value| on
    synthesised inputs, inf where not finite; absent where not measured} or None when it cannot run; `skipped`: why no
    measurement may run (over the work budget), or None; `low_io`: main-graph inputs and outputs in
    the target type, which fit by the user's word."""
    if cg.target != "float16":
        return colour("cost"), None
    if skipped is not None:
        return _settle_unmeasured(cg, colour, skipped, low_io)
    plan = colour("cost")
    tf_plan = colour("tf")
    tf_low = {v for v, c in tf_plan.colour.items() if c == "low"}
    extras = [
        v
        for v, c in plan.colour.items()
        if c == "low" and v not in tf_low and not cg.vertices[v].group.output_only
    ]
    if not extras:
        return plan, None
    bounds = Bounds(cg, tf_low)
    bounds.given.update(dict.fromkeys(low_io, ACCEPTED))  # given or asked for in the target type: they fit
    proven: set = set()
    measured: dict = {}
    count, failed, seconds, why_not = 0, [], 0.0, skipped
    for _ in range(MAX_ROUNDS):
        unproven = {}
        for v in extras:
            if v in proven:
                continue
            vertex = cg.vertices[v]
            tensors = group_tensors(cg, v)
            names = [x for x in tensors if not _is_constant(cg, vertex.scope, x)]
            if all(_bounded(bounds.of(vertex.scope, x)) for x in names) or any(
                bounds.sentinel(vertex.scope, x) for x in tensors
            ):
                proven.add(v)  # (a mask sentinel's reader: the constant scan's rule makes it +-65504 x mask)
            else:
                unproven[v] = names
        if not unproven:
            break
        wanted = sorted({x for names in unproven.values() for x in names} - measured.keys())
        if wanted and why_not is None and measure is not None:
            started = time.perf_counter()
            got = measure(wanted)
            seconds += time.perf_counter() - started
            if got is None:  # the model does not run on made-up inputs (indices, masks): no verdict
                return plan, (
                    f"range check: {len(unproven)} ops low by cost placement but float32 by TF's rule "
                    "are not checked: the model did not run on synthesised inputs (calibrate with "
                    "samples to check them)"
                )
            else:
                measured.update({x: got.get(x) for x in wanted})
        pins = {}
        for v, names in unproven.items():
            values = [measured.get(x) for x in names] if why_not is None else [None]
            worst = max((x for x in values if x is not None), default=0.0)
            if why_not is None and all(x is not None for x in values) and worst <= MEASURED_LIMIT:
                proven.add(v)
                count += 1
                continue
            if why_not is not None:
                pins[v] = (
                    f"cost placement would make it {cg.target}, but TF's rule keeps it float32 and no range "
                    f"evidence could be had ({why_not})"
                )
            elif any(x is None for x in values):
                pins[v] = (
                    f"cost placement would make it {cg.target}, but TF's rule keeps it float32 and "
                    "its values could not be measured (a body's tensor)"
                )
            else:
                pins[v] = (
                    f"cost placement would make it {cg.target}, but TF's rule keeps it float32 and "
                    f"synthesised inputs reach {worst:.4g} (AutoCast's limit {MEASURED_LIMIT:g})"
                )
        if not pins:
            break
        for v, reason in pins.items():
            cg.vertices[v].blocked = reason
            failed.append(v)
        plan = colour("cost")
        extras = [
            v
            for v, c in plan.colour.items()
            if c == "low" and v not in tf_low and not cg.vertices[v].group.output_only
        ]
    else:
        for v in extras:  # the rounds ran out: what is left unproven takes TF's colour
            if v not in proven:
                cg.vertices[
                    v
                ].blocked = "cost placement would make it low; no range evidence after the last round"
                failed.append(v)
        plan = colour("cost")
    return plan, _note(len(measured), count, len(failed), seconds, why_not)


def _settle_unmeasured(cg, colour, why_not: str, low_io: frozenset):
    """`settle` where nothing may be measured: every op TF's rule keeps float32 that the cut could
    make low needs a data-free bound, and those without one are blocked before the one cost
    colouring. The same optimum as pinning what each cut makes low and cutting again, round after
    round (that result is feasible here and optimal under fewer pins), for one cut instead of two
    or more: 1 s at 100k nodes."""
    tf_plan = colour("tf")
    tf_low = {v for v, c in tf_plan.colour.items() if c == "low"}
    bounds = Bounds(cg, tf_low)
    bounds.given.update(dict.fromkeys(low_io, ACCEPTED))
    unproven = 0
    for v, vertex in enumerate(cg.vertices):
        if v in tf_low or vertex.op_list not in ("infer", "clear") or vertex.blocked is not None:
            continue
        if vertex.group.output_only or tf_plan.reason[v].step in NEVER_FREE:
            continue  # never free for the cut
        tensors = group_tensors(cg, v)
        names = [x for x in tensors if not _is_constant(cg, vertex.scope, x)]
        if all(_bounded(bounds.of(vertex.scope, x)) for x in names) or any(
            bounds.sentinel(vertex.scope, x) for x in tensors
        ):
            continue
        vertex.blocked = (
            f"TF's rule keeps it float32 and no range evidence could be had ({why_not}): cost "
            f"placement may not make it {cg.target}"
        )
        unproven += 1
    plan = colour("cost")
    note = (
        f"range check: {unproven} ops float32 by TF's rule had no data-free bound and were not measured "
        f"({why_not}); they stay float32"
    )
    return plan, note if unproven else None


def _note(tensors: int, proven: int, failed: int, seconds: float, why_not: str | None) -> str | None:
    if not tensors and not failed:
        return None
    if why_not is not None:
        return (
            f"range check: {failed} ops low by cost placement but float32 by TF's rule had no data-free bound "
            f"and were not measured ({why_not}); they stay float32"
        )
    return (
        f"range check: {tensors} tensors of ops low by cost placement but float32 by TF's rule measured on "
        f"synthesised inputs in {seconds:.2f} s: {proven} within {MEASURED_LIMIT:g} stay low, {failed} stay float32"
    )
