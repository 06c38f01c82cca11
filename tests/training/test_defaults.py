"""What the Trainer trains by default and what it says: parameters found from their use (never
masks, scalars, RoPE tables), user regexes, skipped steps explained, opset conversion, float16
nodes the CPU provider refuses kept float32, the unreachable-loss error, no leaked warnings."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper

from amp_rewrite.errors import TrainingError
from amp_rewrite.training import SGD, AdamW, Trainer, parameters
from helpers import init, make_model, node, tensor

T, H, V, C = 4, 8, 12, 5


def lm_like(seed=0, opset=17):
    """ids -> Gather(table) + positions -> MatMul -> +bias -> LayerNorm -> causal-masked self
    scores (a float -inf mask, a scalar scale) -> RMS norm as exporters spell it (Pow 2, eps) ->
    Mul(RoPE-like [1,T,H] table) -> MatMul head. Parameters: table, positions, w, b, ln_scale,
    ln_bias, head. Constants: mask, scale, rope, two, eps (d/d two = x^2 ln x: NaN for x < 0)."""
    rng = np.random.default_rng(seed)
    mask = np.triu(np.full((T, T), -np.inf, np.float32), 1)[None]
    inits = [
        init("table", rng.normal(0, 0.5, (V, H)).astype(np.float32)),
        init("positions", rng.normal(0, 0.1, (1, T, H)).astype(np.float32)),
        init("w", rng.normal(0, 0.3, (H, H)).astype(np.float32)),
        init("b", np.zeros(H, np.float32)),
        init("ln_scale", np.ones(H, np.float32)),
        init("ln_bias", np.zeros(H, np.float32)),
        init("mask", mask),
        init("scale", np.array(0.35, np.float32)),
        init("rope", np.cos(np.arange(T * H, dtype=np.float32)).reshape(1, T, H)),
        init("head", rng.normal(0, 0.3, (H, C)).astype(np.float32)),
        init("two", np.array(2.0, np.float32)),
        init("eps", np.array(1e-6, np.float32)),
    ]
    nodes = [
        node("Gather", ["table", "ids"], ["emb"]),
        node("Add", ["emb", "positions"], ["x"]),
        node("MatMul", ["x", "w"], ["h0"]),
        node("Add", ["h0", "b"], ["h1"]),
        node("LayerNormalization", ["h1", "ln_scale", "ln_bias"], ["h"], axis=-1),
        node("Transpose", ["h"], ["hT"], perm=[0, 2, 1]),
        node("MatMul", ["h", "hT"], ["s0"]),
        node("Mul", ["s0", "scale"], ["s1"]),
        node("Add", ["s1", "mask"], ["s2"]),
        node("Softmax", ["s2"], ["p"], axis=-1),
        node("MatMul", ["p", "h"], ["ctx"]),
        node("Pow", ["ctx", "two"], ["sq"]),
        node("ReduceMean", ["sq"], ["ms"], axes=[-1]),
        node("Add", ["ms", "eps"], ["den"]),
        node("Sqrt", ["den"], ["rms"]),
        node("Div", ["ctx", "rms"], ["n"]),
        node("Mul", ["n", "rope"], ["r"]),
        node("MatMul", ["r", "head"], ["logits"]),
    ]
    return make_model(
        nodes, [tensor("ids", [2, T], TensorProto.INT64)], [tensor("logits", [2, T, C])], inits, opset=opset
    )


def batches(count=20, seed=1):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V, (2, T))
    return [{"ids": ids, "labels": ids % C} for _ in range(count)]


def test_parameters_are_found_by_use_and_constants_are_not():
    found = parameters.find(lm_like().graph)
    assert set(found.names) == {"table", "positions", "w", "b", "ln_scale", "ln_bias", "head"}
    assert set(found.frozen) == {"mask", "scale", "rope", "two", "eps"}


def test_defaults_train_where_every_float_initializer_would_skip_every_step(capsys, caplog):
    trainer = Trainer(lm_like(), optimizer=AdamW(1e-2), precision="float32", provider="cpu")
    assert "training 7 tensors, 256 parameters; 5 constants frozen" in capsys.readouterr().err
    results = [trainer.step(b) for b in batches()]
    assert not any(r.skipped for r in results) and results[-1].loss < 0.7 * results[0].loss
    assert trainer.loss_scale == 1.0  # float32: no loss scale by default

    everything = Trainer(
        lm_like(), optimizer=AdamW(1e-2), precision="float32", provider="cpu", trainable=[".*"]
    )
    with caplog.at_level(logging.WARNING, logger="amp_rewrite.training"):
        results = [everything.step(b) for b in batches(12)]
    assert all(r.skipped for r in results)
    warned = [r.getMessage() for r in caplog.records if "in a row skipped" in r.getMessage()]
    assert len(warned) == 1 and "'two'" in warned[0] and "'w'" not in warned[0]


def test_trainable_and_frozen_regexes_override_the_default():
    trainer = Trainer(
        lm_like(),
        optimizer=SGD(0.1),
        precision="float32",
        provider="cpu",
        verbose=False,
        frozen=["ln_.*", "table"],
    )
    assert set(trainer.trainable) == {"positions", "w", "b", "head"}
    trainer = Trainer(
        lm_like(),
        optimizer=SGD(0.1),
        precision="float32",
        provider="cpu",
        verbose=False,
        trainable=["head|w"],
    )
    assert set(trainer.trainable) == {"head", "w"}
    with pytest.raises(TrainingError, match="'nope' matches no float constant"):
        Trainer(lm_like(), optimizer=SGD(0.1), precision="float32", provider="cpu", frozen=["nope"])


def test_float16_gather_gradient_stays_float32_on_cpu_with_a_reason():
    """Gather's gradient is ScatterND(reduction='add'), which ONNX Runtime's CPU provider refuses in float16."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing leaks (numpy's overflow-in-cast warning included)
        trainer = Trainer(
            lm_like(), optimizer=AdamW(1e-2), precision="float16", provider="cpu", verbose=False
        )
    scatter = [n for n in trainer.step_graph.report.nodes if n["op_type"] == "ScatterND"]
    assert scatter and all(
        n["precision"] == "float32" and "refuses ScatterND" in n["because"] for n in scatter
    )
    drawn = [n for n in trainer.report().nodes if n["op_type"] == "ScatterND"]  # Trainer.report agrees
    assert [n["precision"] for n in drawn] == [n["precision"] for n in scatter]
    results = [trainer.step(b) for b in batches()]
    assert not any(r.skipped for r in results) and results[-1].loss < 0.7 * results[0].loss


