"""Time the HTML report of a rewrite, and its size, on synthetic transformer stacks.

Each cell is wall seconds / CPU seconds (medians). Columns: the report's per-node sentences
(`report.nodes`, built on first use and shared with the JSON report), the picture's data alone (regions, layout, casts: `report_page.page_data`), the
whole page (`html_report.render`, sentences already built), the sum, and the file size. The target
is a 100k-node page in <= 10 s and < 5 MB. With `--old`, main's renderer (git show
main:amp_rewrite/report/html.py) is timed beside it on the same rewrite.

    python tools/bench_html.py                       # 1k, 10k, 100k
    python tools/bench_html.py --sizes 10k --repeat 3 --old
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
import types
from pathlib import Path

# A sibling in tools/: Python puts a script's own folder first on sys.path.
import synthetic
from amp_rewrite import rewrite
from amp_rewrite.report import html as html_report
from amp_rewrite.report import picture as report_page

REPO_ROOT = Path(__file__).resolve().parent.parent

BUDGET_S, BUDGET_MB = 10.0, 5.0


def _size(text: str) -> int:
    return int(float(text[:-1]) * 1000) if text.endswith("k") else int(text)


def _old_renderer():
    """main's report/html.py, or None where git or main is not there."""
    try:
        source = subprocess.run(
            ["git", "show", "main:amp_rewrite/report/html.py"],
            cwd=REPO_ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    module = types.ModuleType("html_report_main")
    exec(compile(source, "main:amp_rewrite/html_report.py", "exec"), module.__dict__)
    return module


def _median_time(function, repeat: int) -> tuple[float, float, object]:
    """Median wall and CPU seconds of `repeat` calls (CPU time too: on a shared machine wall time
    also counts the other processes' turns), and the last result."""
    walls, cpus, out = [], [], None
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        out = function()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus), out


def measure(nodes: int, repeat: int, old) -> dict:
    model = synthetic.transformer_stack(nodes)
    result = rewrite(model)
    row = {"nodes": len(model.graph.node)}
    row["sentences"], row["sentences_cpu"], _ = _median_time(lambda: result.report.nodes, 1)  # built once
    row["data"], row["data_cpu"], _ = _median_time(
        lambda: report_page.page_data(result.report, model), repeat
    )
    row["page"], row["page_cpu"], page = _median_time(
        lambda: html_report.render(result.report, model), repeat
    )
    row["total"], row["total_cpu"] = row["sentences"] + row["page"], row["sentences_cpu"] + row["page_cpu"]
    row["mb"] = len(page.encode()) / 1e6
    if old is not None:
        row["old_page"], row["old_cpu"], old_page = _median_time(
            lambda: old.render(result.report, model), repeat
        )
        row["old_mb"] = len(old_page.encode()) / 1e6
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1k,10k,100k", help="comma-separated node counts (k = 1000)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement; the median is shown")
    parser.add_argument("--old", action="store_true", help="also time main's renderer on the same rewrite")
    args = parser.parse_args(argv)
    old = _old_renderer() if args.old else None
    print(
        f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs; "
        "each cell: wall s / CPU s"
    )
    head = (
        f"| nodes | sentences | picture data | page | total | total CPU / {BUDGET_S:g} s | MB "
        f"| MB / {BUDGET_MB:g} |" + (" main's page | main's MB |" if old else "")
    )
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for size in args.sizes.split(","):
        r = measure(_size(size.strip()), args.repeat, old)
        line = (
            f"| {r['nodes']} | {r['sentences']:.2f} / {r['sentences_cpu']:.2f} "
            f"| {r['data']:.2f} / {r['data_cpu']:.2f} | {r['page']:.2f} / {r['page_cpu']:.2f} | {r['total']:.2f} / {r['total_cpu']:.2f} "
            f"| {r['total_cpu'] / BUDGET_S:.2f} | {r['mb']:.2f} | {r['mb'] / BUDGET_MB:.2f} |"
        )
        if old:
            line += f" {r['old_page']:.2f} / {r['old_cpu']:.2f} | {r['old_mb']:.2f} |"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
