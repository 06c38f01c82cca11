"""Hypothesis strategies for random valid ONNX models, and the rewrite's end-to-end check.

One module for the property tests (tests/transform/test_properties.py: `random_models`, DAGs of
MatMul/unary/binary ops over [2, D] tensors), the fuzz tests (tests/transform/test_fuzz.py:
`onnx_graphs`, graphs over a pool of 50+ op types) and the long fuzz run (tools/fuzz.py).

`onnx_graphs()` draws a graph over several inputs (float32 with broadcasting shapes, float16,
float64, int64, bool), ops from `POOL` (elementwise, reductions, shape ops, normalisations, MatMul
with shared weights, Where, Split, Concat, Casts, optional If subgraphs), with fan-out and shared
constants. `check_rewrite` asserts: checker-valid output, loads and runs in ONNX Runtime, numbers
within float16 tolerance of the original, deny ops never low precision (unless relaxed with a reason), non-float32 tensors keep
their types, idempotent, byte-identical reruns.

Numerics are kept well-conditioned on purpose: magnitudes are tracked and bounded with Tanh,
denominators and log/sqrt arguments are kept away from zero, comparisons only read graph inputs
against 0 (float16 rounding never flips a sign), normalisations use a large epsilon.

A tool, not a test module: it imports only the installed amp_rewrite, onnx, numpy and hypothesis
(tests load it with `helpers.load_tool("strategies")`; tools/fuzz.py imports it as a sibling).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import amp_rewrite
from amp_rewrite.analysis.oplists import load_op_lists
from amp_rewrite.checks.validate import synthesise
from amp_rewrite.runtime import open_session

F32, F16, F64, I64, BOOL = (
    TensorProto.FLOAT,
    TensorProto.FLOAT16,
    TensorProto.DOUBLE,
    TensorProto.INT64,
    TensorProto.BOOL,
)
DENY = set(load_op_lists("float16").ops("deny"))
INPUTS = [
    ("x", F32, [2, 3, 4]),
    ("y", F32, [1, 3, 1]),
    ("z", F32, [4]),
    ("h", F16, [2, 3, 4]),
    ("d", F64, [3, 4]),
    ("k", I64, [2, 3, 4]),
    ("m", BOOL, [2, 3, 4]),
    ("cond", BOOL, []),
]


class Builder:
    """Tensors (name -> (type, shape, magnitude bound)), nodes and shared constants of one graph."""

    def __init__(self, draw):
        self.draw = draw
        self.nodes: list = []
        self.inits: dict[str, TensorProto] = {}
        self.tensors: dict[str, tuple[int, tuple, float]] = {n: (t, tuple(s), 4.0) for n, t, s in INPUTS}
        self.count = 0

    def fresh(self, prefix="t"):
        self.count += 1
        return f"{prefix}{self.count}"

    def const(self, name, array):
        """A shared initializer: the same name always means the same value."""
        if name not in self.inits:
            self.inits[name] = numpy_helper.from_array(np.asarray(array), name)
        return name

    def add(self, op, inputs, type_, shape, bound, n_out=1, **attrs):
        outs = [self.fresh() for _ in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=f"n_{outs[0]}", **attrs))
        for out in outs:
            self.tensors[out] = (type_, tuple(shape), float(bound))
        return outs[0] if n_out == 1 else outs

    def floats(self, type_=F32):
        return [n for n, (t, _, _) in self.tensors.items() if t == type_]

    def pick(self, type_=F32):
        return self.draw(st.sampled_from(self.floats(type_)))

    def bounded(self, name, limit=50.0):
        """`name`, or Tanh of it when its magnitude bound is over `limit`."""
        type_, shape, bound = self.tensors[name]
        return name if bound <= limit else self.add("Tanh", [name], type_, shape, 1.0)

    def positive(self, name, shift=0.5):
        """|name| + shift: a safe argument for Log, Sqrt, Div, Reciprocal, Pow."""
        type_, shape, bound = self.tensors[name]
        a = self.add("Abs", [self.bounded(name)], type_, shape, min(bound, 50.0))
        c = self.const(f"shift_{shift}", np.array(shift, np.float32))
        return self.add("Add", [a, c], type_, shape, min(bound, 50.0) + shift)

    def partner(self, name, shape=None):
        """A float32 tensor whose shape broadcasts with `name`'s (or with `shape`)."""
        shape = self.tensors[name][1] if shape is None else shape
        return self.draw(
            st.sampled_from([other for other in self.floats() if _fits(shape, self.tensors[other][1])])
        )