def test_one_rewrite_per_trainer_for_the_device_it_runs_on(monkeypatch):
    """The step graph is rewritten once, for its device (the CPU refusals probed on the float32
    graph first), and `report()` returns that rewrite's report, no rewrite again."""
    import amp_rewrite.api

    real, calls = amp_rewrite.api.rewrite, []
    monkeypatch.setattr(
        amp_rewrite.api, "rewrite", lambda model, options: calls.append(options) or real(model, options)
    )
    trainer = Trainer(lm_like(), optimizer=AdamW(1e-2), precision="float16", provider="cpu", verbose=False)
    assert trainer.report() is trainer.step_graph.report
    [options] = calls
    assert options.provider == "any" and any(
        "refuses ScatterND" in why for why in options.force_fp32.values()
    )


def test_float16_gather_gradient_inside_an_if_body_stays_float32_on_cpu():
    """ONNX Runtime runs If bodies only when the step runs: the refused float16 ScatterND of a Gather
    inside a branch (silero-vad-ifless) is found in the body and kept float32, so the step runs."""
    from onnx import helper

    rng = np.random.default_rng(0)
    then = helper.make_graph(
        [node("Gather", ["table", "ids"], ["emb"])], "then", [], [tensor("emb", [2, T, H])]
    )
    other = helper.make_graph(
        [node("Gather", ["table", "ids"], ["e0"]), node("Neg", ["e0"], ["e"])],
        "else",
        [],
        [tensor("e", [2, T, H])],
    )
    nodes = [
        node("If", ["cond"], ["x"], then_branch=then, else_branch=other, name="pick"),
        node("MatMul", ["x", "head"], ["logits"]),
    ]
    inits = [
        init("table", rng.normal(0, 1, (V, H)).astype(np.float32)),
        init("cond", np.array(True)),
        init("head", rng.normal(0, 0.3, (H, C)).astype(np.float32)),
    ]
    model = make_model(
        nodes, [tensor("ids", [2, T], TensorProto.INT64)], [tensor("logits", [2, T, C])], inits
    )
    trainer = Trainer(model, optimizer=AdamW(1e-2), precision="float16", provider="cpu", verbose=False)
    results = [trainer.step(b) for b in batches(5)]
    assert not any(r.skipped for r in results) and results[-1].loss < results[0].loss


