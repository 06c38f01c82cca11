"""Recompute's trade: peak memory and step time of a training step, recompute off / per layer / auto.

    python tools/bench_recompute.py                   # MLP 24 x 1024 at batch 2048, 12-layer transformer
    python tools/bench_recompute.py --mlp-batch 512 --tf-batch 4 --steps 1   # a quicker, smaller run

Every row runs in fresh processes. A Trainer (Adam, float32 unless --precision) builds the step
graph, which then runs in its own ONNX Runtime CPU session, fed the initial state each step.
Memory is peak RSS (VmHWM, reset with /proc/self/clear_refs once the session is made):
- `--arena off` (default): no ORT arena, glibc's mmap threshold fixed at 64 KiB, so every tensor
  is its own mapping and RSS follows the live tensors;
- `--arena exact`: ORT's CPU arena, grown by what is asked (kSameAsRequested), never shrunk;
- `--arena default`: ORT's default arena (grows in powers of two: coarse).
The *floor* is the peak of a batch-1 step in another fresh process (weights, gradients, optimizer
state and temporaries, the session: all but activations); "above" is the peak over the full-batch
steps minus it (both over a warm-up and the timed count: ORT plans memory from the second run on). Step time is measured in a third fresh process with ORT's default arena (as the
Trainer runs; with the arena off every step pays first-touch page faults, which on this project's
VMs cost more than the recompute): the median of the timed steps after one warm-up, the fastest of
--rounds such processes run alternately with the other configurations (the shared machine's load
drifts). Ratios are to "off", measured side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from procmem import status

IR_VERSION = 8
CONFIGS = ("off", "per-layer", "auto")
PER_LAYER = [r"layer\d+/.*"]


def _model(nodes, weights, inputs, outputs):
    inits = [numpy_helper.from_array(v, k) for k, v in weights.items()]
    graph = helper.make_graph(nodes, "bench", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)


def mlp(layers: int, width: int, batch: int, seed: int = 0):
    """layers x (MatMul, Add, Relu) at width; returns (model, feeds) for an MSE loss."""
    rng = np.random.default_rng(seed)
    nodes, weights, h = [], {}, "x"
    for i in range(layers):
        p = f"layer{i}/"
        weights[p + "W"] = (rng.standard_normal((width, width)) / math.sqrt(width)).astype(np.float32)
        weights[p + "B"] = np.zeros(width, np.float32)
        nodes += [
            helper.make_node("MatMul", [h, p + "W"], [p + "mm"], name=p + "MatMul"),
            helper.make_node("Add", [p + "mm", p + "B"], [p + "pre"], name=p + "Add"),
            helper.make_node("Relu", [p + "pre"], [p + "act"], name=p + "Relu"),
        ]
        h = p + "act"
    nodes.append(helper.make_node("Identity", [h], ["y"], name="out"))
    model = _model(
        nodes,
        weights,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])],
    )
    feeds = {
        "x": rng.standard_normal((batch, width)).astype(np.float32),
        "targets": rng.standard_normal((batch, width)).astype(np.float32),
    }
    return model, feeds


def transformer(layers: int, d: int, heads: int, seq: int, batch: int, seed: int = 0):
    """Pre-LayerNorm transformer layers (attention + erf-GELU MLP), MSE on the last hidden state."""
    rng = np.random.default_rng(seed)
    dh = d // heads
    weights = {}
    constants = {
        "heads_shape": np.array([0, 0, heads, dh], np.int64),
        "model_shape": np.array([0, 0, d], np.int64),
        "scale": np.array(math.sqrt(dh), np.float32),
        "half": np.array(0.5, np.float32),
        "one": np.array(1.0, np.float32),
        "inv_sqrt2": np.array(1 / math.sqrt(2), np.float32),
    }
    # Constant nodes, not initializers: the Trainer would train float initializers, and a scalar
    # shared by every layer gathers its gradient from all of them at the end of the backward
    nodes = [
        helper.make_node("Constant", [], [k], name=f"const/{k}", value=numpy_helper.from_array(v, k))
        for k, v in constants.items()
    ]
    x = "x"

    def n(name, op, inputs, outputs, **attrs):
        nodes.append(helper.make_node(op, inputs, outputs, name=name, **attrs))

    for i in range(layers):
        p = f"layer{i}/"
        for k, shape in {"g1": (d,), "g2": (d,)}.items():
            weights[p + k] = np.ones(shape, np.float32)
        for k, shape in {"b1": (d,), "b2": (d,), "c1": (4 * d,), "c2": (d,)}.items():
            weights[p + k] = np.zeros(shape, np.float32)
        for k, shape in {
            "wq": (d, d),
            "wk": (d, d),
            "wv": (d, d),
            "wo": (d, d),
            "w1": (d, 4 * d),
            "w2": (4 * d, d),
        }.items():
            weights[p + k] = (rng.standard_normal(shape) / math.sqrt(shape[0])).astype(np.float32)
        n(p + "ln1", "LayerNormalization", [x, p + "g1", p + "b1"], [p + "ln1"], axis=-1)
        for k in "qkv":
            n(p + f"{k}/MatMul", "MatMul", [p + "ln1", p + f"w{k}"], [p + f"{k}0"])
            n(p + f"{k}/Reshape", "Reshape", [p + f"{k}0", "heads_shape"], [p + f"{k}1"])
        n(p + "q/Transpose", "Transpose", [p + "q1"], [p + "q"], perm=[0, 2, 1, 3])
        n(p + "k/Transpose", "Transpose", [p + "k1"], [p + "kT"], perm=[0, 2, 3, 1])
        n(p + "v/Transpose", "Transpose", [p + "v1"], [p + "v"], perm=[0, 2, 1, 3])
        n(p + "scores", "MatMul", [p + "q", p + "kT"], [p + "s0"])
        n(p + "scale", "Div", [p + "s0", "scale"], [p + "s"])
        n(p + "softmax", "Softmax", [p + "s"], [p + "a"], axis=-1)
        n(p + "context", "MatMul", [p + "a", p + "v"], [p + "o0"])
        n(p + "o/Transpose", "Transpose", [p + "o0"], [p + "o1"], perm=[0, 2, 1, 3])
        n(p + "o/Reshape", "Reshape", [p + "o1", "model_shape"], [p + "o2"])
        n(p + "o/MatMul", "MatMul", [p + "o2", p + "wo"], [p + "o"])
        n(p + "residual1", "Add", [x, p + "o"], [p + "x2"])
        n(p + "ln2", "LayerNormalization", [p + "x2", p + "g2", p + "b2"], [p + "ln2"], axis=-1)
        n(p + "fc1/MatMul", "MatMul", [p + "ln2", p + "w1"], [p + "f0"])
        n(p + "fc1/Add", "Add", [p + "f0", p + "c1"], [p + "f1"])
        n(p + "gelu/Mul", "Mul", [p + "f1", "inv_sqrt2"], [p + "f2"])
        n(p + "gelu/Erf", "Erf", [p + "f2"], [p + "f3"])
        n(p + "gelu/Add", "Add", [p + "f3", "one"], [p + "f4"])
        n(p + "gelu/Mul2", "Mul", [p + "f1", p + "f4"], [p + "f5"])
        n(p + "gelu/Half", "Mul", [p + "f5", "half"], [p + "gelu"])
        n(p + "fc2/MatMul", "MatMul", [p + "gelu", p + "w2"], [p + "f6"])
        n(p + "fc2/Add", "Add", [p + "f6", p + "c2"], [p + "f7"])
        n(p + "residual2", "Add", [p + "x2", p + "f7"], [p + "out"])
        x = p + "out"
    n("out", "Identity", [x], ["y"])
    model = _model(
        nodes,
        weights,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", seq, d])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", seq, d])],
    )
    feeds = {
        "x": rng.standard_normal((batch, seq, d)).astype(np.float32),
        "targets": rng.standard_normal((batch, seq, d)).astype(np.float32),
    }
    return model, feeds


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak-RSS mark (VmHWM) starts again from the current RSS


def child(args) -> None:
    """One configuration in this (fresh) process; prints one JSON line."""
    import gc

    import onnxruntime as ort

    from amp_rewrite.training import Adam, Trainer

    model, feeds = build(args)
    recompute = {"off": None, "per-layer": PER_LAYER, "auto": "auto"}[args.child_config]
    trainer = Trainer(
        model,
        loss="mse",
        optimizer=Adam(lr=1e-4),
        precision=args.precision,
        provider="cpu",
        loss_scale=1.0,
        recompute=recompute,
    )
    step = trainer.step_graph
    options = ort.SessionOptions()
    options.log_severity_level = 3
    arena = "default" if args.child_time else args.arena  # time: as the Trainer runs, arena on
    if arena == "exact":  # an arena that grows by what is asked, not in powers of two
        cpu = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(cpu, ort.OrtArenaCfg(0, 1, -1, -1))
        options.add_session_config_entry("session.use_env_allocators", "1")
    else:
        options.enable_cpu_mem_arena = arena == "default"
    session = ort.InferenceSession(
        step.model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    state = {**trainer.state(), "opt/lr": np.array(1e-4, np.float32)}
    plan, segments = (
        trainer.recompute_plan,
        len(trainer.recompute_plan.segments) if trainer.recompute_plan else 0,
    )
    del model, trainer
    gc.collect()
    _reset_peak()
    if args.child_floor:  # batch 1: weights, gradients, optimizer state and temporaries, ~no activations
        for _ in range(args.steps + 1):  # ORT plans memory from the second run on: steady state
            session.run(None, {**state, **{k: v[:1] for k, v in feeds.items()}})
        print(json.dumps({"peak": status("VmHWM")}))
        return
    if not args.child_time:  # the peak of the full-batch steps
        for _ in range(args.steps + 1):
            session.run(None, {**state, **feeds})
        print(
            json.dumps(
                {
                    "peak": status("VmHWM"),
                    "segments": segments,
                    "checkpointed": len(plan.checkpointed) if plan else 0,
                }
            )
        )
        return
    times = []
    for k in range(args.steps + 1):
        start = time.perf_counter()
        session.run(None, {**state, **feeds})
        if k:
            times.append(time.perf_counter() - start)
    print(json.dumps({"time": statistics.median(times)}))


def build(args):
    if args.child_model == "mlp":
        return mlp(args.mlp_layers, args.mlp_width, args.mlp_batch)
    return transformer(args.tf_layers, args.tf_d, args.tf_heads, args.tf_seq, args.tf_batch)


def _child(args, argv, name, config, extra) -> dict:
    command = [
        sys.executable,
        os.path.abspath(__file__),
        *(argv if argv is not None else sys.argv[1:]),
        "--child-model",
        name,
        "--child-config",
        config,
        *extra,
    ]
    memory = "--child-time" not in extra
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"} if args.arena == "off" and memory else None
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode:
        raise SystemExit(f"bench child failed ({name}, {config}):\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mlp-layers", type=int, default=24)
    parser.add_argument("--mlp-width", type=int, default=1024)
    parser.add_argument("--mlp-batch", type=int, default=2048)
    parser.add_argument("--tf-layers", type=int, default=12)
    parser.add_argument("--tf-d", type=int, default=256)
    parser.add_argument("--tf-heads", type=int, default=4)
    parser.add_argument("--tf-seq", type=int, default=128)
    parser.add_argument("--tf-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--precision", default="float32", choices=("float32", "float16"))
    parser.add_argument(
        "--rounds", type=int, default=2, help="timing processes per configuration, alternated"
    )
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument(
        "--arena",
        default="off",
        choices=("exact", "default", "off"),
        help="ORT CPU memory: arena grown as requested, the default arena, or malloc",
    )
    parser.add_argument("--child-model", help=argparse.SUPPRESS)
    parser.add_argument("--child-config", help=argparse.SUPPRESS)
    parser.add_argument("--child-floor", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-time", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_model:
        child(args)
        return 0
    rows = []
    for name in args.models.split(","):
        results = {}
        for config in CONFIGS:
            floor = _child(args, argv, name, config, ["--child-floor"])
            results[config] = _child(args, argv, name, config, []) | {
                "floor": floor["peak"],
                "time": math.inf,
            }
        for _ in range(args.rounds):  # the shared machine's load drifts: alternate, keep each one's fastest
            for config in CONFIGS:
                timed = _child(args, argv, name, config, ["--child-time"])["time"]
                results[config]["time"] = min(results[config]["time"], timed)
        off = results["off"]
        for config in CONFIGS:
            r = results[config]
            above = r["peak"] - r["floor"]
            rows.append(
                (
                    name,
                    config,
                    r["segments"],
                    r["floor"] / 2**20,
                    above / 2**20,
                    above / (off["peak"] - off["floor"]) if off["peak"] > off["floor"] else float("nan"),
                    r["time"],
                    r["time"] / off["time"],
                )
            )
    print(
        f"mlp {args.mlp_layers} x {args.mlp_width} at batch {args.mlp_batch}; transformer {args.tf_layers} layers, "
        f"d {args.tf_d}, {args.tf_heads} heads, seq {args.tf_seq}, batch {args.tf_batch}; {args.precision}, CPU, "
        f"arena {args.arena}"
    )
    print(
        f"above = peak RSS over {args.steps + 1} full-batch steps minus the floor (the same at batch 1), each in a "
        f"fresh process; step = fastest of {args.rounds} alternated processes' median of {args.steps} timed steps, default ORT arena"
    )
    head = f"{'model':<12}{'recompute':<11}{'segments':>9}{'floor MB':>10}{'above MB':>10}{'ratio':>7}{'step s':>9}{'ratio':>7}"
    print(head)
    print("-" * len(head))
    for name, config, segs, floor, above, ratio, step, tratio in rows:
        print(
            f"{name:<12}{config:<11}{segs:>9}{floor:>10.0f}{above:>10.0f}{ratio:>7.2f}{step:>9.3f}{tratio:>7.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
