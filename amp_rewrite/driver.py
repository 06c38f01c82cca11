"""The driver: load -> (calibrate) -> rewrite -> (validate) -> (fallback), one run for the CLI and
for the API's checked rewrites (`check`); a plain rewrite is `api.rewrite`, this run's middle.

Every setting is read from one place: the rewrite's `RewriteOptions` (and its `Deployment`:
provider, target, dims), and the checks' own numbers here. Anything a check cannot run with fails
before any work (`check_values`): bad numbers, no samples, a target the device cannot run.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass

from amp_rewrite.analysis.elemtypes import check_dims
from amp_rewrite.analysis.oplists import check_named_ops
from amp_rewrite.api import RewriteOptions, RewriteResult
from amp_rewrite.checks import calibrate as cal_mod
from amp_rewrite.checks import validate as val
from amp_rewrite.checks.fallback import FallbackResult, fit
from amp_rewrite.errors import UsageError, ValidationError
from amp_rewrite.io import LoadedModel, load
from amp_rewrite.onnx_facts import all_graphs
from amp_rewrite.progress import Progress
from amp_rewrite.transform.pipeline import run as rewrite_run


@dataclass
class CheckedResult:
    """What `check` did: the rewrite, and calibration / validation / fallback when asked."""

    result: RewriteResult
    calibration: object = None
    validation: object = None
    fallback: FallbackResult | None = None
    loaded: LoadedModel | None = None  # the input as loaded (its external data, for saving)

    @property
    def passed(self) -> bool:
        return self.validation is None or self.validation.passed


def check_values(
    options: RewriteOptions | None = None,
    *,
    samples_count=1,
    safety=cal_mod.DEFAULT_SAFETY,
    rtol=1e-2,
    atol=1e-3,
    max_runs=10,
    validate=False,
    calibrate=False,
    tolerance=False,
) -> None:
    """Numbers a check cannot run with are usage errors, before any work (no ZeroDivisionError
    from --safety 0, no PASSED from comparing zero samples), and so is a rewritten model the
    deployment's device cannot run at all (bfloat16 for CUDA, checked on ORT's CPU)."""

    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    if not number(safety) or safety <= 0:
        raise UsageError(f"safety {safety!r} must be a positive number (the limit is max/safety)")
    for name, value in (("rtol", rtol), ("atol", atol)):
        if not number(value) or value < 0:
            raise UsageError(f"{name} {value!r} must be a number of at least 0")
    if not isinstance(max_runs, int) or isinstance(max_runs, bool) or max_runs < 1:
        raise UsageError(f"max runs {max_runs!r} must be a whole number of at least 1")
    checks = validate or calibrate or tolerance
    if (
        not isinstance(samples_count, int)
        or isinstance(samples_count, bool)
        or samples_count < (1 if checks else 0)
    ):
        raise UsageError(
            f"samples {samples_count!r} must be a whole number of at least 1 to validate or calibrate"
        )
    if options is not None and (validate or tolerance):
        options.deployment.check_runnable()


def check(
    model,
    *,
    samples=None,
    inputs=None,
    samples_count: int = 1,
    validate: bool = False,
    calibrate: bool = False,
    tolerance: bool = False,
    rtol: float = 1e-2,
    atol: float = 1e-3,
    reference="auto",
    safety: float = cal_mod.DEFAULT_SAFETY,
    progress=None,
    max_runs: int = 10,
    keep_original: bool = True,
    lazy_weights: bool = False,
    outputs=None,
    options: RewriteOptions | None = None,
    **fields,
) -> CheckedResult:
    """load -> calibrate (optional) -> rewrite -> validate (optional) -> fallback (when `tolerance`).

    `options` (changed by `fields`, RewriteOptions' own, e.g. provider="cpu") are the rewrite's;
    their deployment says where the checks run. A model read from a file here is rewritten in
    place (no second copy) only when no check needs the original and `keep_original` is False;
    `lazy_weights` and `outputs` (an io.OutputPlan) go to `io.load`.
    """
    options = (
        options.replace(**fields)
        if options is not None and fields
        else options or RewriteOptions.of(**fields)
    )
    checks = validate or calibrate or tolerance
    check_values(
        options,
        samples_count=samples_count,
        safety=safety,
        rtol=rtol,
        atol=atol,
        max_runs=max_runs,
        validate=validate,
        calibrate=calibrate,
        tolerance=tolerance,
    )
    if samples is not None and not len(samples) and checks:
        raise UsageError("no samples: a check on nothing would pass anything")
    # onnx.checker once, on the rewrite (the input gets it when a stage or ONNX Runtime refuses it)
    with Progress(1, "load", progress) as bar:
        loaded = load(
            model, lazy_weights=lazy_weights and not checks, checker=not options.check, outputs=outputs
        )
        bar.step()
    if keep_original or checks:
        loaded = _shared(loaded)
    model = loaded.model
    deployment = options.deployment
    check_dims(model.graph, deployment.dims)  # a typo fails now, not after calibrating
    check_named_ops(options.lists(), model)  # so does an unknown op type
    check_keep_patterns(model, options.keep_fp32_nodes)  # and a node pattern that pins nothing
    if samples is None and checks:
        samples = (
            val.load_samples(inputs, model)
            if inputs is not None
            else val.synthesise(model, dims=deployment.dims, count=samples_count)
        )
    try:
        out = _checked_run(
            loaded,
            samples,
            options,
            steps=(calibrate or tolerance, validate, tolerance),
            numbers={"rtol": rtol, "atol": atol, "safety": safety, "max_runs": max_runs},
            reference=reference,
            progress=progress,
        )
    except ValidationError:  # ONNX Runtime refused a model: a bad input says so in one ModelError line
        loaded.validate_in_full()
        raise
    if out.calibration is not None:
        exempt = frozenset(out.result.report.sections.get("scaling", {}).get("exempt", ()))
        out.result.report.sections["calibration"] = out.calibration.to_dict(
            deployment.target, exempt=exempt, relax_margin=options.relax_margin
        )
    return out


def _checked_run(loaded, samples, options, *, steps, numbers, reference, progress) -> CheckedResult:
    """calibrate -> rewrite -> validate, or calibrate -> fit, on `loaded` as `check` set it up;
    `steps`: (calibrate, validate, tolerance)."""
    model, deployment = loaded.model, options.deployment
    calibrate, validate, tolerance = steps
    rtol, atol = numbers["rtol"], numbers["atol"]
    calibration = None
    if calibrate:
        calibration = cal_mod.calibrate(
            model, samples, deployment=deployment, safety=numbers["safety"], progress=progress
        )
    if tolerance:
        fb = fit(
            loaded,
            samples,
            rtol=rtol,
            atol=atol,
            calibration=calibration,
            max_runs=numbers["max_runs"],
            reference=reference,
            progress=progress,
            options=options,
        )
        out = CheckedResult(fb.result, calibration, fb.validation, fb, loaded)
    else:
        result = rewrite_run(loaded, options.replace(calibration=calibration), progress=progress)
        validation = None
        if validate:
            validation = val.validate(
                model,
                result.model,
                samples,
                deployment=deployment,
                rtol=rtol,
                atol=atol,
                reference=reference,
                progress=progress,
            )
            result.report.sections["validation"] = validation.to_dict()
        out = CheckedResult(result, calibration, validation, None, loaded)
    return out


def check_keep_patterns(model, patterns) -> None:
    """A keep_fp32_nodes entry (--keep-fp32-node) that names or fully matches no node is a typo that
    would pin nothing: one UsageError line with the closest names."""
    if not patterns:
        return
    names = [n.name for g in all_graphs(model.graph) for n in g.node if n.name]
    for pattern in patterns:
        compiled = re.compile(pattern)
        if not any(name == pattern or compiled.fullmatch(name) for name in names):
            close = difflib.get_close_matches(pattern, names, n=3)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise UsageError(f"--keep-fp32-node {pattern!r} names or fully matches no node{hint}")


def _shared(loaded):
    """The same model marked not owned, so `rewrite` copies it instead of rewriting it in place."""
    if getattr(loaded, "owned", False):
        return dataclasses.replace(loaded, owned=False)
    return loaded


def explain_text(report, name: str) -> str:
    """Every type group's sentence and chain for node `name`; a UsageError naming close names."""
    lines = report.explain(name)
    if not lines:
        names = [n["name"] for n in report.nodes if n["name"]]
        close = difflib.get_close_matches(name, names, n=3)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise UsageError(f"--explain: no float node named {name!r}{hint}")
    return "\n".join(lines)
