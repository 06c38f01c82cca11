"""Time the checks beside the plain rewrite, as a user runs them: `amp-rewrite` on synthetic stacks.

    python tools/bench_checks.py                       # 1k, 10k, 100k nodes
    python tools/bench_checks.py --sizes 1000 --repeat 3
    python tools/bench_checks.py --sizes --model gpt2.onnx --checks tolerance   # tools/export_gpt2.py

Per size: the plain rewrite, then `--validate`, `--calibrate` and `--tolerance` (each its own
process, so every figure includes loading and saving, as a user sees it), with wall seconds, CPU
seconds (user + system: on a shared machine the steadier figure), the CPU ratio to the plain
rewrite and the peak resident memory. Medians over `--repeat` runs. The
tolerance search runs up to `--tolerance-up-to` nodes (default 10k: at 100k its ten validation
runs take many minutes, and its target is set at 10k). A check over tolerance exits 6: the time
still counts (the synthetic stacks do not meet rtol 1e-2 everywhere; that is not what is timed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import onnx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import synthetic  # noqa: E402

CHECKS = {"validate": ["--validate"], "calibrate": ["--calibrate"], "tolerance": ["--tolerance"]}
DIMS = ["--dim", "batch=1", "--dim", "seq=8"]


def timed(args: list) -> tuple[float, float, float, int]:
    """(wall seconds, CPU seconds, peak RSS in MB, exit code) of one `amp-rewrite` process."""
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "amp_rewrite", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    if proc.returncode not in (0, 6):
        raise SystemExit(f"amp-rewrite {' '.join(args)} exited {proc.returncode}: {err.strip()[-500:]}")
    return seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, proc.returncode


def bench(sizes, repeat: int, tolerance_up_to: int, checks, models=(), model_dims=()) -> list[dict]:
    """One row per synthetic stack size, then one per `models` path (run with `model_dims`)."""
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "out.onnx"
        for size in sizes:
            model = Path(folder) / f"stack{size}.onnx"
            onnx.save(synthetic.transformer_stack(size), str(model))
            wanted = [c for c in checks if c != "tolerance" or size <= tolerance_up_to]
            rows.append(_row(size, [str(model), *DIMS], out, repeat, wanted))
            model.unlink()
        for path in models:
            rows.append(_row(Path(path).stem, [str(path), *model_dims], out, repeat, checks))
    return rows


def _row(label, model_args: list, out: Path, repeat: int, checks) -> dict:
    """The plain rewrite and each check of one model, medians over `repeat` runs."""
    base = [*model_args, "-o", str(out), "--force", "--quiet"]
    row = {"nodes": label}
    for name, flags in [("plain", [])] + [(c, CHECKS[c]) for c in checks]:
        runs = [timed(base + flags) for _ in range(repeat)]
        row[name] = (
            statistics.median(r[0] for r in runs),
            statistics.median(r[1] for r in runs),
            max(r[2] for r in runs),
            runs[-1][3],
        )
        print(
            f"  {label} {name}: {row[name][0]:.1f} s wall, {row[name][1]:.1f} s CPU, {row[name][2]:.0f} MB, "
            f"exit {row[name][3]}",
            file=sys.stderr,
            flush=True,
        )
    return row


def table(rows: list[dict], checks) -> str:
    head = f"{'nodes':>8} {'plain s':>8} {'CPU s':>7} {'MB':>6}" + "".join(
        f" {c + ' s':>12} {'CPU s':>7} {'x plain':>8} {'MB':>6}" for c in checks
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        wall, cpu, mb, _ = row["plain"]
        line = f"{row['nodes']:>8} {wall:>8.1f} {cpu:>7.1f} {mb:>6.0f}"
        for c in checks:
            if c in row:
                c_wall, c_cpu, c_mb, _ = row[c]
                line += f" {c_wall:>12.1f} {c_cpu:>7.1f} {c_cpu / cpu:>8.2f} {c_mb:>6.0f}"
            else:
                line += f" {'-':>12} {'-':>7} {'-':>8} {'-':>6}"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="*", default=[1000, 10000, 100000])
    p.add_argument("--repeat", type=int, default=1, help="runs per figure (median)")
    p.add_argument(
        "--tolerance-up-to", type=int, default=10000, help="largest size the tolerance search runs on"
    )
    p.add_argument("--checks", nargs="+", choices=list(CHECKS), default=list(CHECKS))
    p.add_argument(
        "--model",
        nargs="+",
        default=[],
        help="also time these .onnx files (a row each, named by file; e.g. tools/export_gpt2.py's)",
    )
    p.add_argument("--model-dim", action="append", default=[], help="NAME=SIZE for --model's symbolic dims")
    args = p.parse_args(argv)
    model_dims = [flag for dim in args.model_dim for flag in ("--dim", dim)]
    rows = bench(args.sizes, args.repeat, args.tolerance_up_to, args.checks, args.model, model_dims)
    print(
        f"amp-rewrite on synthetic stacks ({' '.join(DIMS)}){' and ' + ', '.join(args.model) if args.model else ''}, "
        f"wall and CPU seconds (median of {args.repeat}), CPU ratio to the plain rewrite, peak RSS"
    )
    print(table(rows, args.checks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
