"""The accuracy fallback: it keeps nodes float32 until the rewrite meets a tolerance the plain
rewrite misses (API and --tolerance).
"""

import json

import onnx

from accuracy_models import cancellation
from amp_rewrite.checks import calibrate, validate
from amp_rewrite.checks import fallback as accuracy
from amp_rewrite.cli import main
from amp_rewrite import rewrite
from helpers import assert_close, run_ort, run_reference

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
    assert_close(run_reference(onnx.load(tmp_path / "c16.onnx"), feeds), run_ort(cancellation(), feeds),
                 rtol=1e-2, atol=3e-3)
