"""The placement table's smoke run: tools/bench_placement.py's main on the small exported BERT and
CNN, without ModelOpt (its rows must say so), every amp-rewrite row measured and validated.
torch is optional: skipped without it."""

from __future__ import annotations

import sys

import pytest

from helpers import load_tool

pytest.importorskip("torch")

AMP_ROWS = (
    "amp-rewrite tf, old lists",
    "amp-rewrite tf",
    "amp-rewrite cost",
    "amp-rewrite tf +calibrate",
    "amp-rewrite cost +calibrate",
    "amp-rewrite cost +calibrate +tolerance",
)


def test_small_exports_without_modelopt(monkeypatch, capsys):
    monkeypatch.setattr(
        sys, "path", list(sys.path)
    )  # the tool puts the checkout and tools/ first: undone after
    monkeypatch.delenv("AMP_MODELOPT_PYTHON", raising=False)
    bench = load_tool("bench_placement", needs=("exported", "synthetic", "bench_rewrite"))
    assert bench.main(["--exports", "small", "--sizes", "", "--samples", "2", "--markdown"]) == 0
    rows = {(cells[0], cells[1]): cells for cells in _markdown_rows(capsys.readouterr().out)}
    head = bench.HEAD
    for model in ("bert (export)", "cnn (export)"):
        for tool in AMP_ROWS:
            cells = dict(zip(head, rows[model, tool]))
            assert cells["validate"] == "ok", (model, tool, cells)
            assert float(cells["MB moved"]) > 0 and float(cells["cosine"]) > 0.999
        assert rows[model, "amp-rewrite tf, old lists"][head.index("moved vs tf old")] == "1.00"
        for tool in ("modelopt autocast", "modelopt autocast +calibrate"):
            assert rows[model, tool][2].startswith("not installed")


def test_tools_option_keeps_the_rows_asked_for(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    bench = load_tool("bench_placement", needs=("exported", "synthetic", "bench_rewrite"))
    assert [tool.name for tool in bench.tools(bench.parse_args(["--tools", "amp-rewrite"]))] == list(AMP_ROWS)
    chosen = bench.tools(bench.parse_args(["--tools", "amp-rewrite cost", "--tools", "modelopt autocast"]))
    assert [tool.name for tool in chosen] == [
        "amp-rewrite cost",
        "amp-rewrite cost +calibrate",
        "amp-rewrite cost +calibrate +tolerance",
        "modelopt autocast",
        "modelopt autocast +calibrate",
    ]
    assert len(bench.tools(bench.parse_args([]))) == len(AMP_ROWS) + 4  # two converters, AutoCast twice


def _markdown_rows(text: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("| ") and not line.startswith("| model ")
    ]
