"""Range-deny ops proved safe without data: the pointwise chain they sit in, run on every float16 value.

Pow, Exp, Reciprocal, Sinh and Cosh are denied because their results may leave float16's range
(`op_lists/range_relax.yaml`). Often the chain around them hands on only a bounded value: the
tanh GELU of GPT-2 computes x**3, which overflows beyond |x| = 40, but tanh then saturates to the
same +-1 float32 gives, so the whole chain is safe in float16 for any input. When everything the
chain computes is a function of one tensor `x` (pointwise ops, `op_lists/pointwise.yaml`, whose
other inputs are one-element constants), there are only 63,490 float16 values `x` can take
(finite ones and +-inf): the chain is run on all of them, once in float32 and once with every op
in float16 (the most rounding any colouring can give it), in `onnx.reference`. If every output
agrees within the tolerance below, the deny op is relaxed to infer with the figures in its
reason; placement then colours it like any infer op. No data, no sampling: a proof by
exhaustion for that chain. bfloat16 keeps float32's range but denies powers and exponentials
for precision: its 65,282 values are run the same way, in its own units, and the chain must also
not magnify its input's rounding (`_verdict`): GPT-2's GELU passes, so its FFN runs in bfloat16.

Agreement, per output value `e` (float32 chain) and `a` (float16 chain): |a - e| <= RTOL |e| +
ATOL, or both NaN, or the same infinity; a finite `e` beyond float16's largest value fails (the
float16 chain cannot hold it). RTOL is ten units in float16's last place; ATOL is float16's
spacing at 1, the scale of normalised activations (the GELU's worst case, x = -3.586, is
4.4e-4 off: tanh rounds to -1, the value is tiny). Linear: a chain is traced only from a deny
node of a range_relax op, through at most MAX_CHAIN nodes, and each distinct chain (op types,
attributes, wiring, constants) is run once per process.
"""

from __future__ import annotations

import heapq
from functools import cache, lru_cache

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from amp_rewrite import ir
from amp_rewrite.analysis.oplists import OpLists, shipped_table
from amp_rewrite.io import tensordata
from amp_rewrite.onnx_facts import DEFAULT_DOMAINS, FLOAT, constant_tensor

RTOL, ATOL = 1e-2, 2.0**-10  # float16's: ten units in its last place, its spacing at 1
MAX_CHAIN = 64  # nodes; a longer pointwise chain is left to the lists
FLOAT16_MAX = float(np.finfo(np.float16).max)


@cache
def pointwise_ops() -> frozenset:
    return frozenset(shipped_table("pointwise.yaml")["pointwise"])


@cache
def _range_ops() -> frozenset:
    return frozenset(shipped_table("range_relax.yaml")["relax"]) & pointwise_ops()


def relieved(scopes, lists: OpLists, types: dict, opsets: dict, borrowed=None) -> dict:
    """{node key: reason} for the deny nodes of range ops whose chain passes on every float16 value
    (node key: the node's name, else its first output, as `graph.build`'s `relax` expects)."""
    if lists.target not in _TYPES:
        return {}
    range_ops = [op for op in _range_ops() if (e := lists.classify("", op)) is not None and e.list == "deny"]
    if not range_ops:
        return {}
    range_ops = frozenset(range_ops)
    found, read_inside = {}, None
    for s, scope in enumerate(scopes):
        candidates = [
            n
            for n, op_type in enumerate(scope.op_types)
            if op_type in range_ops and scope.graph.node[n].domain in DEFAULT_DOMAINS
        ]
        if candidates:
            read_inside = read_inside or _read_by_bodies(scopes)  # only where a chain is traced
            view = _ScopeView(scope, borrowed if s == 0 else None, read_inside[s])
            found.update(_relieved_in(view, candidates, types, opsets, lists.target))
    return found


def _read_by_bodies(scopes) -> list:
    """Per scope: the names its nodes' bodies (If/Loop/Scan subgraphs, at any depth) read or
    return, any of which may be one of its tensors: a chain tensor read there leaves the chain."""
    read = [set() for _ in scopes]
    for s in range(len(scopes) - 1, 0, -1):  # children come after their parents
        scope = scopes[s]
        names = read[s] | {o.name for o in scope.graph.output}
        for inputs, _ in scope.io:
            names.update(inputs)
        read[scope.parent] |= names
    return read


class _ScopeView:
    """What a chain needs of one graph, read lazily: its readers and its one-element constants."""

    def __init__(self, scope, borrowed: dict | None, read_inside: set):
        self.scope, self.borrowed, self.read_inside = scope, borrowed or {}, read_inside
        self._readers = None

    def readers(self, name: str) -> list:
        if self._readers is None:
            self._readers = ir.readers(inputs for inputs, _ in self.scope.io)
            self._outputs = {o.name for o in self.scope.graph.output}
        return self._readers.get(name, [])

    def leaves_the_graph(self, name: str) -> bool:
        """A graph output, or read by a body of one of the graph's nodes."""
        self.readers(name)
        return name in self._outputs or name in self.read_inside

    def scalar(self, name: str):
        """A one-element constant's TensorProto, or None."""
        found = self.scope.defs.get(name)
        if found is None:
            return None
        if found.kind == "initializer":
            tensor = self.borrowed.get(name, self.scope.initializers.get(name))
        elif found.kind == "node" and self.scope.op_types[found.node] == "Constant":
            tensor = constant_tensor(self.scope.graph.node[found.node])
        else:
            return None
        if tensor is None or int(np.prod(tensor.dims)) != 1:
            return None
        return tensor


