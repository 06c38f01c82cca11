"""Training beside torch and ONNX Runtime training: step time and memory, side by side.

    python tools/bench_train.py                          # MLP, CNN, BERT; 1 thread and the default
    python tools/bench_train.py --models mlp --threads 1 --rounds 10
    python tools/bench_train.py --recompute              # BERT batch 64: recompute="auto" vs torch checkpointing
    python tools/bench_train.py --device cuda [--cuda-graph]  # on the GPU: torch on CUDA beside the Trainer

Each contender (torch eager float32, torch CPU autocast bfloat16, ONNX Runtime training artifacts
when an onnxruntime-training Python is given with --ort-training-python or AMP_ORT_TRAINING_PYTHON,
the Trainer float32 and float16) runs in a fresh process of its own; the driver asks each for one
step in turn, rotating the order every round, so load drift hits all alike. Step times are medians
after warm-up; ratios are medians of per-round ratios to torch float32 (and, in a line under the
table, the trainer's to ONNX Runtime training when both ran). Memory is the peak RSS above
the process's floor after its imports (VmHWM minus VmRSS then): setup and steps. Every contender
trains with AdamW(1e-3, weight decay 1e-2) on a cross-entropy loss.

`--device cuda`: torch and the Trainer (provider "cuda"; `--cuda-graph` captures its step) run on
the GPU, and torch-bf16 becomes torch's CUDA recipe, autocast float16 with a GradScaler. Each step
returns its loss to the host, so every contender's time includes its device work. Memory stays the
host's peak RSS (device memory: ONNX Runtime's arena and torch's caching allocator differ in kind).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from procmem import status

IR_VERSION = 8
BATCH = {"mlp": 256, "cnn": 128, "bert": 16}
BERT = dict(
    vocab_size=30522,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    intermediate_size=1024,
    max_position_embeddings=512,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
SEQ = 128
CONTENDERS = ("torch", "torch-bf16", "ort-training", "trainer", "trainer-fp16")
LR = 1e-3
DEVICE = os.environ.get("AMP_BENCH_DEVICE", "cpu")  # the children's device, set by the driver's --device
CUDA_GRAPH = os.environ.get("AMP_BENCH_CUDA_GRAPH") == "1"


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
        nodes.append(
            helper.make_node(
                "Gemm", [current, f"w{i}", f"b{i}"], [out if out == "logits" else out + "_lin"], name=f"fc{i}"
            )
        )
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
        nodes += [
            helper.make_node(
                "Conv", [current, f"conv{i}.w", f"conv{i}.b"], [f"c{i}"], name=f"conv{i}", pads=[1, 1, 1, 1]
            ),
            helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}"),
            helper.make_node(
                "MaxPool", [f"r{i}"], [f"p{i}"], name=f"pool{i}", kernel_shape=[2, 2], strides=[2, 2]
            ),
        ]
        current, c_in, side = f"p{i}", c_out, side // 2
    flat = c_in * side * side
    weights["fc.w"], weights["fc.b"] = _uniform(rng, flat, (flat, classes)), _uniform(rng, flat, (classes,))
    nodes += [
        helper.make_node("Flatten", [current], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "fc.w", "fc.b"], ["logits"], name="fc"),
    ]
    return _model(nodes, weights, [1, size, size], classes), weights, (1, size, size)


def _model(nodes, weights, input_shape, classes):
    graph = helper.make_graph(
        nodes,
        "bench",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", *input_shape])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", classes])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)


def make_feeds(input_shape, batch, classes=10, count=4, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.standard_normal((batch, *input_shape)).astype(np.float32),
            "labels": rng.integers(0, classes, batch).astype(np.int64),
        }
        for _ in range(count)
    ]


def bert_feeds(batch, count=4, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "input_ids": rng.integers(0, BERT["vocab_size"], (batch, SEQ)).astype(np.int64),
            "labels": rng.integers(0, BERT["vocab_size"], (batch, SEQ)).astype(np.int64),
        }
        for _ in range(count)
    ]


def bert_module():
    import torch
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(**BERT)).train()


def export_bert(path: str) -> None:
    """The BERT's ONNX export (TorchScript exporter, logits only), written once per run."""
    import io
    import warnings

    import onnx
    import torch

    module = bert_module().eval()

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = module

        def forward(self, input_ids):
            return self.inner(input_ids=input_ids).logits

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Logits(),
            (torch.zeros(2, SEQ, dtype=torch.int64),),
            buffer,
            dynamo=False,
            opset_version=17,
            input_names=["input_ids"],
            output_names=["logits"],
            dynamic_axes={"input_ids": {0: "N"}, "logits": {0: "N"}},
        )
    model = onnx.load_from_string(buffer.getvalue())
    model.ir_version = min(model.ir_version, 10)
    onnx.save(model, path)


