"""Loss-scale policies and their state machine, emitted in-graph under the `scale/` prefix.

The scale is float32 state (float16 tops out at 65504, below the default 2^15 times any loss
above 2), updated in the same session run as the step so a skipped step needs no host round trip.
Dynamic semantics follow TF's DynamicLossScale and ORT's DynamicLossScaler: x2 after
`growth_interval` finite steps in a row, x0.5 on a non-finite step, clamped to [min, max].
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from amp_rewrite.autodiff.emitter import Emitter
from amp_rewrite.errors import TrainingError

SCALE_STATE = "scale/loss_scale"
GOOD_STEPS_STATE = "scale/good_steps"
SKIPPED_OUTPUT = "scale/skipped"
INVERSE_SCALE = "scale/inverse_scale"


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """Dynamic loss scaling; defaults are TensorFlow's initial scale with ORT's [1, 2^24] range."""

    initial: float = 2.0**15
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 1.0
    max_scale: float = 2.0**24

    def __post_init__(self):
        if not (0 < self.min_scale <= self.initial <= self.max_scale and math.isfinite(self.max_scale)):
            raise TrainingError("dynamic loss scale needs 0 < min_scale <= initial <= max_scale < inf")
        if self.growth_interval < 1 or self.growth_factor <= 1 or not 0 < self.backoff_factor < 1:
            raise TrainingError(
                "dynamic loss scale needs growth_interval >= 1, growth_factor > 1, 0 < backoff_factor < 1"
            )


@dataclasses.dataclass(frozen=True)
class FixedLossScale:
    """A constant loss scale (1 disables scaling; non-finite steps are still skipped)."""

    value: float = 1.0

    def __post_init__(self):
        if not (math.isfinite(self.value) and self.value > 0):
            raise TrainingError(f"a fixed loss scale must be a positive finite number, got {self.value!r}")


def resolve_loss_scale(spec) -> DynamicLossScale | FixedLossScale:
    """Accept "dynamic", a number, or a policy object; anything else is a clear error."""
    if isinstance(spec, (DynamicLossScale, FixedLossScale)):
        return spec
    if spec == "dynamic":
        return DynamicLossScale()
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return FixedLossScale(float(spec))
    raise TrainingError(f"loss_scale must be 'dynamic', a number or a loss-scale policy, got {spec!r}")


def initial_scale_state(policy: DynamicLossScale | FixedLossScale) -> dict[str, np.ndarray]:
    """The scale state fed to the first step: float32 scale and an int64 good-step counter."""
    scale = policy.initial if isinstance(policy, DynamicLossScale) else policy.value
    return {SCALE_STATE: np.array(scale, np.float32), GOOD_STEPS_STATE: np.array(0, np.int64)}


def emit_scale_update(e: Emitter, policy, all_finite: str) -> tuple[str, str]:
    """Nodes computing (next scale, next good-step count) from the current state and the finite flag."""
    one_step = e.const(1, np.int64, "one_step")
    counted = e.op("Add", [GOOD_STEPS_STATE, one_step], "counted_steps")
    zero_steps = e.const(0, np.int64, "zero_steps")
    if isinstance(policy, FixedLossScale):
        return e.op("Identity", [SCALE_STATE], "next_scale"), e.where(
            all_finite, counted, zero_steps, "next_good_steps"
        )

    interval = e.const(policy.growth_interval, np.int64, "growth_interval")
    grow = e.op("And", [all_finite, e.op("GreaterOrEqual", [counted, interval], "interval_reached")], "grow")
    grown = e.op(
        "Min",
        [e.op("Mul", [SCALE_STATE, e.const(policy.growth_factor)], "grown"), e.const(policy.max_scale)],
        "grown_capped",
    )
    backed_off = e.op("Mul", [SCALE_STATE, e.const(policy.backoff_factor)], "backed_off")
    backed_off = e.op("Max", [backed_off, e.const(policy.min_scale)], "backed_off_floored")
    finite_scale = e.where(grow, grown, SCALE_STATE, "finite_scale")
    next_scale = e.where(all_finite, finite_scale, backed_off, "next_scale")
    finite_steps = e.where(grow, zero_steps, counted, "finite_good_steps")
    next_steps = e.where(all_finite, finite_steps, zero_steps, "next_good_steps")
    return next_scale, next_steps


def emit_all_finite(e: Emitter, tensors: list[str]) -> str:
    """One flag for all tensors, one read of each: any Inf/NaN makes the total of all sums Inf or
    NaN, and total - total is then NaN (0 otherwise). Finite unscaled gradients large enough to
    overflow that float32 sum (> 3e38) would also count as non-finite, which they practically are.
    Writes SKIPPED_OUTPUT; returns the flag's negation, all_finite."""
    sums = [e.reduce("ReduceSum", t, None, keepdims=0, hint="sum") for t in tensors]
    total = sums[0] if len(sums) == 1 else e.op("Sum", sums, "total")
    e.op("IsNaN", [e.op("Sub", [total, total], "residue")], out=SKIPPED_OUTPUT)
    return e.op("Not", [SKIPPED_OUTPUT], "all_finite")
