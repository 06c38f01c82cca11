"""Generate op_lists/kernels_cuda.json and op_lists/kernels_cpu.json: which element types ONNX
Runtime's CUDA and CPU providers register kernels for, per op and opset range.

Why data: whether a float16 node runs on the GPU is a fact of ONNX Runtime's kernel registry,
not of the op's numerics; a node without a kernel is placed on the CPU with a copy each side.
The files are read by amp_rewrite/analysis/kernels.py; this script is how they are made.

- CUDA: from the CUDAExecutionProvider section of ONNX Runtime's generated
  docs/OperatorKernels.md, as a JSON (`--cuda-source`, default ../shared/reference/ort_cuda_kernels.json).
- CPU: from `onnxruntime.capi._pybind_state.get_all_opkernel_def()`, run in a *subprocess* of
  `--cpu-python` (a Python with the CPU-only `onnxruntime` wheel): the GPU wheel can crash in
  that call when the CUDA libraries are missing, so it never runs inside this process.

    python tools/gen_kernel_tables.py --cpu-python /tmp/ortcpu/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPEN = None  # `until` of an open-ended opset range
DOMAINS = {
    "ai.onnx": "",
    "": "",
    "com.microsoft": "com.microsoft",
}  # others (internal NHWC) are not ops in models

_CPU_DUMP = r"""
import json, onnxruntime
from onnxruntime.capi import _pybind_state as C
rows = [(k.domain, k.op_name, k.version_range[0], k.version_range[1], k.type_constraints)
        for k in C.get_all_opkernel_def() if k.provider == "CPUExecutionProvider"]
print(json.dumps({"version": onnxruntime.__version__, "rows": rows}))
"""


def _plain(type_string: str) -> str:
    """'tensor(float16)' -> 'float16'; sequences and other containers kept as written."""
    return type_string[7:-1] if type_string.startswith("tensor(") else type_string


def _merge(rows) -> dict:
    """'domain:op' -> [[since, until, {param: sorted types}]]: rows of one range (one per type set
    on the CPU) joined, ranges newest first."""
    merged: dict = {}
    for domain, op, since, until, types in rows:
        if domain not in DOMAINS:
            continue
        key = f"{DOMAINS[domain]}:{op}"
        ranges = merged.setdefault(key, {})
        params = ranges.setdefault((since, until), {})
        for param, allowed in types.items():
            params.setdefault(param, set()).update(_plain(t) for t in allowed)
    return {
        key: [
            [since, until, {p: sorted(t) for p, t in sorted(params.items())}]
            for (since, until), params in sorted(ranges.items(), key=lambda kv: -kv[0][0])
        ]
        for key, ranges in sorted(merged.items())
    }


def cuda_table(source: Path) -> dict:
    data = json.loads(source.read_text())
    rows = [(k["domain"], k["op"], k["since"], k["until"], k["types"]) for k in data["kernels"]]
    return {"provider": "cuda", "source": data["source"], "kernels": _merge(rows)}


def cpu_table(python: str) -> dict:
    done = subprocess.run([python, "-c", _CPU_DUMP], capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        raise SystemExit(
            f"the CPU kernel dump failed in {python} (exit {done.returncode}): "
            f"{done.stderr.strip().splitlines()[-1:] or ''}"
        )
    data = json.loads(done.stdout.strip().splitlines()[-1])
    big = 2**31 - 1  # ORT writes an open range as INT_MAX
    rows = [(d, op, a, None if b >= big else b, t) for d, op, a, b, t in data["rows"]]
    source = f"onnxruntime {data['version']} (CPU wheel) get_all_opkernel_def(), CPUExecutionProvider"
    return {"provider": "cpu", "source": source, "kernels": _merge(rows)}


def write(table: dict, path: Path) -> None:
    lines = [f'  "{key}": {json.dumps(rows)}' for key, rows in table["kernels"].items()]
    head = {k: v for k, v in table.items() if k != "kernels"}
    text = json.dumps(head)[:-1] + ', "kernels": {\n' + ",\n".join(lines) + "\n}}\n"
    json.loads(text)  # one row per op: diffs stay readable
    path.write_text(text)
    print(f"wrote {path} ({len(table['kernels'])} ops)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--cuda-source", type=Path, default=ROOT.parent.parent / "shared/reference/ort_cuda_kernels.json"
    )
    p.add_argument(
        "--cpu-python", help="a Python with the CPU-only onnxruntime wheel (default: skip the CPU table)"
    )
    p.add_argument("--out", type=Path, default=ROOT / "op_lists")
    args = p.parse_args(argv)
    if args.cuda_source.exists():
        write(cuda_table(args.cuda_source), args.out / "kernels_cuda.json")
    else:
        print(f"no {args.cuda_source}: CUDA table not regenerated", file=sys.stderr)
    if args.cpu_python:
        write(cpu_table(args.cpu_python), args.out / "kernels_cpu.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