def _unary(op, bound_of=lambda b: b, **attrs):
    def build(g: Builder):
        a = g.bounded(g.pick())
        _, shape, bound = g.tensors[a]
        return g.add(op, [a], F32, shape, bound_of(bound), **attrs)

    return op, build


def _positive_unary(op, bound_of):
    def build(g: Builder):
        a = g.positive(g.pick())
        _, shape, bound = g.tensors[a]
        return g.add(op, [a], F32, shape, bound_of(bound))

    return op, build


def _binary(op, bound_of):
    def build(g: Builder):
        a = g.bounded(g.pick())
        b = g.bounded(g.partner(a))
        shape = np.broadcast_shapes(g.tensors[a][1], g.tensors[b][1])
        return g.add(op, [a, b], F32, shape, bound_of(g.tensors[a][2], g.tensors[b][2]))

    return op, build


def _variadic(op, bound_of):
    def build(g: Builder):
        a = g.bounded(g.pick())
        shape, rest = g.tensors[a][1], []
        for _ in range(g.draw(st.integers(1, 2))):  # each partner must broadcast with all so far
            rest.append(g.bounded(g.partner(a, shape)))
            shape = np.broadcast_shapes(shape, g.tensors[rest[-1]][1])
        return g.add(op, [a, *rest], F32, shape, bound_of([g.tensors[t][2] for t in [a, *rest]]))

    return op, build


def _div(g):
    a = g.bounded(g.pick())
    b = g.positive(g.partner(a), 1.0)
    return g.add("Div", [a, b], F32, np.broadcast_shapes(g.tensors[a][1], g.tensors[b][1]), g.tensors[a][2])


def _pow(g):
    a = g.positive(g.pick())
    two = g.const("two", np.array(2.0, np.float32))
    return g.add("Pow", [a, two], F32, g.tensors[a][1], g.tensors[a][2] ** 2)


def _matmul(g):
    a = g.bounded(g.pick())
    shape = g.tensors[a][1]
    if len(shape) < 1:
        return None
    k = shape[-1]
    w = g.const(f"W{k}", (np.random.default_rng(k).standard_normal((k, 4)) / np.sqrt(k)).astype(np.float32))
    out_shape = (*shape[:-1], 4) if len(shape) > 1 else (4,)
    return g.add("MatMul", [a, w], F32, out_shape, g.tensors[a][2] * 2)


def _reduce(op, bound_of):
    def build(g: Builder):
        a = g.bounded(g.pick())
        shape = g.tensors[a][1]
        if not shape:
            return None
        axes = g.const("axes_last", np.array([-1], np.int64))
        out = (*shape[:-1], 1)
        if op in ("ReduceSum",):  # opset 13+: axes as an input
            return g.add(op, [a, axes], F32, out, bound_of(g.tensors[a][2], shape[-1]), keepdims=1)
        return g.add(op, [a], F32, out, bound_of(g.tensors[a][2], shape[-1]), axes=[-1], keepdims=1)

    return op, build


def _last_axis(op, bound_of, **attrs):
    def build(g: Builder):
        a = g.bounded(g.pick())
        if not g.tensors[a][1]:
            return None
        return g.add(op, [a], F32, g.tensors[a][1], bound_of(g.tensors[a][2]), axis=-1, **attrs)

    return op, build


def _cumsum(g):
    a = g.bounded(g.pick())
    if not g.tensors[a][1]:
        return None
    axis = g.const("axis_last", np.array(-1, np.int64))
    return g.add("CumSum", [a, axis], F32, g.tensors[a][1], g.tensors[a][2] * g.tensors[a][1][-1])


def _layernorm(g):
    a = g.bounded(g.pick())
    shape = g.tensors[a][1]
    if not shape:
        return None
    scale = g.const(f"ones{shape[-1]}", np.ones(shape[-1], np.float32))
    bias = g.const(f"zeros{shape[-1]}", np.zeros(shape[-1], np.float32))
    return g.add(
        "LayerNormalization", [a, scale, bias], F32, shape, 2 * np.sqrt(shape[-1]) + 1, axis=-1, epsilon=0.1
    )


