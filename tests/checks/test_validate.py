"""validate: synthesised samples, symbolic dims, provider fallback and the comparison figures."""

import numpy as np
import pytest

from accuracy_models import cancellation
from amp_rewrite.checks import validate
from amp_rewrite.deployment import Deployment


def test_samples_dims_provider_and_figures():
    model = cancellation()
    samples = validate.synthesise(model, dims=validate.parse_dims(["batch=5"]), count=3)
    assert len(samples) == 3 and samples[0]["x"].shape == (5, 16)
    with pytest.raises(Exception, match="NAME=SIZE"):
        validate.parse_dims(["batch:5"])
    result = validate.validate(model, model, samples, deployment=Deployment(provider="cuda"), reference=False)
    assert result.provider == "CPUExecutionProvider" and result.passed  # CUDA does not load here
    assert result.runs["ort:CPUExecutionProvider"][0]["max_abs"] == 0.0
    assert any("CUDA" in n for n in result.notes)
    ref = [np.array([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]], np.float32)]
    got = [np.array([[1.0, 2.5, 2.0], [3.0, np.nan, 1.0]], np.float32)]
    s = validate.compare(ref, got, rtol=1e-2, atol=1e-3)
    assert s["max_abs"] == pytest.approx(1.0) and s["max_rel"] == pytest.approx(1 / 3)
    assert s["nan"] == 1 and s["top1"] == 0.5 and not s["passed"]
