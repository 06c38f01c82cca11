"""ONNX Runtime's fused transformer ops, rewritten into standard ops before differentiation.

ORT's transformers optimizer fuses BERT and GPT-2 exports into com.microsoft ops (Attention,
SkipLayerNormalization, EmbedLayerNormalization, BiasGelu, FastGelu...). Their gradients would need
training kernels, so `build_gradient_graph` first replaces each by the standard-op subgraph it
computes (the forward stays within float32 rounding of ORT's kernel: tests/autodiff/
test_real_model_rules.py runs both) and the existing rules differentiate that. One function per
op; `DECOMPOSED` lists them for docs/autodiff_ops.md. An attribute or input form a function does
not handle is a one-line GradientError naming it.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper

from amp_rewrite.autodiff.emitter import Emitter
from amp_rewrite.errors import GradientError
from amp_rewrite.onnx_facts import FLOAT_TYPES, names_in

MS = "com.microsoft"
INT64 = TensorProto.INT64


class _Node:
    """One fused node being decomposed: its inputs, attributes and an emitter under its name."""

    def __init__(self, node: onnx.NodeProto, e: Emitter, elem: dict[str, int], dims: dict):
        self.node, self.e, self._elem, self._dims = node, e, elem, dims
        self.attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}

    def x(self, i: int) -> str:
        return self.node.input[i] if i < len(self.node.input) else ""

    def y(self, i: int) -> str:
        return self.node.output[i] if i < len(self.node.output) else ""

    def elem(self) -> int:
        """The node's float type: that of its first float input (EmbedLayerNormalization's first are ids)."""
        types = (self._elem.get(name) for name in self.node.input if name)
        return next((t for t in types if t in FLOAT_TYPES), TensorProto.FLOAT)

    def dims(self, name: str):
        return self._dims.get(name)

    def const(self, value) -> str:
        return self.e.const(value, self.elem())

    def attr(self, name: str, default=None):
        value = self.attrs.get(name, default)
        return value.decode() if isinstance(value, bytes) else value

    def error(self, why: str) -> GradientError:
        return GradientError(
            f"cannot decompose {self.node.domain}::{self.node.op_type} node '{self.node.name}' "
            f"for its gradient: {why}"
        )

    def out(self, i: int, op: str, inputs, **attrs) -> str:
        """Emit the op writing output i under its own name (or a fresh one when the node lacks it)."""
        name = self.y(i)
        return self.e.op(op, inputs, [name] if name else 1, **attrs)


def _gelu_erf(n: _Node, x: str, i: int = 0) -> str:
    e = n.e
    inner = e.op("Add", [n.const(1.0), e.op("Erf", [e.op("Mul", [x, n.const(1 / math.sqrt(2))])])])
    return n.out(i, "Mul", [e.op("Mul", [x, n.const(0.5)]), inner])


def _gelu_tanh(n: _Node, x: str) -> str:
    e = n.e
    cube = e.op("Mul", [e.op("Mul", [x, x]), x])
    inner = e.op(
        "Mul", [e.op("Add", [x, e.op("Mul", [cube, n.const(0.044715)])]), n.const(math.sqrt(2 / math.pi))]
    )
    return n.out(
        0, "Mul", [e.op("Mul", [x, n.const(0.5)]), e.op("Add", [n.const(1.0), e.op("Tanh", [inner])])]
    )


def _with_bias(n: _Node, x: str, bias_slot: int) -> str:
    return n.e.op("Add", [x, n.x(bias_slot)]) if n.x(bias_slot) else x


def gelu(n: _Node) -> None:
    """x * Phi(x), Phi by Erf."""
    _gelu_erf(n, n.x(0))


def bias_gelu(n: _Node) -> None:
    """Gelu(A + B), Phi by Erf."""
    _gelu_erf(n, n.e.op("Add", [n.x(0), n.x(1)]))


def fast_gelu(n: _Node) -> None:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) of x + bias."""
    _gelu_tanh(n, _with_bias(n, n.x(0), 1))