def _channel_norm(op):
    def build(g: Builder):
        options = [t for t in g.floats() if g.tensors[t][1] == (2, 3, 4)]
        if not options:
            return None
        a = g.bounded(g.draw(st.sampled_from(options)))
        scale = g.const("ones3", np.ones(3, np.float32))
        bias = g.const("zeros3", np.zeros(3, np.float32))
        if op == "BatchNormalization":
            mean = g.const("bn_mean", np.array([0.1, -0.2, 0.0], np.float32))
            var = g.const("bn_var", np.array([1.0, 0.5, 2.0], np.float32))
            return g.add(op, [a, scale, bias, mean, var], F32, (2, 3, 4), g.tensors[a][2] * 1.5 + 1)
        return g.add(op, [a, scale, bias], F32, (2, 3, 4), 4.0, epsilon=0.1)

    return op, build


def _clip(g):
    a = g.pick()
    lo, hi = g.const("clip_lo", np.array(-1.5, np.float32)), g.const("clip_hi", np.array(2.0, np.float32))
    return g.add("Clip", [a, lo, hi], F32, g.tensors[a][1], 2.0)


def _prelu(g):
    a = g.bounded(g.pick())
    shape = g.tensors[a][1]
    slope = g.const(f"slope{shape[-1] if shape else 1}", np.full(shape[-1] if shape else 1, 0.25, np.float32))
    return g.add("PRelu", [a, slope], F32, shape, g.tensors[a][2])


def _fits(shape, *others):
    try:
        np.broadcast_shapes(shape, *others)
        return True
    except ValueError:
        return False


def _where(g):
    options = [t for t in g.floats() if _fits(g.tensors[t][1], (2, 3, 4))]
    a = g.bounded(g.draw(st.sampled_from(options)))
    b = g.bounded(g.draw(st.sampled_from([t for t in options if _fits(g.tensors[t][1], g.tensors[a][1])])))
    cond = g.draw(st.sampled_from(["m", "gt_x"]))
    if cond == "gt_x":  # x > 0: float16 rounding never flips a sign
        zero = g.const("zero", np.array(0.0, np.float32))
        cond = g.add("Greater", ["x", zero], BOOL, (2, 3, 4), 1)
    shape = np.broadcast_shapes((2, 3, 4), g.tensors[a][1], g.tensors[b][1])
    return g.add("Where", [cond, a, b], F32, shape, max(g.tensors[a][2], g.tensors[b][2]))


def _reshape(g):
    options = [t for t in g.floats() if g.tensors[t][1] in ((2, 3, 4), (6, 4))]
    if not options:
        return None
    a = g.draw(st.sampled_from(options))
    target = (6, 4) if g.tensors[a][1] == (2, 3, 4) else (2, 3, 4)
    shape = g.const(f"shape{len(target)}", np.array(target, np.int64))
    return g.add("Reshape", [a, shape], F32, target, g.tensors[a][2])


def _transpose(g):
    a = g.pick()
    shape = g.tensors[a][1]
    if len(shape) < 2:
        return None
    perm = list(range(len(shape)))[::-1]
    return g.add("Transpose", [a], F32, tuple(shape[p] for p in perm), g.tensors[a][2], perm=perm)


def _unsqueeze_squeeze(g):
    a = g.pick()
    shape = g.tensors[a][1]
    axes = g.const("axes0", np.array([0], np.int64))
    u = g.add("Unsqueeze", [a, axes], F32, (1, *shape), g.tensors[a][2])
    return g.add("Squeeze", [u, axes], F32, shape, g.tensors[a][2])


def _concat(g):
    a = g.pick()
    shape = g.tensors[a][1]
    if not shape:
        return None
    same = [t for t in g.floats() if g.tensors[t][1] == shape]
    b = g.draw(st.sampled_from(same))
    return g.add(
        "Concat", [a, b], F32, (*shape[:-1], shape[-1] * 2), max(g.tensors[a][2], g.tensors[b][2]), axis=-1
    )


