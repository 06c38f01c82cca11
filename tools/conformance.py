"""Run amp-rewrite over the ONNX node conformance suite and count what happens.

For every case of `onnx.backend.test.case.node.collect_testcases(None)` that has float32 tensors
and that ONNX Runtime CPU runs in float32 (it loads, and its outputs match the expected ones), each
target type and each mode is tried:

- ``default``: the shipped op lists. Most cases hold no allow op, so the rewrite (rightly) changes
  nothing: that proves little, hence
- ``force``: every op type of the case is put in the allow list, so every type group whose schema
  admits the target at the case's opset really is converted; the schemas decide the rest.

The rewritten model must pass the full checker (types included), load in ONNX Runtime CPU and
match the case's expected outputs within the tolerance of the target type (TOLERANCE). For
bfloat16, where ORT CPU has no kernel the numbers come from onnx.reference.ReferenceEvaluator
(float16 likewise, counted apart). A case where nothing could be converted is "float32" and carries
the report's reason; a case listed in EXCEPTIONS is counted apart with its reason.

    python tools/conformance.py                   # full run, both targets, both modes
    python tools/conformance.py -j 8 --target float16 --mode force --show-failures
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import pickle
import re
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

TARGETS = ("float16", "bfloat16")
MODES = ("default", "force")
MAX_IR = 10  # ONNX Runtime 1.31 refuses newer IR versions; the cases need nothing newer

# |actual - expected| <= rtol * |expected| + atol * max|expected|, per output. About ten units in
# the last place of the target type: float16 has 11 significant bits (eps 9.8e-4), bfloat16 8
# (eps 7.8e-3). Integer and bool outputs (indices, comparisons) must match exactly.
TOLERANCE = {
    "float16": {"rtol": 1e-2, "atol": 1e-2},
    "bfloat16": {"rtol": 8e-2, "atol": 8e-2},
}

# Cases whose float32 math cannot be reproduced in a 16-bit type by construction, with the reason.
# Keys are regular expressions matched against the case name; values the reason shown.
# A key is a pattern, or (pattern, target) for one target only.
EXCEPTIONS: dict = {
    (
        r"test_attention_4d_attn_mask_[34]d_causal",
        "bfloat16",
    ): "ORT 1.31 inlines Attention-23 (is_causal) with a float32 mask Add for bfloat16; onnx's own "
    "function body accepts bfloat16 (the schema probe checks it): ORT bug",
    (
        r"test_(log)?softmax_large_number(_expanded)?(_ver18)?",
        "bfloat16",
    ): "inputs near 10000 differ by 1..3; bfloat16 spacing there is 64",
    (
        r"test_nllloss_NCd1d2d3d4d5_mean_weight(_expanded)?",
        "bfloat16",
    ): "weighted mean over 6480 terms accumulated in bfloat16 by onnx.reference (no ORT bf16 kernel)",
    (
        r"test_maxpool_with_argmax_2d_precomputed_pads",
        "bfloat16",
    ): "onnx.reference's MaxPool returns wrong indices for bfloat16 (negative); ORT has no bf16 kernel",
    (
        r"test_batchnorm_(epsilon|example)_training_mode",
        "bfloat16",
    ): "training-mode running variance computed in bfloat16 by onnx.reference",
}


CACHE = Path(os.environ.get("AMP_REWRITE_CACHE", Path.home() / ".cache" / "amp-rewrite"))


# --- the cases -----------------------------------------------------------------------------------------


def _cache_path() -> Path:
    key = hashlib.sha1(f"{onnx.__version__}|{np.__version__}".encode()).hexdigest()[:12]
    return CACHE / f"onnx-node-cases-{key}.pkl"


def load_cases() -> list[tuple[str, bytes, list]]:
    """(name, model bytes, [(inputs, outputs), ...]) of every node case, cached on disk.

    Collecting the cases runs every generator of the suite (about 25 s); the cache makes later
    runs start in about a second.
    """
    path = _cache_path()
    if path.exists():
        try:
            with path.open("rb") as f:
                return pickle.load(f)
        except Exception:  # a half-written or stale cache: collect again
            pass
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        cases = collect_testcases(None)
    table = []
    for case in cases:
        if case.model is None:
            continue
        table.append((case.name, case.model.SerializeToString(), list(case.data_sets or [])))
    table.sort(key=lambda c: c[0])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        with tmp.open("wb") as f:
            pickle.dump(table, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
    except OSError:
        pass
    return table


def _graphs(graph: onnx.GraphProto):
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("g"):
                yield from _graphs(attr.g)
            for sub in attr.graphs:
                yield from _graphs(sub)


def op_types(model: onnx.ModelProto) -> list[str]:
    """Every op type the model calls, as `domain:Op` outside the default domain."""
    seen = {}
    for g in _graphs(model.graph):
        for node in g.node:
            key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}:{node.op_type}"
            seen[key] = None
    for function in model.functions:
        for node in function.node:
            key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}:{node.op_type}"
            seen[key] = None
    return list(seen)


def has_float32(model: onnx.ModelProto) -> bool:
    """A float32 tensor anywhere: graph I/O, initializers, inferred values, constants."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:
        inferred = model
    for g in _graphs(inferred.graph):
        for value in (*g.input, *g.output, *g.value_info):
            if value.type.tensor_type.elem_type == TensorProto.FLOAT:
                return True
        if any(t.data_type == TensorProto.FLOAT for t in g.initializer):
            return True
        for node in g.node:
            for attr in node.attribute:
                if attr.HasField("t") and attr.t.data_type == TensorProto.FLOAT:
                    return True
                if (
                    attr.type in (onnx.AttributeProto.FLOAT, onnx.AttributeProto.FLOATS)
                    and node.op_type == "Constant"
                ):
                    return True
    return False