def quick_gelu(n: _Node) -> None:
    """x * sigmoid(alpha x)."""
    e = n.e
    n.out(0, "Mul", [n.x(0), e.op("Sigmoid", [e.op("Mul", [n.x(0), n.const(n.attr("alpha", 1.702))])])])


def _layer_norm(
    n: _Node, x: str, gamma: str, beta: str, simplified: bool = False, stats: bool = True
) -> None:
    """LayerNorm (or RMSNorm) over the last axis with the node's epsilon, written to output 0; with
    `stats`, outputs 1 and 2 (mean, inverse standard deviation) where the node has them."""
    e = n.e
    mean = None if simplified else e.reduce_mean(x, [-1])
    centered = x if simplified else e.op("Sub", [x, mean])
    variance = e.reduce_mean(e.op("Mul", [centered, centered]), [-1])
    inv_std = e.op("Reciprocal", [e.op("Sqrt", [e.op("Add", [variance, n.const(n.attr("epsilon", 1e-12))])])])
    scaled = e.op("Mul", [e.op("Mul", [centered, inv_std]), gamma])
    if beta:
        n.out(0, "Add", [scaled, beta])
    else:
        n.out(0, "Identity", [scaled])
    if stats and n.y(1) and mean:
        n.out(1, "Identity", [mean])
    if stats and n.y(2):
        n.out(2, "Identity", [inv_std])


def skip_layer_norm(n: _Node, simplified: bool = False) -> None:
    """s = input + skip (+ bias); LayerNorm(s) * gamma + beta; output 3 is s."""
    bias_slot = 3 if simplified else 4
    total = _with_bias(n, n.e.op("Add", [n.x(0), n.x(1)]), bias_slot)
    if n.y(3):
        total = n.out(3, "Identity", [total])
    _layer_norm(n, total, n.x(2), "" if simplified else n.x(3), simplified)


def skip_simplified_layer_norm(n: _Node) -> None:
    """s = input + skip (+ bias); s / sqrt(mean(s^2) + eps) * gamma; output 3 is s."""
    skip_layer_norm(n, simplified=True)


def simplified_layer_norm(n: _Node) -> None:
    """x / sqrt(mean(x^2) + eps) * scale (RMSNorm; ORT registers it in the default domain)."""
    if n.attr("axis", -1) not in (-1, len(n.dims(n.x(0)) or [0]) - 1):
        raise n.error("only axis=-1 is supported")
    _layer_norm(n, n.x(0), n.x(1), "", simplified=True)


def embed_layer_norm(n: _Node) -> None:
    """word[ids] + position[position_ids or 0..S-1] (+ segment[segment_ids]), then LayerNorm;
    mask_index = sum of the mask per row (int32), embedding_sum = the sum before the norm."""
    e = n.e
    total = e.op("Gather", [n.x(2), n.x(0)])
    if n.x(8):
        positions = n.x(8)
    else:
        length = e.op("Reshape", [e.dim(n.x(0), 1), e.ints([])])
        positions = e.op("Range", [e.const(0, INT64), length, e.const(1, INT64)])
    total = e.op("Add", [total, e.op("Gather", [n.x(3), positions])])
    if n.x(1) and n.x(4):
        total = e.op("Add", [total, e.op("Gather", [n.x(4), n.x(1)])])
    if n.y(2):
        total = n.out(2, "Identity", [total])
    _layer_norm(n, total, n.x(5), n.x(6), stats=False)  # outputs 1, 2 are mask_index, embedding_sum
    if n.y(1):
        if n.x(7):
            n.out(1, "ReduceSum", [n.x(7), e.ints([1])], keepdims=0)
        else:
            value = helper.make_tensor("value", TensorProto.INT32, [1], [0])
            n.out(1, "ConstantOfShape", [e.dim(n.x(0), 0)], value=value)


