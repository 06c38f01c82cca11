"""Run the original and the rewritten model and compare them, per output.

`validate(original, rewritten, samples)` runs both in ONNX Runtime on the deployment's device (CUDA
when it really loads) and, on CPU, also runs the rewritten model in `onnx.reference` (which keeps
float16 tensors float16, as a GPU does; ORT's CPU provider computes most float16 ops in float32
and drops the casts in between, so it hides overflow). The float32 original on ORT is the
reference. Per output: relative L2 error, max abs and max relative error, cosine similarity,
NaN/Inf counts and, for class scores, top-1 agreement. `passed` needs every output of every run
within `rtol`/`atol` relative to its own scale (`compare`'s rule) and no non-finite value where
the original is finite.

Samples are dicts {input name: array}: from an .npz (`load_samples`) or synthesised from the
declared input types (`synthesise`, symbolic dims from the deployment's `dims` or 1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from amp_rewrite.checks.reference import CPU_NOTE, run_reference, use_reference
from amp_rewrite.checks.segments import open_checked, with_outputs
from amp_rewrite.deployment import DEFAULT, Deployment
from amp_rewrite.errors import UsageError, ValidationError
from amp_rewrite.io import load
from amp_rewrite.io.npz import read_npz
from amp_rewrite.io.samples import feed_inputs, synthesise  # noqa: F401  (the checks' names for them)
from amp_rewrite.progress import Progress
from amp_rewrite.runtime import BFLOAT16, CPU, CUDA
from amp_rewrite.runtime import run as run_session


def parse_dims(items) -> dict:
    """['batch=8', 'seq=128'] -> {'batch': 8, 'seq': 128}."""
    dims = {}
    for item in items or ():
        match = re.fullmatch(r"\s*([^=\s]+)\s*=\s*(\d+)\s*", item)
        if not match:
            raise UsageError(f"--dim {item!r}: expected NAME=SIZE, e.g. batch=8")
        dims[match.group(1)] = int(match.group(2))
    return dims


def load_samples(path, model: onnx.ModelProto) -> list:
    """Samples from an .npz: keys `NAME` (one sample) or `I/NAME` (sample I), one per input, each
    of the declared element type and shape (io.npz reads it bounded; every fault a UsageError)."""
    what = f"--inputs {path}"
    data = read_npz(path, what=what)
    inputs = feed_inputs(model)
    by_sample: dict = {}
    for key, array in data.items():
        index, _, name = key.rpartition("/")
        by_sample.setdefault(index, {})[name] = array
    samples = []
    for index in sorted(by_sample, key=lambda k: (len(k), k)):
        feeds = by_sample[index]
        missing = [v.name for v in inputs if v.name not in feeds]
        if missing:
            raise UsageError(f"{what}: sample {index or 0} lacks input(s) {', '.join(missing)}")
        for value in inputs:
            _check_sample(what, index or "0", value, feeds[value.name])
        samples.append({v.name: feeds[v.name] for v in inputs})
    if not samples:
        raise UsageError(f"{what}: no samples")
    return samples


def as_declared(model: onnx.ModelProto, samples) -> list:
    """`samples` with each float input converted to the element type `model` declares for it (a
    rewrite's float16 inputs read the original's float32 samples rounded, as a caller would feed)."""
    declared = {
        v.name: helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type)
        for v in model.graph.input
        if v.type.tensor_type.elem_type
    }
    return [
        {
            name: value.astype(declared[name])
            if name in declared and value.dtype != declared[name] and np.issubdtype(value.dtype, np.floating)
            else value
            for name, value in feeds.items()
        }
        for feeds in samples
    ]


def _check_sample(what: str, index: str, value: onnx.ValueInfoProto, array: np.ndarray) -> None:
    """One sample array against its input's declared type: element type, rank and fixed dims."""
    if not value.type.HasField("tensor_type"):
        return  # sequences, maps: ONNX Runtime says what it expects
    declared = value.type.tensor_type
    expected = helper.tensor_dtype_to_np_dtype(declared.elem_type)
    if array.dtype != expected:
        raise UsageError(
            f"{what}: sample {index} input {value.name!r} is {array.dtype}, the model declares {np.dtype(expected)}"
        )
    if not declared.HasField("shape"):
        return
    dims = [d.dim_value if d.HasField("dim_value") else None for d in declared.shape.dim]
    if len(dims) != array.ndim or any(d is not None and d != n for d, n in zip(dims, array.shape)):
        shown = [d if d is not None else "?" for d in dims]
        raise UsageError(
            f"{what}: sample {index} input {value.name!r} has shape {list(array.shape)}, "
            f"the model declares {shown}"
        )


