"""ONNX Runtime session creation with honest provider detection.

The CUDA provider counts only when the session really runs on it: onnxruntime-gpu lists CUDA as
available even where its libraries fail to load, and then silently falls back to CPU after
printing a red error. We silence that spew while probing, ask the session what it got, and say
the outcome in one line.
"""

from __future__ import annotations

import functools
import logging

import onnxruntime as ort

from amp_rewrite.errors import TrainingError

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
PROVIDER_CHOICES = ("auto", "cuda", "cpu")
_ORT_DEFAULT_SEVERITY = 2
_ORT_FATAL_ONLY = 4

log = logging.getLogger("amp_rewrite.training")


def open_session(model_bytes: bytes, provider: str = "auto") -> tuple[ort.InferenceSession, str]:
    """A session on the requested provider; returns (session, OrtValue device: 'cuda' or 'cpu')."""
    if provider not in PROVIDER_CHOICES:
        raise TrainingError(f"provider must be one of {', '.join(PROVIDER_CHOICES)}, got {provider!r}")
    try_cuda = provider == "cuda" or (provider == "auto" and CUDA in ort.get_available_providers())
    options = ort.SessionOptions()
    options.log_severity_level = 3
    providers = [CUDA, CPU] if try_cuda else [CPU]
    try:
        if try_cuda:
            ort.set_default_logger_severity(_ORT_FATAL_ONLY)
        session = ort.InferenceSession(model_bytes, options, providers=providers)
    except Exception as error:  # ORT raises its own untyped errors for invalid graphs
        raise TrainingError(f"ONNX Runtime refused the step graph: {str(error).splitlines()[0]}") from None
    finally:
        if try_cuda:
            ort.set_default_logger_severity(_ORT_DEFAULT_SEVERITY)
    on_cuda = CUDA in session.get_providers()
    if try_cuda and not on_cuda:
        if provider == "cuda":
            raise TrainingError("provider='cuda' was asked for but ONNX Runtime's CUDA provider did not load")
        _say_cpu_fallback_once()
    return session, "cuda" if on_cuda else "cpu"


@functools.lru_cache(maxsize=1)
def _say_cpu_fallback_once() -> None:
    log.warning("amp-rewrite: ONNX Runtime's CUDA provider did not load; training on CPU")
