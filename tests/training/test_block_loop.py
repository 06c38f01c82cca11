"""The C loop of the host update (training/_blocks.c through block_loop.py) against numpy: each op
bit for bit on special values, in place, over partial blocks; bad programs refused with a
ValueError, never a crash."""

from __future__ import annotations

import numpy as np
import pytest

from amp_rewrite.training import block_loop

pytestmark = pytest.mark.skipif(not block_loop.AVAILABLE, reason="the optional C extension is not built")

SIZE = 2500  # two whole 1024-element blocks and a partial one
BINARY = [np.add, np.subtract, np.multiply, np.divide]
UNARY = [np.sqrt, np.negative, np.absolute, np.reciprocal, None]  # None: Identity's copy
SPECIAL = np.array(
    [0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1e-38, 3.4e38, -3.4e38, 0.1, 7.0],
    np.float32,
)


def _values(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    with np.errstate(over="ignore"):  # beyond float32's range: infinities, wanted
        values = (rng.standard_normal(SIZE) * 10.0 ** rng.integers(-40, 39, SIZE)).astype(np.float32)
    values[rng.choice(SIZE, 200, replace=False)] = rng.choice(SPECIAL, 200)
    return values


def _same(got: np.ndarray, expected: np.ndarray) -> bool:
    """Equal bits, NaN for NaN (a NaN's payload is not a result)."""
    nan = np.isnan(expected)
    return bool(np.array_equal(np.isnan(got), nan) and got[~nan].tobytes() == expected[~nan].tobytes())


def _run(function, names, arrays, holders=(), buffers=None):
    program = block_loop.program(
        [(function, names, "out")], buffers or {}, {n: arrays[n] for n in holders}, arrays, SIZE
    )
    assert program is not None
    block_loop.run(program)


@pytest.mark.parametrize("function", BINARY, ids=lambda f: f.__name__)
@pytest.mark.parametrize("scalar", [None, "a", "b"])
def test_binary_ops_equal_numpy(function, scalar):
    arrays = {"a": _values(1), "b": _values(2), "out": np.empty(SIZE, np.float32)}
    holders = ()
    if scalar:
        arrays[scalar] = np.array(arrays[scalar][7], np.float32)
        holders = (scalar,)
    with np.errstate(all="ignore"):
        expected = function(arrays["a"], arrays["b"])
    _run(function, ["a", "b"], arrays, holders)
    assert _same(arrays["out"], expected)


@pytest.mark.parametrize("function", UNARY, ids=lambda f: getattr(f, "__name__", "copy"))
def test_unary_ops_equal_numpy(function):
    arrays = {"a": _values(3), "out": np.empty(SIZE, np.float32)}
    with np.errstate(all="ignore"):
        expected = arrays["a"].copy() if function is None else function(arrays["a"])
    _run(function, ["a"], arrays)
    assert _same(arrays["out"], expected)


def test_a_chain_in_place_with_a_scratch_buffer():
    """m = m * b1 + g * c (m updated in place), the product through a scratch buffer: AdamW's
    first moment, as host_update.py lays it out."""
    m, g = _values(4), _values(5)
    b1, c = np.array(0.9, np.float32), np.array(0.1, np.float32)
    with np.errstate(all="ignore"):
        expected = m * b1 + g * c
    ops = [
        (np.multiply, ["m", "b1"], "m_decayed"),
        (np.multiply, ["g", "c"], "part"),
        (np.add, ["m_decayed", "part"], "m_next"),
    ]
    buffers = {"m_decayed": ("array", "m"), "part": ("scratch", 0), "m_next": ("array", "m")}
    program = block_loop.program(ops, buffers, {"b1": b1, "c": c}, {"m": m, "g": g}, SIZE)
    block_loop.run(program)
    assert _same(m, expected)


def test_weights_of_one_shape_update_one_after_the_other():
    """A chain holding 40 weights of one shape (w = w * d - g * c each, a scratch buffer reused
    by all): one C call per weight, over more slots than any fixed table, each result numpy's."""
    d, c = np.array(0.999, np.float32), np.array(0.01, np.float32)
    env, ops, buffers, expected = {}, [], {}, {}
    for k in range(40):
        w, g = f"w{k}", f"g{k}"
        env[w], env[g] = _values(10 + k), _values(100 + k)
        with np.errstate(all="ignore"):
            expected[w] = env[w] * d - env[g] * c
        ops += [(np.multiply, [w, "d"], f"{w}/decayed"), (np.multiply, [g, "c"], f"{w}/step")]
        ops += [(np.subtract, [f"{w}/decayed", f"{w}/step"], f"{w}/next")]
        buffers.update({f"{w}/decayed": ("array", w), f"{w}/step": ("scratch", 0), f"{w}/next": ("array", w)})
    calls = block_loop.program(ops, buffers, {"d": d, "c": c}, env, SIZE)
    assert len(calls) == 40
    block_loop.run(calls)
    assert all(_same(env[w], expected[w]) for w in expected)


def test_what_the_loop_cannot_run_is_left_to_numpy():
    arrays = {"a": np.ones(SIZE, np.float64), "out": np.empty(SIZE, np.float32)}
    assert block_loop.program([(np.negative, ["a"], "out")], {}, {}, arrays, SIZE) is None  # float64
    arrays["a"] = np.ones(SIZE, np.float32)
    assert block_loop.program([(np.power, ["a", "a"], "out")], {}, {}, arrays, SIZE) is None  # no opcode
    assert block_loop.program([(np.negative, ["a"], "out")], {}, {}, arrays, SIZE + 1) is None  # too short


def _raw(rows, operands, kinds, size=SIZE):
    return (np.array(rows, np.int32).tobytes(), tuple(operands), np.array(kinds, np.int32).tobytes(), size)


@pytest.mark.parametrize(
    "case",
    [
        _raw([(1, 2, 0, 7)], [np.ones(SIZE, np.float32)] * 3, [0, 0, 0]),  # a slot out of range
        _raw([(1, 2, 0, -1)], [np.ones(SIZE, np.float32)] * 3, [0, 0, 0]),  # Add without its b
        _raw([(99, 1, 0, -1)], [np.ones(SIZE, np.float32)] * 2, [0, 0]),  # no such op
        _raw([(6, 1, 0, -1)], [np.ones(SIZE, np.float32), np.ones(1, np.float32)], [0, 1]),  # into a scalar
        _raw([(6, 1, 0, -1)], [np.ones(SIZE, np.float64), np.ones(SIZE, np.float32)], [0, 0]),  # float64
        _raw([(6, 1, 0, -1)], [np.ones(10, np.float32), np.ones(SIZE, np.float32)], [0, 0]),  # too short
        _raw([(6, 1, 0, -1)], [np.ones(SIZE, np.float32), np.ones(SIZE, np.float32)[::-1]], [0, 0]),
        _raw(
            [(6, 1, 0, -1)], [np.ones(SIZE, np.float32), np.frombuffer(bytes(4 * SIZE), np.float32)], [0, 0]
        ),
        _raw([(6, 1, 0, -1)], [np.ones(SIZE, np.float32)] * 2, [0]),  # a kind short
        _raw([(6, 1, 0, -1)], [np.ones(SIZE, np.float32)] * 2, [0, 5]),  # no such kind
        # 4 * size wraps to 16 bytes in 64 bits: a length check that multiplies lets it through
        _raw([(6, 1, 0, -1)], [np.ones(4, np.float32)] * 2, [0, 0], size=2**62 + 4),
    ],
    ids="slot unary-add opcode to-scalar float64 short strided read-only kinds kind-5 size-overflow".split(),
)
def test_a_malformed_program_is_refused(case):
    with pytest.raises(ValueError):
        block_loop.run((case,))