def run_samples(sess, samples, *, outputs=None, progress=None, label="run") -> list:
    """One session run per sample: [[array per output] per sample]."""
    results = []
    with Progress(len(samples), label, progress) as bar:
        for feeds in samples:
            results.append(run_session(sess, outputs, feeds))
            bar.step()
    return results


# --- comparison ------------------------------------------------------------------------------------


# The rule (README, "Trust the result"): an output is judged against its own scale, never by one
# element alone. A healthy float16 model on float16 hardware is off by about 1.5e-3 of its output's
# RMS (BERT-base, GPT-2, ResNet-50, ViT-B/16 on an H200, every float16 converter alike), and its
# largest error about 2e-3 of its largest value: relative to a value near zero that is a max rel of
# 3-6, so max rel is shown, not judged. What a broken rewrite does is caught: a NaN or inf where
# float32 is finite (overflow), an error of a sizable share of the output (a wrong cast, a denied op
# forced low), one far off its scale anywhere (LOCAL x rtol of the largest value), or a class-score
# row whose top-1 changes although no error within the tolerance could swap them.
LOCAL = 10.0  # an element may be off by LOCAL x rtol of the output's largest |value|, no more


def compare(reference, candidate, *, rtol: float, atol: float, name: str = "", floor=None) -> dict:
    """Figures for one output over all samples (lists of arrays, one per sample), judged by the
    rule above: `passed` needs no new NaN/Inf, RMS error <= atol + rtol x RMS(reference), every
    |error| <= atol + LOCAL x rtol x max|reference|, and no decisive top-1 change. `floor`
    ({"rms": .., "max_abs": ..}): what float32 itself is off by on the provider (TF32), added to
    both bounds."""
    ref = [np.asarray(r) for r in reference]
    cand = [np.asarray(c) for c in candidate]
    stats = {"name": name, "shape": list(ref[0].shape) if ref else [], "passed": True}
    if any(r.shape != c.shape for r, c in zip(ref, cand)):
        stats.update(_failed_figures(), error="shape differs")
        return stats
    if any(not _numeric(x) for x in (*ref, *cand)):  # strings, objects: the rewrite must keep them exactly
        same = all(r.dtype == c.dtype and np.array_equal(r, c) for r, c in zip(ref, cand))
        if same:
            stats.update(max_abs=0.0, max_rel=0.0, rel_l2=0.0, cosine=1.0, nan=0, inf=0, ref_nan=0, ref_inf=0)
            stats.update(top1=None, flips=0, within=1.0)
        else:
            stats.update(_failed_figures(), error="values differ")
        return stats
    r = np.concatenate([x.astype(np.float64).ravel() for x in ref]) if ref else np.zeros(0)
    c = np.concatenate([x.astype(np.float64).ravel() for x in cand]) if cand else np.zeros(0)
    both = np.isfinite(r) & np.isfinite(c)
    diff = np.abs(c[both] - r[both])
    mag = np.abs(r[both])
    rel_mask = mag > max(atol, 1e-30)
    new_bad = int(np.sum(np.isfinite(r) & ~np.isfinite(c)))
    floor = floor or {}
    rms_err = float(np.sqrt(np.mean(diff**2))) if diff.size else 0.0
    rms_ref = float(np.sqrt(np.mean(mag**2))) if mag.size else 0.0
    largest = float(mag.max()) if mag.size else 0.0
    max_abs = float(diff.max()) if diff.size else 0.0
    dot = float(np.dot(r[both], c[both]))
    norm = float(np.linalg.norm(r[both]) * np.linalg.norm(c[both]))
    local_bound = atol + LOCAL * rtol * largest + floor.get("max_abs", 0.0)
    top1, flips = _top1(ref, cand, atol + floor.get("max_abs", 0.0), rtol)
    stats.update(
        max_abs=max_abs,
        max_rel=float((diff[rel_mask] / mag[rel_mask]).max()) if rel_mask.any() else 0.0,
        rel_l2=rms_err / rms_ref if rms_ref > 0 else (0.0 if rms_err == 0 else float("inf")),
        cosine=dot / norm if norm > 0 else (1.0 if not diff.size or diff.max() == 0 else 0.0),
        nan=int(np.isnan(c).sum()),
        inf=int(np.isinf(c).sum()),
        ref_nan=int(np.isnan(r).sum()),
        ref_inf=int(np.isinf(r).sum()),
        within=float(np.mean(diff <= local_bound)) if diff.size else 1.0,
        top1=top1,
        flips=flips,
    )
    stats["passed"] = bool(
        new_bad == 0
        and rms_err <= atol + rtol * rms_ref + floor.get("rms", 0.0)
        and max_abs <= local_bound
        and not flips
    )
    return stats


