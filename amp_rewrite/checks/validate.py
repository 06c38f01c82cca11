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

from amp_rewrite.checks.check_options import CheckOptions
from amp_rewrite.checks.judgement import LOCAL, compare
from amp_rewrite.checks.pieces import open_checked, with_outputs
from amp_rewrite.checks.reference import CPU_NOTE, run_reference, use_reference
from amp_rewrite.deployment import DEFAULT, Deployment
from amp_rewrite.errors import AmpRewriteError, UsageError, ValidationError
from amp_rewrite.io import load
from amp_rewrite.io.npz import read_npz
from amp_rewrite.io.samples import Synthesised, feed_inputs, synthesise  # noqa: F401  (the checks' names for them)
from amp_rewrite.progress import Progress
from amp_rewrite.runtime import CPU, CUDA
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
    # a negative dim_value (-1: some exporters' "dynamic") is dynamic, as ONNX Runtime reads it
    dims = [d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else None for d in declared.shape.dim]
    if len(dims) != array.ndim or any(d is not None and d != n for d, n in zip(dims, array.shape)):
        shown = [d if d is not None else "?" for d in dims]
        raise UsageError(
            f"{what}: sample {index} input {value.name!r} has shape {list(array.shape)}, "
            f"the model declares {shown}"
        )


def run_samples(sess, samples, *, outputs=None, progress=None, label="run") -> list:
    """One session run per sample: [[array per output] per sample]. Synthesised samples the model
    refuses (a window larger than a made-up image) are made again larger, in place (`grow`), and
    past that are one UsageError line naming the inputs to size."""
    while True:
        try:
            with Progress(len(samples), label, progress) as bar:
                results = []
                for feeds in samples:
                    results.append(run_session(sess, outputs, feeds))
                    bar.step()
                return results
        except Exception as error:
            if not isinstance(samples, Synthesised) or isinstance(error, AmpRewriteError):
                raise
            if not samples.grow():
                raise samples.refused(error) from None


# --- comparison ------------------------------------------------------------------------------------


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
    """(output names, float32 outputs per sample, provider used): the original run once on ORT,
    in IEEE float32 (TF32 off on CUDA)."""
    sess, used = open_checked(
        original, deployment.device, progress=progress, label="validate: original", tf32=False
    )  # IEEE float32: the reference
    names = [o.name for o in sess.get_outputs()]
    return names, run_samples(sess, samples, progress=progress, label="validate: original"), used


def validate(
    original,
    rewritten,
    samples=None,
    *,
    deployment: Deployment = DEFAULT,
    checks: CheckOptions | None = None,
    progress=None,
    expected=None,
    **fields,
) -> ValidationResult:
    """Compare `rewritten` with `original` (paths or ModelProtos) on `samples` (synthesised if None).

    `checks` (changed by `fields`, CheckOptions' own: `rtol`, `atol`, `reference`, `tf32`) say
    how: `reference` also runs `onnx.reference` on the rewritten model (True/False, or "auto": on
    CPU when its estimated work is small, reference.py's `use_reference`); `tf32` lets CUDA run
    float32 in TF32, when the original is also run so and its own error allowed for (`floor`).
    `expected` reuses `reference_outputs(...)`.
    """
    checks = CheckOptions.of(checks, **fields)
    rtol, atol, reference = checks.rtol, checks.atol, checks.reference
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
    floors = float32_floor(original, samples, deployment, names, ref, checks.tf32, progress)
    if floors is not None:
        result.notes.append("TF32: float32's own error on CUDA (the original run in TF32) is allowed for")
    samples = as_declared(rewritten, samples)  # float16 inputs (low_precision_io, keep_io_types=False)
    deployment.check_runs_here(rewritten)  # a node the device here refuses by its attributes: one line
    sess, used_new = open_checked(
        rewritten, deployment.device, progress=progress, label="validate: rewritten", tf32=checks.tf32
    )
    got = run_samples(sess, samples, outputs=names, progress=progress, label="validate: rewritten")
    result.runs[f"ort:{used_new}"] = _compare_all(names, ref, got, rtol, atol, floors)
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


def float32_floor(original, samples, deployment: Deployment, names, ref, tf32: bool, progress=None):
    """[{"rms", "max_abs"} per output]: how far the original itself is off IEEE float32 (`ref`)
    when CUDA runs it in TF32, or None where it runs IEEE float32 (TF32 off, or not on CUDA)."""
    if not tf32 or deployment.device != "cuda":
        return None
    sess, used = open_checked(
        original, "cuda", progress=progress, label="validate: original, TF32", tf32=True
    )
    if used != CUDA:
        return None
    got = run_samples(sess, samples, outputs=names, progress=progress, label="validate: original, TF32")
    floors = []
    for i in range(len(names)):
        diff = [np.abs(np.asarray(g[i], np.float64) - np.asarray(r[i], np.float64)) for g, r in zip(got, ref)]
        finite = np.concatenate([d[np.isfinite(d)].ravel() for d in diff]) if diff else np.zeros(0)
        floors.append(
            {
                "rms": float(np.sqrt(np.mean(finite**2))) if finite.size else 0.0,
                "max_abs": float(finite.max()) if finite.size else 0.0,
            }
        )
    return floors


def _compare_all(names, ref, got, rtol, atol, floors=None) -> list:
    return [
        compare(
            [r[i] for r in ref],
            [g[i] for g in got],
            rtol=rtol,
            atol=atol,
            name=name,
            floor=floors[i] if floors else None,
        )
        for i, name in enumerate(names)
    ]


def expose(model: onnx.ModelProto, names) -> onnx.ModelProto:
    """A copy of `model` whose graph also outputs the main-graph tensors `names`, declared untyped
    (`open_checked(..., expose=names)` does the same without the copy for a model run in pieces)."""
    return with_outputs(model, names)