def _split(g):
    options = [t for t in g.floats() if g.tensors[t][1] and g.tensors[t][1][-1] == 4]
    if not options:
        return None
    a = g.draw(st.sampled_from(options))
    shape = g.tensors[a][1]
    sizes = g.const("split22", np.array([2, 2], np.int64))
    first, _ = g.add("Split", [a, sizes], F32, (*shape[:-1], 2), g.tensors[a][2], n_out=2, axis=-1)
    return first


def _slice(g):
    a = g.pick()
    shape = g.tensors[a][1]
    if not shape or shape[-1] < 2:
        return None
    starts, ends = g.const("s_start", np.array([1], np.int64)), g.const("s_end", np.array([2**31], np.int64))
    axes = g.const("axes_last", np.array([-1], np.int64))
    return g.add("Slice", [a, starts, ends, axes], F32, (*shape[:-1], shape[-1] - 1), g.tensors[a][2])


def _gather(g):
    a = g.pick()
    shape = g.tensors[a][1]
    if not shape:
        return None
    idx = g.const("idx0", np.array([0, 0], np.int64))
    return g.add("Gather", [a, idx], F32, (2, *shape[1:]), g.tensors[a][2], axis=0)


def _expand(g):
    a = g.pick()
    shape = g.tensors[a][1]
    try:
        out = np.broadcast_shapes(shape, (2, 3, 4))
    except ValueError:
        return None
    target = g.const("shape_234", np.array([2, 3, 4], np.int64))
    return g.add("Expand", [a, target], F32, out, g.tensors[a][2])


def _tile(g):
    a = g.pick()
    shape = g.tensors[a][1]
    reps = g.const(f"reps{len(shape)}", np.array([1] * (len(shape) - 1) + [2], np.int64))
    if not shape:
        return None
    return g.add("Tile", [a, reps], F32, (*shape[:-1], shape[-1] * 2), g.tensors[a][2])


def _pad(g):
    a = g.pick()
    shape = g.tensors[a][1]
    if not shape:
        return None
    pads = g.const(
        f"pads{len(shape)}", np.array([0] * (len(shape) - 1) + [1] + [0] * (len(shape) - 1) + [1], np.int64)
    )
    return g.add("Pad", [a, pads], F32, (*shape[:-1], shape[-1] + 2), g.tensors[a][2])


def _flatten(g):
    a = g.pick()
    shape = g.tensors[a][1]
    if len(shape) < 2:
        return None
    return g.add("Flatten", [a], F32, (shape[0], int(np.prod(shape[1:]))), g.tensors[a][2], axis=1)


def _cast_in(g):
    """Other types joining the float32 graph: float16 / float64 / int64 / bool -> float32."""
    source = g.draw(st.sampled_from(["h", "d", "k", "m"] + g.floats(F16) + g.floats(I64)))
    type_, shape, bound = g.tensors[source]
    return g.add("Cast", [source], F32, shape, bound, to=F32)


def _cast_out(g):
    """float32 -> float64 (exact round trip of what was computed) feeding float64 ops."""
    a = g.pick()
    c = g.add("Cast", [a], F64, g.tensors[a][1], g.tensors[a][2], to=F64)
    return g.add("Relu", [c], F64, g.tensors[a][1], g.tensors[a][2])


def _other_types(g):
    """Ops on float16 / int64 / bool tensors: the rewrite must leave them exactly as they are."""
    kind = g.draw(st.sampled_from(["f16", "i64", "bool", "shape"]))
    if kind == "f16":
        a = g.bounded(g.draw(st.sampled_from(g.floats(F16))), 4.0)
        op = g.draw(st.sampled_from(["Relu", "Sigmoid", "Neg"]))
        return g.add(op, [a], F16, g.tensors[a][1], g.tensors[a][2])
    if kind == "i64":  # with k: a Shape's output (3,) does not broadcast with k's (2, 3, 4)
        a = g.draw(st.sampled_from([t for t in g.floats(I64) if _fits(g.tensors[t][1], (2, 3, 4))]))
        return g.add(
            g.draw(st.sampled_from(["Add", "Mul", "Sub"])),
            [a, "k"],
            I64,
            np.broadcast_shapes(g.tensors[a][1], (2, 3, 4)),
            min(g.tensors[a][2] * 4, 1e6),
        )
    if kind == "bool":
        op = g.draw(st.sampled_from(["And", "Or", "Xor"]))
        return g.add(op, ["m", g.draw(st.sampled_from(g.floats(BOOL)))], BOOL, (2, 3, 4), 1)
    a = g.pick()
    return g.add("Shape", [a], I64, (len(g.tensors[a][1]),), 10)