def _relieved_in(view: _ScopeView, candidates: list, types: dict, opsets: dict, target: str) -> dict:
    nodes, io = view.scope.graph.node, view.scope.io
    found, candidate_set = {}, set(candidates)
    for d in candidates:
        inputs, outputs = io[d]
        key = nodes[d].name or (outputs[0] if outputs else "")
        if key in found:
            continue
        dynamic = [x for x in inputs if x and view.scalar(x) is None]
        if len(dynamic) != 1 or types.get(dynamic[0]) != FLOAT:
            continue
        chain = _chain(view, dynamic[0])
        if chain is None or d not in chain:
            continue
        description = _describe(view, dynamic[0], chain)
        compared = _compared(description, chain)
        if d not in compared:  # nothing the chain hands on depends on it: there is nothing to compare
            continue
        ok, detail = _verdict(description, _opset_key(opsets), target)
        if ok:
            for (
                n
            ) in chain:  # every range-deny op of the chain whose value was compared is proved by the same run
                if n in candidate_set and n in compared:
                    found[nodes[n].name or io[n][1][0]] = (
                        f"checked on every {target} value: the pointwise chain of {len(chain)} ops from "
                        f"'{dynamic[0]}' agrees with float32 ({detail})"
                    )
    return found


def _chain(view: _ScopeView, x: str):
    """The nodes computed from `x` alone by pointwise ops (one-output, one-element constants
    beside), in node order; None when the graph is unsorted there or the chain is too long."""
    ops = pointwise_ops()
    nodes, io = view.scope.graph.node, view.scope.io
    inside, chain, seen = {x}, [], set()
    heap = list(view.readers(x))
    heapq.heapify(heap)
    while heap:
        n = heapq.heappop(heap)
        if n in seen:
            continue
        seen.add(n)
        inputs, outputs = io[n]
        node = nodes[n]
        if node.op_type not in ops or node.domain not in DEFAULT_DOMAINS or len(outputs) != 1:
            continue
        if not all(not i or i in inside or view.scalar(i) is not None for i in inputs):
            continue
        for i in inputs:  # a cone input made later than the node: unsorted here, give up
            found = view.scope.defs.get(i)
            if i in inside and i != x and found.node > n:
                return None
        chain.append(n)
        if len(chain) > MAX_CHAIN:
            return None
        inside.add(outputs[0])
        for r in view.readers(outputs[0]):
            if r not in seen:
                heapq.heappush(heap, r)
    return chain


def _describe(view: _ScopeView, x: str, chain: list) -> tuple:
    """The chain as a hashable, model-independent description: per node (op type, attributes,
    inputs), inputs as "x", ("t", k) for node k's output, or ("c", constant bytes); then which
    node outputs leave the chain."""
    nodes, io = view.scope.graph.node, view.scope.io
    index = {io[n][1][0]: k for k, n in enumerate(chain)}
    rows, leaving = [], []
    for k, n in enumerate(chain):
        inputs, outputs = io[n]
        refs = []
        for i in inputs:
            if not i:
                refs.append(None)
            elif i == x:
                refs.append("x")
            elif i in index:
                refs.append(("t", index[i]))
            else:
                refs.append(("c", _tensor_key(view.scalar(i))))
        node = nodes[n]
        rows.append((node.op_type, tuple(a.SerializeToString() for a in node.attribute), tuple(refs)))
        out = outputs[0]
        if view.leaves_the_graph(out) or any(r not in chain for r in view.readers(out)):
            leaving.append(k)
    return tuple(rows), tuple(leaving)


def _compared(description: tuple, chain: list) -> set:
    """The chain's nodes whose values reach an output that leaves it: only those did the run
    compare (a node whose output nothing reads, MatMul -> Exp and no reader, proves nothing)."""
    rows, leaving = description
    reaching = set(leaving)
    for k in range(len(rows) - 1, -1, -1):  # rows are in node order: readers come after
        if k in reaching:
            continue
        if any(ref == ("t", k) for j in reaching for ref in rows[j][2]):
            reaching.add(k)
    return {chain[k] for k in reaching}


def _tensor_key(tensor: onnx.TensorProto) -> tuple:
    return tensor.data_type, tuple(tensor.dims), tensordata.tensor_bytes(tensor)


def _opset_key(opsets: dict) -> tuple:
    return tuple(sorted(opsets.items()))


