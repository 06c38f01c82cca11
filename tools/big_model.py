"""Build a model over 2 GB (weights in external data), rewrite it with the CLI, report time and memory.

    python tools/big_model.py [--gb 2.2] [--dir /tmp] [--keep]

The model is a chain of MatMul -> Relu with square float32 weights, written straight to disk in
chunks (the builder never holds the weights). The rewrite runs as `python -m amp_rewrite` in a
subprocess; its wall time and peak resident memory (getrusage of the child) are printed next to the
model's size, with the size of the rewritten external data (float16: about half). Refuses to run
with less than 8 GB free. Deletes its files unless --keep.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
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
    inits, nodes = [], []
    offset = 0
    with open(data_path, "wb") as handle:
        for i in range(layers):
            rows_per_chunk = max(1, 2**26 // (dim * 4))
            for start in range(0, dim, rows_per_chunk):
                rows = min(rows_per_chunk, dim - start)
                chunk = (rng.standard_normal((rows, dim), dtype=np.float32) / np.sqrt(dim)).astype(np.float32)
                handle.write(chunk.tobytes())
            tensor = TensorProto(name=f"W{i}", data_type=TensorProto.FLOAT, dims=[dim, dim])
            tensor.data_location = TensorProto.EXTERNAL
            for key, value in (("location", data_path.name), ("offset", str(offset)), ("length", str(layer_bytes))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
            offset += layer_bytes
            inits.append(tensor)
            source = "x" if i == 0 else f"r{i - 1}"
            nodes.append(helper.make_node("MatMul", [source, f"W{i}"], [f"h{i}"], name=f"mm{i}"))
            nodes.append(helper.make_node("Relu", [f"h{i}"], [f"r{i}"], name=f"relu{i}"))
    graph = helper.make_graph(nodes, "big", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, dim])],
                              [helper.make_tensor_value_info(f"r{layers - 1}", TensorProto.FLOAT, [1, dim])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = folder / "big.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.2, help="model size in GiB (default 2.2)")
    parser.add_argument("--dim", type=int, default=8192, help="weight size dim x dim (default 8192: 256 MiB)")
    parser.add_argument("--dir", default=None, help="working folder (default: a temp folder)")
    parser.add_argument("--keep", action="store_true", help="keep the files")
    args = parser.parse_args(argv)
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    free = shutil.disk_usage(base).free
    if free < 8 * 2**30:
        print(f"big_model: only {free / 2**30:.1f} GiB free in {base}; need 8 GiB", file=sys.stderr)
        return 1
    folder = Path(tempfile.mkdtemp(prefix="amp-big-", dir=base))
    try:
        started = time.perf_counter()
        path = build(folder, args.gb, args.dim)
        built_s = time.perf_counter() - started
        size_in = path.stat().st_size + (folder / "big.onnx.data").stat().st_size
        out = folder / "big.fp16.onnx"
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "amp_rewrite", str(path), "-o", str(out), "--quiet"],
                              cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - started
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux: KiB
        result = {"model_bytes": size_in, "build_s": round(built_s, 1), "rewrite_exit": proc.returncode,
                  "rewrite_wall_s": round(wall, 1), "peak_rss_bytes": peak,
                  "peak_rss_over_model": round(peak / size_in, 2)}
        if proc.returncode == 0:
            data_out = folder / "big.fp16.onnx.data"
            result["output_bytes"] = out.stat().st_size + (data_out.stat().st_size if data_out.exists() else 0)
            result["output_over_input"] = round(result["output_bytes"] / size_in, 3)
            started = time.perf_counter()
            onnx.checker.check_model(str(out))
            result["checker_by_path"] = "ok"
            rewritten = onnx.load(str(out), load_external_data=False)
            result["low_precision_weights"] = sum(t.data_type == TensorProto.FLOAT16 for t in rewritten.graph.initializer)
            result["weights"] = len(rewritten.graph.initializer)
        else:
            result["stderr"] = proc.stderr.strip()[-2000:]
        print(json.dumps(result, indent=1))
        print(f"model {size_in / 2**30:.2f} GiB -> rewrite {wall:.1f} s, peak RSS {peak / 2**30:.2f} GiB "
              f"({peak / size_in:.2f}x the model)")
        return 0 if proc.returncode == 0 else 1
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