# --- one contender in its own process ------------------------------------------------------------


def _torch_step(kind, threads, bf16, batch, recompute, model_dir):
    import torch

    if threads:
        torch.set_num_threads(threads)
    F = torch.nn.functional
    if kind == "bert":
        import transformers  # noqa: F401  (imported before the floor, as the module needs it)
    floor = status("VmRSS")
    if kind == "bert":
        module = bert_module()
        if recompute:
            module.gradient_checkpointing_enable()
        params = list(module.parameters())
        module.to(DEVICE)
        feeds = [(torch.from_numpy(f["input_ids"]), torch.from_numpy(f["labels"])) for f in bert_feeds(batch)]

        def loss_of(x, labels):
            logits = module(input_ids=x).logits
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
    else:
        _, weights, shape = mlp(width=1024) if kind == "mlp" else small_cnn()
        tensors = {k: torch.tensor(v, requires_grad=True, device=DEVICE) for k, v in weights.items()}
        params = list(tensors.values())
        feeds = [(torch.from_numpy(f["x"]), torch.from_numpy(f["labels"])) for f in make_feeds(shape, batch)]

        def loss_of(x, labels):
            if kind == "mlp":
                count = len(tensors) // 2
                for i in range(count):
                    x = x @ tensors[f"w{i}"] + tensors[f"b{i}"]
                    x = F.relu(x) if i < count - 1 else x
            else:
                i = 0
                while f"conv{i}.w" in tensors:
                    x = F.max_pool2d(
                        F.relu(F.conv2d(x, tensors[f"conv{i}.w"], tensors[f"conv{i}.b"], padding=1)), 2
                    )
                    i += 1
                x = torch.flatten(x, 1) @ tensors["fc.w"] + tensors["fc.b"]
            return F.cross_entropy(x.float(), labels)

    optimizer = torch.optim.AdamW(params, lr=LR)
    feeds = [(x.to(DEVICE), labels.to(DEVICE)) for x, labels in feeds]
    low = torch.float16 if DEVICE == "cuda" else torch.bfloat16  # CUDA's recipe: float16, scaled
    scaler = torch.amp.GradScaler(DEVICE, enabled=bf16 and DEVICE == "cuda")

    def step(i):
        x, labels = feeds[i % len(feeds)]
        optimizer.zero_grad(set_to_none=True)
        if bf16:
            with torch.autocast(DEVICE, dtype=low):
                loss = loss_of(x, labels)
        else:
            loss = loss_of(x, labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss.item()

    return floor, step


def _trainer_step(kind, threads, precision, batch, recompute, model_dir):
    import onnx

    from amp_rewrite.training import AdamW, Trainer

    floor = status("VmRSS")
    if kind == "bert":
        model, feeds = os.path.join(model_dir, "bert.onnx"), bert_feeds(batch)
    else:
        model, _, shape = mlp(width=1024) if kind == "mlp" else small_cnn()
        model, feeds = model.SerializeToString(), make_feeds(shape, batch)
        model = onnx.load_from_string(model)
    options = {"threads": threads} if threads else {}  # an older checkout, compared with PYTHONPATH, has none
    if CUDA_GRAPH:
        options["cuda_graph"] = True
    trainer = Trainer(
        model,
        optimizer=AdamW(LR),
        precision=precision,
        provider=DEVICE,
        recompute=recompute,
        verbose=False,
        **options,
    )
    del model

    def step(i):
        return trainer.step(feeds[i % len(feeds)]).loss

    return floor, step


def _ort_training_step(kind, threads, batch, recompute, model_dir):
    """ONNX Runtime training artifacts (onnxruntime-training), in its own Python."""
    import onnx
    import onnxruntime as ort
    from onnxruntime.training import api, artifacts

    ort.set_default_logger_severity(3)
    floor = status("VmRSS")
    if kind == "bert":
        model = _bert_for_ort_training(onnx.load(os.path.join(model_dir, "bert.onnx")))
        feeds = [{"x": f["input_ids"], "labels": f["labels"].reshape(-1)} for f in bert_feeds(batch)]
    else:
        model, _, shape = mlp(width=1024) if kind == "mlp" else small_cnn()
        feeds = make_feeds(shape, batch)
    folder = tempfile.mkdtemp(prefix="ortt-")
    artifacts.generate_artifacts(
        model,
        requires_grad=[
            t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT and t.dims
        ],
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=artifacts.OptimType.AdamW,
        artifact_directory=folder,
    )
    for name in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            saved = onnx.load(path)
            saved.ir_version = min(saved.ir_version, 10)
            onnx.save(saved, path)
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    state = api.CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    module = api.Module(
        os.path.join(folder, "training_model.onnx"),
        state,
        os.path.join(folder, "eval_model.onnx"),
        session_options=options,
    )
    optimizer = api.Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(LR)
    module.train()

    def step(i):
        f = feeds[i % len(feeds)]
        loss = module(f["x"], f["labels"])
        optimizer.step()
        module.lazy_reset_grad()
        return float(loss)

    return floor, step


def _bert_for_ort_training(model):
    """The BERT export as ONNX Runtime training's artifacts take it: each LayerNormalization given
    its Mean and InvStdDev outputs (its gradient builder reads them; the TorchScript export leaves
    them out, and artifact generation fails), the logits flattened to [N*SEQ, vocab] for its
    CrossEntropyLoss (SoftmaxCrossEntropyLoss over [N, C]; the labels are flattened alike)."""
    graph = model.graph
    for node in graph.node:
        if node.op_type == "LayerNormalization" and len(node.output) == 1:
            node.output.extend([node.output[0] + "_mean", node.output[0] + "_inv_std_dev"])
    logits = graph.output[0]
    vocab = logits.type.tensor_type.shape.dim[-1].dim_value
    shape = numpy_helper.from_array(np.array([-1, vocab], np.int64), "bench/flat_logits_shape")
    graph.initializer.append(shape)
    graph.node.append(helper.make_node("Reshape", [logits.name, shape.name], ["flat_logits"]))
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info("flat_logits", TensorProto.FLOAT, ["M", vocab]))
    return model


