"""`--validate`'s judgement of one output: the rewritten model's values against the float32
original's, relative to the output's own scale (`compare`), and the figures it shows.

The rule (README, "Trust the result"): an output is judged against its own scale, never by one
element alone. A healthy float16 model on float16 hardware is off by about 1.5e-3 of its output's
RMS (BERT-base, GPT-2, ResNet-50, ViT-B/16 on an H200, every float16 converter alike), and its
largest error about 2e-3 of its largest value: relative to a value near zero that is a max rel of
3-6, so max rel is shown, not judged. What a broken rewrite does is caught: a NaN or inf where
float32 is finite (overflow), an error of a sizable share of the output (a wrong cast, a denied op
forced low), one far off its scale anywhere (LOCAL x rtol of the largest value), or a class-score
row whose top-1 changes although no error within the tolerance could swap them.
"""

from __future__ import annotations

import numpy as np

from amp_rewrite.runtime import BFLOAT16

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
    for r, c in zip(ref, cand):  # float32 views, no float64 copies: a GPT-2 batch's logits are 51M values
        r2 = np.nan_to_num(r.reshape(-1, r.shape[-1]).astype(np.float32, copy=False), nan=-np.inf)
        c2 = np.nan_to_num(c.reshape(-1, c.shape[-1]).astype(np.float32, copy=False), nan=-np.inf)
        r_top, c_top = r2.argmax(-1), c2.argmax(-1)
        changed = np.flatnonzero(r_top != c_top)
        if changed.size:
            rows = r2[changed].astype(np.float64)
            at = np.arange(changed.size)
            margin = rows[at, r_top[changed]] - rows[at, c_top[changed]]
            with np.errstate(invalid="ignore"):
                scale = np.max(np.where(np.isfinite(rows), np.abs(rows), 0.0), axis=-1)
                flips += int(np.sum(margin > 2 * (atol + rtol * scale)))
        agree += r2.shape[0] - changed.size
        total += r2.shape[0]
    return (agree / total if total else None), flips
