"""The apply half of a CPU step, run by numpy over cache-sized blocks of each weight.

ONNX Runtime's inference build has no fused optimizer kernel, so the update (optimizers.py) is a
chain of whole-tensor elementwise ops (AdamW: 13 per weight, 11.6 of the MLP's 52 ms step). Run
block by block, the chain's operands stay in cache between its ops (6.4 ms). (A C loop fusing each
chain saved 0.5 ms of the MLP's 58 ms step when last measured, under 1%: it was dropped, and the
wheel is pure Python; docs/decisions.md.)

The program is compiled once from the split step's apply graph (`split_step.py`), so an optimizer
is still written once, as ONNX. Tensors are *big* (an input of at least `BIG` elements, or an
elementwise op of a big one: blocked, written into preallocated buffers, a chain's result into the
state array in place) or *small* (scalars and reductions of an input: evaluated whole each step,
like the `If` on the skip flag). The ops are ONNX Runtime's, in its order, each rounded as it
rounds (a small Pow through C's powf, `_power`). The promise is a tolerance, tested
(tests/training/test_host_update.py): the state stays within 1e-6 of itself of the apply session's,
step after step; it is bit for bit where numpy, libm and ONNX Runtime agree, as here, but another
powf may round beta^t an ulp apart, and a reduction's sum (a global-norm clip) is taken in another
order. An op outside the tables below (a user's optimizer) is `Unsupported`: ONNX Runtime's apply
session runs that update (split_runner.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses

import numpy as np
import onnx
from onnx import helper, numpy_helper

BLOCK = 65536  # elements per block: fewer calls than 32K, as fast from cache (16K-256K measured)
BIG = 2  # inputs of 2+ elements run in chains, biases too: a chain's call costs about 1 us, a node
# evaluated whole about 7 (the MLP's update 0.15 ms faster than from 4096 elements up)

_FLOAT_OPS = dict(  # elementwise, float32 in and out: blocked when an input is big
    Add=np.add, Sub=np.subtract, Mul=np.multiply, Div=np.divide, Sqrt=np.sqrt, Neg=np.negative,
    Reciprocal=np.reciprocal, Abs=np.absolute, Sign=np.sign,
)  # fmt: skip


def _divide(a, b):
    """ONNX Div: integers divided as ONNX Runtime does, truncating toward zero, and kept integers."""
    a, b = np.asarray(a), np.asarray(b)
    if np.issubdtype(a.dtype, np.integer):
        return (np.abs(a) // np.abs(b) * np.sign(a) * np.sign(b)).astype(a.dtype)
    return np.divide(a, b)


def _libm_power(dtype, name, ctype):
    """C's powf or pow, which ONNX Runtime's CPU Pow calls (std::pow), over an array."""
    function = getattr(ctypes.CDLL(ctypes.util.find_library("m") or ctypes.util.find_library("c")), name)
    function.restype, function.argtypes = ctype, [ctype, ctype]
    return np.dtype(dtype), np.vectorize(function, otypes=[dtype])


_LIBM_POWER = dict(
    _libm_power(*f) for f in ((np.float32, "powf", ctypes.c_float), (np.float64, "pow", ctypes.c_double))
)


def _power(base, exponent):
    """ONNX Pow on small tensors (Adam's beta^t) as ONNX Runtime computes it: numpy's power is SIMD
    code on AVX-512 machines, an ulp off powf on 11 of 98 values of beta^t. (A big tensor's Pow is
    not compiled, `_FLOAT_OPS`: ONNX Runtime's apply session runs it.)"""
    base = np.asarray(base)
    power = _LIBM_POWER.get(base.dtype, np.power)  # integers: exact in numpy
    return np.asarray(power(base, np.asarray(exponent).astype(base.dtype)), base.dtype)


_SMALL_OPS = _FLOAT_OPS | dict(  # evaluated whole, on scalars and small tensors
    Pow=_power, Div=_divide, Min=np.minimum, Max=np.maximum, And=np.logical_and,
    Or=np.logical_or, Not=np.logical_not, Greater=np.greater, GreaterOrEqual=np.greater_equal,
    Less=np.less, LessOrEqual=np.less_equal, Equal=np.equal, IsNaN=np.isnan, IsInf=np.isinf,
    Where=np.where,
)  # fmt: skip
_REDUCTIONS = {"ReduceSumSquare": lambda x: np.dot(x.reshape(-1), x.reshape(-1)), "ReduceSum": np.sum}


class Unsupported(Exception):
    """The apply graph holds something this program does not run."""


@dataclasses.dataclass
class _Chain:
    """The big ops of one tensor shape, run block by block: (function, inputs, output) each, with
    each output's buffer: ('array', name) for a state's array, or ('scratch', index)."""

    size: int
    ops: list
    buffers: dict
    scratch_count: int
    calls: list = dataclasses.field(default_factory=list)  # (function, args, out) per block and op
    holders: dict = dataclasses.field(default_factory=dict)  # small input -> the array calls read


@dataclasses.dataclass
class _Program:
    """One graph's nodes: small steps in order (an If among them), then the big chains, then the
    small results copied into their state arrays (`writes`: tensor -> state name)."""

    small: list
    chains: list
    writes: dict


class HostUpdate:
    """`run()` applies one step: reads the gradients and the flag from their arrays and updates the
    state arrays in place."""

    def __init__(self, program: _Program, env: dict):
        self._program, self._env = program, env

    @classmethod
    def compile(cls, apply: onnx.ModelProto, arrays: dict[str, np.ndarray], next_state: dict[str, str]):
        """The program of `apply` over `arrays` (an array per apply input: state, gradients, flag,
        rate), writing each state's next value into its array. `Unsupported` (saying what) when
        `apply` holds an op or a form this does not run: ONNX Runtime's apply session runs it then."""
        graph = apply.graph
        missing = [i.name for i in graph.input if i.name not in arrays]
        if missing:
            raise RuntimeError(f"no array for apply input {missing[0]!r}")  # our own bug
        env = dict(arrays)
        env.update((t.name, numpy_helper.to_array(t)) for t in graph.initializer)
        big = {name: a.shape for name, a in arrays.items() if a.dtype == np.float32 and a.size >= BIG}
        writes = {out: state for state, out in next_state.items()}
        scalars = {name for name, value in env.items() if np.size(value) == 1}
        return cls(_compile(list(graph.node), _Scope(big, writes, env, scalars)), env)

    def run(self) -> None:
        with np.errstate(all="ignore"):  # Inf and NaN are values here, as in ONNX Runtime: no warnings
            _run(self._program, self._env)

    def blocked_sizes(self) -> list[int]:
        """The element count of each blocked chain, the If's branches included."""
        return _chain_sizes(self._program)


def _chain_sizes(program: _Program) -> list[int]:
    return [chain.size for chain in _chains(program)]


def _chains(program: _Program) -> list[_Chain]:
    """The program's chains, its If's branches' included."""
    inner = [c for step in program.small for p in getattr(step, "programs", ()) for c in _chains(p)]
    return list(program.chains) + inner


@dataclasses.dataclass
class _Scope:
    """What compiling a graph knows beyond its nodes, shared with its If's branches."""

    big: dict  # big tensor -> its shape
    writes: dict  # tensor -> the state whose array it must end in
    env: dict
    scalars: set  # tensors known to hold one element
    same: dict = dataclasses.field(default_factory=dict)  # a small node's output -> an equal earlier one
    seen: dict = dataclasses.field(default_factory=dict)  # a small node's (op, inputs, attributes) -> output


def _compile(nodes: list, scope: _Scope) -> _Program:
    big, writes = scope.big, scope.writes
    small, by_shape, computed, handled, written = [], {}, set(), set(), set()
    for node in nodes:
        if node.domain not in ("", "ai.onnx") or len(node.output) != 1 and node.op_type != "If":
            raise Unsupported(f"{node.domain or 'ai.onnx'} op {node.op_type} {node.name!r}")
        node = _deduplicated_inputs(node, scope.same)
        reads = set(node.input)
        if reads & written:  # a state an If has already updated in place
            raise Unsupported(f"{node.name} reads a state after its update")
        big_inputs = [name for name in node.input if name in big]
        if node.op_type == "If":
            run_if, states = _if_step(node, scope)
            small.append(run_if)
            handled.update(node.output)
            written |= states
        elif big_inputs and node.op_type == "Identity" and writes.get(node.output[0]) == node.input[0]:
            handled.add(node.output[0])  # a state passed through unchanged: already where it must be
        elif big_inputs and node.op_type in (*_FLOAT_OPS, "Identity"):
            shapes = {big[name] for name in big_inputs}
            if len(shapes) > 1 or not all(n in big or n in scope.scalars for n in node.input):
                raise Unsupported(f"{node.name}: operands of several shapes")
            big[node.output[0]] = shapes.pop()
            computed.add(node.output[0])
            by_shape.setdefault(big[node.output[0]], []).append(node)
        elif big_inputs:
            if node.op_type not in _REDUCTIONS or computed & reads or not _reduces_all(node):
                raise Unsupported(f"op {node.op_type} {node.name!r}")
            small.append(_small_step(node))
            scope.scalars.add(node.output[0])
        elif not _repeats(node, scope):
            small.append(_small_step(node))
            whole = node.op_type in _REDUCTIONS and _reduces_all(node)
            if whole or all(name in scope.scalars for name in node.input):
                scope.scalars.add(node.output[0])
    chains = [_chain(shape, chain_nodes, writes) for shape, chain_nodes in by_shape.items()]
    if any(name in written for chain in chains for _, inputs, _ in chain.ops for name in inputs):
        raise Unsupported("a chain reads a state an If updated")
    small_writes = {t: s for t, s in writes.items() if t not in computed and t not in handled}
    return _Program(small, chains, small_writes)


def _repeats(node: onnx.NodeProto, scope: _Scope) -> bool:
    """Whether a small node computes what an earlier one did (each weight's update repeats the
    optimizer's scalars: the bias corrections, the step size): its output is then that one's."""
    key = (node.op_type, tuple(node.input), tuple(a.SerializeToString() for a in node.attribute))
    earlier = scope.seen.get(key)
    if earlier is None or node.output[0] in scope.writes:
        scope.seen.setdefault(key, node.output[0])
        return False
    scope.same[node.output[0]] = earlier
    return True


def _deduplicated_inputs(node: onnx.NodeProto, same: dict) -> onnx.NodeProto:
    """`node` reading the first of each set of equal small tensors."""
    if not any(name in same for name in node.input):
        return node
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    copy.input[:] = [same.get(name, name) for name in node.input]
    return copy


def _run(program: _Program, env: dict) -> None:
    for step in program.small:
        step(env)
    for chain in program.chains:
        _run_chain(chain, env)
    for tensor, state in program.writes.items():
        if tensor in env:
            np.copyto(env[state], env[tensor])


def _reduces_all(node: onnx.NodeProto) -> bool:
    """A reduction over every axis to a scalar (keepdims=0, no axes): what a global-norm clip uses."""
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return attributes.get("keepdims", 1) == 0 and "axes" not in attributes and len(node.input) == 1


def _small_step(node: onnx.NodeProto):
    """A callable evaluating `node` whole over the environment."""
    op, inputs, output = node.op_type, list(node.input), node.output[0]
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if op == "Cast":
        dtype = helper.tensor_dtype_to_np_dtype(attributes["to"])
        function = lambda x: np.asarray(x).astype(dtype)  # noqa: E731
    elif op == "Identity":
        function = lambda x: x  # noqa: E731
    elif op == "Sum":
        function = _sum
    elif op in _REDUCTIONS:
        function = _REDUCTIONS[op]
    elif op in _SMALL_OPS and not (op in ("Min", "Max") and len(inputs) != 2):
        function = _SMALL_OPS[op]
    else:
        raise Unsupported(f"op {op} {node.name!r}")

    def step(env):
        env[output] = np.asarray(function(*[env[name] for name in inputs]))

    return step


def _sum(*values):
    """ONNX Sum, added left to right as ONNX Runtime does."""
    total = values[0]
    for value in values[1:]:
        total = np.add(total, value)
    return total


def _if_step(node: onnx.NodeProto, scope: _Scope):
    """(a step running the branch the flag picks, the states it writes): each branch compiled
    alike, its outputs written where the If's outputs must land."""
    branches, states = {}, set()
    for attribute in node.attribute:
        branch = attribute.g
        inner = {
            o.name: scope.writes[out] for o, out in zip(branch.output, node.output) if out in scope.writes
        }
        states |= set(inner.values())
        scope.env.update((t.name, numpy_helper.to_array(t)) for t in branch.initializer)
        scope.scalars.update(t.name for t in branch.initializer if np.prod(t.dims, dtype=np.int64) == 1)
        branch_scope = dataclasses.replace(  # what a branch computes is not there in the other one
            scope, big=dict(scope.big), writes=inner, same=dict(scope.same), seen=dict(scope.seen)
        )
        program = _compile(list(branch.node), branch_scope)
        results = [branch_scope.same.get(o.name, o.name) for o in branch.output]
        branches[attribute.name] = (program, results)
    flag, outputs = node.input[0], list(node.output)

    def run_branch(env):
        program, results = branches["then_branch" if bool(env[flag]) else "else_branch"]
        _run(program, env)
        for result, output in zip(results, outputs):
            env[output] = env.get(result)

    run_branch.programs = [program for program, _ in branches.values()]
    return run_branch, states


def _chain(shape: tuple, nodes: list, writes: dict) -> _Chain:
    """Buffers for a chain's outputs, so that a block touches few arrays: a state's next value goes
    into the state's array; an intermediate into a scratch buffer whose value is dead, or into a
    state's own array (dead once read) until that state's next value is written there: m * b1
    goes where m was. The gradients' arrays are not reused: written, they would go back to memory
    (6.9 vs 6.4 ms on the MLP); AdamW needs two scratch buffers."""
    last_read = {name: i for i, node in enumerate(nodes) for name in node.input}
    writer = {writes[n.output[0]]: i for i, n in enumerate(nodes) if n.output[0] in writes}
    if any(last_read.get(state, -1) > i for state, i in writer.items()):
        raise Unsupported("a state is read after its next value is written")
    buffers, free, count, ops = {}, [], 0, []  # free: (buffer, the last op it may serve)
    for i, node in enumerate(nodes):
        for name in dict.fromkeys(node.input):
            if last_read[name] != i or name in writes:
                continue
            buffer = buffers.get(name, ("array", name) if name in writer else None)
            if buffer is not None:
                free.append(
                    (buffer, writer.get(buffer[1], len(nodes)) if buffer[0] == "array" else len(nodes))
                )
        output = node.output[0]
        if output in writes:
            buffer = ("array", writes[output])
            free = [entry for entry in free if entry[0] != buffer]
        else:
            fits = [entry for entry in free if last_read.get(output, i) <= entry[1]]
            if fits:
                free.remove(fits[0])
                buffer = fits[0][0]
            else:
                buffer, count = ("scratch", count), count + 1
        buffers[output] = buffer
        function = None if node.op_type == "Identity" else _FLOAT_OPS[node.op_type]
        ops.append((function, list(node.input), output))
    return _Chain(int(np.prod(shape, dtype=np.int64)), ops, buffers, count)


def _run_chain(chain: _Chain, env: dict) -> None:
    if not chain.calls:
        _bind(chain, env)
    for name, holder in chain.holders.items():
        np.copyto(holder, env[name])
    for function, args, out in chain.calls:
        if function is None:
            np.copyto(out, args[0])
        else:
            function(*args, out=out)


def _bind(chain: _Chain, env: dict) -> None:
    """The calls of every block over flat views of the arrays, built once: small operands are read
    from holders refreshed each step."""
    for _, inputs, _ in chain.ops:
        for name in inputs:
            value = env.get(name)
            if name not in chain.buffers and value is not None and np.size(value) == 1 and chain.size != 1:
                chain.holders.setdefault(name, np.array(np.asarray(value).reshape(()), copy=True))
    scratch = [np.empty(min(BLOCK, chain.size), np.float32) for _ in range(chain.scratch_count)]

    def view(name: str, start: int, end: int):
        if name in chain.holders:
            return chain.holders[name]
        kind, where = chain.buffers.get(name, ("array", name))
        if kind == "scratch":
            return scratch[where][: end - start]
        return env[where].reshape(-1)[start:end]

    for start in range(0, chain.size, BLOCK):
        end = min(chain.size, start + BLOCK)
        for function, inputs, output in chain.ops:
            args = tuple(view(name, start, end) for name in inputs)
            chain.calls.append((function, args, view(output, start, end)))
