"""Training-step time: amp-rewrite's ONNX Runtime step (float32 and mixed precision) against
PyTorch eager on the same MLP and small CNN (same run, medians, torch optional).

    python tools/bench_train.py                 # CPU: float32 vs torch eager, mixed-precision overhead
    python tools/bench_train.py --provider cuda # GPU: float32 vs float16 on the CUDA provider

A step is forward + cross-entropy + backward + SGD(momentum) update; the ONNX Runtime step also
does the loss scaling, finite check and gated update, all in one session run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from amp_rewrite.training import SGD, Trainer

IR_VERSION = 8


def _uniform(rng, fan_in, shape):
    bound = 1 / np.sqrt(fan_in)
    return rng.uniform(-bound, bound, shape).astype(np.float32)


def mlp(width: int = 512, depth: int = 3, features: int = 784, classes: int = 10, seed: int = 0):
    """Gemm+Relu stack; returns (onnx model, {name: array}, input shape without the batch)."""
    rng = np.random.default_rng(seed)
    sizes = [features] + [width] * (depth - 1) + [classes]
    nodes, weights, current = [], {}, "x"
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        weights[f"w{i}"], weights[f"b{i}"] = _uniform(rng, a, (a, b)), _uniform(rng, a, (b,))
        out = "logits" if i == len(sizes) - 2 else f"h{i}"
        nodes.append(helper.make_node("Gemm", [current, f"w{i}", f"b{i}"], [out if out == "logits" else out + "_lin"], name=f"fc{i}"))
        if out != "logits":
            nodes.append(helper.make_node("Relu", [out + "_lin"], [out], name=f"relu{i}"))
        current = out
    return _model(nodes, weights, [features], classes), weights, (features,)


def small_cnn(channels=(16, 32), size: int = 28, classes: int = 10, seed: int = 0):
    """conv3x3-relu-maxpool twice, flatten, linear (NCHW, one input channel)."""
    rng = np.random.default_rng(seed)
    nodes, weights, current, c_in, side = [], {}, "x", 1, size
    for i, c_out in enumerate(channels):
        weights[f"conv{i}.w"] = _uniform(rng, c_in * 9, (c_out, c_in, 3, 3))
        weights[f"conv{i}.b"] = _uniform(rng, c_in * 9, (c_out,))
        nodes += [helper.make_node("Conv", [current, f"conv{i}.w", f"conv{i}.b"], [f"c{i}"], name=f"conv{i}", pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}"),
                  helper.make_node("MaxPool", [f"r{i}"], [f"p{i}"], name=f"pool{i}", kernel_shape=[2, 2], strides=[2, 2])]
        current, c_in, side = f"p{i}", c_out, side // 2
    flat = c_in * side * side
    weights["fc.w"], weights["fc.b"] = _uniform(rng, flat, (flat, classes)), _uniform(rng, flat, (classes,))
    nodes += [helper.make_node("Flatten", [current], ["flat"], name="flatten"),
              helper.make_node("Gemm", ["flat", "fc.w", "fc.b"], ["logits"], name="fc")]
    return _model(nodes, weights, [1, size, size], classes), weights, (1, size, size)


def _model(nodes, weights, input_shape, classes):
    graph = helper.make_graph(nodes, "bench", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", *input_shape])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", classes])],
                              [numpy_helper.from_array(v, k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)


def median_ms(steps: dict, feeds: dict, warmup: int, repeat: int) -> dict:
    """Median step time of each runner, timed round-robin so load drift hits all of them alike."""
    for i in range(warmup):
        for name, step in steps.items():
            step(feeds[name][i % len(feeds[name])])
    times = {name: [] for name in steps}
    for i in range(repeat):
        for name, step in steps.items():
            start = time.perf_counter()
            step(feeds[name][i % len(feeds[name])])
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def ort_trainer(model, precision, provider):
    return Trainer(model, optimizer=SGD(0.01, momentum=0.9), precision=precision, provider=provider)


def torch_runner(kind, weights, feeds_list, threads):
    """(step function, its feeds): the same model, loss and optimizer in PyTorch eager on CPU; None without torch."""
    try:
        import torch
    except ImportError:
        return None, None
    torch.set_num_threads(threads)
    params = {k: torch.tensor(v, requires_grad=True) for k, v in weights.items()}
    optimizer = torch.optim.SGD(list(params.values()), lr=0.01, momentum=0.9)
    F = torch.nn.functional

    def forward(x):
        if kind == "mlp":
            count = len(params) // 2
            for i in range(count):
                x = x @ params[f"w{i}"] + params[f"b{i}"]
                x = F.relu(x) if i < count - 1 else x
            return x
        i = 0
        while f"conv{i}.w" in params:
            x = F.max_pool2d(F.relu(F.conv2d(x, params[f"conv{i}.w"], params[f"conv{i}.b"], padding=1)), 2)
            i += 1
        return torch.flatten(x, 1) @ params["fc.w"] + params["fc.b"]

    torch_feeds = [(torch.from_numpy(f["x"]), torch.from_numpy(f["labels"])) for f in feeds_list]

    def step(feeds):
        x, labels = feeds
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(forward(x), labels)
        loss.backward()
        optimizer.step()
        return loss.item()  # the host read our step does too

    return step, torch_feeds


def make_feeds(input_shape, batch, classes=10, count=4, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((batch, *input_shape)).astype(np.float32),
             "labels": rng.integers(0, classes, batch).astype(np.int64)} for _ in range(count)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", default="cpu", choices=["cpu", "cuda", "auto"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    parser.add_argument("--models", default="mlp,cnn")
    args = parser.parse_args(argv)
    try:
        import torch
        threads = args.threads or torch.get_num_threads()
    except ImportError:
        threads = args.threads or 1
    builders = {"mlp": mlp, "cnn": small_cnn}
    rows = []
    for kind in args.models.split(","):
        model, weights, input_shape = builders[kind]()
        feeds = make_feeds(input_shape, args.batch)
        full, mixed = ort_trainer(model, "float32", args.provider), ort_trainer(model, "float16", args.provider)
        steps, all_feeds = {"fp32": full.step, "fp16": mixed.step}, {"fp32": feeds, "fp16": feeds}
        eager_step, eager_feeds = torch_runner(kind, weights, feeds, threads) if full.device == "cpu" else (None, None)
        if eager_step is not None:
            steps["torch"], all_feeds["torch"] = eager_step, eager_feeds
        ms = median_ms(steps, all_feeds, args.warmup, args.repeat)
        skipped = args.warmup + args.repeat - mixed.step_count  # costs the same, but would mean a broken run
        rows.append((kind, full.device, ms.get("torch"), ms["fp32"], ms["fp16"], skipped))
    print(f"batch {args.batch}, median of {args.repeat} steps after {args.warmup} warm-up (round-robin), SGD(momentum=0.9)")
    print("| model | device | torch eager ms | ORT float32 ms | ORT fp32 / torch | ORT float16 AMP ms | AMP / fp32 | AMP skipped |")
    print("|---|---|---|---|---|---|---|---|")
    for kind, device, eager, fp32, fp16, skipped in rows:
        eager_text = f"{eager:.2f}" if eager is not None else "n/a"
        ratio = f"{fp32 / eager:.2f}" if eager is not None else "n/a"
        print(f"| {kind} | {device} | {eager_text} | {fp32:.2f} | {ratio} | {fp16:.2f} | {fp16 / fp32:.2f} | {skipped} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