def test_opset_11_is_converted_and_an_unconvertible_op_is_named(capsys):
    trainer = Trainer(mlp_opset11(), optimizer=SGD(0.5), precision="float32", provider="cpu")
    assert "converted the model from opset 11 to 16" in capsys.readouterr().err
    x = np.random.default_rng(0).normal(size=(8, 6)).astype(np.float32)
    results = [trainer.step({"x": x, "labels": np.arange(8) % 3}) for _ in range(20)]
    assert results[-1].loss < 0.7 * results[0].loss


def test_an_op_the_version_converter_cannot_convert_is_named(monkeypatch):
    """onnx.version_converter converts every valid default-domain op from 11 to 13 that we know of,
    so its failure is simulated: a converter without an adapter for Relu."""
    import onnx.version_converter

    real = onnx.version_converter.convert_version

    def no_relu_adapter(model, target):
        if any(n.op_type == "Relu" for n in model.graph.node):
            raise RuntimeError("convert.cc:101: Assertion `adapter` failed: No Adapter For Relu")
        return real(model, target)

    monkeypatch.setattr(onnx.version_converter, "convert_version", no_relu_adapter)
    with pytest.raises(
        TrainingError,
        match=r"cannot convert opset 11 to 16 for autodiff: op Relu \(node .*\) "
        r"blocked it: No Adapter For Relu",
    ):
        Trainer(mlp_opset11(), optimizer=SGD(0.5), precision="float32", provider="cpu")


def mlp_opset11():
    rng = np.random.default_rng(0)
    inits = [
        init("w0", rng.normal(0, 0.5, (6, 8)).astype(np.float32)),
        init("b0", np.zeros(8, np.float32)),
        init("w1", rng.normal(0, 0.5, (8, 3)).astype(np.float32)),
    ]
    nodes = [
        node("Gemm", ["x", "w0", "b0"], ["h0"]),
        node("Relu", ["h0"], ["h"]),
        node("MatMul", ["h", "w1"], ["logits"]),
    ]
    return make_model(nodes, [tensor("x", ["N", 6])], [tensor("logits", ["N", 3])], inits, opset=11)


def test_unreachable_loss_names_the_op_that_cuts_the_path():
    inits = [init("w", np.ones((3, 3), np.float32))]
    nodes = [
        node("MatMul", ["x", "w"], ["h"], name="mm"),
        node("ArgMax", ["h"], ["k"], name="pick", axis=-1),
        node("Cast", ["k"], ["kf"], to=TensorProto.FLOAT, name="to_float"),
        node("Add", ["x", "kf"], ["logits"], name="add"),
    ]
    model = make_model(nodes, [tensor("x", ["N", 3])], [tensor("logits", ["N", 3])], inits)
    with pytest.raises(TrainingError, match=r"ArgMax \(node 'pick'\): no gradient rule"):
        Trainer(model, optimizer=SGD(0.1), precision="float32", provider="cpu", trainable=["w"])


def test_cuda_refusals_come_from_the_kernel_table():
    """No GPU here: the CUDA decision is the rewrite's kernel-table lookup (ONNX Runtime's
    registered kernels), checked with a training step's options: Clip at opset 11 has no float16
    CUDA kernel, so it stays float32 between two float16 MatMuls there, and not on CPU."""
    from amp_rewrite.api import rewrite
    from amp_rewrite.training import cpu_refusals
    from amp_rewrite.training.step_graph import precision_options

    def clipped(elem):
        nodes = [
            node("MatMul", ["a", "a"], ["m"], name="mm"),
            node("Clip", ["m", "lo", "hi"], ["c"], name="clip"),
            node("MatMul", ["c", "a"], ["y"], name="mm2"),
        ]
        dtype = helper.tensor_dtype_to_np_dtype(elem)
        bounds = [init("lo", np.array(-1, dtype)), init("hi", np.array(1, dtype))]
        return make_model(nodes, [tensor("a", [3, 3], elem)], [tensor("y", [3, 3], elem)], bounds, opset=11)

    cuda = rewrite(clipped(TensorProto.FLOAT), precision_options("float16", device="cuda")).report
    assert (
        cuda.node("clip")["precision"] == "float32"
        and "no float16 kernel on CUDA" in cuda.node("clip")["because"]
    )
    assert cuda.node("mm")["precision"] == "float16"
    cpu = rewrite(clipped(TensorProto.FLOAT), precision_options("float16", device="cpu")).report
    assert cpu.node("clip")["precision"] == "float16"
    assert (
        cpu_refusals.refused_nodes(clipped(TensorProto.FLOAT16)) == {}
    )  # the CPU provider runs it in float16
