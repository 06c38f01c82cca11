"""The corpus table: every real model of tests/corpus.py fine-tuned with the Trainer's defaults.

    python tools/train_corpus.py [--models rapidocr-det,silero-vad] [--steps 6]

Each model trains `Trainer(model, loss="mse", precision=p, provider="cpu")` (the default optimizer:
AdamW(1e-4) warmed up over 10 steps) toward its own output on another batch, in float32 and
float16, on one batch. `--lr`/`--warmup` set `AdamW(lr, warmup_steps=...)` instead. Columns: model,
source, exporter / opset, parameters found by default (tensors, values), steps skipped in float32 /
float16, the loss at the first and last step (float32, float16). A model the Trainer refuses shows
the one-line error instead; a traceback is printed as such (it is a bug).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import corpus  # noqa: E402 - after the sys.path line above
from amp_rewrite.errors import AmpRewriteError  # noqa: E402 - after the sys.path line above
from amp_rewrite.training import AdamW, Trainer  # noqa: E402 - after the sys.path line above


def train(model, feeds: dict, precision: str, steps: int, optimizer=None):
    """(trainer, losses, skipped) for `steps` steps on one batch (`optimizer` None: the default)."""
    options = {"optimizer": optimizer} if optimizer is not None else {}
    trainer = Trainer(model, loss="mse", precision=precision, provider="cpu", verbose=False, **options)
    results = [trainer.step(feeds) for _ in range(steps)]
    return trainer, [r.loss for r in results if not r.skipped], sum(r.skipped for r in results)


def row(entry: corpus.Entry, steps: int, optimizer=None) -> str:
    opset = "?"
    try:
        model = corpus.fetch(entry)
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), "?")
        feeds = corpus.batch(model, entry)
        feeds["targets"] = corpus.target(model, entry)
        runs = {p: train(model, feeds, p, steps, optimizer) for p in ("float32", "float16")}
    except corpus.Unavailable as why:
        return f"| {entry.name} | {entry.source} | {opset} | unavailable: {why} | | |"
    except AmpRewriteError as error:
        return f"| {entry.name} | {entry.source} | {opset} | refused: {str(error).splitlines()[0]} | | |"
    except Exception as error:  # noqa: BLE001 - shown as the bug it is
        first = (str(error).strip().splitlines() or [""])[0]
        return f"| {entry.name} | {entry.source} | {opset} | TRACEBACK {type(error).__name__}: {first} | | |"
    trainer, l32, s32 = runs["float32"]
    _, l16, s16 = runs["float16"]
    count = sum(int(np.prod(v.shape)) for v in trainer.weights().values())
    return (
        f"| {entry.name} | {entry.source} | {opset} | {len(trainer.trainable)} ({count:,}) | {s32} / {s16} | "
        f"{_curve(l32)} / {_curve(l16)} |"
    )


def _curve(losses: list[float]) -> str:
    return f"{losses[0]:.4g} -> {losses[-1]:.4g}" if losses else "no step"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(corpus.CORPUS))
    parser.add_argument("--steps", type=int, default=corpus.STEPS)
    parser.add_argument("--lr", type=float, help="AdamW's rate instead of the Trainer's default optimizer")
    parser.add_argument("--warmup", type=int, default=0, help="with --lr: AdamW's warmup_steps")
    args = parser.parse_args(argv)
    optimizer = AdamW(args.lr, warmup_steps=args.warmup) if args.lr is not None else None
    print(
        "| model | source | opset | parameters (values) | skipped fp32 / fp16 | loss first -> last, fp32 / fp16 |"
    )
    print("|---|---|---|---|---|---|")
    for name in args.models.split(","):
        start = time.perf_counter()
        print(row(corpus.CORPUS[name], args.steps, optimizer), flush=True)
        print(f"  ({name}: {time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
