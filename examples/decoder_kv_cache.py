"""A Llama-style decoder with its key/value cache in float16, decoded greedily in ONNX Runtime.

    pip install torch transformers onnxscript   # without them this script says so and exits 0
    python examples/decoder_kv_cache.py [--steps 32] [--out DIR]

A tiny LlamaConfig (GQA: 4 query heads over 2 key/value heads, RoPE, RMSNorm; random weights) is
exported by torch's dynamo exporter with the cache as graph inputs `past_key_values.L.key/value`
and outputs `present.L.key/value`, then rewritten with

    amp_rewrite.rewrite(model, low_precision_io=[r"past_key_values\\..*", r"present\\..*"])

(`--low-precision-io` on the command line): the cache is float16 at the graph's edge, so each step
reads and writes half the bytes and feeds `present` back as `past` with no Cast, while
`input_ids`, `attention_mask` and `logits` keep their types. Both models decode side by side, fed
the same tokens (float32's greedy choice), and the script prints the logits' cosine per step.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

import amp_rewrite

CACHE_IO = [r"past_key_values\..*", r"present\..*"]
CONFIG = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
OPSET = 18


def missing() -> list[str]:
    return [
        name for name in ("torch", "transformers", "onnxscript") if importlib.util.find_spec(name) is None
    ]


def cache_names(layers: int) -> tuple[list[str], list[str]]:
    past = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    return past, [name.replace("past_key_values", "present") for name in past]


def export(config: dict = CONFIG, seed: int = 0) -> onnx.ModelProto:
    """The decoder with the cache as flat inputs and outputs, exported by the dynamo exporter
    (eager attention: the SDPA path's causal flag does not trace with a symbolic length)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.cache_utils import DynamicCache

    torch.manual_seed(seed)
    cfg = LlamaConfig(**config, use_cache=True, attn_implementation="eager")
    llama = LlamaForCausalLM(cfg).eval()
    layers, kv_heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    head_dim = cfg.hidden_size // cfg.num_attention_heads

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.llama = llama

        def forward(self, input_ids, attention_mask, *past):
            cache = DynamicCache(config=cfg)
            for i in range(layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.llama(
                input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True
            )
            present = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
            return (out.logits, *present)

    batch, seq, past_len = 2, 2, 3  # sizes of 1 would be specialised by torch.export
    example = (
        torch.zeros(batch, seq, dtype=torch.int64),
        torch.ones(batch, past_len + seq, dtype=torch.int64),
        *[torch.zeros(batch, kv_heads, past_len, head_dim) for _ in range(2 * layers)],
    )
    past_names, present_names = cache_names(layers)
    dims = (
        {0: "batch", 1: "seq"},
        {0: "batch", 1: "total"},
        tuple({0: "batch", 2: "past"} for _ in past_names),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            Decoder(),
            example,
            dynamo=True,
            opset_version=OPSET,
            verbose=False,
            input_names=["input_ids", "attention_mask", *past_names],
            output_names=["logits", *present_names],
            dynamic_shapes=dims,
        )
    model = program.model_proto
    model.ir_version = min(model.ir_version, 10)  # ONNX Runtime refuses newer IR versions
    return model


def rewrite(model: onnx.ModelProto) -> amp_rewrite.RewriteResult:
    """float16 compute, the cache float16 at the graph's edge, everything else as exported."""
    return amp_rewrite.rewrite(model, low_precision_io=CACHE_IO)


def cache_inputs(model: onnx.ModelProto) -> dict:
    """Each past input's name -> (element dtype, [kv heads, head dim]) as declared."""
    out = {}
    for value in model.graph.input:
        if value.name.startswith("past_key_values."):
            dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
            out[value.name] = (
                onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type),
                (dims[1], dims[3]),
            )
    return out


def decode(run, model: onnx.ModelProto, prompt, steps: int, follow=None):
    """Greedy decoding, one token a step after the prompt: `run(feeds) -> outputs` (ONNX Runtime or
    onnx.reference). Each step's `present` is fed back as the next `past`, as it came out. With
    `follow` (a list of tokens), those tokens are fed instead of this model's own choices, so two
    models can be compared step by step. Returns (tokens, each step's last logits, each step's
    cache dtypes)."""
    past = {
        name: np.zeros((1, heads, 0, head_dim), dtype)
        for name, (dtype, (heads, head_dim)) in cache_inputs(model).items()
    }
    ids = np.asarray([prompt], np.int64)
    length = 0
    tokens, logits, dtypes = [], [], []
    for step in range(steps):
        length += ids.shape[1]
        outputs = run({"input_ids": ids, "attention_mask": np.ones((1, length), np.int64), **past})
        last = np.asarray(outputs[0])[0, -1].astype(np.float32)
        chosen = int(last.argmax()) if follow is None else follow[step]
        tokens.append(chosen)
        logits.append(last)
        past = dict(zip(past, outputs[1:]))
        dtypes.append({np.asarray(v).dtype for v in past.values()})
        ids = np.asarray([[chosen]], np.int64)
    return tokens, logits, dtypes


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def cache_casts(model: onnx.ModelProto) -> list[str]:
    """Cast nodes that read a past input or write a present output: none, when the cache is float16 end to end."""
    past, present = cache_names(sum(v.name.endswith(".key") for v in model.graph.input))
    return [
        n.name
        for n in model.graph.node
        if n.op_type == "Cast" and (n.input[0] in past or n.output[0] in present)
    ]


def session_runner(model: onnx.ModelProto):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return lambda feeds: session.run(None, feeds)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument(
        "--out", type=Path, help="folder for decoder.onnx and decoder.fp16.onnx (default: a temporary one)"
    )
    args = parser.parse_args(argv)
    absent = missing()
    if absent:
        print(f"this example needs {', '.join(absent)}: pip install {' '.join(absent)}")
        return 0
    float32 = export()
    result = rewrite(float32)
    half = result.model
    print(result.report.to_text())
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.out or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        onnx.save(float32, folder / "decoder.onnx")
        onnx.save(half, folder / "decoder.fp16.onnx")
        prompt = [1, 5, 9, 2]
        tokens, expected, _ = decode(session_runner(float32), float32, prompt, args.steps)
        own, _, _ = decode(session_runner(half), half, prompt, args.steps)
        _, got, dtypes = decode(session_runner(half), half, prompt, args.steps, follow=tokens)
    cosines = [cosine(g, e) for g, e in zip(got, expected)]
    print(
        f"cache I/O: {', '.join(sorted(set().union(*[{str(d) for d in step} for step in dtypes])))} at every step; "
        f"Casts on the cache path: {len(cache_casts(half))}"
    )
    print(
        f"logits cosine vs float32 over {args.steps} steps: min {min(cosines):.6f}, mean {np.mean(cosines):.6f}"
    )
    print(f"greedy tokens equal to float32's: {sum(a == b for a, b in zip(own, tokens))}/{args.steps}")
    return 0 if min(cosines) >= 0.999 and not cache_casts(half) else 1


if __name__ == "__main__":
    sys.exit(main())
