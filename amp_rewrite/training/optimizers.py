"""Optimizers as in-graph update rules over float32 master weights, under the `opt/` prefix.

ONNX Runtime's inference build has no optimizer kernels, so each optimizer writes its update in
standard ops. Formulas and defaults follow PyTorch (`torch.optim.SGD/Adam/AdamW`), so a float32
run can be checked step for step against it. Each optimizer declares its per-weight state slots
(zero-initialised) and emits the new weight and new slots from (weight, unscaled gradient, slots).

`warmup_steps` ramps the rate linearly, lr * min(1, t / warmup_steps) at applied step t (torch's
`LinearLR(start_factor=1/warmup_steps)`): Adam's first update moves every weight by about lr
whatever its gradient (m / sqrt(v) is +-1 from one gradient), so on a trained network of a
million weights AdamW(1e-4)'s first step overshoots a fine-tune's target; the Trainer's default
optimizer warms up (DEFAULT_WARMUP_STEPS), as fine-tuning recipes do.
"""

from __future__ import annotations

import abc
import math

import numpy as np
from onnx import TensorProto

from amp_rewrite.autodiff.emitter import Emitter
from amp_rewrite.errors import TrainingError

LR_INPUT = "opt/lr"
STEP_STATE = "opt/step"


class Optimizer(abc.ABC):
    """Base: hyperparameters, per-weight state slots, optional global-norm gradient clipping."""

    slots: tuple[str, ...] = ()

    def __init__(
        self, lr: float, weight_decay: float = 0.0, max_grad_norm: float | None = None, warmup_steps: int = 0
    ):
        _check_non_negative("lr", lr)
        _check_non_negative("weight_decay", weight_decay)
        if max_grad_norm is not None:
            _check_positive("max_grad_norm", max_grad_norm)
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise TrainingError(f"warmup_steps must be a whole number >= 0, got {warmup_steps!r}")
        self.lr = float(lr)
        self.weight_decay = float(weight_decay)
        self.max_grad_norm = max_grad_norm
        self.warmup_steps = warmup_steps

    def config(self) -> dict:
        """Hyperparameters that define the step graph (checkpoints must match them; no warmup
        leaves the key out, as checkpoints written before it had none)."""
        skip = {"lr"} | ({"warmup_steps"} if not self.warmup_steps else set())
        return {"optimizer": type(self).__name__, **{k: v for k, v in vars(self).items() if k not in skip}}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"

    @abc.abstractmethod
    def emit_update(self, e: Emitter, weight: str, grad: str, slots: dict[str, str], lr: str, step: str):
        """Emit the update from float32 tensors; returns (new weight, {slot: new slot tensor})."""


class SGD(Optimizer):
    """torch.optim.SGD: L2 weight decay added to the gradient, heavy-ball or Nesterov momentum."""

    def __init__(
        self,
        lr: float,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float | None = None,
        warmup_steps: int = 0,
    ):
        super().__init__(lr, weight_decay, max_grad_norm, warmup_steps)
        _check_fraction("momentum", momentum)
        if nesterov and momentum == 0:
            raise TrainingError("SGD with nesterov=True needs a momentum > 0")
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)

    @property
    def slots(self) -> tuple[str, ...]:
        return ("momentum",) if self.momentum else ()

    def emit_update(self, e, weight, grad, slots, lr, step):
        grad = _add_l2(e, grad, weight, self.weight_decay)
        new_slots = {}
        direction = grad
        if self.momentum:
            decayed = e.op("Mul", [slots["momentum"], e.const(self.momentum)], "momentum_decayed")
            buffer = e.op("Add", [decayed, grad], "momentum")
            new_slots["momentum"] = buffer
            direction = buffer
            if self.nesterov:
                look_ahead = e.op("Mul", [buffer, e.const(self.momentum)], "look_ahead")
                direction = e.op("Add", [grad, look_ahead], "nesterov_direction")
        delta = e.op("Mul", [direction, lr], "delta")
        return e.op("Sub", [weight, delta], "weight"), new_slots


class Adam(Optimizer):
    """torch.optim.Adam: bias-corrected moments; weight_decay is L2 added to the gradient."""

    slots = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_grad_norm: float | None = None,
        warmup_steps: int = 0,
    ):
        super().__init__(lr, weight_decay, max_grad_norm, warmup_steps)
        _check_fraction("betas[0]", betas[0])
        _check_fraction("betas[1]", betas[1])
        _check_positive("eps", eps)
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)

    def emit_update(self, e, weight, grad, slots, lr, step):
        grad = _add_l2(e, grad, weight, self.weight_decay)
        return _adam_update(e, weight, grad, slots, lr, step, self.betas, self.eps)


class AdamW(Adam):
    """torch.optim.AdamW: decoupled weight decay (w *= 1 - lr*wd) before the Adam update."""

    def __init__(
        self,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        max_grad_norm: float | None = None,
        warmup_steps: int = 0,
    ):
        super().__init__(lr, betas, eps, weight_decay, max_grad_norm, warmup_steps)

    def emit_update(self, e, weight, grad, slots, lr, step):
        if self.weight_decay:
            keep = e.op(
                "Sub", [e.const(1.0), e.op("Mul", [lr, e.const(self.weight_decay)], "lr_wd")], "decay_keep"
            )
            weight = e.op("Mul", [weight, keep], "decayed_weight")
        return _adam_update(e, weight, grad, slots, lr, step, self.betas, self.eps)


