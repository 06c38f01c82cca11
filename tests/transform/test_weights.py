"""Constant conversion: ORT's float16 cast bit for bit against numpy, range checks by chunks,
out-of-range constants (and --clamp), many-chunk weights converted once.
"""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import amp_rewrite
from helpers import (
    big_weights_model,
    check_both,
    init,
    make_model,
    node,
    tensor,
    weights,
)

F16 = TensorProto.FLOAT16


def test_onnxruntime_float16_cast_matches_numpy_bit_for_bit():
    from amp_rewrite.io import tensordata as weights

    rng = np.random.default_rng(0)
    patterns = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    near_range = np.arange(0x33000000, 0x47800000, 9973, dtype=np.uint32)  # subnormals .. past 65504
    special = np.array(
        [
            0,
            0x80000000,
            0x7F800000,
            0xFF800000,
            0x7FC00000,
            0x477FE000,
            0x477FEFFF,
            0x477FF000,
            0x387FC000,
            0x33000001,
        ],
        dtype=np.uint32,
    )  # ties, overflow, tiny
    values = np.concatenate([patterns, near_range, near_range | 0x80000000, special]).view(np.float32)
    assert values.size >= weights.ORT_CAST_MIN_VALUES and weights._ort_float16_cast() is not None
    with np.errstate(over="ignore"):
        ours, reference = weights.cast_values(values, F16), values.astype(np.float16)
    nan = np.isnan(reference)
    assert ours.dtype == np.float16 and (np.isnan(ours) == nan).all()
    assert (ours.view(np.uint16)[~nan] == reference.view(np.uint16)[~nan]).all()


def test_rewrite_is_the_same_with_numpy_doing_the_casts(monkeypatch):
    from amp_rewrite.io import tensordata as weights

    model = big_weights_model()
    fast = amp_rewrite.rewrite(model).model.SerializeToString()
    monkeypatch.setattr(weights, "_ort_float16_cast", lambda: None)
    assert amp_rewrite.rewrite(model).model.SerializeToString() == fast


def test_out_of_range_constant_keeps_consumer_float32_unless_clamped():
    rng = np.random.default_rng(0)
    model = make_model(
        [
            node("MatMul", ["x", "W"], ["h"], "mm"),
            node("Add", ["h", "big"], ["a"], "add_big"),
            node("Relu", ["a"], ["r"], "relu"),
            node("MatMul", ["r", "W"], ["y"], "mm2"),
        ],
        [tensor("x", [2, 4])],
        [tensor("y", [2, 4])],
        [init("W", weights(rng, 4, 4)), init("big", np.array([0, -1e9, 0, 0], np.float32))],
    )
    result = amp_rewrite.rewrite(model)
    entry = result.report.node("add_big")
    assert entry["precision"] == "float32"
    assert "outside the float16 range" in entry["groups"]["T"]["reason"]
    assert {t.name: t.data_type for t in result.model.graph.initializer}["big"] == TensorProto.FLOAT
    check_both(model, result.model, rtol=2e-2, atol=1e9 * 1e-3)
    clamped = amp_rewrite.rewrite(model, clamp=True)
    assert clamped.report.node("add_big")["precision"] == "float16"
    assert clamped.report.summary["values_clamped"] == 1


def test_range_check_by_chunks_names_exactly_the_tensors_out_of_range():
    from amp_rewrite import ir
    from amp_rewrite.transform import weights

    rng = np.random.default_rng(1)
    tensors = [init(f"w{i}", rng.standard_normal(1000).astype(np.float32)) for i in range(700)]  # ~3 chunks
    for i, value in ((3, 7e4), (400, -1e9), (699, np.inf)):  # inf is representable: not out of range
        array = onnx.numpy_helper.to_array(tensors[i]).copy()
        array[17] = value
        tensors[i].CopyFrom(onnx.numpy_helper.from_array(array, f"w{i}"))
    g = helper.make_graph([], "g", [], [], tensors)
    scopes = ir.read_scopes(g)
    scan = weights.scan(scopes, {}, "float16", convert_to=F16)
    assert scan.out_of_range == {(0, "w3"): 7e4, (0, "w400"): 1e9}
    values = {t.name: onnx.numpy_helper.to_array(t).reshape(-1) for t in tensors}
    assert set(scan.converted) == {(0, name) for name in values} - {(0, "w3"), (0, "w400")}
    for (_, name), (converted, clamped) in scan.converted.items():  # converted a chunk at a time
        assert clamped == 0 and converted == values[name].astype(np.float16).tobytes(), name
    clamped = weights.scan(scopes, {}, "float16", clamp=True, convert_to=F16)
    assert not clamped.out_of_range and len(clamped.converted) == 700
    assert [(name, n) for (_, name), (_, n) in clamped.converted.items() if n] == [("w3", 1), ("w400", 1)]
    assert np.frombuffer(clamped.converted[(0, "w400")][0], np.float16)[17] == np.float16(-65504)


