"""Synthetic pre-LN transformer stacks as ONNX models, for benchmarks and examples.

Why synthetic: the competitor numbers in the reference were taken on generated graphs, and a
generated stack lets the benchmark pick the node count (1k .. 100k) while keeping weights tiny
(hidden 64), so building, rewriting and running stay cheap and the timings measure graph work.

    python tools/synthetic.py 10000 -o stack.onnx
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8
GELU_NODES = 5  # Div, Erf, Add, Mul, Mul: the exact GELU at opset 17 (Gelu itself is opset 20)
NODES_PER_LAYER = 34
FINAL_NODES = 1  # the last LayerNormalization


class _Builder:
    """Collects nodes and initializers, naming each after its layer so names stay unique."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def const(self, name: str, array) -> str:
        self.initializers.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def weight(self, name: str, shape) -> str:
        fan_in = shape[0] if len(shape) > 1 else 1
        scale = 1.0 / math.sqrt(fan_in)
        return self.const(name, (self.rng.standard_normal(shape) * scale).astype(np.float32))

    def op(self, op_type: str, inputs: list[str], name: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [name], name=name, **attrs))
        return name


def _layer_norm(b: _Builder, x: str, prefix: str, hidden: int) -> str:
    gamma = b.const(f"{prefix}/gamma", np.ones(hidden, np.float32))
    beta = b.const(f"{prefix}/beta", np.zeros(hidden, np.float32))
    return b.op("LayerNormalization", [x, gamma, beta], f"{prefix}/ln", axis=-1, epsilon=1e-5)


def _linear(b: _Builder, x: str, prefix: str, d_in: int, d_out: int) -> str:
    w = b.weight(f"{prefix}/w", (d_in, d_out))
    bias = b.const(f"{prefix}/b", np.zeros(d_out, np.float32))
    return b.op("Add", [b.op("MatMul", [x, w], f"{prefix}/matmul"), bias], f"{prefix}/add")


def _split_heads(b: _Builder, x: str, prefix: str, perm: list[int]) -> str:
    """[B, S, H*D] -> [B, H, S, D] (or [B, H, D, S] for keys, so QK^T is one MatMul)."""
    heads = b.op("Reshape", [x, "shape/heads"], f"{prefix}/reshape")
    return b.op("Transpose", [heads], f"{prefix}/transpose", perm=perm)


