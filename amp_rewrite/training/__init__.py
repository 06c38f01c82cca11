"""Mixed-precision training on ONNX Runtime with loss scaling (see `Trainer`)."""

from amp_rewrite.training.loss_scale import DynamicLossScale, FixedLossScale
from amp_rewrite.training.optimizers import SGD, Adam, AdamW, Optimizer
from amp_rewrite.training.step_graph import StepGraph, build_step_graph
from amp_rewrite.training.trainer import StepResult, Trainer

__all__ = [
    "Adam",
    "AdamW",
    "DynamicLossScale",
    "FixedLossScale",
    "Optimizer",
    "SGD",
    "StepGraph",
    "StepResult",
    "Trainer",
    "build_step_graph",
]
