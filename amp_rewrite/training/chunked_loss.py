"""Cross-entropy over row chunks of a language-model head ("fused linear cross-entropy", after
Liger-Kernel and Apple's cut-cross-entropy).

When the logits are `H @ W (+ b)` with many classes (a BERT's 30522), they are the step's largest
tensors: [tokens, classes] float32 is 250 MB at 16x128 tokens, and the backward keeps one or two
more of that size. Here the head's MatMul moves into the loss and runs per chunk of the flattened
tokens: chunk c's logits `H_c @ W (+ b)` give its rows' logsumexp and label logit. Only one
chunk's logits (and their gradient) are alive at a time: chunk c's backward needs nothing of
chunk c+1 (the loss gradient does not depend on the loss value), and `order_chunks` makes chunk
c+1 start once chunk c is finished. The weight's chunk gradients accumulate as a chain (chunk c
reads W through an Identity of chunk c+1's), not in one Sum of all chunks' [K, C] partials.

The loss is the unchunked one's formula (same ignore_index and label smoothing), exact up to the
float32 summation order of the per-chunk sums and of the weight gradient's accumulation.

Decision (docs/decisions.md): chunked when the head's weight is a float32 [K, C] initializer with
C >= CHUNK_CLASSES; always CHUNKS chunks, sized at run time (the token count is known only then:
a Split with a computed sizes input, opset >= 13) as evenly as the rows allow. One zero row with
count weight 0 is appended per chunk, so no chunk is empty (ONNX Runtime reduces an empty [0, C]
tensor to [0, C], not [0, 1]); such rows add exactly 0 to the loss and to every gradient.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import onnx
from onnx import TensorProto

from amp_rewrite.autodiff.emitter import Emitter
from amp_rewrite.autodiff.graphinfo import model_opset
from amp_rewrite.ir import sort_graphs

CHUNK_CLASSES = 4096  # fewer classes: the logits are no larger than the activations around them
# a chunk's nodes: forward `loss/chunk_<c>/...`, backward `grad/loss/chunk_<c>/...` (autodiff names a
# node's gradient nodes after it) and `grad/accumulate/loss/chunk_<c>/...` (its weight-gradient link)
_CHUNK_NODE = re.compile(r"(?:grad/(?:accumulate/)?)?loss/chunk_(\d+)/")
CHUNKS = 16  # BERT's 30522 classes: 16 MB of logits per chunk at 16x128 tokens, 62 MB at 64x128


@dataclasses.dataclass(frozen=True)
class Head:
    """logits = [Reshape](MatMul(hidden, weight) [+ bias]); `nodes`: the indices of those nodes."""

    hidden: str
    weight: str
    width: int
    bias: str | None
    classes: int
    nodes: tuple[int, ...]


def find_head(graph: onnx.GraphProto, logits: str, opset: int) -> Head | None:
    """The LM head that makes `logits`, if chunking it is exact and worth it, else None (also
    before opset 13, whose Split takes its sizes as an attribute, fixed)."""
    if opset < 13:
        return None
    producer, readers = {}, {}
    for n, node in enumerate(graph.node):
        producer.update((t, n) for t in node.output)
        for t in node.input:
            readers[t] = readers.get(t, 0) + 1
    weights = {t.name: t for t in graph.initializer}
    outputs = {o.name for o in graph.output}

    def only_for_head(t: str) -> bool:
        return readers.get(t, 0) == 1 and t not in outputs

    n = producer.get(logits)
    if n is None or readers.get(logits):
        return None
    chain, reshape_last = [n], None
    if graph.node[n].op_type == "Reshape":
        reshape_last = _constant_last(graph.node[n].input[1], weights)
        inner = producer.get(graph.node[n].input[0])
        if reshape_last is None or inner is None or not only_for_head(graph.node[n].input[0]):
            return None
        chain.append(inner)
    bias = None
    node = graph.node[chain[-1]]
    if node.op_type == "Add":
        matmuls = [t for t in node.input if t in producer and graph.node[producer[t]].op_type == "MatMul"]
        if len(matmuls) != 1 or not only_for_head(matmuls[0]):
            return None
        bias = next(t for t in node.input if t != matmuls[0])
        chain.append(producer[matmuls[0]])
    matmul = graph.node[chain[-1]]
    if matmul.op_type != "MatMul" or matmul.input[1] not in weights:
        return None
    dims = list(weights[matmul.input[1]].dims)
    if len(dims) != 2 or dims[1] < CHUNK_CLASSES or reshape_last not in (None, dims[1]):
        return None
    if bias is not None and (
        bias not in weights or list(weights[bias].dims) not in ([dims[1]], [1, dims[1]])
    ):
        return None
    if any(weights[t].data_type != onnx.TensorProto.FLOAT for t in (matmul.input[1], bias) if t):
        return None
    return Head(matmul.input[0], matmul.input[1], dims[0], bias, dims[1], tuple(chain))


def _constant_last(name: str, weights: dict) -> int | None:
    """The last entry of a Reshape's constant shape (an initializer), if positive."""
    if name not in weights:
        return None
    shape = onnx.numpy_helper.to_array(weights[name])
    return int(shape[-1]) if shape.size and shape[-1] > 0 else None


