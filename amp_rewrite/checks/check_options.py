"""`CheckOptions`: what the checks are asked to do (validate, calibrate, the --tolerance fallback),
one frozen value whose defaults are written here once and checked in `__post_init__`, so every way
in (the CLI, `driver.check`, `validate`, `fit`, `calibrate`) is checked alike. It owns its CLI
flags as Polygraphy's argument groups own theirs: `add_arguments` declares them (each defaults to
None, "not given", so the field's default applies) and `from_args` reads them back.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass

from amp_rewrite.errors import UsageError
from amp_rewrite.options import option_names

REFERENCE_CHOICES = {"auto": "auto", "always": True, "never": False}  # --reference's words -> the field


@dataclass(frozen=True)
class CheckOptions:
    """`validate`/`calibrate`/`tolerance`: which checks run (calibration also runs for tolerance).
    `inputs`: an .npz of samples, else `samples_count` synthesised. `rtol`/`atol`: the tolerance,
    judged against each output's own scale (checks/validate.compare). `safety`: calibration's
    margin, the limit is max/safety. `max_runs`: validation runs the fallback may use.
    `reference`: also run onnx.reference (True/False, "auto": on CPU when small). `tf32`: let
    CUDA compute float32 MatMul/Conv in TF32 (ONNX Runtime's `use_tf32`; off: IEEE float32)."""

    validate: bool = False
    calibrate: bool = False
    tolerance: bool = False
    inputs: str | None = None
    samples_count: int = 1
    rtol: float = 1e-2
    atol: float = 1e-3
    safety: float = 4.0
    max_runs: int = 10
    reference: object = "auto"
    tf32: bool = False

    def __post_init__(self):
        """Numbers a check cannot run with are usage errors before any work (no ZeroDivisionError
        from --safety 0, no PASSED from comparing zero samples)."""
        if not _number(self.safety) or self.safety <= 0:
            raise UsageError(f"safety {self.safety!r} must be a positive number (the limit is max/safety)")
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if not _number(value) or value < 0:
                raise UsageError(f"{name} {value!r} must be a number of at least 0")
        if not _whole(self.max_runs) or self.max_runs < 1:
            raise UsageError(f"max runs {self.max_runs!r} must be a whole number of at least 1")
        if not _whole(self.samples_count) or self.samples_count < (1 if self.runs else 0):
            raise UsageError(
                f"samples {self.samples_count!r} must be a whole number of at least 1 to validate or calibrate"
            )
        if isinstance(self.reference, str) and self.reference in REFERENCE_CHOICES:
            object.__setattr__(self, "reference", REFERENCE_CHOICES[self.reference])
        if not (isinstance(self.reference, bool) or self.reference == "auto"):
            raise UsageError(
                f"reference {self.reference!r}: expected True, False or 'auto' ('always', 'never')"
            )
        for name in ("validate", "calibrate", "tolerance", "tf32"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"{name} {getattr(self, name)!r}: expected True or False")

    @property
    def runs(self) -> bool:
        """Whether any check runs the model (and so needs samples)."""
        return self.validate or self.calibrate or self.tolerance

    @classmethod
    def of(cls, base: CheckOptions | None = None, **fields) -> CheckOptions:
        """`base` (or the defaults) with `fields` changed; an unknown name is a UsageError."""
        check_names(fields)
        return dataclasses.replace(base, **fields) if base is not None else cls(**fields)

    def replace(self, **changes) -> CheckOptions:
        return CheckOptions.of(self, **changes)

    # --- the CLI flags it owns ------------------------------------------------------------------

    @staticmethod
    def add_arguments(group) -> None:
        """Its flags, into an argparse parser or group; none sets a default (None: not given)."""
        d = CheckOptions()
        flag = group.add_argument
        flag(
            "--validate",
            action="store_const",
            const=True,
            help="run both models in ONNX Runtime and compare outputs",
        )
        flag(
            "--calibrate",
            action="store_const",
            const=True,
            help="measure float32 tensor ranges on the samples; overflowing producers/readers stay float32",
        )
        flag(
            "--tolerance",
            action="store_const",
            const=True,
            help="after calibration, pin nodes float32 where the error enters until --rtol/--atol pass",
        )
        flag("--inputs", metavar="FILE.npz", help="sample inputs: keys NAME, or I/NAME for sample I")
        flag(
            "--samples",
            dest="samples_count",
            type=int,
            metavar="N",
            help=f"synthesised samples (default {d.samples_count})",
        )
        flag(
            "--rtol",
            type=float,
            help=f"relative tolerance, of each output's own scale: RMS error <= atol + rtol x RMS(float32), "
            f"every error <= atol + 10 x rtol x max|float32| (default {d.rtol:g})",
        )
        flag("--atol", type=float, help=f"absolute tolerance (default {d.atol:g})")
        flag("--safety", type=float, help=f"calibration margin: limit is max/SAFETY (default {d.safety:g})")
        flag(
            "--reference",
            nargs="?",
            const="always",
            choices=tuple(REFERENCE_CHOICES),
            help="also run onnx.reference on CPU, which keeps float16 (--reference alone: always; auto "
            "(default): when its estimated work is small, about 20 s)",
        )
        flag(
            "--max-runs",
            type=int,
            help=f"validation runs the --tolerance search may use (default {d.max_runs})",
        )
        flag(
            "--tf32",
            action="store_const",
            const=True,
            help="checks on CUDA compute float32 MatMul/Conv in TF32 (ONNX Runtime's default, faster, "
            "10-bit mantissa); float32 itself is then measured against IEEE float32 and its error "
            "allowed for. Default: IEEE float32 (--no-tf32)",
        )
        flag(
            "--no-tf32", dest="tf32", action="store_const", const=False, help="IEEE float32 on CUDA (default)"
        )

    @classmethod
    def from_args(cls, args) -> CheckOptions:
        """The flags the user gave (the rest: the defaults above)."""
        given = {name: getattr(args, name, None) for name in field_names()}
        return cls(**{name: value for name, value in given.items() if value is not None})


def field_names() -> tuple:
    return tuple(f.name for f in dataclasses.fields(CheckOptions))


def check_names(fields, others=()) -> None:
    """An unknown option is a UsageError, with "did you mean" where a known one (of CheckOptions'
    or `others`, the RewriteOptions' a caller also takes) is close."""
    known = (*field_names(), *others)
    for name in sorted(set(fields) - set(known)):
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f" (known: {', '.join(known)})"
        raise UsageError(f"unknown {'' if others else 'check '}option {name!r}{hint}")


def split_fields(fields: dict) -> tuple[dict, dict]:
    """(CheckOptions' fields, RewriteOptions') of keyword arguments that mix both (driver.check,
    fit); a name neither knows is a UsageError naming the closest of both."""
    check_names(fields, option_names())
    names = set(field_names())
    return (
        {k: v for k, v in fields.items() if k in names},
        {k: v for k, v in fields.items() if k not in names},
    )


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
