"""Whatever bytes ONNX Runtime's errors hold, a failure reaches the caller as one printable
AmpRewriteError line, and ONNX Runtime's own "EP Error" print never reaches stdout."""

from __future__ import annotations

import onnxruntime
import pytest

from amp_rewrite import driver, errors
from amp_rewrite.cli import main
from amp_rewrite.runtime import open_session
from helpers import mlp

UNDECODABLE = (
    UnicodeDecodeError("utf-8", b"\xc8\x01node", 0, 1, "invalid continuation byte"),
    RuntimeError("[ONNXRuntimeError] : 1 : FAIL : node \udcc8\udc01 \x07 refused\n==> details"),
    RuntimeError(""),  # an empty message: its first line was an IndexError
)


@pytest.fixture(params=range(len(UNDECODABLE)), ids=["decode-error", "surrogates", "empty"])
def refusing_runtime(request, monkeypatch):
    """Every session ONNX Runtime's Python class creates fails as a truncated, mutated model made
    it fail: its CUDA attempt (printing "EP Error ..." and falling back) and the CPU retry."""

    def refuse(self, *args, **kwargs):
        raise UNDECODABLE[request.param]

    monkeypatch.setattr(onnxruntime.InferenceSession, "_create_inference_session", refuse)


def _printable_line(text: str) -> None:
    assert "\n" not in text and text.isprintable(), repr(text)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_session_factory_says_one_printable_line(refusing_runtime, device, capsys):
    with pytest.raises(errors.AmpRewriteError) as info:
        open_session(mlp(), device)
    _printable_line(str(info.value))
    assert "ONNX Runtime refused the model" in str(info.value)
    assert "EP Error" not in capsys.readouterr().out


def test_the_api_check_raises_an_amp_rewrite_error(refusing_runtime, capsys):
    with pytest.raises(errors.AmpRewriteError) as info:
        driver.check(mlp(), validate=True, provider="cuda")
    _printable_line(str(info.value))
    assert "EP Error" not in capsys.readouterr().out


def test_the_cli_says_one_line_and_no_traceback(refusing_runtime, tmp_path, capsys):
    path = tmp_path / "model.onnx"
    path.write_bytes(mlp().SerializeToString())
    code = main([str(path), "-o", str(tmp_path / "out.onnx"), "--validate", "--provider", "cuda"])
    captured = capsys.readouterr()
    assert code not in (0, 70), captured.err
    lines = captured.err.strip().splitlines()
    assert lines[-1].startswith("amp-rewrite: error: "), captured.err
    _printable_line(lines[-1])
    assert "Traceback" not in captured.err and "EP Error" not in captured.out
    assert not (tmp_path / "out.onnx").exists()
