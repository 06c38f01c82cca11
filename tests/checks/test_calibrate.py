"""Calibration on a model whose naive float16 rewrite overflows: measured ranges make the
overflowing nodes deny roots, and validate (cross-checked with ORT and onnx.reference) agrees.
"""

import json

import numpy as np
import onnx
import pytest

from accuracy_models import hazard_samples, hazards, naive_lists
from amp_rewrite import driver, rewrite
from amp_rewrite.checks import calibrate, validate
from amp_rewrite.cli import main
from helpers import assert_close, loaded_provider, on_cuda, run_ort, run_reference

RTOL, ATOL = 1e-2, 1e-2


@pytest.fixture(scope="module")
def hazard():
    model = hazards()
    return model, hazard_samples(count=2)


def test_naive_float16_overflows_and_calibration_removes_it(hazard):
    model, samples = hazard
    naive = rewrite(model, allow=naive_lists(model))
    before = validate.validate(model, naive.model, samples, rtol=RTOL, atol=ATOL, reference=True)
    assert not before.passed
    nan_before = {s["name"]: s["nan"] + s["inf"] for s in before.runs["reference"]}
    assert nan_before["act"] > 0 and nan_before["attn"] > 0  # overflow -> inf -> NaN in float16
    norm = next(s for s in before.runs["reference"] if s["name"] == "norm")
    assert norm["max_rel"] > 0.5  # variance overflow: the normalised output collapses
    # ORT's CPU provider computes these float16 ops in float32: it does not see the overflow; CUDA does
    ort_nonfinite = sum(s["nan"] + s["inf"] for s in before.runs[f"ort:{loaded_provider()}"])
    assert (ort_nonfinite > 0) == on_cuda()

    cal = calibrate.calibrate(model, samples)
    culprits = {r.name: r for r in cal.culprits()}
    assert {"h", "sq", "var", "bias"} <= set(culprits)
    assert culprits["h"].max_abs > 65504 and culprits["h"].producer == "act/MatMul"
    assert culprits["bias"].max_abs == pytest.approx(1e9)

    # without power-of-two scaling, every producer and reader of an over-limit tensor stays float32
    fixed = rewrite(model, allow=naive_lists(model), calibration=cal, scale_activations=False)
    scaled = rewrite(model, allow=naive_lists(model), calibration=cal)  # act/MatMul's region runs on h x 2^-k
    for result in (fixed, scaled):
        after = validate.validate(model, result.model, samples, rtol=RTOL, atol=ATOL, reference=True)
        assert after.passed, after.to_text()
        for feeds in samples:  # independent check of the verdict
            expected = run_ort(model, feeds)
            for got in (run_ort(result.model, feeds), run_reference(result.model, feeds)):
                assert all(np.isfinite(g).all() for g in got)
                assert_close(got, expected, rtol=RTOL, atol=ATOL)
    assert scaled.report.node("act/MatMul")["precision"] == "float16"
    assert fixed.report.node("act/MatMul")["precision"] == "float32"
    # ReduceMean sums 32 values before dividing: not scaled (that sum would overflow), kept float32
    assert scaled.report.node("act/ReduceMean")["precision"] == "float32"
    reasons = {n["name"]: n["because"] for n in fixed.report.nodes}
    assert "calibrated: output 'h' reaches 1." in reasons["act/MatMul"]
    assert "calibrated: output 'sq' reaches" in reasons["ln/Square"]
    assert "'bias' reaches 1e+09" in reasons["attn/add_mask"]
    assert fixed.report.summary["nodes_low"] > 0  # the rest still runs in float16


def test_default_lists_miss_the_overflowing_matmul_calibration_catches_it(hazard):
    model, samples = hazard
    plain = rewrite(model)
    with np.errstate(all="ignore"):
        plain_ref = [run_reference(plain.model, f) for f in samples]
    assert any(not np.isfinite(out[0]).all() for out in plain_ref)  # 'act' overflows
    checked = driver.check(
        model, samples=samples, calibrate=True, validate=True, rtol=RTOL, atol=ATOL, reference=True
    )
    assert checked.passed, checked.validation.to_text()
    section = checked.result.report.to_dict()["calibration"]
    assert section["culprits"][0]["tensor"] == "bias"
    assert not any(f["node"] == "act/MatMul" for f in section["forced"])  # scaled instead: float16
    assert "act/MatMul" in checked.result.report.to_dict()["scaling"]["regions"][0]["nodes"]
    assert checked.result.report.node("act/MatMul")["precision"] == "float16"
    for feeds in samples:
        assert_close(run_reference(checked.result.model, feeds), run_ort(model, feeds), rtol=RTOL, atol=ATOL)


def test_cli_validate_exits_6_over_tolerance_and_0_after_calibration(tmp_path, hazard, capsys):
    model, samples = hazard
    path = tmp_path / "hazards.onnx"
    onnx.save(model, path)
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, **{f"{i}/{k}": v for i, s in enumerate(samples) for k, v in s.items()})
    common = [str(path), "--validate", "--inputs", str(inputs), "--rtol", str(RTOL), "--atol", str(ATOL)]
    assert main(common + ["--allow", "ReduceMean", "-o", str(tmp_path / "a.onnx")]) == 6
    err = capsys.readouterr().err
    assert "over tolerance" in err and "NaN" in err
    report = tmp_path / "r.json"
    assert main(common + ["--calibrate", "-o", str(tmp_path / "b.onnx"), "--report", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["validation"]["passed"] and "reference" in data["validation"]["runs"]
    assert {c["tensor"] for c in data["calibration"]["culprits"]} >= {"h", "bias", "sq"}
    written = onnx.load(tmp_path / "b.onnx")
    for feeds in samples:
        assert_close(run_reference(written, feeds), run_ort(model, feeds), rtol=RTOL, atol=ATOL)
