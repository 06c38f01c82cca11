"""Accuracy-guided fallback (`fit`); the driver (driver.py) runs it after calibration for --tolerance.

`fit` rewrites, runs the candidate once per sample with every main-graph float tensor exposed
(ONNX Runtime on the chosen provider and, on CPU, `onnx.reference`, which keeps float16 as
float16), and compares each tensor with the float32 original. Where the relative error *jumps*
(a node's output error minus its inputs' error) is where the error enters: the top-k such nodes
are pinned float32 (as deny roots, so float32 spreads as from a deny op), k grows 1, 2, 4, ...
A node that is already float32 yet still shows a jump only amplifies what it is fed (a
subtraction of nearly equal values): its low-precision producers are blamed instead. Each
candidate costs one validation run; the search stops at `max_runs` (10) including the final check.
k grows by 2, or faster where the last search run would not reach every low-precision node of the
first candidate (growth = count ** (1 / search runs)): doubling stops at 511 pins in 10 runs, short
of what an element-wise tolerance takes on a 10k-node model. Once a run passes, the runs left
bisect the last batch (a prefix of the ranking), so the result pins no more of it than it needs.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import onnx

from amp_rewrite.analysis.elemtypes import tensor_types
from amp_rewrite.api import RewriteOptions, RewriteResult, rewrite
from amp_rewrite.checks import calibrate as cal_mod
from amp_rewrite.checks import validate as val
from amp_rewrite.checks.check_options import CheckOptions, split_fields
from amp_rewrite.checks.pieces import open_checked
from amp_rewrite.checks.reference import CPU_NOTE, use_reference
from amp_rewrite.io import load
from amp_rewrite.transform.result import check_valid

HUGE = 1e30
LOW_MAX = cal_mod.LIMITS["float16"]  # bfloat16's is larger: a low type's sentinel is at least this


@dataclass
class FallbackResult:
    result: RewriteResult
    validation: val.ValidationResult
    passed: bool
    runs: int
    pinned: dict  # node key -> reason
    history: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "validation_runs": self.runs,
            "pinned": list(self.pinned),
            "reasons": self.pinned,
            "history": self.history,
        }


def _rel_error(ref: list, got: list, prepared: list | None = None) -> float:
    """Relative L2 error of `got` against `ref` over the finite reference values. A float32
    sentinel (+-finfo(float32).max, see checks.calibrate) that the candidate holds as inf or its
    own largest value of the same sign is no error, as calibration decided: it is left out.
    `prepared` (`_prepare(ref)`, kept across runs) saves the reference's own passes."""
    num = den = 0.0
    for r, g, (plain, r_den) in zip(ref, got, prepared or _prepare(ref)):
        r, g = np.asarray(r), np.asarray(g)
        if r.shape != g.shape:
            return HUGE
        if plain:  # every reference value finite, no sentinel: the mask below would keep them all
            if not np.isfinite(g).all():
                return HUGE
            num += float(np.sum(np.subtract(g.ravel(), r.ravel(), dtype=np.float64) ** 2))
            den += r_den
            continue
        r = np.asarray(r, np.float64)
        g = np.asarray(g, np.float64)
        finite = np.isfinite(r)
        sentinel = np.abs(r) == cal_mod.SENTINEL
        if sentinel.any():
            with np.errstate(invalid="ignore"):
                kept = sentinel & (np.sign(g) == np.sign(r)) & (np.abs(g) >= LOW_MAX)
            finite &= ~kept
        if np.any(finite & ~np.isfinite(g)):
            return HUGE
        num += float(np.sum((g[finite] - r[finite]) ** 2))
        den += float(np.sum(r[finite] ** 2))
    return float(np.sqrt(num / den)) if den > 0 else (0.0 if num == 0 else HUGE)


def _prepare(ref: list) -> list:
    """Per reference array: (all finite and no sentinel, its sum of squares in float64)."""
    out = []
    for r in ref:
        r = np.asarray(r)
        plain = bool(np.isfinite(r).all()) and not bool((np.abs(r) == cal_mod.SENTINEL).any())
        out.append((plain, float(np.sum(np.asarray(r, np.float64).ravel() ** 2)) if plain else 0.0))
    return out