def chunked_total(e: Emitter, head: Head, labels: str, weight: str, row_log_likelihood) -> str:
    """sum over rows of weight x row_log_likelihood(logits_c, label_c), one chunk at a time.

    `labels`, `weight`: each row's label and count weight, shaped like the logits without the
    class axis; `row_log_likelihood(e, logits, labels, class axis)` gives a chunk's [rows, 1]."""

    def padded(t: str, shape, dtype, hint: str) -> str:  # one zero-weight row per chunk appended
        return e.op(
            "Concat",
            [
                e.op("Reshape", [t, e.const(shape, np.int64)]),
                e.const(np.zeros((CHUNKS, *shape[1:]), dtype), dtype),
            ],
            hint,
            axis=0,
        )

    flat_labels = padded(labels, [-1], np.int64, "flat_labels")  # first: recompute plans up to here
    flat_weights = padded(weight, [-1], np.float32, "flat_weights")
    rows = padded(head.hidden, [-1, head.width], np.float32, "rows")
    count = e.dim(rows, 0)
    least = e.op("Div", [count, e.const([CHUNKS], np.int64, "chunks")])
    extra = e.op("Sub", [count, e.op("Mul", [least, e.const([CHUNKS], np.int64, "chunks")])])
    later = e.op("Less", [e.const(np.arange(CHUNKS), np.int64, "chunk_index"), extra])
    sizes = e.op("Add", [least, e.cast(later, TensorProto.INT64)], "chunk_sizes")

    def split(t: str, hint: str) -> list[str]:
        return e.op("Split", [t, sizes], [e.fresh(f"{e.scope}/{hint}_{c}") for c in range(CHUNKS)], axis=0)

    hidden = split(rows, "rows")
    chunk_labels = split(flat_labels, "labels")
    chunk_weights = split(flat_weights, "weights")
    chunks = [e.scoped(f"{e.scope}/chunk_{c}") for c in range(CHUNKS)]
    weights = _chain(chunks, head.weight, "weight")
    biases = head.bias and _chain(chunks, head.bias, "bias")
    totals = []
    for c, ce in enumerate(chunks):
        logits = ce.op("MatMul", [hidden[c], weights[c]], "logits")
        if biases:
            logits = ce.op("Add", [logits, biases[c]], "biased_logits")
        kept = ce.axes_op("Squeeze", row_log_likelihood(ce, logits, chunk_labels[c], 1), [-1])
        totals.append(
            ce.reduce("ReduceSum", ce.op("Mul", [kept, chunk_weights[c]]), None, keepdims=0, hint="total")
        )
    return e.op("Sum", totals, "total_log_likelihood")


def _chain(chunks: list[Emitter], t: str, hint: str) -> list[str]:
    """t as each chunk reads it: chunk c reads an Identity of chunk c+1's, so t's gradient is a
    chain of two-part sums, the first chunk's deepest: each chunk's [K, C] product is added (and
    freed) in chunk order, not kept for one Sum of all chunks'."""
    names = [t]
    for ce in chunks[-2::-1]:
        names.append(ce.op("Identity", [names[-1]], hint))
    return names[::-1]


def drop_head(graph: onnx.GraphProto, head: Head) -> None:
    """Remove the head's nodes: the chunks compute what they did."""
    gone = set(head.nodes)
    kept = [node for n, node in enumerate(graph.node) if n not in gone]
    del graph.node[:]
    graph.node.extend(kept)


def order_chunks(model: onnx.ModelProto) -> None:
    """Make each chunk's forward start after the previous chunk's last result (its loss sum, its
    hidden-state gradient, its weight-gradient link) in a finished gradient graph, so at most one
    chunk's logits and their gradient are alive. Without this ONNX Runtime's order (a depth-first
    walk from the graph's ends) reaches every chunk's logits gradient through the hidden-state
    gradient's Concat, then keeps them all until the weight gradient's chain reads them.

    The dependency adds -0.0, made at run time from the previous chunk's results (as
    `autodiff.recompute` does: Where(b == b, -0.0, NaN) is -0.0 for every b), to the chunk's rows:
    no value changes. A graph without chunks is left as it is."""
    graph = model.graph
    chunk_of = {}
    for n, node in enumerate(graph.node):
        m = _CHUNK_NODE.match(node.name)
        if m:
            chunk_of[n] = int(m.group(1))
    if not chunk_of:
        return
    made_in = {t: chunk_of[n] for n in chunk_of for t in graph.node[n].output if t}
    results: dict[int, dict[str, None]] = {c: {} for c in set(chunk_of.values())}
    for n, node in enumerate(graph.node):
        for t in node.input:
            c = made_in.get(t)
            if c is not None and c != chunk_of.get(n):
                results[c][t] = None
    entries = {
        chunk_of[n]: node
        for n, node in enumerate(graph.node)
        if n in chunk_of and node.name.endswith("/MatMul") and node.name.startswith("loss/")
    }
    e = Emitter.for_graph(graph, model_opset(model), scope="loss")
    for c, entry in sorted(entries.items()):
        if c - 1 in results:
            e.scope = f"loss/chunk_{c}/after_{c - 1}"
            entry.input[0] = e.op("Add", [entry.input[0], _negative_zero(e, list(results[c - 1]))])
    graph.node.extend(e.new_nodes)
    sort_graphs(model)


def _negative_zero(e: Emitter, tensors: list[str]) -> str:
    """-0.0 (float32 scalar), computed only once every tensor is."""
    firsts = [
        e.reduce(
            "ReduceSum",
            e.cast(
                e.op("Slice", [e.op("Reshape", [t, e.ints([-1])]), e.ints([0]), e.ints([1])]),
                TensorProto.FLOAT,
            ),
            None,
            keepdims=0,
        )
        for t in tensors
    ]
    flag = e.cast(e.op("Sum", firsts) if len(firsts) > 1 else firsts[0], TensorProto.BOOL)
    same = e.op("Equal", [flag, flag])
    return e.op("Where", [same, e.const(-0.0, TensorProto.FLOAT), e.const(np.nan, TensorProto.FLOAT)])