def _if(g):
    """An optional subgraph: both branches read an outer float32 tensor and a shared constant."""
    a = g.bounded(g.pick())
    type_, shape, bound = g.tensors[a]
    half = g.const("half", np.array(0.5, np.float32))
    then_nodes = [
        helper.make_node("Mul", [a, half], ["if_t1"], name="then_mul"),
        helper.make_node("Relu", ["if_t1"], ["if_t2"], name="then_relu"),
    ]
    if shape and shape[-1] in (3, 4):
        w = g.const(
            f"W{shape[-1]}",
            (np.random.default_rng(shape[-1]).standard_normal((shape[-1], 4)) / np.sqrt(shape[-1])).astype(
                np.float32
            ),
        )
        then_nodes.append(helper.make_node("MatMul", ["if_t2", w], ["if_t3"], name="then_mm"))
        out_shape = (*shape[:-1], 4) if len(shape) > 1 else (4,)
        else_nodes = [
            helper.make_node("MatMul", [a, w], ["if_e0"], name="else_mm"),
            helper.make_node("Sigmoid", ["if_e0"], ["if_e1"], name="else_sig"),
        ]
    else:
        then_nodes.append(helper.make_node("Identity", ["if_t2"], ["if_t3"], name="then_id"))
        out_shape = shape
        else_nodes = [helper.make_node("Sigmoid", [a], ["if_e1"], name="else_sig")]
    then_branch = helper.make_graph(
        then_nodes, "then", [], [helper.make_tensor_value_info("if_t3", F32, out_shape)]
    )
    else_branch = helper.make_graph(
        else_nodes, "else", [], [helper.make_tensor_value_info("if_e1", F32, out_shape)]
    )
    if any(n.name.startswith("if_") for n in g.nodes):
        return None  # one If per graph keeps its branch tensor names unique
    out = g.add(
        "If", ["cond"], F32, out_shape, bound * 2 + 1, then_branch=then_branch, else_branch=else_branch
    )
    g.nodes[-1].name = "if_node"
    return out


POOL = dict(
    [
        _unary("Relu"),
        _unary("Sigmoid", lambda b: 1),
        _unary("Tanh", lambda b: 1),
        _unary("Neg"),
        _unary("Abs"),
        _unary("Identity"),
        _unary("Erf", lambda b: 1),
        _unary("Softsign", lambda b: 1),
        _unary("Softplus", lambda b: b + 1),
        _unary("Sin", lambda b: 1),
        _unary("Cos", lambda b: 1),
        _unary("Atan", lambda b: 2),
        _unary("LeakyRelu", alpha=0.1),
        _unary("Elu", lambda b: b + 1),
        _unary("Selu", lambda b: 2 * b + 2),
        _unary("HardSigmoid", lambda b: 1),
        _unary("HardSwish", lambda b: b + 1),
        _unary("Celu", lambda b: b + 1),
        _unary("ThresholdedRelu", alpha=0.5),
        _positive_unary("Log", lambda b: max(1.0, np.log(b + 1))),
        _positive_unary("Sqrt", lambda b: np.sqrt(b) + 1),
        _positive_unary("Reciprocal", lambda b: 2.0),
        _binary("Add", lambda a, b: a + b),
        _binary("Sub", lambda a, b: a + b),
        _binary("Mul", lambda a, b: a * b),
        _binary("Max", max),
        _binary("Min", max),
        ("Div", _div),
        ("Pow", _pow),
        _variadic("Sum", sum),
        _variadic("Mean", max),
        ("MatMul", _matmul),
        _reduce("ReduceSum", lambda b, n: b * n),
        _reduce("ReduceMean", lambda b, n: b),
        _reduce("ReduceMax", lambda b, n: b),
        _reduce("ReduceMin", lambda b, n: b),
        _reduce("ReduceL2", lambda b, n: b * np.sqrt(n)),
        _reduce("ReduceSumSquare", lambda b, n: b * b * n),
        _reduce("ReduceLogSumExp", lambda b, n: b + np.log(n)),
        _last_axis("Softmax", lambda b: 1),
        _last_axis("LogSoftmax", lambda b: 2 * b + 2),
        ("CumSum", _cumsum),
        ("LayerNormalization", _layernorm),
        _channel_norm("InstanceNormalization"),
        _channel_norm("BatchNormalization"),
        ("Clip", _clip),
        ("PRelu", _prelu),
        ("Where", _where),
        ("Reshape", _reshape),
        ("Transpose", _transpose),
        ("Unsqueeze", _unsqueeze_squeeze),
        ("Concat", _concat),
        ("Split", _split),
        ("Slice", _slice),
        ("Gather", _gather),
        ("Expand", _expand),
        ("Tile", _tile),
        ("Pad", _pad),
        ("Flatten", _flatten),
        ("Cast", _cast_in),
        ("CastDouble", _cast_out),
        ("OtherTypes", _other_types),
        ("If", _if),
    ]
)