def child(args) -> None:
    """Set up one contender, then serve the driver: `step` runs one step and prints its ms,
    `mem` prints the peak MB above the floor."""
    batch = args.batch or BATCH[args.model]
    recompute = "auto" if args.with_recompute else None
    if args.child in ("torch", "torch-bf16"):
        floor, step = _torch_step(
            args.model, args.child_threads, args.child == "torch-bf16", batch, recompute, args.model_dir
        )
    elif args.child == "ort-training":
        floor, step = _ort_training_step(args.model, args.child_threads, batch, recompute, args.model_dir)
    else:
        precision = "float16" if args.child == "trainer-fp16" else "float32"
        floor, step = _trainer_step(
            args.model, args.child_threads, precision, batch, recompute, args.model_dir
        )
    print("ready", flush=True)
    count = 0
    for line in sys.stdin:
        if line.strip() == "step":
            start = time.perf_counter()
            step(count)
            print(f"{1e3 * (time.perf_counter() - start):.3f}", flush=True)
            count += 1
        elif line.strip() == "mem":
            print(f"{(status('VmHWM') - floor) / 2**20:.1f}", flush=True)
        else:
            return


# --- the driver ----------------------------------------------------------------------------------


class Contender:
    def __init__(self, python, name, model, threads, model_dir, batch, recompute):
        argv = [
            python,
            os.path.abspath(__file__),
            "--child",
            name,
            "--model",
            model,
            "--child-threads",
            str(threads),
            "--model-dir",
            model_dir,
        ]
        if batch:
            argv += ["--batch", str(batch)]
        if recompute:
            argv += ["--with-recompute"]
        self.name = name
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ready(self) -> bool:
        line = self.process.stdout.readline()
        return line.strip() == "ready"

    def ask(self, command: str) -> float:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return float(self.process.stdout.readline())

    def close(self) -> None:
        try:
            self.process.stdin.write("quit\n")
            self.process.stdin.close()
        except (BrokenPipeError, ValueError):
            pass
        self.process.wait(timeout=60)


def measure(specs: dict, model: str, threads: int, model_dir: str, warmup: int, rounds: int, batch=None):
    """{label: (median ms, median ratio to the first label, peak MB above floor)}; labels whose
    process failed to start get None."""
    started = {}
    for label, (python, name, recompute) in specs.items():
        started[label] = Contender(python, name, model, threads, model_dir, batch, recompute)
    alive = {label: c for label, c in started.items() if c.ready()}
    times = {label: [] for label in alive}
    labels = list(alive)
    for r in range(warmup + rounds):
        order = labels[r % len(labels) :] + labels[: r % len(labels)]
        for label in order:
            ms = alive[label].ask("step")
            if r >= warmup:
                times[label].append(ms)
    memory = {label: alive[label].ask("mem") for label in labels}
    for c in started.values():
        c.close()
    base = labels[0] if labels else None
    results = {}
    for label in specs:
        if label not in alive:
            results[label] = None
            continue
        ratios = [t / b for t, b in zip(times[label], times[base])]
        results[label] = (statistics.median(times[label]), statistics.median(ratios), memory[label])
    if "trainer" in times and "ort-training" in times:  # the other yardstick, round by round
        pairs = zip(times["trainer"], times["ort-training"])
        results["trainer / ort-training"] = statistics.median(t / o for t, o in pairs)
    return results