@dataclass
class _Structure:
    keys: list  # node key per main-graph node index
    float_in: dict  # key -> float tensors read (node outputs or graph inputs)
    float_out: dict  # key -> float tensors written
    producer: dict  # tensor -> node key


def _structure(model: onnx.ModelProto, measured: dict) -> _Structure:
    keys, float_in, float_out, producer = [], {}, {}, {}
    for node in model.graph.node:
        key = cal_mod._node_key(node)
        keys.append(key)
        float_in[key] = [x for x in node.input if x in measured]
        float_out[key] = [x for x in node.output if x in measured]
        for x in float_out[key]:
            producer[x] = key
    return _Structure(keys, float_in, float_out, producer)


def _precision_by_key(result: RewriteResult, st: _Structure) -> dict:
    """Node key -> precision; the scale Muls power-of-two scaling inserted shift the indices."""
    inserted = set(result.report.sections.get("scaling", {}).get("inserted", ()))
    main = [(i, name, p) for (scope, i), (name, p) in result.report.precisions.items() if scope == 0]
    main = [row for row in main if row[0] is not None]
    shift = sorted(index for index, name, _ in main if name in inserted) if inserted else []
    out = {}
    for index, name, precision in main:
        if name in inserted:
            continue
        index -= bisect.bisect_left(shift, index)
        if index < len(st.keys):
            out[st.keys[index]] = precision
    return out


def _unscaled(result: RewriteResult, tensors: dict) -> dict:
    """Tensors power-of-two scaling keeps under their names hold values x 2^-k: compared x 2^k."""
    scaled = result.report.sections.get("scaling", {}).get("scaled_tensors", {})
    if not scaled:
        return tensors
    return {
        run: {
            t: [np.asarray(a, np.float64) * 2.0 ** scaled[t] for a in arrays] if t in scaled else arrays
            for t, arrays in per_run.items()
        }
        for run, per_run in tensors.items()
    }


def _evaluate(
    candidate: onnx.ModelProto, samples, names, measured: list, device: str, reference, progress, opening
) -> tuple[dict, dict]:
    """{run name: [outputs per sample]}, {run name: {tensor: [array per sample]}}. `opening`: the
    sessions' `tf32` and `cache`, the last candidate's piece sessions (those whose bytes no pin
    changed are reused)."""
    samples = val.as_declared(candidate, samples)  # low inputs (--no-keep-io-types): read rounded
    exposed = val.expose(candidate, measured)
    sess, used = open_checked(exposed, device, progress=progress, label="fallback: validate", **opening)
    available = {o.name for o in sess.get_outputs()}
    kept = set(names)
    inter = [m for m in measured if m in available and m not in kept]  # sets: 10k tensors, one pass
    got = val.run_samples(sess, samples, outputs=names + inter, progress=progress, label="fallback: validate")
    outputs = {f"ort:{used}": [g[: len(names)] for g in got]}
    tensors = {f"ort:{used}": {t: [g[len(names) + i] for g in got] for i, t in enumerate(inter)}}
    if use_reference(candidate, used, reference):
        from onnx.reference import ReferenceEvaluator

        try:
            evaluator = ReferenceEvaluator(candidate)
            rows = []
            with (
                val.Progress(len(samples), "fallback: reference", progress) as bar,
                np.errstate(all="ignore"),
            ):
                for feeds in samples:
                    rows.append(evaluator.run(None, feeds, intermediate=True))
                    bar.step()
            outputs["reference"] = [[row[n] for n in names] for row in rows]
            tensors["reference"] = {t: [row[t] for row in rows] for t in measured if t in rows[0]}
        except Exception:  # an op onnx.reference lacks: ORT's figures only
            pass
    return outputs, tensors


