"""tools/bench_checks.py's smoke run at 1k nodes: every figure measured, the table has its ratios."""

from __future__ import annotations

import sys

from helpers import load_tool


def test_bench_checks_at_1k(monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the tool puts tools/ first: undone after
    bench = load_tool("bench_checks", needs=("synthetic",))
    assert bench.main(["--sizes", "1000", "--checks", "validate"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "validate s" in lines[1] and "calibrate" not in lines[1]
    cells = lines[3].split()
    assert int(cells[0]) == 1000 and len(cells) == 8
    plain_cpu, validated_cpu, ratio = float(cells[2]), float(cells[5]), float(cells[6])
    assert plain_cpu > 0 and ratio > 1
    # the seconds are printed to 0.05, the ratio to 0.005: it must lie within what they allow
    low, high = (validated_cpu - 0.05) / (plain_cpu + 0.05), (validated_cpu + 0.05) / (plain_cpu - 0.05)
    assert low - 0.005 <= ratio <= high + 0.005
