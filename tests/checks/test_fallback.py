"""The accuracy fallback: it keeps nodes float32 until the rewrite meets a tolerance the plain
rewrite misses (API and --tolerance).
"""

import json

import numpy as np
import onnx

from accuracy_models import cancellation
from amp_rewrite import rewrite
from amp_rewrite.checks import calibrate, validate
from amp_rewrite.checks import fallback as accuracy
from amp_rewrite.cli import main
from helpers import assert_close, init, make_model, node, run_loaded, run_ort, run_reference, tensor, weights

RTOL, ATOL = 1e-2, 1e-2


def test_fallback_meets_a_tolerance_the_plain_rewrite_misses():
    model = cancellation()
    samples = validate.synthesise(model, dims={"batch": 8}, count=2)
    plain = rewrite(model)
    before = validate.validate(model, plain.model, samples, rtol=1e-2, atol=1e-3, reference=True)
    assert not before.passed and before.worst("max_abs") > 0.1
    fb = accuracy.fit(model, samples, rtol=1e-2, atol=1e-3, calibration=calibrate.calibrate(model, samples))
    assert fb.passed and fb.runs <= 10, fb.history
    assert set(fb.pinned) == {"diff/Sub", "diff/u", "diff/v"}  # where the error enters, nothing else
    assert fb.result.report.summary["nodes_low"] >= 3
    assert fb.result.report.to_dict()["fallback"]["validation_runs"] == fb.runs
    for feeds in samples:
        expected = run_ort(model, feeds)
        assert_close(run_reference(fb.result.model, feeds), expected, rtol=1e-2, atol=2e-3)
        assert_close(run_ort(fb.result.model, feeds), expected, rtol=1e-2, atol=2e-3)


def test_cli_tolerance_runs_the_fallback(tmp_path, capsys):
    path = tmp_path / "c.onnx"
    onnx.save(cancellation(), path)
    report = tmp_path / "r.json"
    args = [str(path), "--dim", "batch=8", "--samples", "2", "--atol", "1e-3", "--report", str(report)]
    assert main(args + ["--validate", "--dry-run", "--quiet"]) == 6
    assert main(args + ["--tolerance", "-o", str(tmp_path / "c16.onnx")]) == 0
    data = json.loads(report.read_text())
    assert data["fallback"]["passed"] and data["fallback"]["validation_runs"] <= 10
    assert "fallback: passed after" in capsys.readouterr().out
    feeds = validate.synthesise(cancellation(), dims={"batch": 8}, seed=5)[0]
    assert_close(
        run_reference(onnx.load(tmp_path / "c16.onnx"), feeds),
        run_ort(cancellation(), feeds),
        rtol=1e-2,
        atol=3e-3,
    )


def _deep_chain(depth=24, width=16, seed=0):
    """MatMul -> Tanh, `depth` times: every node adds a little float16 rounding, none dominates."""
    rng = np.random.default_rng(seed)
    nodes, weights_, current = [], [], "x"
    for i in range(depth):
        nodes += [
            node("MatMul", [current, f"W{i}"], [f"h{i}"], f"mm{i}"),
            node("Tanh", [f"h{i}"], [f"t{i}"], f"tanh{i}"),
        ]
        weights_.append(init(f"W{i}", weights(rng, width, width)))
        current = f"t{i}"
    return make_model(nodes, [tensor("x", ["N", width])], [tensor(current, ["N", width])], weights_)


def test_fallback_search_reaches_every_node_when_errors_are_diffuse():
    """A tolerance only float32 meets (atol 1e-6) on 48 low-precision nodes: doubling k would pin
    at most 1 + 2 + 4 + 8 + 16 = 31 nodes in 6 runs and fail; k grows fast enough to reach them all."""
    model = _deep_chain()
    samples = validate.synthesise(model, dims={"N": 4}, count=1)
    assert rewrite(model).report.summary["nodes_low"] == 48
    fb = accuracy.fit(model, samples, rtol=0.0, atol=1e-6, max_runs=6, reference=False)
    assert fb.passed, fb.history
    assert len(fb.pinned) > 31 and fb.runs <= 6
    # on the provider the fallback judged on (CUDA's float32 runs TF32: CPU's numbers differ by more)
    assert_close(run_loaded(fb.result.model, samples[0]), run_loaded(model, samples[0]), rtol=0.0, atol=1e-6)


def test_fallback_pins_only_the_part_of_the_last_batch_it_needs():
    """k doubles to 1 + 2 + 4 + 8 = 15 pins before the chain meets atol 1e-3; the runs left then
    bisect that last batch of 8 (the ranking's prefix), and the result keeps the fewest pins that
    passed, each checked in ORT."""
    model = _deep_chain()
    samples = validate.synthesise(model, dims={"N": 4}, count=1)
    fb = accuracy.fit(model, samples, rtol=0.0, atol=1e-3, max_runs=10, reference=False)
    assert fb.passed, fb.history
    passes = [h["pinned"] for h in fb.history if h["passed"] and not h.get("final")]
    assert passes[0] > len(fb.pinned) == min(passes), fb.history
    # on the provider the fallback judged on (CUDA's float32 runs TF32: CPU's numbers differ by more)
    assert_close(run_loaded(fb.result.model, samples[0]), run_loaded(model, samples[0]), rtol=0.0, atol=1e-3)


def test_rewrites_of_one_loaded_model_match_fresh_ones():
    """The search rewrites one LoadedModel with different pins: what it reads once (byte size,
    element types: LoadedModel.memo) must not carry one rewrite's changes into the next."""
    from amp_rewrite.io import load
    from helpers import mlp

    loaded = accuracy._shared(load(mlp()))
    seen = set()
    for pins in ({}, {"mm1": "pinned"}, {"mm2": "pinned", "relu": "pinned"}, {}):
        again = rewrite(loaded, force_fp32=pins, dims={"N": 2})
        fresh = rewrite(mlp(), force_fp32=pins, dims={"N": 2})
        assert again.model.SerializeToString() == fresh.model.SerializeToString(), pins
        assert again.report.summary["bytes_before"] == fresh.report.summary["bytes_before"]
        assert again.report.precisions == fresh.report.precisions
        seen.add(again.model.SerializeToString())
    assert len(seen) == 3  # the pins change the model
    assert any(key[0] == "types" for key in loaded.memo)