def fit(
    model,
    samples=None,
    *,
    calibration=None,
    progress=None,
    options: RewriteOptions | None = None,
    checks: CheckOptions | None = None,
    **fields,
) -> FallbackResult:
    """Rewrite `model`, then pin a few nodes float32 until it validates within rtol/atol.

    `calibration` (a CalibrationResult) is applied to every candidate; `options` (the rewrite's,
    their deployment where the runs go) and `checks` (rtol, atol, at most `max_runs` validation
    runs with the final check, reference, tf32) are changed by `fields`, each by its own names.
    """
    check_fields, rewrite_fields = split_fields(fields)
    checks = CheckOptions.of(checks, **check_fields)
    rtol, atol, max_runs, reference = checks.rtol, checks.atol, checks.max_runs, checks.reference
    options = (
        options.replace(**rewrite_fields)
        if options is not None and rewrite_fields
        else options or RewriteOptions.of(**rewrite_fields)
    )
    deployment = options.deployment
    device = deployment.device
    loaded = _shared(load(model))
    model = loaded.model
    if samples is None:
        samples = val.synthesise(model, dims=deployment.dims)
    types, _ = tensor_types(model)
    measured = cal_mod._measured_tensors(model, types)
    st = _structure(model, measured)
    names = [o.name for o in model.graph.output]
    measured_names = [t for t in measured if t not in names] + [t for t in names if t in measured]
    ref_sess, ref_used = open_checked(
        val.expose(model, measured_names), device, progress=progress, label="fallback: original", tf32=False
    )
    ref_available = [o.name for o in ref_sess.get_outputs()]
    ref_rows = val.run_samples(
        ref_sess, samples, outputs=ref_available, progress=progress, label="fallback: original"
    )
    ref_tensors = {t: [row[i] for row in ref_rows] for i, t in enumerate(ref_available)}
    ref_sess = None  # its weights and buffers: the original's values are all it was for
    skipped: list = []  # decided once, on the original: every candidate has its shapes
    reference = use_reference(model, ref_used, reference, samples, skipped, repeats=max_runs)
    ref_out = [[row[ref_available.index(n)] for n in names] for row in ref_rows]
    ref_rows = None  # ref_tensors and ref_out hold what the search and the checks read
    floor = {f"ort:{ref_used}": val.float32_floor(model, samples, deployment, names, ref_out, checks.tf32)}
    base_force = dict(options.force_fp32)

    history: list = []
    runs = 0
    sessions: dict = {}  # the last candidate's pieces: the next shares those before its first change
    opening = {"cache": sessions, "tf32": checks.tf32}

    unchecked = options.replace(check=False)  # onnx.checker runs once, on the candidate kept

    def rewritten(pins: dict) -> RewriteResult:
        return rewrite(loaded, unchecked.replace(calibration=calibration, force_fp32={**base_force, **pins}))

    def record(pins: dict, passed: bool, worst_rel: float, worst_abs: float, **extra) -> None:
        history.append(
            {
                "run": runs,
                "pinned": len(pins),
                "passed": passed,
                **extra,
                "worst_max_rel": worst_rel,
                "worst_max_abs": worst_abs,
            }
        )

    def attempt(pins: dict):
        """One run of the rewrite with `pins`, every tensor exposed for the ranking: (result, passed, tensors)."""
        nonlocal runs
        candidate = rewritten(pins)
        deployment.check_runs_here(candidate.model)  # a node the device refuses by its attributes: one line
        outputs, tensors = _evaluate(
            candidate.model, samples, names, measured_names, device, reference, progress, opening
        )
        runs += 1
        stats = [
            s
            for run, got in outputs.items()
            for s in val._compare_all(names, ref_out, got, rtol, atol, floor.get(run))
        ]
        passed = all(s["passed"] for s in stats)
        record(
            pins,
            passed,
            max((s["max_rel"] if np.isfinite(s["max_rel"]) else HUGE) for s in stats),
            max(s["max_abs"] for s in stats),
        )
        return candidate, passed, tensors

    def check(candidate: RewriteResult, pins: dict, **extra) -> val.ValidationResult:
        """The outputs alone, as the final check runs them (exposing every tensor, as `attempt`
        does, stops ORT's fusions and moves the numbers: a prefix found at the edge must pass here)."""
        nonlocal runs
        validation = val.validate(
            model,
            candidate.model,
            samples,
            deployment=deployment,
            checks=checks.replace(reference=reference),
            progress=progress,
            expected=(names, ref_out, ref_used),
        )
        runs += 1
        record(pins, validation.passed, validation.worst("max_rel"), validation.worst("max_abs"), **extra)
        return validation

    pinned: dict = {}
    prepared: dict = {}  # reference tensor -> _prepare(...), the same every run
    k, growth, batch = 1, 2.0, []
    result = None
    while runs < max_runs - 1:  # the last run is the final check
        result, passed, tensors = attempt(pinned)
        if passed:
            break
        if runs == 1:
            growth = _growth(result, st, max_runs)
        new = _rank(result, st, _unscaled(result, tensors), ref_tensors, pinned, runs, prepared)
        if not new:
            break
        batch = new[:k]
        pinned.update(batch)
        k = math.ceil(k * growth)
    else:
        result, passed = rewritten(pinned), False
    sessions.clear()  # the checks below need neither the last candidate's sessions nor its tensors
    tensors = ref_tensors = None
    if passed and len(batch) > 1:  # runs left: pin only as much of the last batch as it takes
        before = dict(list(pinned.items())[: len(pinned) - len(batch)])
        low, high = 0, len(batch)
        while high - low > 1 and runs < max_runs - 1:
            middle = (low + high) // 2
            pins = {**before, **dict(batch[:middle])}
            candidate = rewritten(pins)
            if check(candidate, pins).passed:
                high, result = middle, candidate
            else:
                low = middle
        pinned = {**before, **dict(batch[:high])}
    if options.check:
        check_valid(result.model, skeleton=loaded.lazy)
    validation = check(result, pinned, final=True)
    if skipped:  # say why onnx.reference did not run, instead of how to run it
        validation.notes[:] = [n for n in validation.notes if n != CPU_NOTE] + skipped
    fallback = FallbackResult(result, validation, validation.passed, runs, pinned, history)
    result.report.sections["fallback"] = fallback.to_dict()
    result.report.sections["validation"] = validation.to_dict()
    return fallback


