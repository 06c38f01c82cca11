"""The driver: load -> (calibrate) -> rewrite -> (validate) -> (fallback), one run for the CLI and
for the API's checked rewrites (`check`); a plain rewrite is `api.rewrite`, this run's middle.

Every setting is read from one place: the rewrite's `RewriteOptions` (and its `Deployment`:
provider, target, dims), and the checks' `CheckOptions` (checks/check_options.py). Anything a
check cannot run with fails before any work (`check_values`): bad numbers, no samples, a target
the device cannot run.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass

from amp_rewrite.api import RewriteOptions, RewriteResult
from amp_rewrite.checks import calibrate as cal_mod
from amp_rewrite.checks import validate as val
from amp_rewrite.checks.check_options import CheckOptions, split_fields
from amp_rewrite.checks.fallback import FallbackResult, fit
from amp_rewrite.errors import UsageError, ValidationError
from amp_rewrite.io import LoadedModel, load
from amp_rewrite.onnx_facts import all_graphs
from amp_rewrite.progress import Progress
from amp_rewrite.transform.pipeline import preflight
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
    options: RewriteOptions | None = None, checks: CheckOptions | None = None, **fields
) -> CheckOptions:
    """The checks' options (`checks` changed by `fields`, CheckOptions' own), checked before any
    work (CheckOptions.__post_init__: bad numbers, no samples), and a rewritten model the
    deployment's device cannot run at all (bfloat16 for CUDA, checked on ORT's CPU) refused."""
    checks = CheckOptions.of(checks, **fields)
    if options is not None and (checks.validate or checks.tolerance):
        options.deployment.check_runnable()
    return checks


def check(
    model,
    *,
    samples=None,
    checks: CheckOptions | None = None,
    progress=None,
    keep_original: bool = True,
    lazy_weights: bool = False,
    outputs=None,
    options: RewriteOptions | None = None,
    **fields,
) -> CheckedResult:
    """load -> calibrate (optional) -> rewrite -> validate (optional) -> fallback (when `tolerance`).

    `checks` (a CheckOptions: which checks, `inputs` or `samples_count`, the tolerance...) and
    `options` (a RewriteOptions) are changed by `fields`, each by its own names (e.g.
    validate=True, rtol=1e-3, provider="cpu"); the deployment says where the checks run. `samples`:
    the sample feeds themselves, instead of `inputs`. A model read from a file here is rewritten
    in place (no second copy) only when no check needs the original and `keep_original` is False;
    `lazy_weights` and `outputs` (an io.OutputPlan) go to `io.load`.
    """
    check_fields, rewrite_fields = split_fields(fields)
    options = (
        options.replace(**rewrite_fields)
        if options is not None and rewrite_fields
        else options or RewriteOptions.of(**rewrite_fields)
    )
    checks = check_values(options, checks, **check_fields)
    runs = checks.runs
    if samples is not None and not len(samples) and runs:
        raise UsageError("no samples: a check on nothing would pass anything")
    # onnx.checker once, on the rewrite (the input gets it when a stage or ONNX Runtime refuses it)
    with Progress(1, "load", progress) as bar:
        loaded = load(
            model, lazy_weights=lazy_weights and not runs, checker=not options.check, outputs=outputs
        )
        bar.step()
    if keep_original or runs:
        loaded = _shared(loaded)
    model = loaded.model
    deployment = options.deployment
    preflight(loaded, options)  # a --dim or op type typo fails now, not after calibrating
    check_keep_patterns(model, options.keep_fp32_nodes)  # and a node pattern that pins nothing
    if samples is None and runs:
        samples = (
            val.load_samples(checks.inputs, model)
            if checks.inputs is not None
            else val.synthesise(model, dims=deployment.dims, count=checks.samples_count)
        )
    try:
        out = _checked_run(loaded, samples, options, checks, progress=progress)
    except ValidationError:  # ONNX Runtime refused a model: a bad input says so in one ModelError line
        loaded.validate_in_full()
        raise
    if out.calibration is not None:
        exempt = frozenset(out.result.report.sections.get("scaling", {}).get("exempt", ()))
        out.result.report.sections["calibration"] = out.calibration.to_dict(
            deployment.target, exempt=exempt, relax_margin=options.relax_margin
        )
    return out


def _checked_run(loaded, samples, options, checks: CheckOptions, *, progress) -> CheckedResult:
    """calibrate -> rewrite -> validate, or calibrate -> fit, on `loaded` as `check` set it up."""
    model, deployment = loaded.model, options.deployment
    calibration = None
    if checks.calibrate or checks.tolerance:
        calibration = cal_mod.calibrate(
            model, samples, deployment=deployment, safety=checks.safety, progress=progress
        )
    if checks.tolerance:
        fb = fit(loaded, samples, calibration=calibration, progress=progress, options=options, checks=checks)
        return CheckedResult(fb.result, calibration, fb.validation, fb, loaded)
    result = rewrite_run(loaded, options.replace(calibration=calibration), progress=progress)
    validation = None
    if checks.validate:
        validation = val.validate(
            model, result.model, samples, deployment=deployment, checks=checks, progress=progress
        )
        result.report.sections["validation"] = validation.to_dict()
    return CheckedResult(result, calibration, validation, None, loaded)


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