def test_scan_notes_each_constants_reach_where_every_value_is_finite():
    """The reach of each float32 constant (its largest |value|) comes from the same read as the
    range check, chunk by chunk: what the range evidence bounds a big table's Gather by."""
    from amp_rewrite import ir
    from amp_rewrite.transform import weights

    rng = np.random.default_rng(2)
    arrays = {
        f"w{i}": rng.standard_normal(1000).astype(np.float32) * (i + 1) for i in range(600)
    }  # ~3 chunks
    arrays["empty"] = np.zeros(0, np.float32)
    arrays["w5"][3], arrays["w9"][4], arrays["w11"][5] = np.inf, np.nan, -7e4
    g = helper.make_graph([], "g", [], [], [init(name, a) for name, a in arrays.items()])
    for clamp in (False, True):
        scan = weights.scan(ir.read_scopes(g), {}, "float16", clamp=clamp, convert_to=F16)
        expected = {
            (0, name): float(np.abs(a).max()) for name, a in arrays.items() if a.size and np.isfinite(a).all()
        }
        assert scan.reach == expected  # not w5 (inf), w9 (nan), nor the empty one
        assert scan.reach[(0, "w11")] == 7e4


def test_weights_over_many_chunks_convert_once_and_run_the_same():
    """4 MB of weights (several scan chunks), one bias out of range in a late chunk: its reader
    stays float32, every other weight is converted once, and both models agree in ONNX Runtime."""
    from amp_rewrite.transform import weights

    rng = np.random.default_rng(3)
    nodes, inits, h = [], [], "x"
    for i in range(64):
        bias = (rng.standard_normal(128) * 0.1).astype(np.float32)
        if i == 50:
            bias[7] = 1e5
        inits += [
            init(f"W{i}", (rng.standard_normal((128, 128)) / 16).astype(np.float32)),
            init(f"b{i}", bias),
        ]
        nodes += [
            node("MatMul", [h, f"W{i}"], [f"m{i}"], f"mm{i}"),
            node("Add", [f"m{i}", f"b{i}"], [f"a{i}"], f"add{i}"),
            node("Tanh", [f"a{i}"], [f"h{i}"], f"tanh{i}"),
        ]
        h = f"h{i}"
    model = make_model(nodes, [tensor("x", [2, 128])], [tensor(h, [2, 128])], inits)
    assert 64 * 128 * 128 * 4 > 3 * weights.CHUNK_BYTES
    result = amp_rewrite.rewrite(model)
    assert result.report.node("add50")["precision"] == "float32"
    assert (
        result.report.node("add49")["precision"] == "float16"
        and result.report.node("mm50")["precision"] == "float16"
    )
    converted = {t.name for t in result.model.graph.initializer if t.data_type == F16}
    # every bias whose Add is float16 is converted once: all but b50 (b63's Add, before the float32
    # output, goes either way by the cut's byte count)
    low_adds = {f"b{i}" for i in range(64) if result.report.node(f"add{i}")["precision"] == "float16"}
    assert low_adds >= {f"b{i}" for i in range(63)} - {"b50"}
    assert converted == {f"W{i}" for i in range(64)} | low_adds
    assert result.report.summary["constants_converted"] == len(converted)
    assert result.report.summary["constants_duplicated"] == 0
    check_both(model, result.model, rtol=5e-2, atol=5e-2)


def test_mask_sentinel_constant_becomes_float16s_largest_and_zero_times_it_stays_zero():
    """BERT's additive mask, (1 - m) * finfo(float32).min: the constant's only out-of-range values
    are float32's largest, so it is -65504 in float16 and the Mul goes low; a kept position is
    0 x -65504 = 0 (with -inf it would be NaN). A constant holding 1e6 as well keeps its reader."""
    rng = np.random.default_rng(5)
    model = make_model(
        [
            node("MatMul", ["x", "W"], ["s"], "scores"),
            node("Sub", ["one", "m"], ["inv"], "inv"),
            node("Mul", ["inv", "fill"], ["mask"], "mask"),
            node("Add", ["s", "mask"], ["masked"], "add"),
            node("Softmax", ["masked"], ["p"], "softmax", axis=-1),
            node("MatMul", ["p", "V"], ["y"], "out"),
            node("Mul", ["x", "other"], ["o"], "other_mul"),
        ],
        [tensor("x", [2, 8]), tensor("m", [2, 8])],
        [tensor("y", [2, 4]), tensor("o", [2, 8])],
        [
            init("W", weights(rng, 8, 8)),
            init("V", weights(rng, 8, 4)),
            init("one", np.array(1.0, np.float32)),
            init("fill", np.array(np.finfo(np.float32).min, np.float32)),
            init("other", np.array([np.finfo(np.float32).max, 1e6, np.inf, 1, 1, 1, 1, 1], np.float32)),
        ],
    )
    result = amp_rewrite.rewrite(model)
    assert result.report.node("mask")["precision"] == "float16"
    assert result.report.node("other_mul")["precision"] == "float32"  # 1e6 is a value, not a sentinel
    fill = next(t for t in result.model.graph.initializer if t.name == "fill")
    assert numpy_helper.to_array(fill) == np.float16(-65504)
    feeds = {
        "x": rng.standard_normal((2, 8)).astype(np.float32),
        "m": (rng.random((2, 8)) > 0.3).astype(np.float32),
    }
    feeds["m"][:, 0] = 1  # every row keeps a key
    check_both(model, result.model, feeds)