def _growth(result: RewriteResult, st: _Structure, max_runs: int) -> float:
    """How fast k grows: 2, or faster where doubling would not reach every low-precision node: k is
    grown max_runs - 2 times before the final check, so g = low ** (1 / (max_runs - 2)) makes the
    last batch alone as large as the count of low nodes."""
    low = sum(1 for p in _precision_by_key(result, st).values() if p != "float32")
    searches = max_runs - 2
    return max(2.0, low ** (1.0 / searches)) if searches > 0 and low > 1 else 2.0


def _rank(
    result: RewriteResult, st: _Structure, tensors: dict, ref_tensors: dict, pinned: dict, run: int, prepared
) -> list:
    """[(node key, reason)] best first: nodes where the relative error jumps most. `prepared` (a
    dict) keeps each reference tensor's own figures (`_prepare`) across runs."""
    error: dict = {}
    for per_run in tensors.values():
        for t, arrays in per_run.items():
            if t in ref_tensors:
                if t not in prepared:
                    prepared[t] = _prepare(ref_tensors[t])
                error[t] = max(error.get(t, 0.0), _rel_error(ref_tensors[t], arrays, prepared[t]))
    precision = _precision_by_key(result, st)
    scores: dict = {}
    for key in st.keys:
        outs = [t for t in st.float_out.get(key, []) if t in error]
        if not outs:
            continue
        t_out = max(outs, key=lambda t: error[t])
        e_out = error[t_out]
        e_in = max((error.get(t, 0.0) for t in st.float_in.get(key, [])), default=0.0)
        jump = e_out - e_in if e_out < HUGE or e_in < HUGE else 0.0
        if jump <= 1e-7:
            continue
        if precision.get(key, "float32") != "float32" and key not in pinned:
            why = (
                f"accuracy fallback (run {run}): relative error of {t_out!r} jumps {e_in:.3g} -> {e_out:.3g}"
            )
            if jump > scores.get(key, (0.0, ""))[0]:
                scores[key] = (jump, why)
        else:  # float32 already: it amplifies its inputs' rounding; blame its low-precision producers
            for t in st.float_in.get(key, []):
                p = st.producer.get(t)
                if p is None or p in pinned or precision.get(p, "float32") == "float32":
                    continue
                why = (
                    f"accuracy fallback (run {run}): feeds {t!r} to float32 '{key}', whose output error "
                    f"jumps {e_in:.3g} -> {e_out:.3g}"
                )
                if jump > scores.get(p, (0.0, ""))[0]:
                    scores[p] = (jump, why)
    return [(key, why) for key, (_, why) in sorted(scores.items(), key=lambda kv: -kv[1][0])]


def _shared(loaded):
    """The same model marked not owned, so `rewrite` copies it instead of rewriting it in place."""
    if getattr(loaded, "owned", False):
        return dataclasses.replace(loaded, owned=False)
    return loaded
