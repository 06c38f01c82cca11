"""The rewrite benchmark's smoke run: tools/bench_rewrite.py --quick, as a user runs it from a checkout."""

from __future__ import annotations

import importlib.util

from helpers import run_script

HAS_OCC = importlib.util.find_spec("onnxconverter_common") is not None


def test_bench_quick_runs_and_reports_valid_outputs():
    done = run_script("tools/bench_rewrite.py", "--quick", "--markdown", timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {cells[2]: cells for cells in _markdown_rows(done.stdout, "1k")}
    ours = rows["amp-rewrite"]
    assert float(ours[3]) > 0 and ours[7] == "232/232" and ours[8] == "valid"
    if HAS_OCC:
        anchor = rows["onnxconverter-common"]
        assert float(anchor[3]) > 0 and anchor[8] == "valid"
    else:
        assert "not installed" in rows["onnxconverter-common"][3]


def _markdown_rows(text: str, size: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith(f"| {size} ")
    ]