def _adam_update(e: Emitter, weight, grad, slots, lr, step, betas, eps):
    """m, v moments, then w - lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps), as torch computes it."""
    b1, b2 = betas
    exp_avg = e.op(
        "Add",
        [
            e.op("Mul", [slots["exp_avg"], e.const(b1)], "m_decayed"),
            e.op("Mul", [grad, e.const(1 - b1)], "m_new_part"),
        ],
        "exp_avg",
    )
    grad_sq = e.op("Mul", [grad, grad], "grad_sq")
    exp_avg_sq = e.op(
        "Add",
        [
            e.op("Mul", [slots["exp_avg_sq"], e.const(b2)], "v_decayed"),
            e.op("Mul", [grad_sq, e.const(1 - b2)], "v_new_part"),
        ],
        "exp_avg_sq",
    )
    correction1 = e.op("Sub", [e.const(1.0), e.op("Pow", [e.const(b1), step], "b1_pow")], "bias_correction1")
    correction2 = e.op("Sub", [e.const(1.0), e.op("Pow", [e.const(b2), step], "b2_pow")], "bias_correction2")
    # m / (sqrt(v) / c + eps) = c * m / (sqrt(v) + eps * c), c = sqrt(1 - b2^t): the scalar c moves
    # to the scalars, one pass over the weight fewer than torch's order (float32 rounding apart)
    correction2_sqrt = e.op("Sqrt", [correction2], "correction2_sqrt")
    step_size = e.op("Mul", [e.op("Div", [lr, correction1], "step_size"), correction2_sqrt], "scaled_step")
    eps_scaled = e.op("Mul", [e.const(eps), correction2_sqrt], "eps_scaled")
    denom = e.op("Add", [e.op("Sqrt", [exp_avg_sq], "v_sqrt"), eps_scaled], "denom")
    delta = e.op("Mul", [e.op("Div", [exp_avg, denom], "direction"), step_size], "delta")
    return e.op("Sub", [weight, delta], "weight"), {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def emit_step_count(e: Emitter, optimizer: Optimizer) -> tuple[str, str, str]:
    """(next step count, it as float32, the rate at that step): the scalars every update reads."""
    next_step = e.op("Add", [STEP_STATE, e.const(1, np.int64, "one")], "next_step")
    step_float = e.op("Cast", [next_step], "step_float", to=TensorProto.FLOAT)
    if not optimizer.warmup_steps:
        return next_step, step_float, LR_INPUT
    return next_step, step_float, emit_warmup(e, LR_INPUT, step_float, optimizer.warmup_steps)


def emit_warmup(e: Emitter, lr: str, step: str, warmup_steps: int) -> str:
    """lr * min(1, step / warmup_steps): the linear warmup's rate at (1-based) applied step `step`."""
    ramp = e.op("Div", [step, e.const(float(warmup_steps))], "warmup_ramp")
    return e.op("Mul", [lr, e.op("Min", [ramp, e.const(1.0)], "warmup_factor")], "warmed_lr")


def emit_clip_by_global_norm(e: Emitter, grads: list[str], max_norm: float) -> list[str]:
    """torch.nn.utils.clip_grad_norm_: scale by min(1, max_norm / (norm + 1e-6)) over all grads."""
    squares = [e.reduce("ReduceSumSquare", g, None, keepdims=0, hint="grad_sq_sum") for g in grads]
    total = squares[0] if len(squares) == 1 else e.op("Sum", squares, "grad_sq_total")
    norm = e.op("Sqrt", [total], "grad_norm")
    coefficient = e.op(
        "Div", [e.const(max_norm), e.op("Add", [norm, e.const(1e-6)], "grad_norm_eps")], "clip_ratio"
    )
    coefficient = e.op("Min", [coefficient, e.const(1.0)], "clip_coefficient")
    return [e.op("Mul", [g, coefficient], "clipped_grad") for g in grads]


def _add_l2(e: Emitter, grad: str, weight: str, weight_decay: float) -> str:
    if not weight_decay:
        return grad
    return e.op("Add", [grad, e.op("Mul", [weight, e.const(weight_decay)], "l2")], "grad_l2")


def _check_non_negative(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise TrainingError(f"{name} must be a finite number >= 0, got {value!r}")


def _check_positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise TrainingError(f"{name} must be a finite number > 0, got {value!r}")


def _check_fraction(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and 0 <= value < 1):
        raise TrainingError(f"{name} must be in [0, 1), got {value!r}")


def zero_slots(optimizer: Optimizer, weight: np.ndarray) -> dict[str, np.ndarray]:
    """Initial per-weight optimizer state: zeros shaped like the weight."""
    return {slot: np.zeros_like(weight, dtype=np.float32) for slot in optimizer.slots}


# The Trainer's default (each trainer copies it): torch's AdamW at a fine-tuning rate, warmed up over
# 10 steps. Without the warmup its first step overshoots a fine-tune of several trained networks of
# the corpus (nudenet's loss 2.17 -> 6.46, the SVTR recogniser's x4); with 100 steps the first
# steps are too small for float16 to resolve on small models (docs/benchmarks.md, "Training corpus").
DEFAULT_WARMUP_STEPS = 10
DEFAULT_OPTIMIZER = AdamW(lr=1e-4, warmup_steps=DEFAULT_WARMUP_STEPS)
