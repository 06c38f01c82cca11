"""TF32: ONNX Runtime's CUDA provider computes float32 MatMul/Conv in TF32 unless told otherwise
(`use_tf32`). amp-rewrite asks for IEEE float32 unless `tf32=True` (`--tf32`, `Trainer(tf32=...)`),
and every session it opens on CUDA carries the choice (runtime.cuda_options). No GPU here: the
options built for the CUDA provider are what is checked."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from amp_rewrite import runtime
from amp_rewrite.cli import main
from amp_rewrite.errors import TrainingError
from amp_rewrite.training import Trainer
from amp_rewrite.training import runner as training_runner
from helpers import mlp
from training_models import classification_batches
from training_models import mlp as training_mlp


def test_the_cuda_provider_options_carry_tf32():
    assert runtime.cuda_options() == {"device_id": "0", "use_tf32": "0"}
    assert runtime.providers_for("cuda", 1, tf32=True) == [
        ("CUDAExecutionProvider", {"device_id": "1", "use_tf32": "1"}),
        "CPUExecutionProvider",
    ]
    assert runtime.providers_for("cpu", tf32=True) == ["CPUExecutionProvider"]


@pytest.fixture
def asked(monkeypatch):
    """The providers each InferenceSession is asked for, with CUDA said to load: sessions still
    run on CPU (ORT falls back), so a check runs through as it would on a GPU machine."""
    calls = []
    real = runtime.ort().InferenceSession

    def recording(source, options=None, providers=None, **kwargs):
        calls.append(providers)
        return real(source, options, providers=["CPUExecutionProvider"], **kwargs)

    monkeypatch.setattr(runtime.ort(), "InferenceSession", recording)
    monkeypatch.setattr(runtime, "cuda_loads", lambda: True)
    return calls


def cuda_tf32(calls) -> list:
    return [dict(p[0][1])["use_tf32"] for p in calls if p and isinstance(p[0], tuple)]


@pytest.mark.parametrize("flags, expected", [([], {"0"}), (["--no-tf32"], {"0"}), (["--tf32"], {"0", "1"})])
def test_the_checks_open_cuda_sessions_with_the_choice(tmp_path, asked, flags, expected, capsys):
    path = tmp_path / "m.onnx"
    onnx.save(mlp(), path)
    assert main([str(path), "--validate", "--dim", "N=4", "--dry-run", "--quiet", *flags]) == 0
    asked_for = cuda_tf32(asked)
    assert asked_for and set(asked_for) == expected  # with --tf32 the float32 reference stays IEEE: "0"
    if "--tf32" in flags:
        assert asked_for[0] == "0"  # the original, the reference, first


def test_the_trainer_passes_tf32_to_its_sessions(monkeypatch):
    seen = []
    real = training_runner.open_session

    def recording(*args, **kwargs):
        seen.append(kwargs.get("tf32"))
        return real(*args, **kwargs)

    monkeypatch.setattr(training_runner, "open_session", recording)
    model = training_mlp((4, 8, 3))
    for tf32 in (True, False):
        trainer = Trainer(model, precision="float16", provider="cpu", verbose=False, threads=1, tf32=tf32)
        trainer.step(classification_batches(count=1)[0])
        assert seen and set(seen) == {tf32}
        seen.clear()
    with pytest.raises(TrainingError, match="tf32 must be True or False"):
        Trainer(model, provider="cpu", verbose=False, tf32="on")


def test_float32s_own_tf32_error_widens_the_bounds(monkeypatch):
    """With --tf32 the original also runs in TF32, and what it is off IEEE float32 by is allowed
    for: here "TF32" shifts every output by +-0.05 (rel L2 about 3e-2, over rtol 1e-2), in the
    original as in the rewrite, and the check passes only because float32 itself shows it."""
    from amp_rewrite.checks import validate

    real = validate.open_checked

    class InTf32:
        def __init__(self, session):
            self.session = session

        def get_outputs(self):
            return self.session.get_outputs()

        def run(self, outputs, feeds):
            got = self.session.run(outputs, feeds)
            return [g + np.where(np.indices(g.shape).sum(0) % 2, 0.05, -0.05).astype(g.dtype) for g in got]

    def opened(model, device, *, tf32=False, **kwargs):
        session, used = real(model, "cpu", **kwargs)
        return (InTf32(session), runtime.CUDA) if tf32 else (session, used)

    monkeypatch.setattr(validate, "open_checked", opened)
    monkeypatch.setattr(runtime, "cuda_loads", lambda: True)
    model = mlp()
    samples = validate.synthesise(model, dims={"N": 64})
    result = validate.validate(model, model, samples, tf32=True, reference=False)
    [stats] = result.runs["ort:CUDAExecutionProvider"]
    assert stats["rel_l2"] > 1e-2 and result.passed, result.to_text()
    assert any("TF32" in note for note in result.notes)
    names, ref, _ = validate.reference_outputs(model, samples)
    shifted = InTf32(real(model, "cpu")[0]).run(names, samples[0])
    assert not validate.compare([ref[0][0]], [shifted[0]], rtol=1e-2, atol=1e-3)["passed"]  # no floor: fails
