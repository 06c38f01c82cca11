"""The CPU step's optimizer update, by engine: the C loop (training/_blocks.c) against numpy's calls.

    python tools/bench_update.py                      # the MLP 784-1024-1024-10, batch 256, AdamW
    python tools/bench_update.py --width 2048 --rounds 60

Two Trainers on one step graph in one process, one per engine, stepping in turn (the order
swapped every round): each step's gradients, then its update, timed apart; medians, and the
median of the per-round ratios. The update runs right after its gradients, as in a step, so the
state comes from memory. The states are compared at the end: the engines must agree bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import onnx

from bench_train import LR, make_feeds, mlp


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)

    from amp_rewrite.training import AdamW, Trainer, block_loop

    if not block_loop.AVAILABLE:
        print("the C loop (amp_rewrite.training._blocks) is not built here: numpy's calls only")
        return 1
    model, _, shape = mlp(width=args.width)
    feeds = make_feeds(shape, args.batch)
    trainers = {}
    for engine in ("numpy", "c-loop"):
        block_loop.AVAILABLE = engine == "c-loop"  # read when the update is compiled
        trainers[engine] = Trainer(
            onnx.load_from_string(model.SerializeToString()),
            optimizer=AdamW(LR),
            provider="cpu",
            precision="float32",
            verbose=False,
            threads=1,
        )
    block_loop.AVAILABLE = True
    update = {engine: [] for engine in trainers}
    gradients = {engine: [] for engine in trainers}
    for r in range(args.warmup + args.rounds):
        for engine in list(trainers)[:: 1 if r % 2 else -1]:
            runner = trainers[engine].engine
            start = time.perf_counter()
            runner.compute_gradients(feeds[r % len(feeds)])
            middle = time.perf_counter()
            runner.apply()
            end = time.perf_counter()
            if r >= args.warmup:
                gradients[engine].append(1e3 * (middle - start))
                update[engine].append(1e3 * (end - middle))
    same = all(
        np.array_equal(a, b)
        for a, b in zip(trainers["numpy"].state().values(), trainers["c-loop"].state().values())
    )
    print(f"MLP 784-{args.width}-{args.width}-10, batch {args.batch}, AdamW, 1 thread, {args.rounds} rounds")
    print("| engine | update ms | gradients ms | update / numpy's |")
    print("|---|---|---|---|")
    for engine in trainers:
        ratio = statistics.median(u / n for u, n in zip(update[engine], update["numpy"]))
        print(
            f"| {engine} | {statistics.median(update[engine]):.2f} | "
            f"{statistics.median(gradients[engine]):.2f} | {ratio:.2f} |"
        )
    print(f"states bit for bit equal: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
