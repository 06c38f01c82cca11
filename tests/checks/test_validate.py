"""validate: synthesised samples, symbolic dims, provider fallback and the comparison figures."""

import numpy as np
import pytest

from accuracy_models import cancellation
from amp_rewrite.checks import validate
from amp_rewrite.deployment import Deployment
from helpers import loaded_provider, on_cuda


def test_samples_dims_provider_and_figures():
    model = cancellation()
    samples = validate.synthesise(model, dims=validate.parse_dims(["batch=5"]), count=3)
    assert len(samples) == 3 and samples[0]["x"].shape == (5, 16)
    with pytest.raises(Exception, match="NAME=SIZE"):
        validate.parse_dims(["batch:5"])
    result = validate.validate(model, model, samples, deployment=Deployment(provider="cuda"), reference=False)
    used = loaded_provider()
    assert result.provider == used and result.passed
    assert result.runs[f"ort:{used}"][0]["max_abs"] <= (1e-6 if on_cuda() else 0.0)  # the same model
    assert any("CUDA provider did not load" in n for n in result.notes) == (not on_cuda())
    ref = [np.array([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]], np.float32)]
    got = [np.array([[1.0, 2.5, 2.0], [3.0, np.nan, 1.0]], np.float32)]
    s = validate.compare(ref, got, rtol=1e-2, atol=1e-3)
    assert s["max_abs"] == pytest.approx(1.0) and s["max_rel"] == pytest.approx(1 / 3)
    assert s["nan"] == 1 and s["top1"] == 0.5 and not s["passed"]


def test_checked_run_checks_the_input_once_and_blames_a_bad_one(capsys):
    """The checks no longer run onnx.checker on the input up front (it runs once, on the rewrite):
    an input the checker rejects is still one ModelError line, whether the rewrite's checker
    (validate) or ONNX Runtime (calibrate, first to see the original) meets it first; and every
    phase draws its progress: load, the rewrite's stages, the session setups and the runs."""
    import onnx

    from amp_rewrite import driver
    from amp_rewrite.errors import ModelError
    from helpers import mlp

    bad = mlp()
    bad.graph.node[0].attribute.append(onnx.helper.make_attribute("bogus", 1))
    for check in ({"validate": True}, {"calibrate": True}):
        with pytest.raises(ModelError, match="Unrecognized attribute: bogus"):
            driver.check(bad, provider="cpu", **check)
    capsys.readouterr()
    assert driver.check(mlp(), validate=True, calibrate=True, provider="cpu", progress=True).passed
    drawn = capsys.readouterr().err
    for phase in ("load [", "rewrite [", "calibrate [", "validate: original [", "validate: rewritten ["):
        assert phase in drawn