def _exp(g: Builder):
    """Exp reads Tanh of any float32 tensor: shapes follow the tensor read."""
    a = g.pick()
    t = g.add("Tanh", [a], F32, g.tensors[a][1], 1)
    return g.add("Exp", [t], F32, g.tensors[a][1], 3)


POOL["Exp"] = _exp
OP_CHOICES = sorted(POOL) + ["MatMul"] * 8  # MatMul is the allow op: without one nothing changes


@st.composite
def onnx_graphs(draw, max_ops=16):
    """A random valid model (opset 17, IR 8) over INPUTS, built from POOL."""
    g = Builder(draw)
    for _ in range(draw(st.integers(2, max_ops))):
        op = draw(st.sampled_from(OP_CHOICES))
        POOL[op](g)
    if not g.nodes:  # every drawn builder declined (no fitting tensor): fuzz found models without outputs
        g.add("Relu", ["x"], F32, (2, 3, 4), 4.0)
    read = {name for node in g.nodes for name in node.input}
    for node in g.nodes:
        for attr in node.attribute:
            if attr.HasField("g"):
                read.update(name for n in attr.g.node for name in n.input)
    produced = [out for node in g.nodes for out in node.output]
    outputs = [t for t in produced if t not in read]
    extra = [t for t in produced if t in read]
    if extra and draw(st.booleans()):  # fan-out to a graph output too
        outputs.append(draw(st.sampled_from(extra)))
    graph = helper.make_graph(
        g.nodes,
        "fuzz",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in INPUTS],
        [helper.make_tensor_value_info(t, g.tensors[t][0], g.tensors[t][1]) for t in outputs],
        list(g.inits.values()),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def _types(model):
    inferred = onnx.shape_inference.infer_shapes(model)
    found = {}
    for g in [inferred.graph]:
        for v in (*g.input, *g.output, *g.value_info):
            found[v.name] = v.type.tensor_type.elem_type
    return found


def check_rewrite(model: onnx.ModelProto, keep_io_types: bool = True, seed: int = 0) -> None:
    """Every property the rewrite promises, on one model. Raises AssertionError naming the first broken."""
    result = amp_rewrite.rewrite(model, keep_io_types=keep_io_types)
    out = result.model
    onnx.checker.check_model(out, full_check=True)
    for entry in result.report.nodes:
        if entry["op_type"] in DENY and "relaxed" not in entry:  # relaxed: proved on every float16 value
            assert entry["precision"] == "float32", f"deny op low precision: {entry}"
    before, after = _types(model), _types(out)
    for name, type_ in before.items():  # only float32 tensors change type
        if type_ not in (0, F32) and name in after:
            assert after[name] == type_, f"{name}: {type_} became {after[name]}"
    again = amp_rewrite.rewrite(out, keep_io_types=keep_io_types).model
    assert again.SerializeToString() == out.SerializeToString(), "not idempotent"
    assert (
        amp_rewrite.rewrite(model, keep_io_types=keep_io_types).model.SerializeToString()
        == out.SerializeToString()
    ), "reruns differ"
    feeds = synthesise(model, seed=seed)[0]
    expected = _run(model, feeds)
    out_inputs = {v.name: v.type.tensor_type.elem_type for v in out.graph.input}
    out_feeds = {k: v.astype(helper.tensor_dtype_to_np_dtype(out_inputs[k])) for k, v in feeds.items()}
    got = _run(out, out_feeds)
    for value, g_, w in zip(model.graph.output, got, expected):
        assert g_.shape == w.shape, f"{value.name}: shape {g_.shape} != {w.shape}"
        if w.dtype.kind in "biu":
            assert np.array_equal(g_, w), f"{value.name}: non-float output changed"
            continue
        w64, g64 = w.astype(np.float64), g_.astype(np.float64)
        scale = 1.0 + np.max(np.abs(w64), initial=0.0)
        err = np.max(np.abs(g64 - w64), initial=0.0)
        assert np.isfinite(g64).all() == np.isfinite(w64).all() and err <= 0.03 * scale, (
            f"{value.name}: error {err:.3g} over tolerance {0.03 * scale:.3g}"
        )


