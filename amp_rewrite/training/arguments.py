"""The Trainer's arguments checked and resolved before anything is built: the choices (precision,
`on_nonfinite`), the data-parallel options, `threads`, the optimizer (no loss scaling of its own),
the trainable/frozen patterns, the model through the one loader, and the Deployment it will run on.
Each bad argument is one TrainingError line.
"""

from __future__ import annotations

import copy
import re

import onnx

from amp_rewrite.deployment import Deployment
from amp_rewrite.errors import AmpRewriteError, TrainingError, UsageError
from amp_rewrite.io import load
from amp_rewrite.training.optimizers import DEFAULT_OPTIMIZER, Optimizer

PRECISIONS = ("float16", "bfloat16", "float32")
NONFINITE_POLICIES = ("skip", "retry")
DISTRIBUTED_OPTIONS = {"loss_reduction", "bucket_mb", "device_id", "comm"}


def check_distributed(distributed, options: dict) -> None:
    if distributed not in (None, "mpi"):
        raise TrainingError(f"distributed must be None or 'mpi', got {distributed!r}")
    unknown = sorted(set(options) - DISTRIBUTED_OPTIONS)
    if unknown:
        raise TrainingError(f"Trainer got an unexpected option {unknown[0]!r}")
    if options and distributed is None:
        raise TrainingError(f"{sorted(options)[0]} is a data-parallel option: pass distributed='mpi' too")


def check_threads(threads) -> None:
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise TrainingError(
            f"threads must be a whole number >= 0 (0: ONNX Runtime's default), got {threads!r}"
        )


def literal_patterns(patterns, names: list[str]):
    """Exact names stay literal (they may hold regex characters); anything else is a regex."""
    if patterns is None:
        return None
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    known = set(names)
    return [re.escape(p) if p in known else p for p in patterns]


def load_model(model, say) -> onnx.ModelProto:
    """Through the one loader (external data containment, input checks), as a TrainingError."""
    try:
        loaded = load(model)
    except AmpRewriteError as error:
        raise TrainingError(f"cannot load model: {error}") from None
    for note in loaded.notes:
        say(f"amp-rewrite: {note}")
    return loaded.model


_LOSS_SCALING_MARKERS = ("loss_scale", "get_scale", "loss_scale_factor", "_loss_scale")


def check_optimizer(optimizer) -> Optimizer:
    """Only amp_rewrite optimizers; one that already scales the loss would scale it twice."""
    if optimizer is None or optimizer is DEFAULT_OPTIMIZER:
        return copy.deepcopy(DEFAULT_OPTIMIZER)
    if (
        any(hasattr(optimizer, marker) for marker in _LOSS_SCALING_MARKERS)
        or "LossScale" in type(optimizer).__name__
    ):
        raise TrainingError(
            f"{type(optimizer).__name__} already does loss scaling: pass the plain optimizer and set Trainer(loss_scale=...)"
        )
    if not isinstance(optimizer, Optimizer):
        raise TrainingError(
            f"optimizer must be an amp_rewrite.training optimizer (SGD, Adam, AdamW), got {type(optimizer).__name__}"
        )
    return optimizer


def deployment(provider: str, precision: str) -> Deployment:
    """The Trainer's `provider` and `precision` as one Deployment (deployment.py's vocabulary),
    resolved once: the engine reads its device (engine.plan), known before the rewrite, which
    colours for it. A bad provider is a TrainingError."""
    try:
        return Deployment(provider=provider, target="float16" if precision == "float32" else precision)
    except UsageError as error:
        raise TrainingError(f"provider: {error}") from None


def check_flag(name: str, value) -> None:
    """`tf32`, `cuda_graph`: True or False."""
    if not isinstance(value, bool):
        raise TrainingError(f"{name} must be True or False, got {value!r}")


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise TrainingError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value
