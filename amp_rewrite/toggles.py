"""Turn the rewrite on and off for export pipelines, after TensorFlow's
enable/disable_mixed_precision_graph_rewrite: `maybe_rewrite(model)` rewrites only while enabled.

Module state, off by default (or on with AMP_REWRITE_ENABLED=1).
"""

from __future__ import annotations

import contextlib
import os
import warnings

import onnx

from amp_rewrite.api import rewrite
from amp_rewrite.io import load

_state = {"enabled": os.environ.get("AMP_REWRITE_ENABLED", "").lower() in ("1", "true", "yes"), "options": {}}


def enable(**options) -> None:
    """Turn the rewrite on for `maybe_rewrite`; `options` become its default keyword arguments."""
    _state["enabled"] = True
    _state["options"] = dict(options)


def disable() -> None:
    """Turn the rewrite off for `maybe_rewrite` (warns if it was already off)."""
    if not _state["enabled"]:
        warnings.warn("amp_rewrite.disable(): the rewrite is already disabled", stacklevel=2)
    _state["enabled"] = False


def is_enabled() -> bool:
    return _state["enabled"]


@contextlib.contextmanager
def enabled(on: bool = True, **options):
    """Context manager: the rewrite is on (or off) inside, as before outside."""
    saved = dict(_state)
    _state["enabled"] = on
    _state["options"] = dict(options) if on else saved["options"]
    try:
        yield
    finally:
        _state.update(saved)


def maybe_rewrite(model, **options):
    """Rewrite when enabled and return the new ModelProto; otherwise return `model` untouched."""
    if not _state["enabled"]:
        return model if isinstance(model, onnx.ModelProto) else load(model).model
    return rewrite(model, **{**_state["options"], **options}).model