def _attention(b: _Builder, x: str, prefix: str, hidden: int, heads: int) -> str:
    q = _split_heads(b, _linear(b, x, f"{prefix}/q", hidden, hidden), f"{prefix}/q", [0, 2, 1, 3])
    k = _split_heads(b, _linear(b, x, f"{prefix}/k", hidden, hidden), f"{prefix}/k", [0, 2, 3, 1])
    v = _split_heads(b, _linear(b, x, f"{prefix}/v", hidden, hidden), f"{prefix}/v", [0, 2, 1, 3])
    scale = b.const(f"{prefix}/scale", np.array(math.sqrt(hidden // heads), np.float32))
    scores = b.op("Div", [b.op("MatMul", [q, k], f"{prefix}/qk"), scale], f"{prefix}/scaled")
    probs = b.op("Softmax", [b.op("Add", [scores, "mask"], f"{prefix}/masked")], f"{prefix}/softmax", axis=-1)
    context = b.op(
        "Transpose", [b.op("MatMul", [probs, v], f"{prefix}/pv")], f"{prefix}/merge_t", perm=[0, 2, 1, 3]
    )
    merged = b.op("Reshape", [context, "shape/merge"], f"{prefix}/merge")
    return _linear(b, merged, f"{prefix}/out", hidden, hidden)


def _gelu(b: _Builder, x: str, prefix: str) -> str:
    """0.5 * x * (1 + erf(x / sqrt 2)), as torch exports nn.GELU() at opset 17."""
    root2 = b.const(f"{prefix}/sqrt2", np.array(math.sqrt(2.0), np.float32))
    one = b.const(f"{prefix}/one", np.array(1.0, np.float32))
    half = b.const(f"{prefix}/half", np.array(0.5, np.float32))
    erf = b.op("Erf", [b.op("Div", [x, root2], f"{prefix}/div")], f"{prefix}/erf")
    return b.op(
        "Mul",
        [b.op("Mul", [x, b.op("Add", [erf, one], f"{prefix}/add")], f"{prefix}/mul"), half],
        f"{prefix}/half_mul",
    )


def _block(b: _Builder, x: str, index: int, hidden: int, heads: int) -> str:
    prefix = f"layer{index}"
    attn = _attention(b, _layer_norm(b, x, f"{prefix}/ln1", hidden), f"{prefix}/attn", hidden, heads)
    x = b.op("Add", [x, attn], f"{prefix}/residual1")
    up = _gelu(
        b,
        _linear(b, _layer_norm(b, x, f"{prefix}/ln2", hidden), f"{prefix}/fc1", hidden, 4 * hidden),
        f"{prefix}/gelu",
    )
    return b.op("Add", [x, _linear(b, up, f"{prefix}/fc2", 4 * hidden, hidden)], f"{prefix}/residual2")


def layers_for(num_nodes: int) -> int:
    """How many blocks come closest to `num_nodes` nodes (at least one)."""
    return max(1, round((num_nodes - FINAL_NODES) / NODES_PER_LAYER))


def transformer_stack(num_nodes: int, hidden: int = 64, heads: int = 4, seed: int = 0) -> onnx.ModelProto:
    """A pre-LN transformer encoder of about `num_nodes` nodes; inputs x [batch, seq, hidden] and an
    additive attention mask [batch, 1, 1, seq]; opset 17, IR 8, weights seeded by `seed`."""
    if hidden % heads:
        raise ValueError(f"hidden {hidden} is not divisible by heads {heads}")
    b = _Builder(np.random.default_rng(seed))
    b.const("shape/heads", np.array([0, 0, heads, hidden // heads], np.int64))
    b.const("shape/merge", np.array([0, 0, hidden], np.int64))
    x = "x"
    for index in range(layers_for(num_nodes)):
        x = _block(b, x, index, hidden, heads)
    _layer_norm(b, x, "final", hidden)
    b.nodes[-1].output[0] = "y"
    graph = helper.make_graph(
        b.nodes,
        f"transformer_stack_{num_nodes}",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", hidden]),
            helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["batch", 1, 1, "seq"]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", hidden])],
        b.initializers,
    )
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        ir_version=IR_VERSION,
        producer_name="amp-rewrite tools/synthetic.py",
    )


def language_model(
    kind: str, vocab: int = 2000, hidden: int = 64, heads: int = 4, layers: int = 2, seed: int = 0
) -> onnx.ModelProto:
    """A transformer over token embeddings, its weights mostly embedding tables (as in BERT-base
    and GPT-2, whose tables hold a fifth and a third of their weights). `kind` "bert": word,
    position and token-type tables Gathered and summed, LayerNorm, the blocks, hidden states out;
    "gpt2": word and position tables, the blocks, a final LayerNorm and the LM head reading the
    word table again (tied, through a Transpose), logits out. Inputs input_ids, position_ids
    (and token_type_ids) int64 [batch, seq] and the additive mask [batch, 1, 1, seq]."""
    if kind not in ("bert", "gpt2"):
        raise ValueError(f"kind {kind!r}: bert or gpt2")
    b = _Builder(np.random.default_rng(seed))
    b.const("shape/heads", np.array([0, 0, heads, hidden // heads], np.int64))
    b.const("shape/merge", np.array([0, 0, hidden], np.int64))
    ids = ["input_ids", "position_ids"] + (["token_type_ids"] if kind == "bert" else [])
    rows = {"input_ids": vocab, "position_ids": 64, "token_type_ids": 2}
    tables = {"input_ids": "wte", "position_ids": "wpe", "token_type_ids": "wtt"}
    x = None
    for name in ids:  # N(0, 0.02) like both models' initialisation
        table = b.const(tables[name], (b.rng.standard_normal((rows[name], hidden)) * 0.02).astype(np.float32))
        looked_up = b.op("Gather", [table, name], f"embed/{tables[name]}")
        x = looked_up if x is None else b.op("Add", [x, looked_up], f"embed/add_{tables[name]}")
    if kind == "bert":
        x = _layer_norm(b, x, "embed/ln", hidden)
    for index in range(layers):
        x = _block(b, x, index, hidden, heads)
    x = _layer_norm(b, x, "final", hidden)
    if kind == "gpt2":
        head = b.op("Transpose", ["wte"], "lm_head/transpose", perm=[1, 0])
        x = b.op("MatMul", [x, head], "lm_head/matmul")
    b.nodes[-1].output[0] = "y"
    int64 = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"]) for n in ids]
    mask = helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["batch", 1, 1, "seq"])
    out = helper.make_tensor_value_info(
        "y", TensorProto.FLOAT, ["batch", "seq", vocab if kind == "gpt2" else hidden]
    )
    graph = helper.make_graph(b.nodes, f"{kind}_like", [*int64, mask], [out], b.initializers)
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        ir_version=IR_VERSION,
        producer_name="amp-rewrite tools/synthetic.py",
    )


def language_feeds(model: onnx.ModelProto, batch: int = 2, seq: int = 8, seed: int = 0) -> dict:
    """Inputs for a model from `language_model`: random tokens, positions 0..seq-1, the last
    position masked out."""
    rng = np.random.default_rng(seed)
    vocab = next(t.dims[0] for t in model.graph.initializer if t.name == "wte")
    feeds = {
        "input_ids": rng.integers(0, vocab, (batch, seq), dtype=np.int64),
        "position_ids": np.broadcast_to(np.arange(seq, dtype=np.int64), (batch, seq)).copy(),
        "mask": np.zeros((batch, 1, 1, seq), np.float32),
    }
    feeds["mask"][..., -1] = -10000.0
    if any(i.name == "token_type_ids" for i in model.graph.input):
        feeds["token_type_ids"] = (np.arange(seq) >= seq // 2).astype(np.int64)[None].repeat(batch, 0)
    return feeds


def sample_feeds(model: onnx.ModelProto, batch: int = 2, seq: int = 8, seed: int = 0) -> dict:
    """Inputs for a stack from `transformer_stack`: unit-normal x, last position masked out."""
    hidden = model.graph.input[0].type.tensor_type.shape.dim[2].dim_value
    rng = np.random.default_rng(seed)
    mask = np.zeros((batch, 1, 1, seq), np.float32)
    mask[..., -1] = -10000.0
    return {"x": rng.standard_normal((batch, seq, hidden)).astype(np.float32), "mask": mask}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("num_nodes", type=int, help="approximate node count")
    parser.add_argument("-o", "--output", required=True, help="where to write the .onnx file")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model = transformer_stack(args.num_nodes, hidden=args.hidden, heads=args.heads, seed=args.seed)
    onnx.save(model, args.output)
    print(f"{args.output}: {len(model.graph.node)} nodes, {layers_for(args.num_nodes)} layers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
