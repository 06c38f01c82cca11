"""Issue 40, item 1: a float16 model holds half the float32 weights, embedding tables included.

BERT-base and GPT-2 exports are over the range run's work budget, so nothing is measured there:
their embedding Gathers, the sums and the LayerNormalization after them (low by cost placement,
float32 by TF's rule) need a data-free bound, or they stay float32 and keep the tables float32
(GPT-2's tied table twice: float32 for its Gather, a float16 copy for the LM head). The tests
force that budget on small models built here (tools/synthetic.language_model), compare the size
and casts with onnxconverter-common's float16 converter and run all three models in ONNX Runtime.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from amp_rewrite import rewrite
from amp_rewrite.transform import range_run
from helpers import check_both, init, make_model, node, run_ort, tensor

float16 = pytest.importorskip("onnxconverter_common.float16")


def _casts(model: onnx.ModelProto) -> int:
    return sum(n.op_type == "Cast" for n in model.graph.node)


@pytest.fixture
def over_budget(monkeypatch):
    """Every model is over the range run's budget, as BERT-base (414 MiB) and GPT-2 are."""
    monkeypatch.setattr(range_run, "RANGE_CHECK_BYTES", 0)


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_language_model_is_as_small_as_onnxconverter_commons(synthetic, over_budget, kind):
    model = synthetic.language_model(kind)
    result = rewrite(model)
    theirs = float16.convert_float_to_float16(model, keep_io_types=True)
    ours = len(result.model.SerializeToString())
    assert ours <= 1.01 * len(theirs.SerializeToString()), (ours, len(theirs.SerializeToString()))
    assert ours <= 0.51 * len(model.SerializeToString())
    assert _casts(result.model) <= _casts(theirs)
    tables = {t.name: t.data_type for t in result.model.graph.initializer if t.name.startswith("wt")}
    assert set(tables.values()) == {TensorProto.FLOAT16}, tables  # each table once, in float16
    assert len([t for t in result.model.graph.initializer if t.dims[:] == [2000, 64]]) == 1
    feeds = synthetic.language_feeds(model)
    expected = check_both(model, result.model, feeds)
    # no loss of accuracy against the converter people use
    error = np.abs(run_ort(result.model, feeds)[0] - expected[0]).max()
    assert error <= np.abs(run_ort(theirs, feeds)[0] - expected[0]).max() * 1.5 + 1e-4


def _table_norm_model(scale: float):
    """Gather (a 1000 x 64 table) -> LayerNormalization (scale, bias 0.5) -> Pow 2 (deny), and a
    MatMul apart: the Gather and the LayerNormalization are low only by cost placement."""
    rng = np.random.default_rng(0)
    return make_model(
        [
            node("Gather", ["table", "ids"], ["e"], "gather"),
            node("LayerNormalization", ["e", "scale", "bias"], ["n"], "ln", axis=-1),
            node("Pow", ["n", "two"], ["y"], "pow"),
            node("MatMul", ["x", "W"], ["h"], "mm"),
        ],
        [tensor("ids", ["N"], TensorProto.INT64), tensor("x", ["N", 64])],
        [tensor("y", ["N", 64]), tensor("h", ["N", 64])],
        [
            init("table", (rng.standard_normal((1000, 64)) * 0.1).astype(np.float32)),
            init("two", np.array(2.0, np.float32)),
            init("scale", np.full(64, scale, np.float32)),
            init("bias", np.full(64, 0.5, np.float32)),
            init("W", (rng.standard_normal((64, 64)) * 0.1).astype(np.float32)),
        ],
    )


@pytest.mark.parametrize("scale, low", [(0.1, True), (5000.0, False)])
def test_layer_norm_is_bounded_by_its_scale_and_bias(over_budget, scale, low):
    """|y| <= sqrt(64 - 1) x |scale| + |bias|: 1.3 with scale 0.1 (low), 39686 with 5000 (over
    65504 / 4: no evidence, float32); the Gather is low either way (its table's reach is 0.4)."""
    model = _table_norm_model(scale)
    result = rewrite(model)
    assert result.report.node("gather")["precision"] == "float16"
    ln = result.report.node("ln")
    assert ln["precision"] == ("float16" if low else "float32"), ln
    if not low:
        assert "no range evidence" in str(ln["groups"])
    rng = np.random.default_rng(1)
    feeds = {"ids": np.array([0, 7, 999, 7], np.int64), "x": rng.standard_normal((4, 64)).astype(np.float32)}
    expected = run_ort(model, feeds)  # y reaches (sqrt(63) x scale)^2: errors relative to scale^2
    for got, want in zip(run_ort(result.model, feeds), expected):
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * max(1.0, scale) ** 2)


def test_a_table_whose_values_overflow_float16_keeps_its_gather_float32(synthetic, over_budget):
    """The table's reach is the constant scan's: a value beyond 65504 is no bound."""
    model = synthetic.language_model("bert")
    table = next(t for t in model.graph.initializer if t.name == "wte")
    values = onnx.numpy_helper.to_array(table).copy()
    values[3, 5] = 1e6
    table.CopyFrom(onnx.numpy_helper.from_array(values, "wte"))
    result = rewrite(model)
    assert result.report.node("embed/wte")["precision"] == "float32"
    assert next(t for t in result.model.graph.initializer if t.name == "wte").data_type == TensorProto.FLOAT


