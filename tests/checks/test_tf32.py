"""TF32: ONNX Runtime's CUDA provider computes float32 MatMul/Conv in TF32 unless told otherwise
(`use_tf32`). amp-rewrite asks for IEEE float32 unless `tf32=True` (`--tf32`, `Trainer(tf32=...)`),
and every session it opens on CUDA carries the choice (runtime.cuda_options). No GPU here: the
options built for the CUDA provider are what is checked."""

from __future__ import annotations

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