def _run(model, feeds):
    return open_session(model, "cpu")[0].run(None, feeds)


# --- random DAGs over [2, D] tensors (the property tests) ------------------------------------------

D = 4
UNARY = ["Relu", "Sigmoid", "Tanh", "Softmax", "Exp", "Neg", "Abs", "Identity", "Erf", "Sqrt", "Log"]
BINARY = ["Add", "Mul", "Sub", "Max", "Min"]


def _init(name, array):
    return numpy_helper.from_array(np.asarray(array), name)


def _node(op, inputs, outputs, name, **attrs):
    return helper.make_node(op, inputs, outputs, name=name, **attrs)


def _value(name, shape):
    return helper.make_tensor_value_info(name, F32, shape)


@st.composite
def random_models(draw):
    """A DAG over [2, D] float tensors: MatMuls with weights, unary and binary ops, shared constants."""
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    tensors, nodes, inits, used = ["x"], [], [_init("c", np.array(0.5, np.float32))], Counter()
    for i in range(draw(st.integers(2, 14))):
        kind = draw(st.sampled_from(["matmul", "unary", "binary", "const", "cast", "layernorm"]))
        a = draw(st.sampled_from(tensors))
        out = f"t{i}"
        if kind == "matmul":
            inits.append(_init(f"W{i}", (rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32)))
            nodes.append(_node("MatMul", [a, f"W{i}"], [out], f"n{i}"))
        elif kind == "unary":
            op = draw(st.sampled_from(UNARY))
            source = a
            if op in ("Sqrt", "Log"):  # keep the domain positive
                nodes.append(_node("Abs", [a], [f"abs{i}"], f"abs{i}"))
                nodes.append(_node("Add", [f"abs{i}", "c"], [f"pos{i}"], f"pos{i}"))
                source = f"pos{i}"
            if op == "Exp":
                nodes.append(_node("Tanh", [a], [f"tanh{i}"], f"tanh{i}"))
                source = f"tanh{i}"
            nodes.append(_node(op, [source], [out], f"n{i}"))
        elif kind == "binary":
            b = draw(st.sampled_from(tensors))
            nodes.append(_node(draw(st.sampled_from(BINARY)), [a, b], [out], f"n{i}"))
        elif kind == "const":
            nodes.append(_node("Mul", [a, "c"], [out], f"n{i}"))
        elif kind == "cast":
            nodes.append(_node("Cast", [a], [out], f"n{i}", to=onnx.TensorProto.FLOAT))
        else:
            inits += [_init(f"s{i}", np.ones(D, np.float32)), _init(f"b{i}", np.zeros(D, np.float32))]
            nodes.append(_node("LayerNormalization", [a, f"s{i}", f"b{i}"], [out], f"n{i}"))
        for x in nodes[-1].input:
            used[x] += 1
        tensors.append(out)
    outputs = [t for t in tensors[1:] if not used[t]] or [tensors[-1]]
    model = helper.make_model(
        helper.make_graph(nodes, "dag", [_value("x", [2, D])], [_value(t, [2, D]) for t in outputs], inits),
        opset_imports=[helper.make_opsetid("", 17)],
        ir_version=8,
    )
    onnx.checker.check_model(model, full_check=True)
    return model