def _failed_figures() -> dict:
    return {
        "passed": False,
        "max_abs": float("inf"),
        "max_rel": float("inf"),
        "rel_l2": float("inf"),
        "cosine": 0.0,
        "nan": 0,
        "inf": 0,
        "ref_nan": 0,
        "ref_inf": 0,
        "top1": None,
        "flips": 0,
        "within": 0.0,
    }


def _numeric(array: np.ndarray) -> bool:
    return array.dtype.kind in "biufc" or array.dtype == BFLOAT16


def _floating(array: np.ndarray) -> bool:
    return array.dtype.kind == "f" or array.dtype == BFLOAT16


def _top1(ref, cand, atol: float, rtol: float):
    """(share of rows whose argmax over the last axis agrees, decisive changes) for class scores
    (float, last dim >= 2), else (None, 0). A change is decisive when float32 puts the new pick
    more than 2 x (atol + rtol x the row's largest |value|) below its own: errors within the
    tolerance cannot swap them (near ties, a hidden state's features, may swap)."""
    if not ref or ref[0].ndim < 1 or ref[0].shape[-1] < 2 or not _floating(ref[0]):
        return None, 0
    agree = total = flips = 0
    for r, c in zip(ref, cand):
        r2 = np.nan_to_num(r.reshape(-1, r.shape[-1]).astype(np.float64), nan=-np.inf)
        c2 = np.nan_to_num(c.reshape(-1, c.shape[-1]).astype(np.float64), nan=-np.inf)
        r_top, c_top = r2.argmax(-1), c2.argmax(-1)
        rows = np.arange(r2.shape[0])
        margin = r2[rows, r_top] - r2[rows, c_top]
        with np.errstate(invalid="ignore"):
            scale = np.max(np.where(np.isfinite(r2), np.abs(r2), 0.0), axis=-1)
            flips += int(np.sum((r_top != c_top) & (margin > 2 * (atol + rtol * scale))))
        agree += int((r_top == c_top).sum())
        total += r2.shape[0]
    return (agree / total if total else None), flips


@dataclass
class ValidationResult:
    """Per-output figures for each run ("ort:<provider>", and "reference" on CPU)."""

    rtol: float
    atol: float
    provider: str
    samples: int
    runs: dict = field(default_factory=dict)  # run name -> [stats per output]
    notes: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.runs) and all(s["passed"] for stats in self.runs.values() for s in stats)

    def worst(self, key: str = "max_rel") -> float:
        values = [s.get(key, 0.0) for stats in self.runs.values() for s in stats]
        return max(values) if values else 0.0

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "provider": self.provider,
            "samples": self.samples,
            "rtol": self.rtol,
            "atol": self.atol,
            "runs": self.runs,
            "notes": self.notes,
        }

    def to_text(self) -> str:
        lines = [
            f"validation on {self.provider}, {self.samples} sample(s): "
            + ("PASSED" if self.passed else "FAILED"),
            f"  ok: per output, RMS error <= atol + rtol x RMS(float32), every |error| <= atol + "
            f"{LOCAL:g} x rtol x max|float32| (atol {self.atol:g}, rtol {self.rtol:g}), no new NaN/Inf, no "
            f"class-score row whose top-1 changes beyond a near tie; max rel is shown, not judged",
        ]
        head = (
            f"  {'run':<26}{'output':<20}{'rel L2':>10}{'max abs':>11}{'max rel':>11}{'cosine':>10}"
            f"{'NaN':>6}{'Inf':>6}{'top1':>7}  ok"
        )
        lines.append(head)
        for run, stats in self.runs.items():
            for s in stats:
                top1 = "-" if s.get("top1") is None else f"{s['top1']:.3f}"
                lines.append(
                    f"  {run:<26}{s['name'][:19]:<20}{s.get('rel_l2', 0.0):>10.3g}{s['max_abs']:>11.3g}"
                    f"{s['max_rel']:>11.3g}{s['cosine']:>10.6f}{s['nan']:>6}{s['inf']:>6}{top1:>7}"
                    f"  {'yes' if s['passed'] else 'NO'}"
                )
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def raise_if_failed(self) -> None:
        if not self.passed:
            bad = [
                f"{run} {s['name']} (rel L2 {s.get('rel_l2', 0.0):.3g}, max abs {s['max_abs']:.3g}, "
                f"NaN {s['nan']}, Inf {s['inf']}, top-1 changes {s.get('flips', 0)})"
                for run, stats in self.runs.items()
                for s in stats
                if not s["passed"]
            ]
            raise ValidationError(f"over tolerance rtol {self.rtol:g} atol {self.atol:g}: " + "; ".join(bad))


