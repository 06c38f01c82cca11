"""The fine-tuning table: each real export of tests/exported_training.py trained 30 steps with the
Trainer's defaults in float32 and float16, side by side in one run.

    python tools/finetune_exports.py [--models mlp,llama]     # needs torch, transformers, onnxscript, scikit-learn

Columns: exporter and opset, nodes and op types, parameters found by default vs by hand (the
exporter's tensors holding a torch parameter; the torch count in brackets), constants left frozen,
skipped steps, the loss at step 1 and 30, and the largest per-step gap of the float16 curve.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import exported_training as et  # noqa: E402
from amp_rewrite.training import AdamW, Trainer  # noqa: E402

DYNAMO = {"gpt2", "llama"}


def row(name: str) -> str:
    model, batches, module = et.EXPORTS[name]()
    curves, trainers, skipped = {}, {}, {}
    for precision in ("float32", "float16"):
        trainer = Trainer(
            model, optimizer=AdamW(et.LR.get(name, 3e-3)), precision=precision, provider="cpu", verbose=False
        )
        results = [trainer.step(b) for b in batches]
        curves[precision] = np.array([r.loss for r in results])
        trainers[precision], skipped[precision] = trainer, sum(r.skipped for r in results)
    l32, l16 = curves["float32"], curves["float16"]
    trainer = trainers["float32"]
    floats = sum(1 for t in trainer._model.graph.initializer if t.data_type == 1)
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    ops = len({n.op_type for n in model.graph.node})
    return (
        f"| {name} | {'dynamo' if name in DYNAMO else 'torchscript'}, {opset} | {len(model.graph.node)} / {ops} | "
        f"{len(trainer.trainable)} / {len(et.by_hand(model, module))} ({len(list(module.parameters()))}) | "
        f"{floats - len(trainer.trainable)} | {skipped['float32']} / {skipped['float16']} | {l32[0]:.3f} | "
        f"{l32[-1]:.3f} | {l16[-1]:.3f} | {np.max(np.abs(l16 - l32) / l32):.2%} |"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(et.EXPORTS))
    args = parser.parse_args(argv)
    print(
        "| model | exporter, opset | nodes / op types | parameters default / by hand (torch) | frozen constants "
        "| skipped fp32 / fp16 | loss step 1 | step 30 fp32 | step 30 fp16 | max fp16 gap |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        print(row(name), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
