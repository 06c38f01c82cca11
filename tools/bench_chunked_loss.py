"""Peak memory of one training step on a toy language-model head, cross-entropy over the whole
logits vs over row chunks (training/chunked_loss.py), beside torch eager.

    python tools/bench_chunked_loss.py                 # batch 16 x 128 tokens, 30522 classes
    python tools/bench_chunked_loss.py --batch 64

The model is x [B, 128, 256] -> Tanh(x W0) -> (h W + b) with W [256, 30522]: the logits are
B x 15.6 MB. Each variant runs in a fresh process, 1 thread, SGD; times are CPU seconds (the
machine may be shared); memory is the peak RSS of three steps above the resident size once the
trainer (or torch's tensors) is built. "chunked, unordered" leaves the chunks to ONNX Runtime's
own order (`order_chunks` off).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

from procmem import status

SEQ, HIDDEN, CLASSES = 128, 256, 30522
VARIANTS = ("whole logits", "chunked, unordered", "chunked", "torch")


def weights(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "W0": (rng.normal(size=(HIDDEN, HIDDEN)) * 0.05).astype(np.float32),
        "W": (rng.normal(size=(HIDDEN, CLASSES)) * 0.05).astype(np.float32),
        "b": np.zeros(CLASSES, np.float32),
    }


def batch(size, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(size, SEQ, HIDDEN)).astype(np.float32), rng.integers(0, CLASSES, (size, SEQ))


def trainer_step(variant, size):
    from onnx import TensorProto, helper, numpy_helper

    from amp_rewrite.training import SGD, Trainer, chunked_loss, step_graph

    if variant == "whole logits":
        chunked_loss.CHUNK_CLASSES = 10**9
    if variant == "chunked, unordered":
        step_graph.order_chunks = lambda model: None
    nodes = [
        helper.make_node("MatMul", ["x", "W0"], ["h0"], name="inner"),
        helper.make_node("Tanh", ["h0"], ["h"], name="act"),
        helper.make_node("MatMul", ["h", "W"], ["mm"], name="decoder"),
        helper.make_node("Add", ["b", "mm"], ["logits"], name="decoder_bias"),
    ]
    graph = helper.make_graph(
        nodes,
        "lm_head",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", SEQ, HIDDEN])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", SEQ, CLASSES])],
        [numpy_helper.from_array(v, k) for k, v in weights().items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    trainer = Trainer(
        model, optimizer=SGD(0.1), precision="float32", provider="cpu", threads=1, verbose=False
    )
    x, labels = batch(size)
    return lambda: trainer.step({"x": x, "labels": labels}).loss


def torch_step(size):
    import torch

    torch.set_num_threads(1)
    params = [torch.tensor(v, requires_grad=True) for v in weights().values()]
    optimizer = torch.optim.SGD(params, lr=0.1)
    x, labels = (torch.tensor(a) for a in batch(size))

    def step():
        optimizer.zero_grad(set_to_none=True)
        w0, w, b = params
        logits = torch.tanh(x @ w0) @ w + b
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, CLASSES), labels.reshape(-1))
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


def child(variant, size) -> None:
    step = torch_step(size) if variant == "torch" else trainer_step(variant, size)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) restarts from the resident size now
    base = status("VmRSS")
    times, losses = [], []
    for _ in range(3):
        start = time.process_time()
        losses.append(step())
        times.append(time.process_time() - start)
    peak = (status("VmHWM") - base) / 2**20
    print(f"| {variant} | {peak:.0f} | {1e3 * np.median(times):.0f} | {losses[-1]:.6f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.batch)
        return 0
    logits_mb = args.batch * SEQ * CLASSES * 4 / 2**20
    print(f"batch {args.batch} x {SEQ} tokens, {CLASSES} classes: the logits are {logits_mb:.0f} MB")
    print(
        "| variant | peak MB of a step above the built state | step CPU ms (median of 3) | loss after 3 steps |"
    )
    print("|---|---|---|---|")
    for variant in VARIANTS:
        command = [sys.executable, os.path.abspath(__file__), "--child", variant, "--batch", str(args.batch)]
        run = subprocess.run(command, capture_output=True, text=True)
        print(
            run.stdout.strip()
            if run.returncode == 0
            else f"| {variant} | failed: {run.stderr.strip()[-200:]} | | |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
