"""The one ONNX Runtime session factory: validation, calibration, the fallback search and training.

The CUDA provider counts only when the session really runs on it: onnxruntime-gpu lists CUDA as
available even where its libraries fail to load, and then falls back to CPU after printing a red
error. We silence that spew while probing, ask the session what it got, and remember the answer,
so the next session does not probe again.
"""

from __future__ import annotations

import functools
import logging
import tempfile
from pathlib import Path

import onnx

from amp_rewrite.errors import UsageError, ValidationError

PROVIDERS = ("auto", "cuda", "cpu")
CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
TWO_GB = 2**31
_ORT_DEFAULT_SEVERITY = 2
_QUIET = 3  # errors only: ORT's warnings about our own graphs are not the user's business
_FATAL_ONLY = 4

_cuda_loads: dict = {}
log = logging.getLogger("amp_rewrite")


def _ort():
    import onnxruntime as ort

    return ort


def session_options(**settings):
    """SessionOptions with ORT's log quietened; `settings` set as attributes."""
    options = _ort().SessionOptions()
    options.log_severity_level = _QUIET
    for name, value in settings.items():
        setattr(options, name, value)
    return options


def _session_source(model, keep_alive: list):
    """Bytes, or for a model over 2 GB a temporary file with external data (kept in `keep_alive`)."""
    if isinstance(model, (bytes, str)):
        return model
    if model.ByteSize() < TWO_GB:
        return model.SerializeToString()
    folder = tempfile.TemporaryDirectory()
    keep_alive.append(folder)
    path = Path(folder.name) / "model.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="model.onnx.data")
    return str(path)


def open_session(model, provider: str = "auto", *, options=None, error=ValidationError,
                 what: str = "the model", device_id: int = 0):
    """(session, provider used: CUDA or CPU). `model`: a ModelProto or its bytes. CUDA only when
    it really loads (on device `device_id`), with ORT's load-failure spew silenced; a model ORT
    refuses is `error`."""
    if provider not in PROVIDERS:
        raise UsageError(f"unknown provider {provider!r}: choose one of {', '.join(PROVIDERS)}")
    ort = _ort()
    want_cuda = provider == "cuda" or (provider == "auto" and CUDA in ort.get_available_providers())
    if want_cuda and provider == "auto" and _cuda_loads.get("ok") is False:
        want_cuda = False
    keep_alive: list = []
    source = _session_source(model, keep_alive)
    ort.set_default_logger_severity(_FATAL_ONLY if want_cuda else _QUIET)
    try:
        sess = ort.InferenceSession(source, options or session_options(),
                                    providers=[(CUDA, {"device_id": str(device_id)}), CPU] if want_cuda else [CPU])
    except Exception as exc:  # ORT raises its own untyped errors for invalid graphs
        raise error(f"ONNX Runtime refused {what}: {str(exc).strip().splitlines()[0]}") from None
    finally:
        ort.set_default_logger_severity(_ORT_DEFAULT_SEVERITY)
    used = CUDA if CUDA in sess.get_providers() else CPU
    if want_cuda:
        _cuda_loads["ok"] = used == CUDA
        if used != CUDA:
            _say_cpu_fallback_once()
    sess._amp_keep_alive = keep_alive  # external data lives as long as the session
    return sess, used


@functools.lru_cache(maxsize=1)
def _say_cpu_fallback_once() -> None:
    log.warning("amp-rewrite: ONNX Runtime's CUDA provider did not load; running on CPU")
