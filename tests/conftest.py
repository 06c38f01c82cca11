"""Fixtures shared across the test folders. Builders and runners are plain functions in
helpers.py (importable at module level, e.g. in parametrize lists); what is here is state worth
building once per session."""

from __future__ import annotations

import os

import onnx
import pytest
from hypothesis import settings

from helpers import ROOT, load_tool

# CI replays the same examples every run (a failure there is one a developer can reproduce);
# locally hypothesis explores, and keeps what it found in .hypothesis/.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(scope="session")
def synthetic():
    """tools/synthetic.py: the benchmark's transformer stacks (`transformer_stack`, `sample_feeds`)."""
    return load_tool("synthetic")


@pytest.fixture(scope="session")
def example_models():
    """The models shipped in examples/, by file stem, loaded once. Never mutate them: the rewrite
    copies its input (a test that edits a model builds its own)."""
    return {path.stem: onnx.load(str(path)) for path in sorted((ROOT / "examples").glob("*.onnx"))}


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "even_if_worse: a toy graph whose colouring's structure is under test, rewritten even where cost "
        "placement's estimate favours float32 (its I/O casts outweigh a 2x4 MatMul), as --even-if-worse",
    )


@pytest.fixture(autouse=True)
def _even_if_worse(request, monkeypatch):
    """For tests marked even_if_worse: the rewrite's never-worse guard (paint.never_worse) is off."""
    if request.node.get_closest_marker("even_if_worse"):
        from amp_rewrite.analysis import paint

        monkeypatch.setattr(paint, "never_worse", lambda cg, plan, low_io=frozenset(): (plan, None, None))
