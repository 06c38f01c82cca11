"""Fuzzing: random valid ONNX graphs from a pool of 50+ op types, checked end to end.

The strategy (`onnx_graphs`) and the check (`check_rewrite`: valid, runs, numbers within float16
tolerance, deny ops float32, other types kept, idempotent, deterministic) live in
tools/strategies.py, shared with the property tests and `tools/fuzz.py`, which runs thousands.
CI runs a bounded, derandomised number of examples.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import load_tool

strategies = load_tool("strategies")


def test_pool_is_big_enough():
    assert len([op for op in strategies.POOL if op not in ("CastDouble", "OtherTypes")]) >= 40


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(strategies.onnx_graphs(), st.booleans())
def test_fuzz_rewrite(model, keep_io_types):
    strategies.check_rewrite(model, keep_io_types)