def reference_outputs(original: onnx.ModelProto, samples, deployment: Deployment = DEFAULT, progress=None):
    """(float32 outputs per sample, provider used): the original run once on ORT."""
    sess, used = open_checked(original, deployment.device, progress=progress, label="validate: original")
    names = [o.name for o in sess.get_outputs()]
    return names, run_samples(sess, samples, progress=progress, label="validate: original"), used


def validate(
    original,
    rewritten,
    samples=None,
    *,
    deployment: Deployment = DEFAULT,
    rtol: float = 1e-2,
    atol: float = 1e-3,
    reference="auto",
    progress=None,
    expected=None,
) -> ValidationResult:
    """Compare `rewritten` with `original` (paths or ModelProtos) on `samples` (synthesised if None).

    `reference`: also run `onnx.reference` on the rewritten model (True/False, or "auto": on CPU
    when its estimated work is small, reference.py's `use_reference`). `expected` reuses `reference_outputs(...)`.
    """
    original = load(original).model if not isinstance(original, onnx.ModelProto) else original
    rewritten = load(rewritten).model if not isinstance(rewritten, onnx.ModelProto) else rewritten
    if samples is None:
        samples = synthesise(original, dims=deployment.dims)
    if not len(samples):
        raise UsageError("no samples to validate on: comparing nothing would pass anything")
    names, ref, used = expected or reference_outputs(original, samples, deployment, progress)
    result = ValidationResult(rtol, atol, used, len(samples))
    if deployment.provider == "cuda" and used != CUDA:
        result.notes.append("CUDA provider did not load; validated on CPU")
    samples = as_declared(rewritten, samples)  # float16 inputs (low_precision_io, keep_io_types=False)
    sess, used_new = open_checked(
        rewritten, deployment.device, progress=progress, label="validate: rewritten"
    )
    got = run_samples(sess, samples, outputs=names, progress=progress, label="validate: rewritten")
    result.runs[f"ort:{used_new}"] = _compare_all(names, ref, got, rtol, atol)
    skipped: list = []
    if use_reference(rewritten, used_new, reference, samples, skipped):
        try:
            emulated = run_reference(
                rewritten, samples, outputs=names, progress=progress, label="validate: reference"
            )
            result.runs["reference"] = _compare_all(names, ref, emulated, rtol, atol)
        except Exception as exc:  # an op the reference evaluator lacks: say so, keep ORT's verdict
            result.notes.append(
                f"onnx.reference could not run the rewritten model: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}"
            )
    elif used_new == CPU:
        result.notes += skipped or [CPU_NOTE]
    return result


def _compare_all(names, ref, got, rtol, atol) -> list:
    return [
        compare([r[i] for r in ref], [g[i] for g in got], rtol=rtol, atol=atol, name=name)
        for i, name in enumerate(names)
    ]


def expose(model: onnx.ModelProto, names) -> onnx.ModelProto:
    """A copy of `model` whose graph also outputs the main-graph tensors `names`, declared untyped
    (`open_checked(..., expose=names)` does the same without the copy for a model run in pieces)."""
    return with_outputs(model, names)