def test_a_region_without_an_allow_op_stays_low_when_its_table_pays():
    """Gather -> Exp (deny): the Gather's region has no allow op (TF would drop it), but its
    1000 x 64 table halves while its one cast moves 6 bytes per gathered value."""
    rng = np.random.default_rng(0)
    model = make_model(
        [
            node("Gather", ["table", "ids"], ["e"], "gather"),
            node("Exp", ["e"], ["y"], "exp"),
            node("MatMul", ["x", "W"], ["h"], "mm"),
        ],
        [tensor("ids", ["N"], TensorProto.INT64), tensor("x", ["N", 64])],
        [tensor("y", ["N", 64]), tensor("h", ["N", 64])],
        [
            init("table", (rng.standard_normal((1000, 64)) * 0.1).astype(np.float32)),
            init("W", (rng.standard_normal((64, 64)) * 0.1).astype(np.float32)),
        ],
    )
    result = rewrite(model)
    assert result.report.node("gather")["precision"] == "float16"
    assert result.report.node("exp")["precision"] == "float32"
    feeds = {"ids": np.array([0, 7, 999, 7], np.int64), "x": rng.standard_normal((4, 64)).astype(np.float32)}
    check_both(model, result.model, feeds)
    # a 2 x 64 table saves 256 bytes, less than the cast of a row (64 values, 6 bytes each)
    model.graph.initializer[0].CopyFrom(init("table", np.full((2, 64), 0.5, np.float32)))
    small = rewrite(model)
    assert small.report.node("gather")["precision"] == "float32"
    check_both(model, small.model, {**feeds, "ids": np.array([0, 1, 1, 0], np.int64)})


def _post_ln_block():
    """BERT's last block end: MatMul -> LayerNorm (its weight through an Identity, as TorchScript
    shares equal parameters) -> MatMul -> bias Add -> residual Add -> LayerNorm -> output."""
    rng = np.random.default_rng(0)
    return make_model(
        [
            node("MatMul", ["x", "W1"], ["h"], "mm1"),
            node("Identity", ["gamma"], ["gamma1"], "shared_gamma"),
            node("LayerNormalization", ["h", "gamma1", "beta"], ["n1"], "ln1", axis=-1),
            node("MatMul", ["n1", "W2"], ["d"], "mm2"),
            node("Add", ["d", "bias"], ["db"], "bias_add"),
            node("Add", ["db", "n1"], ["r"], "residual"),
            node("LayerNormalization", ["r", "gamma", "beta"], ["y"], "ln2", axis=-1),
        ],
        [tensor("x", ["batch", 64])],
        [tensor("y", ["batch", 64])],
        [
            init("W1", (rng.standard_normal((64, 64)) * 0.1).astype(np.float32)),
            init("W2", (rng.standard_normal((64, 64)) * 0.1).astype(np.float32)),
            init("gamma", np.ones(64, np.float32)),
            init("beta", np.zeros(64, np.float32)),
            init("bias", np.full(64, 0.1, np.float32)),
        ],
    )


def test_a_residual_add_of_a_layer_norm_is_bounded(over_budget):
    """The residual Add reads a MatMul's output (one unit of accepted reach) and ln1's, which TF's
    rule holds low but whose values are bounded (sqrt(63) x 1 + 0): the Add and the last LayerNorm
    are proven, so the only casts are the model's input and output (onnxconverter-common's two)."""
    model = _post_ln_block()
    result = rewrite(model)
    assert {
        n["name"]: n["precision"] for n in result.report.nodes if n["name"] != "shared_gamma"
    } == dict.fromkeys(["mm1", "ln1", "mm2", "bias_add", "residual", "ln2"], "float16")
    theirs = float16.convert_float_to_float16(model, keep_io_types=True)
    assert _casts(result.model) == _casts(theirs) == 2
    check_both(model, result.model)


def test_tables_left_on_disk_are_bounded_too(synthetic, tmp_path):
    """The CLI reads big weights lazily (never measured: over the budget by definition): a table
    on disk has its reach from the scan's pieces, and the GPT-2-like model's tied table is written
    once, in float16."""
    from amp_rewrite import cli

    model = synthetic.language_model("gpt2", vocab=5000)  # 1.3 MB: over io.loader's LAZY_MIN_BYTES
    path, out = tmp_path / "lm.onnx", tmp_path / "lm16.onnx"
    stored = onnx.ModelProto()
    stored.CopyFrom(model)  # onnx.save turns the weights it writes out into references
    onnx.save(stored, path, save_as_external_data=True, location="lm.onnx.data", size_threshold=1024)
    assert cli.main([str(path), "-o", str(out), "--quiet"]) == 0
    result = onnx.load(str(out))
    tables = [t for t in result.graph.initializer if list(t.dims) == [5000, 64]]
    assert [(t.name, t.data_type) for t in tables] == [("wte", TensorProto.FLOAT16)]
    assert _casts(result) <= _casts(float16.convert_float_to_float16(model, keep_io_types=True))
    check_both(model, result, synthetic.language_feeds(model))
