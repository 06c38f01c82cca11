"""Build a model of N GiB (weights in external data), rewrite it with the CLI, report time and
memory beside copying the model's files with `cp`.

    python tools/big_model.py [--gb 2.2] [--dim 8192] [--repeat 1] [--dir /tmp] [--keep]

The model is a chain of MatMul -> Relu with square float32 weights, written straight to disk in
chunks (the builder never holds the weights). The rewrite runs as `python -m amp_rewrite` in a
fresh child; its wall time and peak resident memory (getrusage of that child) are printed beside
`cp` of the model's files on the same disk (and `cp` + `sync` of the copies: the rewrite fsyncs
its output), alternated `--repeat` times (medians), with the size of the output (float16: about
half), whether its data is one file and every weight's offset 64 KiB aligned. The last lines are
a row for docs/benchmarks.md. Refuses to run without room for the model, a copy and the output.
Deletes its files unless --keep.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parent.parent


def build(folder: Path, gigabytes: float, dim: int) -> Path:
    """Write big.onnx + big.onnx.data with enough dim x dim weights to pass `gigabytes`."""
    layer_bytes = dim * dim * 4
    layers = max(1, int(np.ceil(gigabytes * 2**30 / layer_bytes)))
    data_path = folder / "big.onnx.data"
    rng = np.random.default_rng(0)
    rows_per_chunk = max(1, 2**26 // (dim * 4))
    block = rng.standard_normal((min(rows_per_chunk, dim), dim), dtype=np.float32) / np.float32(np.sqrt(dim))
    inits, nodes = [], []
    offset = 0
    with open(data_path, "wb") as handle:
        for i in range(layers):
            for start in range(
                0, dim, rows_per_chunk
            ):  # one random block, scaled: drawing GiBs would dominate
                rows = min(rows_per_chunk, dim - start)
                handle.write((block[:rows] * np.float32(1 + 0.001 * (i + start / dim))).tobytes())
            tensor = TensorProto(name=f"W{i}", data_type=TensorProto.FLOAT, dims=[dim, dim])
            tensor.data_location = TensorProto.EXTERNAL
            for key, value in (
                ("location", data_path.name),
                ("offset", str(offset)),
                ("length", str(layer_bytes)),
            ):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
            offset += layer_bytes
            inits.append(tensor)
            source = "x" if i == 0 else f"r{i - 1}"
            nodes.append(helper.make_node("MatMul", [source, f"W{i}"], [f"h{i}"], name=f"mm{i}"))
            nodes.append(helper.make_node("Relu", [f"h{i}"], [f"r{i}"], name=f"relu{i}"))
    graph = helper.make_graph(
        nodes,
        "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, dim])],
        [helper.make_tensor_value_info(f"r{layers - 1}", TensorProto.FLOAT, [1, dim])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = folder / "big.onnx"
    path.write_bytes(model.SerializeToString())
    return path


RUN_MEASURED = (
    "import resource, subprocess, sys, time\n"
    "started = time.perf_counter()\n"
    "code = subprocess.run(sys.argv[1:]).returncode\n"
    "print(time.perf_counter() - started, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, code)"
)


def measured(command: list) -> tuple[float, int, int]:
    """(wall seconds, peak RSS bytes, exit code) of `command`, run alone in a fresh child (getrusage
    of this process's children would mix runs)."""
    done = subprocess.run(
        [sys.executable, "-c", RUN_MEASURED, *command], cwd=ROOT, capture_output=True, text=True, check=False
    )
    wall, peak, code = done.stdout.split()
    return float(wall), int(peak), int(code)


def copy_time(files: list, dest: Path) -> tuple[float, float]:
    """(cp, cp + sync) seconds for the model's files into `dest` on the same disk; the copies removed.
    The rewrite fsyncs what it writes: `sync` of the copies is its fair counterpart."""
    dest.mkdir(exist_ok=True)
    started = time.perf_counter()
    subprocess.run(["cp", *map(str, files), str(dest)], check=True)
    copied = time.perf_counter() - started
    subprocess.run(["sync", *[str(dest / f.name) for f in files]], check=True)
    synced = time.perf_counter() - started
    shutil.rmtree(dest)
    return copied, synced


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.2, help="model size in GiB (default 2.2)")
    parser.add_argument("--dim", type=int, default=8192, help="weight size dim x dim (default 8192: 256 MiB)")
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs of cp and of the rewrite, alternated (medians)"
    )
    parser.add_argument("--dir", default=None, help="working folder (default: a temp folder)")
    parser.add_argument("--keep", action="store_true", help="keep the files")
    args = parser.parse_args(argv)
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    free = shutil.disk_usage(base).free
    need = args.gb * 2.6 * 2**30  # the model, a copy, the float16 output
    if free < need:
        print(
            f"big_model: only {free / 2**30:.1f} GiB free in {base}; need {need / 2**30:.1f} GiB",
            file=sys.stderr,
        )
        return 1
    folder = Path(tempfile.mkdtemp(prefix="amp-big-", dir=base))
    try:
        started = time.perf_counter()
        path = build(folder, args.gb, args.dim)
        built_s = time.perf_counter() - started
        files = [path, folder / "big.onnx.data"]
        size_in = sum(f.stat().st_size for f in files)
        out = folder / "big.fp16.onnx"
        command = [sys.executable, "-m", "amp_rewrite", str(path), "-o", str(out), "--quiet", "--force"]
        runs, copies = [], []
        for _ in range(args.repeat):
            copies.append(copy_time(files, folder / "copy"))
            runs.append(measured(command))
        wall = statistics.median(r[0] for r in runs)
        peak = max(r[1] for r in runs)
        code = max(r[2] for r in runs)
        cp_s = statistics.median(c[0] for c in copies)
        cp_sync_s = statistics.median(c[1] for c in copies)
        largest = args.dim * args.dim * 4
        result = {
            "model_bytes": size_in,
            "largest_tensor_bytes": largest,
            "build_s": round(built_s, 1),
            "rewrite_exit": code,
            "rewrite_wall_s": round(wall, 1),
            "cp_s": round(cp_s, 1),
            "cp_sync_s": round(cp_sync_s, 1),
            "rewrite_over_cp": round(wall / cp_s, 2),
            "rewrite_over_cp_sync": round(wall / cp_sync_s, 2),
            "peak_rss_bytes": peak,
            "peak_rss_over_model": round(peak / size_in, 3),
            "peak_within_1GB_plus_largest": peak <= 2**30 + largest,
        }
        if code == 0:
            data_out = [
                f for f in folder.iterdir() if f.name.startswith("big.fp16.onnx.") and f.suffix == ".data"
            ]
            result["output_bytes"] = out.stat().st_size + sum(f.stat().st_size for f in data_out)
            result["output_over_input"] = round(result["output_bytes"] / size_in, 3)
            onnx.checker.check_model(str(out))
            result["checker_by_path"] = "ok"
            rewritten = onnx.load(str(out), load_external_data=False)
            result["low_precision_weights"] = sum(
                t.data_type == TensorProto.FLOAT16 for t in rewritten.graph.initializer
            )
            result["weights"] = len(rewritten.graph.initializer)
            result["data_files"] = len(
                {e.value for t in rewritten.graph.initializer for e in t.external_data if e.key == "location"}
            )
            result["offsets_64KiB_aligned"] = all(
                int({e.key: e.value for e in t.external_data}["offset"]) % 65536 == 0
                for t in rewritten.graph.initializer
            )
        print(json.dumps(result, indent=1))
        print(
            "| model | largest tensor | rewrite | cp | cp + sync | rewrite / cp | peak RSS | peak / model |"
        )
        print("|---|---|---|---|---|---|---|---|")
        print(
            f"| {size_in / 2**30:.2f} GiB | {largest / 2**20:.0f} MiB | {wall:.1f} s | {cp_s:.1f} s | {cp_sync_s:.1f} s "
            f"| {wall / cp_s:.2f}x | {peak / 2**20:.0f} MiB | {peak / size_in:.3f} |"
        )
        return 0 if code == 0 else 1
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