def attention(n: _Node) -> None:
    """softmax(Q K^T * scale + masks) V with Q, K, V = input @ weights + bias split per head;
    past keys/values prepended and present returned; masks: raw 2-D/3-D (0 masks), 1-D end positions,
    unidirectional (causal), attention_bias; each masked score gets mask_filter_value added, as ORT."""
    e = n.e
    _check_attention(n)
    heads = n.attr("num_heads")
    w_dims = n.dims(n.x(1))
    if w_dims is None or not isinstance(w_dims[1], int):
        raise n.error("the weights' shape must be static")
    sizes = list(n.attr("qkv_hidden_sizes") or [w_dims[1] // 3] * 3)
    qkv = e.op("MatMul", [n.x(0), n.x(1)])
    if n.x(2):
        qkv = e.op("Add", [qkv, n.x(2)])
    q, k, v = e.op("Split", [qkv, e.ints(sizes)], 3, axis=2)
    split_heads = lambda t, size: e.op("Reshape", [t, e.ints([0, 0, heads, size // heads])])  # noqa: E731
    q = e.op("Transpose", [split_heads(q, sizes[0])], perm=[0, 2, 1, 3])
    k = e.op("Transpose", [split_heads(k, sizes[1])], perm=[0, 2, 1, 3])
    v = e.op("Transpose", [split_heads(v, sizes[2])], perm=[0, 2, 1, 3])
    if n.x(4):  # past: [2, B, N, P, head]
        past_k, past_v = (e.op("Gather", [n.x(4), e.const(np.int64(i), INT64)]) for i in (0, 1))
        k, v = e.op("Concat", [past_k, k], axis=2), e.op("Concat", [past_v, v], axis=2)
    if n.y(1):
        n.out(1, "Concat", [e.unsqueeze(k, [0]), e.unsqueeze(v, [0])], axis=0)
    scale = n.attr("scale") or 1 / math.sqrt(sizes[0] // heads)
    scores = e.op("Mul", [e.op("MatMul", [q, e.op("Transpose", [k], perm=[0, 1, 3, 2])]), n.const(scale)])
    for bias in _attention_masks(n, q, k):
        scores = e.op("Add", [scores, bias])
    probs = e.op("Softmax", [scores], axis=-1)
    context = e.op("Transpose", [e.op("MatMul", [probs, v])], perm=[0, 2, 1, 3])
    n.out(0, "Reshape", [context, e.ints([0, 0, sizes[2]])])


def _check_attention(n: _Node) -> None:
    for name in ("do_rotary", "past_present_share_buffer"):
        if n.attr(name, 0):
            raise n.error(f"{name}=1 is not supported")
    if n.x(6):
        raise n.error("the past_sequence_length input is not supported")
    mask_dims = n.dims(n.x(3)) if n.x(3) else None
    if n.x(3) and (mask_dims is None or len(mask_dims) not in (1, 2, 3)):
        raise n.error("mask_index must have a known rank of 1 (end positions), 2 or 3 (raw 0/1 masks)")


def _attention_masks(n: _Node, q: str, k: str) -> list[str]:
    """Additive score biases: mask_filter_value where a key is masked, plus attention_bias."""
    e = n.e
    filter_value = n.const(n.attr("mask_filter_value", -10000.0))
    zero = n.const(0.0)
    biases = []
    key_positions = e.op(
        "Range", [e.const(0, INT64), e.op("Reshape", [e.dim(k, 2), e.ints([])]), e.const(1, INT64)]
    )
    if n.x(3):
        rank = len(n.dims(n.x(3)))
        if rank == 1:  # keys at or past each row's end position are masked: [B, 1, 1, T]
            ends = e.unsqueeze(e.cast(n.x(3), INT64), [1])
            masked = e.op("GreaterOrEqual", [e.unsqueeze(key_positions, [0]), ends])
            biases.append(e.unsqueeze(e.op("Where", [masked, filter_value, zero]), [1, 2]))
        else:  # raw 0/1 masks, [B, T] or [B, S, T]
            masked = e.op("Equal", [n.x(3), e.const(0, n._elem.get(n.x(3), TensorProto.INT32))])
            biases.append(
                e.unsqueeze(e.op("Where", [masked, filter_value, zero]), [1, 2] if rank == 2 else [1])
            )
    if n.attr("unidirectional", 0):  # query i (at past + i) sees keys j <= past + i
        past = e.op("Sub", [e.dim(k, 2), e.dim(q, 2)])
        queries = e.op(
            "Range", [e.const(0, INT64), e.op("Reshape", [e.dim(q, 2), e.ints([])]), e.const(1, INT64)]
        )
        limit = e.unsqueeze(e.op("Add", [queries, past]), [1])
        biases.append(
            e.op("Where", [e.op("Greater", [e.unsqueeze(key_positions, [0]), limit]), filter_value, zero])
        )
    if n.x(5):
        biases.append(n.x(5))
    return biases


def fused_matmul(n: _Node) -> None:
    """alpha * op(A) @ op(B), op transposing the last two axes where transA/transB."""
    e = n.e
    if n.attr("transBatchA", 0) or n.attr("transBatchB", 0):
        raise n.error("transBatchA/transBatchB are not supported")
    a, b = n.x(0), n.x(1)
    for flag, name in (("transA", "a"), ("transB", "b")):
        if n.attr(flag, 0):
            rank = len(n.dims(a if name == "a" else b) or [])
            if rank < 2:
                raise n.error(f"{flag} needs the operand's rank")
            perm = list(range(rank - 2)) + [rank - 1, rank - 2]
            if name == "a":
                a = e.op("Transpose", [a], perm=perm)
            else:
                b = e.op("Transpose", [b], perm=perm)
    alpha = n.attr("alpha", 1.0)
    if alpha == 1.0:
        n.out(0, "MatMul", [a, b])
    else:
        n.out(0, "Mul", [e.op("MatMul", [a, b]), n.const(alpha)])


DECOMPOSED = {  # (domain, op type): function; its docstring is the row in docs/autodiff_ops.md
    (MS, "Attention"): attention,
    (MS, "BiasGelu"): bias_gelu,
    (MS, "EmbedLayerNormalization"): embed_layer_norm,
    (MS, "FastGelu"): fast_gelu,
    (MS, "FusedMatMul"): fused_matmul,
    (MS, "Gelu"): gelu,
    (MS, "QuickGelu"): quick_gelu,
    (MS, "SkipLayerNormalization"): skip_layer_norm,
    (MS, "SkipSimplifiedLayerNormalization"): skip_simplified_layer_norm,
    ("", "SimplifiedLayerNormalization"): simplified_layer_norm,
}


def decompose_contrib_ops(model: onnx.ModelProto) -> int:
    """Replace every fused op of `DECOMPOSED` in the main graph by standard ops, in place; returns how many."""
    graph = model.graph
    found = [i for i, node in enumerate(graph.node) if (_domain(node), node.op_type) in DECOMPOSED]
    if not found:
        return 0
    from amp_rewrite.autodiff.graphinfo import TypeInfo, model_opset

    info = TypeInfo.of(model)
    emit = Emitter([], graph.initializer, model_opset(model), names_in(graph), scope="decomposed")
    replaced = {}
    for i in found:
        node = graph.node[i]
        emit.nodes = []
        emit.scope = f"decomposed/{node.name or node.op_type}"
        DECOMPOSED[(_domain(node), node.op_type)](_Node(node, emit, info.elem, info.dims))
        replaced[i] = emit.nodes
    nodes = []
    for i, node in enumerate(graph.node):
        if i in replaced:
            nodes.extend(replaced[i])
        else:
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            nodes.append(copy)
    del graph.node[:]
    graph.node.extend(nodes)
    return len(found)


def _domain(node: onnx.NodeProto) -> str:
    return "" if node.domain == "ai.onnx" else node.domain
