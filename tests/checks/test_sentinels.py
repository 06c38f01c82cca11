"""Calibration and mask sentinels: finfo(float32).min in an attention mask is not overflow.

The model is the dynamo exports' attention (GPT-2, BERT, ViT): scores = q k^T / sqrt(d), a mask
`Where(keep, 0, -3.4028235e38)` added to them, Softmax, and optionally the exports' guard of fully
masked rows, `Where(IsNaN(p), 0, p)`. float32 absorbs the sentinel (s + -3.4e38 == -3.4e38), so
every masked score holds it too; measured as a value, it pinned the Add and the Softmax float32.
Numbers are checked under ONNX Runtime and onnx.reference (float16 arithmetic).
"""

import numpy as np
import pytest

from amp_rewrite import driver, rewrite
from amp_rewrite.checks import calibrate
from amp_rewrite.checks import fallback as accuracy
from helpers import assert_close, init, make_model, node, run_ort, run_reference, tensor

F32 = np.float32
MIN = np.finfo(F32).min
B, S, D = 2, 8, 16


def attention(fill=MIN, guard=False, seed=0):
    """x [B,S,D], keep [B,1,S,S] (bool) -> y [B,S,D]: one attention head with an additive mask."""
    rng = np.random.default_rng(seed)
    inits = [init(f"W{n}", (rng.standard_normal((D, D)) * 0.3).astype(F32)) for n in "qkvo"]
    inits += [
        init("scale", np.array(D**-0.5, F32)),
        init("zero", np.array(0.0, F32)),
        init("fill", np.array(fill, F32)),
    ]
    nodes = [
        node("MatMul", ["x", "Wq"], ["q"], name="q"),
        node("MatMul", ["x", "Wk"], ["k"], name="k"),
        node("MatMul", ["x", "Wv"], ["v"], name="v"),
        node("Transpose", ["k"], ["kt"], name="kt", perm=[0, 2, 1]),
        node("MatMul", ["q", "kt"], ["qk"], name="scores"),
        node("Mul", ["qk", "scale"], ["s"], name="scaled"),
        node("Unsqueeze", ["s", "one"], ["s4"], name="heads"),
        node("Where", ["keep", "zero", "fill"], ["mask"], name="mask"),
        node("Add", ["s4", "mask"], ["masked"], name="add_mask"),
        node("Softmax", ["masked"], ["p"], name="softmax", axis=-1),
    ]
    probs = "p"
    if guard:
        nodes += [
            node("IsNaN", ["p"], ["nan"], name="isnan"),
            node("Where", ["nan", "zero", "p"], ["pg"], name="guard"),
        ]
        probs = "pg"
    nodes += [
        node("Squeeze", [probs, "one"], ["p3"], name="unheads"),
        node("MatMul", ["p3", "v"], ["ctx"], name="context"),
        node("MatMul", ["ctx", "Wo"], ["y"], name="out"),
    ]
    inits.append(init("one", np.array([1], np.int64)))
    return make_model(
        nodes, [tensor("x", [B, S, D]), tensor("keep", [B, 1, S, S], 9)], [tensor("y", [B, S, D])], inits
    )


def samples(count=2, full_row=False, seed=1):
    """Causal masks (every query sees itself: no row fully masked); `full_row`: sample 0's
    first query of batch 0 sees no key."""
    rng = np.random.default_rng(seed)
    causal = np.tril(np.ones((S, S), bool))
    out = []
    for i in range(count):
        keep = np.broadcast_to(causal, (B, 1, S, S)).copy()
        if full_row and i == 0:
            keep[0, 0, 0, :] = False
        out.append({"x": rng.standard_normal((B, S, D)).astype(F32), "keep": keep})
    return out


def precision(result, name):
    return result.report.node(name)["precision"]