def _ort_training_python(args):
    python = args.ort_training_python or os.environ.get("AMP_ORT_TRAINING_PYTHON")
    if not python:
        return None
    check = subprocess.run([python, "-c", "import onnxruntime.training"], capture_output=True)
    return python if check.returncode == 0 else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cnn,bert")
    parser.add_argument(
        "--threads", default="1,0", help="intra-op threads, comma-separated (0: each library's default)"
    )
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=None, help="batch size (default: the model's)")
    parser.add_argument(
        "--recompute", action="store_true", help="BERT at batch 64 with and without recompute"
    )
    parser.add_argument("--ort-training-python", default=None)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where every contender runs")
    parser.add_argument("--cuda-graph", action="store_true", help="the Trainer captures its CUDA step")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-threads", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--with-recompute", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    os.environ["AMP_BENCH_DEVICE"] = args.device  # the children read it (DEVICE, CUDA_GRAPH)
    os.environ["AMP_BENCH_CUDA_GRAPH"] = "1" if args.cuda_graph else "0"
    model_dir = tempfile.mkdtemp(prefix="bench-train-")
    try:
        if args.recompute:
            return _recompute_table(args, model_dir)
        return _table(args, model_dir)
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)


def _table(args, model_dir) -> int:
    wanted = args.contenders.split(",")
    ort_python = _ort_training_python(args) if "ort-training" in wanted else None
    specs = {name: (sys.executable, name, False) for name in wanted if name != "ort-training"}
    if "ort-training" in wanted and ort_python:
        specs["ort-training"] = (ort_python, "ort-training", False)
    print(
        f"rounds {args.rounds} after {args.warmup} warm-up, fresh process per contender, order rotated each round; "
        "ms / ratio to torch fp32 (median of per-round ratios) / peak MB above the import floor"
    )
    if "ort-training" in wanted and not ort_python:
        print("ONNX Runtime training: not installed (give --ort-training-python or AMP_ORT_TRAINING_PYTHON)")
    models = args.models.split(",")
    print(
        "| threads | contender | "
        + " | ".join(f"{m} (batch {args.batch or BATCH[m]})" for m in models)
        + " |"
    )
    print("|---|---|" + "---|" * len(models))
    for threads in [int(t) for t in args.threads.split(",")]:
        cells = {label: [] for label in specs}
        versus_ort = []
        for model in models:
            if model == "bert" and not os.path.exists(os.path.join(model_dir, "bert.onnx")):
                export_bert(os.path.join(model_dir, "bert.onnx"))
            results = measure(specs, model, threads, model_dir, args.warmup, args.rounds, args.batch)
            for label in specs:
                result = results.get(label)
                cells[label].append(
                    f"{result[0]:.1f} / {result[1]:.2f} / {result[2]:.0f}" if result else "n/a"
                )
            ratio = results.get("trainer / ort-training")
            versus_ort.append(f"{model} {ratio:.3f}" if ratio else f"{model} n/a")
        for label in specs:
            print(f"| {threads or 'default'} | {label} | " + " | ".join(cells[label]) + " |", flush=True)
        if "ort-training" in specs and "trainer" in specs:
            print(
                f"threads {threads or 'default'}: trainer / ort-training, median of per-round ratios: "
                + ", ".join(versus_ort),
                flush=True,
            )
    return 0


def _recompute_table(args, model_dir) -> int:
    batch = args.batch or 64
    export_bert(os.path.join(model_dir, "bert.onnx"))
    threads = int(args.threads.split(",")[0])
    specs = {
        "torch": (sys.executable, "torch", False),
        "torch checkpointing": (sys.executable, "torch", True),
        "trainer": (sys.executable, "trainer", False),
        'trainer recompute="auto"': (sys.executable, "trainer", True),
    }
    results = measure(specs, "bert", threads, model_dir, args.warmup, args.rounds, batch)
    print(
        f"BERT batch {batch}x{SEQ}, {threads or 'default'} threads, rounds {args.rounds} after {args.warmup} warm-up"
    )
    print("| contender | ms | time vs its plain run | peak MB above floor | memory vs its plain run |")
    print("|---|---|---|---|---|")
    for label, plain in (
        ("torch", "torch"),
        ("torch checkpointing", "torch"),
        ("trainer", "trainer"),
        ('trainer recompute="auto"', "trainer"),
    ):
        ms, _, mb = results[label]
        print(
            f"| {label} | {ms:.0f} | {ms / results[plain][0]:.2f} | {mb:.0f} | {mb / results[plain][2]:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