# --- running ---------------------------------------------------------------------------------------------


def _for_ort(model: onnx.ModelProto) -> onnx.ModelProto:
    if model.ir_version > MAX_IR:
        model = onnx.ModelProto.FromString(model.SerializeToString())
        model.ir_version = MAX_IR
    return model


def _session(model: onnx.ModelProto):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return ort.InferenceSession(
        _for_ort(model).SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _feeds(model: onnx.ModelProto, inputs: list) -> dict:
    names = [v.name for v in model.graph.input if v.name not in {t.name for t in model.graph.initializer}]
    return dict(zip(names, inputs))


def _run_ort(model, inputs):
    sess = _session(model)
    return sess.run(None, _feeds(model, inputs))


def _run_reference(model, inputs):
    from onnx.reference import ReferenceEvaluator

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return ReferenceEvaluator(model).run(None, _feeds(model, inputs))


def _as_list(value):
    if isinstance(value, (list, tuple)):
        return [np.asarray(v) if not isinstance(v, (list, dict)) else v for v in value]
    return value


def compare(actual, expected, rtol: float, atol: float) -> str | None:
    """None when `actual` matches `expected`, else what differs (first difference)."""
    if isinstance(expected, (list, tuple)) or isinstance(actual, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or not isinstance(expected, (list, tuple)):
            return "sequence expected" if isinstance(expected, (list, tuple)) else "tensor expected"
        if len(actual) != len(expected):
            return f"sequence length {len(actual)} != {len(expected)}"
        for a, e in zip(actual, expected):
            problem = compare(a, e, rtol, atol)
            if problem:
                return problem
        return None
    if expected is None or actual is None:
        return None if expected is None and actual is None else "optional value differs"
    if isinstance(expected, dict):
        return None
    a, e = np.asarray(actual), np.asarray(expected)
    if a.shape != e.shape:
        return f"shape {a.shape} != {e.shape}"
    if e.dtype.kind in "biuUSOM":  # indices, comparisons, strings: exact
        if a.dtype != e.dtype or not np.array_equal(a, e):
            bad = int(np.sum(a != e)) if a.dtype == e.dtype else e.size
            return f"{bad}/{e.size} {e.dtype} values differ"
        return None
    try:
        a64 = a.astype(np.float64)
        e64 = e.astype(np.float64)
    except (TypeError, ValueError):
        return None if np.array_equal(a, e) else "values differ"
    if a.dtype != e.dtype:
        return f"dtype {a.dtype} != {e.dtype}"
    finite = np.isfinite(e64)
    same_nonfinite = np.array_equal(np.isnan(a64), np.isnan(e64)) and np.array_equal(
        a64[np.isinf(e64)], e64[np.isinf(e64)]
    )
    if not same_nonfinite:
        return f"non-finite values differ ({int(np.sum(~np.isfinite(a64)))} vs {int(np.sum(~finite))})"
    if not finite.any():
        return None
    scale = float(np.max(np.abs(e64[finite])))
    limit = rtol * np.abs(e64[finite]) + atol * scale
    err = np.abs(a64[finite] - e64[finite])
    if np.all(err <= limit):
        return None
    i = int(np.argmax(err - limit))
    return f"max error {float(err[i]):.3g} > {float(limit[i]):.3g} (expected {float(e64[finite][i]):.4g}, scale {scale:.3g})"


def baseline(name: str, model_bytes: bytes, data_sets: list) -> str | None:
    """None if the case is in scope, else why not (no float32, ORT cannot run it in float32)."""
    model = onnx.ModelProto.FromString(model_bytes)
    if not has_float32(model):
        return "no float32 tensor"
    if not data_sets:
        return "no data set"
    try:
        sess = _session(model)
    except Exception as exc:
        return f"ORT cannot load the float32 model: {_first_line(exc)}"
    for inputs, outputs in data_sets:
        try:
            got = sess.run(None, _feeds(model, inputs))
        except Exception as exc:
            return f"ORT cannot run the float32 model: {_first_line(exc)}"
        for a, e in zip(got, outputs):
            if compare(a, e, 1e-3, 1e-4):
                return "ORT float32 does not match the expected outputs"
    return None


def _missing_kernel(exc) -> bool:
    text = str(exc)
    return "NOT_IMPLEMENTED" in text or "data type is not supported" in text or "not supported" in text


def _first_line(exc) -> str:
    text = str(exc).strip().splitlines()
    text = text[0] if text else type(exc).__name__
    text = re.sub(r"\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)
    return text[:200]


def _low_nodes(result) -> int:
    return result.report.summary["groups_low"]


def _float32_reason(result) -> str:
    """Why nothing was converted, in one line from the report."""
    reasons = Counter()
    for node in result.report.nodes:
        for group in node["groups"].values():
            step = group["reason"].split(": ", 1)[-1].split(" <- ")[0]
            reasons[re.sub(r"'[^']*'", "'…'", step)] += 1
    for note in result.report.notes:
        reasons[re.sub(r"^.*?: ", "", note)] += 1
    if not reasons:
        return "no float32 type group"
    return reasons.most_common(1)[0][0]


def run_case(name: str, model_bytes: bytes, data_sets: list, target: str, mode: str) -> tuple[str, str, str]:
    """(status, detail, evaluator): status passed | float32 | failing | exception."""
    from amp_rewrite import rewrite

    for key, reason in EXCEPTIONS.items():
        pattern, only = (key, None) if isinstance(key, str) else key
        if re.fullmatch(pattern, name) and only in (None, target):
            return "exception", reason, ""
    model = onnx.ModelProto.FromString(model_bytes)
    allow = op_types(model) if mode == "force" else ()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # force: the schema alone decides, not a provider's kernels; default: what ships (CUDA's kernels)
            result = rewrite(
                model,
                target=target,
                allow=allow,
                provider="any" if mode == "force" else "cuda",
                never_worse=False,  # one op on a tiny tensor never pays: its rewrite is what is under test
            )
    except Exception as exc:
        return "failing", f"rewrite raised {type(exc).__name__}: {_first_line(exc)}", ""
    if _low_nodes(result) == 0:
        return "float32", _float32_reason(result), ""
    out = result.model
    try:
        onnx.checker.check_model(out, full_check=True)
    except Exception as exc:
        return "failing", f"full check: {_first_line(exc)}", ""
    evaluator = "ort"
    try:
        sess = _session(out)
    except Exception as exc:
        text = _first_line(exc)
        if _missing_kernel(exc) or "Could not find an implementation" in str(exc):
            evaluator = "reference"  # ORT CPU has no kernel for this type: numbers from onnx.reference
            sess = None
        else:
            return "failing", f"ORT cannot load: {text}", ""
    tol = TOLERANCE[target]
    for inputs, outputs in data_sets:
        try:
            got = sess.run(None, _feeds(out, inputs)) if sess is not None else _run_reference(out, inputs)
        except Exception as exc:
            if sess is None or not _missing_kernel(exc):
                return "failing", f"{evaluator} run: {_first_line(exc)}", evaluator
            sess, evaluator = None, "reference"  # e.g. ScatterND reduction: no float16 kernel on CPU
            try:
                got = _run_reference(out, inputs)
            except Exception as exc2:
                return "failing", f"reference run: {_first_line(exc2)}", evaluator
        if len(got) != len(outputs):
            return "failing", f"{len(got)} outputs, expected {len(outputs)}", evaluator
        for k, (a, e) in enumerate(zip(got, outputs)):
            problem = compare(a, e, **tol)
            if problem:
                return "failing", f"output {k}: {problem}", evaluator
    return "passed", "", evaluator


def _job(args):
    index, name, model_bytes, data_sets, targets, modes = args
    out = {"name": name}
    try:
        reason = baseline(name, model_bytes, data_sets)
    except Exception as exc:
        reason = f"baseline raised {_first_line(exc)}"
    out["baseline"] = reason
    if reason is None:
        for target in targets:
            for mode in modes:
                started = time.perf_counter()
                try:
                    out[(target, mode)] = run_case(name, model_bytes, data_sets, target, mode)
                except Exception as exc:  # a crash of the harness is a failure of the case
                    out[(target, mode)] = (
                        "failing",
                        f"harness: {type(exc).__name__}: {_first_line(exc)}",
                        "",
                    )
                out[("seconds", target, mode)] = time.perf_counter() - started
    return out


def run(cases, targets=TARGETS, modes=MODES, jobs: int | None = None) -> list[dict]:
    jobs = jobs or os.cpu_count() or 1
    work = [(i, name, m, d, tuple(targets), tuple(modes)) for i, (name, m, d) in enumerate(cases)]
    if jobs == 1:
        return [_job(w) for w in work]
    ctx = mp.get_context("spawn" if sys.platform == "darwin" else "fork")
    with ctx.Pool(jobs, maxtasksperchild=200) as pool:
        return list(pool.imap(_job, work, chunksize=4))


def counts(results: list[dict], targets=TARGETS, modes=MODES) -> dict:
    """{(target, mode): Counter(considered, passed, float32, failing, exception, ort, reference)}."""
    table = {}
    for target in targets:
        for mode in modes:
            c = Counter()
            for r in results:
                if r["baseline"] is not None:
                    continue
                status, _, evaluator = r[(target, mode)]
                c["considered"] += 1
                c[status] += 1
                if status == "passed":
                    c[f"passed_{evaluator}"] += 1
            table[(target, mode)] = c
    return table


def summary_text(
    results: list[dict], targets=TARGETS, modes=MODES, show_failures: bool = True, show_float32: bool = False
) -> str:
    lines = []
    skipped = Counter(r["baseline"].split(":")[0] for r in results if r["baseline"] is not None)
    lines.append(
        f"cases: {len(results)}; out of scope: {sum(skipped.values())} "
        f"({', '.join(f'{k}: {v}' for k, v in skipped.most_common())})"
    )
    table = counts(results, targets, modes)
    lines.append(
        f"{'target':9} {'mode':8} {'considered':>10} {'passed':>7} {'(ort':>6} {'ref)':>5} "
        f"{'float32':>8} {'failing':>8} {'exception':>9}"
    )
    for (target, mode), c in table.items():
        lines.append(
            f"{target:9} {mode:8} {c['considered']:>10} {c['passed']:>7} {c['passed_ort']:>6} "
            f"{c['passed_reference']:>5} {c['float32']:>8} {c['failing']:>8} {c['exception']:>9}"
        )
    for target in targets:
        for mode in modes:
            if show_failures:
                fails = [
                    (r["name"], r[(target, mode)][1])
                    for r in results
                    if r["baseline"] is None and r[(target, mode)][0] == "failing"
                ]
                if fails:
                    lines.append(f"-- failing, {target} {mode}:")
                    lines += [f"   {n}: {d}" for n, d in fails]
            if show_float32:
                why = Counter(
                    r[(target, mode)][1]
                    for r in results
                    if r["baseline"] is None and r[(target, mode)][0] == "float32"
                )
                if why:
                    lines.append(f"-- left float32, {target} {mode}, by reason:")
                    lines += [f"   {v:5} {k}" for k, v in why.most_common()]
    slow = sorted(
        (
            (sum(v for k, v in r.items() if isinstance(k, tuple) and k[0] == "seconds"), r["name"])
            for r in results
        ),
        reverse=True,
    )[:8]
    if slow and slow[0][0] > 1:
        lines.append("-- slowest cases: " + ", ".join(f"{n} {t:.1f} s" for t, n in slow))
    exceptions = sorted(
        {
            (r["name"], r[(t, m)][1])
            for r in results
            if r["baseline"] is None
            for t in targets
            for m in modes
            if r[(t, m)][0] == "exception"
        }
    )
    if exceptions:
        lines.append("-- exceptions (listed in tools/conformance.py EXCEPTIONS):")
        lines += [f"   {n}: {d}" for n, d in exceptions]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", choices=TARGETS, action="append")
    parser.add_argument("--mode", choices=MODES, action="append")
    parser.add_argument("-j", "--jobs", type=int, default=None)
    parser.add_argument("-k", "--filter", default=None, help="regular expression on case names")
    parser.add_argument("--show-float32", action="store_true", help="list the reasons of cases left float32")
    args = parser.parse_args(argv)
    targets = tuple(args.target or TARGETS)
    modes = tuple(args.mode or MODES)
    started = time.perf_counter()
    cases = load_cases()
    if args.filter:
        cases = [c for c in cases if re.search(args.filter, c[0])]
    loaded = time.perf_counter() - started
    results = run(cases, targets, modes, args.jobs)
    print(summary_text(results, targets, modes, show_float32=args.show_float32))
    print(
        f"time: {time.perf_counter() - started:.1f} s ({loaded:.1f} s loading the cases), jobs {args.jobs or os.cpu_count()}"
    )
    failing = sum(c["failing"] for c in counts(results, targets, modes).values())
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