def assert_matches(original, rewritten, feeds, rtol=1e-2, atol=1e-2):
    for f in feeds:
        expected = run_ort(original, f)
        for got in (run_ort(rewritten, f), run_reference(rewritten, f)):
            assert np.isfinite(got[0]).all()
            assert_close(got, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("guard", [False, True])
def test_mask_sentinel_is_not_overflow_add_and_softmax_go_float16(guard):
    model, feeds = attention(guard=guard), samples()
    cal = calibrate.calibrate(model, feeds)
    assert cal.culprits() == [] and cal.force_fp32() == {}
    held = {r.name: r for r in cal.with_sentinels()}
    assert set(held) == {"mask", "masked"}  # the Where's output, and absorbed in the sum
    assert held["mask"].sentinels == 2 * B * S * (S - 1) // 2 and held["mask"].sentinel_rows == 0
    assert held["mask"].max_abs == 0.0 and held["masked"].max_abs < 10  # the scores, not the sentinel
    result = rewrite(model, calibration=cal)
    assert precision(result, "add_mask") == precision(result, "softmax") == "float16"
    assert (
        precision(result, "mask") == "float16"
    )  # its sentinel constant is -65504 in float16 (weights.SENTINEL)
    plain = rewrite(model)  # calibration no longer changes anything here
    assert result.model.SerializeToString() == plain.model.SerializeToString()
    assert_matches(model, result.model, feeds + samples(seed=7))
    section = cal.to_dict()
    assert [s["tensor"] for s in section["sentinels"]] == ["mask", "masked"]
    assert section["sentinels"][1]["sentinels"] == held["masked"].sentinels
    text = cal.to_text()
    assert "sentinels (+-3.4028235e+38, not overflow) in 2 tensor(s)" in text and "'masked' from Add" in text


def test_a_large_value_that_is_not_a_sentinel_still_overflows():
    model, feeds = attention(fill=-1e6), samples()
    cal = calibrate.calibrate(model, feeds)
    assert {r.name for r in cal.culprits()} == {"mask", "masked"} and not cal.with_sentinels()
    result = rewrite(model, calibration=cal)
    assert precision(result, "add_mask") == precision(result, "softmax") == "float32"
    assert "'masked' reaches 1e+06" in cal.force_fp32()["add_mask"]
    assert_matches(model, result.model, feeds)
    # a value one float32 step below the sentinel is a value too
    near = np.nextafter(MIN, F32(0))
    cal = calibrate.calibrate(attention(fill=near), feeds)
    assert {r.name for r in cal.culprits()} == {"mask", "masked"} and not cal.with_sentinels()


@pytest.mark.parametrize("guard", [False, True])
def test_fully_masked_row_keeps_its_add_and_softmax_float32(guard):
    """float32 subtracts equal sentinels: the fully masked row is uniform (and the guard passes it).
    Without data the sentinel constant is float16's -65504 (not -inf, whose -inf - -inf is NaN):
    the row stays finite; calibration sees the row and keeps it float32, exactly as float32."""
    model, feeds = attention(guard=guard), samples(full_row=True)
    plain = rewrite(model)
    assert any("become +-65504" in note for note in plain.report.notes)
    expected = run_ort(model, feeds[0])[0]
    assert np.isfinite(expected).all()
    for got in (run_reference(plain.model, feeds[0])[0], run_ort(plain.model, feeds[0])[0]):
        assert np.isfinite(got).all()

    cal = calibrate.calibrate(model, feeds)
    rows = {r.name: r.sentinel_rows for r in cal.with_sentinels()}
    assert rows == {"mask": 1, "masked": 1}
    forced = cal.force_fp32()
    assert set(forced) >= {"mask", "add_mask", "softmax"} and "row(s) of only" in forced["softmax"]
    result = rewrite(model, calibration=cal)
    assert precision(result, "add_mask") == precision(result, "softmax") == "float32"
    assert precision(result, "scores") == precision(result, "context") == "float16"
    assert_matches(model, result.model, feeds)
    assert "1 row(s) of only sentinels: kept float32" in cal.to_text()


def test_check_validates_and_the_fallback_does_not_blame_the_mask():
    """calibrate -> rewrite -> validate passes; the fallback's per-tensor error takes float16's -inf
    for float32's sentinel, so it has nothing to pin."""
    model, feeds = attention(guard=True), samples()
    checked = driver.check(model, samples=feeds, calibrate=True, validate=True, reference=True)
    assert checked.passed, checked.validation.to_text()
    assert checked.result.report.node("softmax")["precision"] == "float16"
    assert [s["tensor"] for s in checked.result.report.to_dict()["calibration"]["sentinels"]] == [
        "mask",
        "masked",
    ]
    assert (
        "2 tensor(s) held +-finfo(float32).max sentinels, not counted as overflow: 'mask', 'masked'"
        in checked.result.report.to_text()
    )
    # a tolerance float16 cannot meet: the fallback pins where rounding enters, never the masked sum
    fitted = driver.check(
        model, samples=feeds, calibrate=True, tolerance=True, reference=True, rtol=1e-6, atol=1e-7, max_runs=3
    )
    # (k grows fast enough to reach every node the ranking blames within max_runs: the second
    # search pins all of them, so the first pin is the one that shows the ranking)
    pinned = fitted.fallback.pinned
    first = [key for key, why in pinned.items() if "(run 1)" in why]
    assert len(first) == 1 and not {"add_mask", "softmax"} & set(first), pinned
    assert len(pinned) >= 3 and "add_mask" not in pinned, pinned
    ref = [np.array([[1.0, MIN, MIN]], F32)]
    assert accuracy._rel_error(ref, [np.array([[1.0, -np.inf, -65504.0]], np.float16)]) == 0.0
    assert accuracy._rel_error(ref, [np.array([[1.0, np.inf, -1.0]], np.float16)]) == accuracy.HUGE


def _expected(arrays, flush):
    """The figures of calibrate._accumulate, value by value in plain Python/numpy."""
    big = float(np.finfo(F32).max)
    out = {
        "count": 0,
        "nonfinite": 0,
        "sentinels": 0,
        "sentinel_rows": 0,
        "max_abs": 0.0,
        "nonzero": 0,
        "flushed": 0,
    }
    for a in arrays:
        flat = np.abs(a.astype(np.float64)).ravel()
        out["count"] += flat.size
        for value in flat:
            if not np.isfinite(value):
                out["nonfinite"] += 1
            elif value == big:
                out["sentinels"] += 1
            else:
                out["max_abs"] = max(out["max_abs"], value)
                out["nonzero"] += value > 0
                out["flushed"] += 0 < value < flush
        for row in np.abs(a.astype(np.float64)).reshape(-1, a.shape[-1] if a.ndim else 1):
            special = [v == big or np.isinf(v) for v in row]
            out["sentinel_rows"] += all(special) and any(v == big for v in row)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_accumulate_matches_numpy(seed):
    rng = np.random.default_rng(seed)
    flush = calibrate.FLUSH["float16"]
    shapes = [(3, 5), (4,), (), (2, 3, 4)]
    arrays = []
    for shape in shapes[: 1 + seed % 4]:
        a = np.asarray(rng.standard_normal(shape) * 10.0 ** rng.integers(-9, 6, shape)).astype(F32)
        specials = np.array([MIN, -MIN, np.inf, -np.inf, np.nan, 1e-9, 0.0, 7e4], F32)
        pick = rng.random(a.shape) < 0.3
        a[pick] = rng.choice(specials, int(pick.sum()))
        if a.ndim > 1:
            a[0] = MIN  # a whole row of sentinels
            a.reshape(-1, a.shape[-1])[-1] = np.where(rng.random(a.shape[-1]) < 0.5, -np.inf, MIN)
        arrays.append(a)
    r = calibrate.TensorRange("t", None, None)
    for a in arrays:
        calibrate._accumulate(r, a, flush)
    want = _expected(arrays, flush)
    got = {k: getattr(r, k) for k in want}
    assert got == pytest.approx(want)
    assert r.max_abs < float(np.finfo(F32).max)
    # measured together (calibration's pass over a sample): each tensor's figures as on its own
    clean = [np.where(np.abs(a) == float(np.finfo(F32).max), F32(3.0), a) for a in arrays]
    for chunk in (1 << 22, 7):
        calibrate.CHUNK, saved = chunk, calibrate.CHUNK
        try:
            together = [calibrate.TensorRange(str(i), None, None) for i in range(2 * len(arrays))]
            calibrate._accumulate_all(together, [*arrays, *clean], flush)
        finally:
            calibrate.CHUNK = saved
        for r_all, a in zip(together, [*arrays, *clean]):
            alone = calibrate.TensorRange("t", None, None)
            calibrate._accumulate(alone, a, flush)
            assert {k: getattr(r_all, k) for k in want} == {k: getattr(alone, k) for k in want}
