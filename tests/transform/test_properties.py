"""Property tests on random DAGs: the rewrite's invariants hold whatever the graph looks like.

The DAG strategy (`random_models`) lives in tools/strategies.py with the fuzz strategy."""

from collections import Counter

import numpy as np
import onnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import amp_rewrite
from amp_rewrite.analysis.oplists import load_op_lists
from helpers import load_tool, run_ort

strategies = load_tool("strategies")
D = strategies.D
DENY = set(load_op_lists("float16").ops("deny"))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(strategies.random_models(), st.booleans())
def test_rewrite_invariants(model, keep_io_types):
    result = amp_rewrite.rewrite(model, keep_io_types=keep_io_types)
    out = result.model
    onnx.checker.check_model(out, full_check=True)
    for entry in result.report.nodes:  # deny ops never low precision
        if entry["op_type"] in DENY:
            assert entry["precision"] == "float32", entry
    casts = Counter((n.input[0], n.attribute[0].i) for n in out.graph.node if n.name.startswith("amp/"))
    assert all(count == 1 for count in casts.values()), casts  # one cast per tensor and direction
    again = amp_rewrite.rewrite(out, keep_io_types=keep_io_types)  # idempotent
    assert again.model.SerializeToString() == out.SerializeToString()
    assert amp_rewrite.rewrite(model, keep_io_types=keep_io_types).model.SerializeToString() == \
        out.SerializeToString()  # deterministic
    x = np.random.default_rng(1).standard_normal((2, D)).astype(np.float32)
    expected = run_ort(model, {"x": x})
    feed = x if keep_io_types else x.astype(np.float16)
    for got, want in zip(run_ort(out, {"x": feed}), expected):
        assert got.shape == want.shape
        scale = 1 + np.nanmax(np.abs(want))
        assert np.nanmax(np.abs(got.astype(np.float64) - want)) <= 0.05 * scale
