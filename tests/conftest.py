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
