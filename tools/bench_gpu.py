"""Float16 and bfloat16 on the GPU: each converter's model timed on CUDA beside float32 (TF32 on and
off) and torch eager, with its accuracy against float32, its casts and its size.

    python tools/bench_gpu.py                          # BERT-base, GPT-2, ResNet-50, ViT-B/16 (issue 37)
    python tools/bench_gpu.py --models bert --tiny     # a tiny config in seconds (the smoke test)

Models are exported from transformers configs with random weights (nothing is downloaded), at the
batch sizes of the H200 figures in issue 37: BERT-base 16x128, GPT-2 8x128, ResNet-50 and ViT-B/16
32 images. Converters: amp-rewrite (float16, bfloat16), ONNX Runtime's float16 converter,
onnxconverter-common, and ONNX Runtime's transformer optimizer then its float16 (transformers only).
On CUDA every model runs with its inputs and outputs bound on the device (IO binding), after a
warm-up, as a median over `--runs`; again with CUDA graphs (`enable_cuda_graph`); accuracy is the
relative L2 error and cosine of the first output against float32 with TF32 off. Without CUDA it
says so and prints the conversion columns only (a CPU computes most float16 ops in float32: its
times and errors would say nothing of a GPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import numpy as np
import onnx

# Siblings in tools/: Python puts a script's own folder first on sys.path.
import exported
from amp_rewrite.runtime import cuda_loads
from amp_rewrite.runtime import ort as ort_module

FULL = {"bert": 16, "gpt2": 8, "resnet50": 32, "vit": 32}  # batch sizes of the figures
OPTIMIZER_TYPES = {"bert": "bert", "gpt2": "gpt2", "vit": "vit"}  # ORT's transformer optimizer


def _module(name: str, tiny: bool):
    """(torch module returning one tensor, example inputs as numpy, input names)."""
    import torch
    import transformers as tr

    torch.manual_seed(0)
    batch = 2 if tiny else FULL[name]
    seq = 8 if tiny else 128
    small = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
    if name == "bert":
        module = tr.BertModel(
            tr.BertConfig(**(small if tiny else {}), attn_implementation="eager"), add_pooling_layer=False
        )
        ids = np.random.default_rng(0).integers(0, 1000, (batch, seq)).astype(np.int64)
        return module, {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    if name == "gpt2":
        config = (
            tr.GPT2Config(n_embd=32, n_layer=2, n_head=2, use_cache=False)
            if tiny
            else tr.GPT2Config(use_cache=False)
        )
        ids = np.random.default_rng(0).integers(0, 1000, (batch, seq)).astype(np.int64)
        return tr.GPT2LMHeadModel(config), {"input_ids": ids}
    size = 32 if tiny else 224
    pixels = np.random.default_rng(0).standard_normal((batch, 3, size, size)).astype(np.float32)
    if name == "resnet50":
        config = (
            tr.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1])
            if tiny
            else tr.ResNetConfig()
        )
        return tr.ResNetModel(config), {"pixel_values": pixels}
    config = tr.ViTConfig(**small, image_size=32, patch_size=8) if tiny else tr.ViTConfig()
    return tr.ViTModel(
        tr.ViTConfig(**{**config.to_dict(), "attn_implementation": "eager"}), add_pooling_layer=False
    ), {"pixel_values": pixels}


def _first(module):
    import torch

    class First(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = module.eval()

        def forward(self, *args):
            return self.inner(*args, return_dict=False)[0]

    return First().eval()


def export(name: str, tiny: bool):
    """(ONNX model, feeds, torch module) for `name`: TorchScript at opset 17, GPT-2 dynamo at 18."""
    import torch

    module, feeds = _module(name, tiny)
    wrapped = _first(module)
    args = tuple(torch.from_numpy(v) for v in feeds.values())
    model = exported.to_onnx(wrapped, args, list(feeds), dynamo=name == "gpt2")
    return model, feeds, wrapped


def converters(name: str) -> dict:
    """{label: model -> converted model}; each gets its own copy of the float32 model."""

    def amp(target):
        def convert(model):
            import amp_rewrite

            return amp_rewrite.rewrite(model, target=target).model

        return convert

    def ort_float16(model):
        from onnxruntime.transformers.float16 import convert_float_to_float16

        return convert_float_to_float16(model, keep_io_types=True)

    def occ(model):
        from onnxconverter_common.float16 import convert_float_to_float16

        return convert_float_to_float16(model, keep_io_types=True)

    def optimizer(model):
        from onnxruntime.transformers.optimizer import optimize_model

        optimized = optimize_model(
            model, model_type=OPTIMIZER_TYPES[name], num_heads=0, hidden_size=0, opt_level=1
        )
        optimized.convert_float_to_float16(keep_io_types=True)
        return optimized.model

    found = {
        "amp-rewrite float16": amp("float16"),
        "amp-rewrite bfloat16": amp("bfloat16"),
        "ORT float16": ort_float16,
    }
    found["onnxconverter-common"] = occ
    if name in OPTIMIZER_TYPES:
        found["ORT optimizer + float16"] = optimizer
    return found


def casts(model: onnx.ModelProto) -> int:
    graphs, count = [model.graph], 0
    while graphs:
        graph = graphs.pop()
        for node in graph.node:
            count += node.op_type == "Cast"
            graphs.extend(a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH)
    return count


def time_on_cuda(model: onnx.ModelProto, feeds: dict, runs: int, *, tf32: bool = False, graph: bool = False):
    """(median ms, first output) with inputs and outputs bound on the device."""
    ort = ort_module()
    options = {"device_id": "0", "use_tf32": "1" if tf32 else "0", "enable_cuda_graph": "1" if graph else "0"}
    session = ort.InferenceSession(model.SerializeToString(), providers=[("CUDAExecutionProvider", options)])
    shapes = [o.shape for o in session.get_outputs()]
    outputs = session.run(None, feeds)  # the output shapes, for buffers a captured graph can reuse
    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_ortvalue_input(
            name, ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value), "cuda", 0)
        )
    for o, value, _ in zip(session.get_outputs(), outputs, shapes):
        binding.bind_ortvalue_output(
            o.name, ort.OrtValue.ortvalue_from_numpy(np.empty_like(value), "cuda", 0)
        )
    for _ in range(5):
        session.run_with_iobinding(binding)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times), binding.copy_outputs_to_cpu()[0]


def time_torch(module, feeds: dict, runs: int, autocast: bool) -> float:
    import torch

    module = module.cuda()
    args = [torch.from_numpy(v).cuda() for v in feeds.values()]
    times = []
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16, enabled=autocast):
        for i in range(runs + 5):
            torch.cuda.synchronize()
            started = time.perf_counter()
            module(*args)
            torch.cuda.synchronize()
            if i >= 5:
                times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def accuracy(got: np.ndarray, expected: np.ndarray) -> tuple[float, float]:
    """(relative L2 error, cosine) of `got` against `expected`."""
    a, b = np.asarray(got, np.float64).ravel(), np.asarray(expected, np.float64).ravel()
    rel = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    cosine = float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))
    return rel, cosine


def _cell(value, form="{:.2f}") -> str:
    return form.format(value) if isinstance(value, (int, float)) else str(value)


def bench(name: str, tiny: bool, runs: int, cuda: bool) -> list[dict]:
    """One row per variant of `name`: conversion figures, and on CUDA times and accuracy."""
    model, feeds, module = export(name, tiny)
    rows = [{"model": name, "variant": "float32", "casts": casts(model), "MB": model.ByteSize() / 1e6}]
    reference = None
    if cuda:
        rows[0]["ms"], reference = time_on_cuda(model, feeds, runs, tf32=False)
        tf32_ms, tf32_out = time_on_cuda(model, feeds, runs, tf32=True)
        rows.append({"model": name, "variant": "float32 TF32", "ms": tf32_ms, **_errors(tf32_out, reference)})
        rows.append({"model": name, "variant": "torch eager", "ms": time_torch(module, feeds, runs, False)})
        rows.append({"model": name, "variant": "torch autocast", "ms": time_torch(module, feeds, runs, True)})
    for label, convert in converters(name).items():
        row = {"model": name, "variant": label}
        copy = onnx.ModelProto.FromString(model.SerializeToString())
        started = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                converted = convert(copy)
        except Exception as error:  # noqa: BLE001 - a converter that fails is a row that says so
            rows.append({**row, "note": f"conversion fails: {str(error).splitlines()[0][:60]}"})
            continue
        row.update(
            convert_s=time.perf_counter() - started, casts=casts(converted), MB=converted.ByteSize() / 1e6
        )
        if cuda:
            try:
                row["ms"], out = time_on_cuda(converted, feeds, runs)
                row.update(_errors(out, reference))
                row["ms graph"] = time_on_cuda(converted, feeds, runs, graph=True)[0]
            except Exception as error:  # noqa: BLE001
                row["note"] = f"fails on CUDA: {str(error).splitlines()[0][:60]}"
        rows.append(row)
    base = rows[0].get("ms")
    for row in rows:
        if base and isinstance(row.get("ms"), float):
            row["speed-up"] = base / row["ms"]
    return rows


def _errors(got, reference) -> dict:
    rel, cosine = accuracy(got, reference)
    return {"rel L2": rel, "cosine": cosine}


COLUMNS = (
    ("model", "{}"),
    ("variant", "{}"),
    ("convert_s", "{:.2f}"),
    ("casts", "{}"),
    ("MB", "{:.1f}"),
    ("ms", "{:.2f}"),
    ("ms graph", "{:.2f}"),
    ("speed-up", "{:.2f}x"),
    ("rel L2", "{:.2e}"),
    ("cosine", "{:.6f}"),
    ("note", "{}"),
)


def table(rows: list[dict], cuda: bool) -> str:
    columns = [
        (c, f) for c, f in COLUMNS if cuda or c not in ("ms", "ms graph", "speed-up", "rel L2", "cosine")
    ]
    lines = ["| " + " | ".join(c for c, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append(
            "| " + " | ".join(_cell(row.get(c, ""), f) if c in row else "" for c, f in columns) + " |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", default="bert,gpt2,resnet50,vit", help="comma-separated: bert, gpt2, resnet50, vit"
    )
    parser.add_argument("--tiny", action="store_true", help="tiny configs and batches: a smoke run")
    parser.add_argument("--runs", type=int, default=50, help="timed runs per variant (the median is shown)")
    args = parser.parse_args(argv)
    names = [m for m in args.models.split(",") if m]
    unknown = sorted(set(names) - set(FULL))
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}: choose from {', '.join(FULL)}")
    cuda = cuda_loads()
    if not cuda:
        print("no CUDA here (ONNX Runtime's CUDA provider does not load): conversion columns only")
    rows = [row for name in names for row in bench(name, args.tiny, args.runs, cuda)]
    print(table(rows, cuda))
    return 0


if __name__ == "__main__":
    sys.exit(main())
