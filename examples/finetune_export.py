"""Fine-tune a model exported from transformers, in float16 mixed precision, with default arguments.

    pip install torch transformers onnxscript   # optional: without them this script says so and exits 0
    python examples/finetune_export.py [--steps 30] [--precision float16]

A tiny Llama (GQA, RoPE, RMSNorm) is exported with torch's dynamo exporter, as a user would, and
fine-tuned on next-token prediction over a short text. The Trainer finds the parameters itself
(the exporter's masks and constants stay frozen) and prints what it trains; the curve follows.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import warnings

import numpy as np

TEXT = (
    "the quick brown fox jumps over the lazy dog. a stitch in time saves nine. "
    "all that glitters is not gold. the early bird catches the worm. "
) * 4
SEQ, BATCH = 16, 16


def export_llama(vocab: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        use_cache=False,
    )
    model = LlamaForCausalLM(config).eval()

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, input_ids):
            return self.inner(input_ids, return_dict=False)[0]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            Logits(),
            (torch.zeros(BATCH, SEQ, dtype=torch.int64),),
            dynamo=True,
            opset_version=18,
            verbose=False,
            input_names=["input_ids"],
            output_names=["logits"],
        )
    proto = program.model_proto
    proto.ir_version = min(proto.ir_version, 10)  # ONNX Runtime 1.31 loads up to IR 10
    return proto


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--precision", default="float16", choices=["float16", "bfloat16", "float32"])
    args = parser.parse_args(argv)
    missing = [m for m in ("torch", "transformers", "onnxscript") if importlib.util.find_spec(m) is None]
    if missing:
        print(
            f"this example needs {', '.join(missing)} (pip install torch transformers onnxscript); skipping"
        )
        return 0
    from amp_rewrite.training import AdamW, Trainer

    vocab = sorted(set(TEXT))
    ids = np.array([vocab.index(c) for c in TEXT], np.int64)
    model = export_llama(len(vocab))
    trainer = Trainer(model, loss="cross_entropy", optimizer=AdamW(3e-3), precision=args.precision)
    rng = np.random.default_rng(0)
    print(f"trainable: {len(trainer.trainable)} tensors, e.g. {', '.join(trainer.trainable[:3])}")
    print("step  loss    scale  skipped")
    for step in range(args.steps):
        starts = rng.integers(0, len(ids) - SEQ - 1, BATCH)
        batch = {
            "input_ids": np.stack([ids[s : s + SEQ] for s in starts]),
            "labels": np.stack([ids[s + 1 : s + SEQ + 1] for s in starts]),
        }
        result = trainer.step(batch)
        print(f"{step + 1:4d}  {result.loss:.4f}  {result.loss_scale:5g}  {result.skipped}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