@lru_cache(maxsize=256)
def _verdict(description: tuple, opsets: tuple, target: str = "float16") -> tuple[bool, str]:
    """(agrees, the figures): the chain run on every `target` value in both precisions. For
    bfloat16, whose range is float32's, what must hold is precision: also that the chain does
    not magnify a rounding of its input, the float32 chain at x moved half a unit either way
    agreeing with it at x (a high power after a rounded product would magnify it)."""
    from onnx.reference import ReferenceEvaluator

    elem, dtype = _TYPES[target]
    rtol, atol, largest = _tolerances(target)
    x16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dtype)
    x16 = x16[~np.isnan(x16.astype(np.float32))]
    xs = x16.astype(np.float32)
    if target == "bfloat16":
        half_unit = float(ml_dtypes.finfo(dtype).eps) / 2
        xs = np.concatenate([xs, xs * (1 + half_unit), xs * (1 - half_unit)])
    try:
        with np.errstate(all="ignore"):
            e = ReferenceEvaluator(_model(description, opsets, TensorProto.FLOAT)).run(None, {"x": xs})
            a = ReferenceEvaluator(_model(description, opsets, elem)).run(None, {"x": x16})
    except _OutOfRange as exc:
        return False, str(exc)
    except Exception as exc:  # noqa: BLE001 - an op onnx.reference cannot run: the list decides
        return False, f"onnx.reference could not run it ({type(exc).__name__})"
    worst = 0.0
    n = x16.size
    with np.errstate(all="ignore"):
        for e_out, a_out in zip(e, a):
            ev, av = e_out.astype(np.float32).reshape(-1), a_out.astype(np.float32).reshape(-1)
            if ev.size != xs.size or av.size != n:  # a constant broadcast it wider: not one value per x
                return False, "its outputs are not one value per input value"
            ev, moved = ev[:n], ev[n:].reshape(-1, n)
            beyond = np.isfinite(ev) & (np.abs(ev) > largest)
            if beyond.any():
                i = int(np.argmax(beyond))
                return False, f"float32 gives {ev[i]:.4g} at x = {float(x16[i]):.4g}, beyond {target}'s range"
            allowed = rtol * np.abs(ev) + atol
            for got, what in [(av, target), *((m, "float32 at x moved half a unit") for m in moved)]:
                err = np.abs(got - ev)
                agree = (err <= allowed) | (np.isnan(ev) & np.isnan(got)) | (np.isinf(ev) & (got == ev))
                if not agree.all():
                    i = int(np.argmin(agree))
                    return (
                        False,
                        f"{what} gives {got[i]:.4g} where float32 gives {ev[i]:.4g} at x = {float(x16[i]):.4g}",
                    )
                finite = np.isfinite(ev)
                if finite.any():
                    worst = max(worst, float(np.max(err[finite] / allowed[finite])))
    return True, f"worst error {worst:.2f} of |a-e| <= {rtol:.3g}|e| + {atol:.3g}"


_TYPES = {
    "float16": (TensorProto.FLOAT16, np.float16),
    "bfloat16": (TensorProto.BFLOAT16, ml_dtypes.bfloat16),
}


def _tolerances(target: str) -> tuple:
    """(rtol, atol, largest value) of the agreement rule: float16's RTOL and ATOL, and for bfloat16
    the same in its own units (eight times coarser: 7 stored mantissa bits, not 10)."""
    if target == "float16":
        return RTOL, ATOL, FLOAT16_MAX
    scale = float(ml_dtypes.finfo(ml_dtypes.bfloat16).eps / np.finfo(np.float16).eps)
    return RTOL * scale, ATOL * scale, float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)


class _OutOfRange(ValueError):
    pass


def _model(description: tuple, opsets: tuple, elem: int) -> onnx.ModelProto:
    """The chain as a model of one input `x` (shape [N]) in element type `elem`: float32 constants
    are converted with it (one beyond float16's range fails the check)."""
    rows, leaving = description
    nodes, inits = [], []
    for k, (op_type, attributes, refs) in enumerate(rows):
        names = []
        for j, ref in enumerate(refs):
            if ref is None:
                names.append("")
            elif ref == "x":
                names.append("x")
            elif ref[0] == "t":
                names.append(f"t{ref[1]}")
            else:
                names.append(f"c{k}_{j}")
                inits.append(_constant(names[-1], ref[1], elem))
        node = helper.make_node(op_type, names, [f"t{k}"])
        for raw in attributes:
            attr = node.attribute.add()
            attr.ParseFromString(raw)
        nodes.append(node)
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", elem, [None])],
        [helper.make_tensor_value_info(f"t{k}", elem, None) for k in leaving],
        inits,
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets], ir_version=8
    )


def _constant(name: str, key: tuple, elem: int) -> onnx.TensorProto:
    data_type, dims, data = key
    values = np.frombuffer(data, dtype=helper.tensor_dtype_to_np_dtype(data_type)).reshape(dims)
    if data_type == FLOAT and elem != FLOAT:
        low = helper.tensor_dtype_to_np_dtype(elem)
        if np.any(np.abs(values) > float(ml_dtypes.finfo(low).max)):
            raise _OutOfRange(f"constant {float(values.reshape(-1)[0]):.4g} is beyond its type's range")
        values = values.astype(low)
    return numpy_helper.from_array(values, name)
