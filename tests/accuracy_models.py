"""Models whose float16 rewrite goes wrong, for the report / validate / calibrate / fallback tests.

`hazards()`: three classic float16 failures in one graph (opset 17, IR 8):
  act:  h = x @ W1 reaches ~1e5 (> 65504) before a ReduceMean: float16 MatMul overflows;
  norm: a decomposed LayerNorm whose squared deviations and variance exceed 65504;
  attn: an attention mask built as (1 - mask) * -1e9 before Softmax; a fully masked row.
`cancellation()`: no overflow, but two nearly equal products are subtracted, so float16
rounding of the products becomes a ~50% error of the difference.
"""

import numpy as np

from helpers import init, make_model, node, tensor


def hazards(seed=0):
    rng = np.random.default_rng(seed)
    f32 = np.float32
    inits = [
        init("W1", (rng.standard_normal((16, 32)) * 1e4).astype(f32)),
        init("W2", (rng.standard_normal((32, 4)) * 0.1).astype(f32)),
        init("W3", (rng.standard_normal((16, 64)) * 100).astype(f32)),
        init("W4", (rng.standard_normal((64, 4)) * 0.1).astype(f32)),
        init("W5", (rng.standard_normal((16, 8)) * 0.5).astype(f32)),
        init("W6", (rng.standard_normal((8, 4))).astype(f32)),
        init("small", np.array(1e-4, f32)),
        init("eps", np.array(1e-5, f32)),
        init("one", np.array(1.0, f32)),
        init("neg_big", np.array(-1e9, f32)),
    ]
    nodes = [
        node("MatMul", ["x", "W1"], ["h"], name="act/MatMul"),
        node("ReduceMean", ["h"], ["h_mean"], name="act/ReduceMean", axes=[-1]),
        node("Sub", ["h", "h_mean"], ["h_c"], name="act/Sub"),
        node("Mul", ["h_c", "small"], ["h_s"], name="act/Mul"),
        node("MatMul", ["h_s", "W2"], ["act"], name="act/out"),
        node("MatMul", ["x", "W3"], ["z"], name="ln/MatMul"),
        node("ReduceMean", ["z"], ["mu"], name="ln/ReduceMean", axes=[-1]),
        node("Sub", ["z", "mu"], ["d"], name="ln/Sub"),
        node("Mul", ["d", "d"], ["sq"], name="ln/Square"),
        node("ReduceMean", ["sq"], ["var"], name="ln/Variance", axes=[-1]),
        node("Add", ["var", "eps"], ["var_eps"], name="ln/AddEps"),
        node("Sqrt", ["var_eps"], ["sd"], name="ln/Sqrt"),
        node("Div", ["d", "sd"], ["n"], name="ln/Div"),
        node("MatMul", ["n", "W4"], ["norm"], name="ln/out"),
        node("MatMul", ["x", "W5"], ["scores"], name="attn/scores"),
        node("Sub", ["one", "mask"], ["inv"], name="attn/inv"),
        node("Mul", ["inv", "neg_big"], ["bias"], name="attn/mask_bias"),
        node("Add", ["scores", "bias"], ["masked"], name="attn/add_mask"),
        node("Softmax", ["masked"], ["probs"], name="attn/Softmax", axis=-1),
        node("MatMul", ["probs", "W6"], ["attn"], name="attn/out"),
    ]
    return make_model(
        nodes,
        [tensor("x", ["batch", 16]), tensor("mask", ["batch", 8])],
        [tensor("act", ["batch", 4]), tensor("norm", ["batch", 4]), tensor("attn", ["batch", 4])],
        inits,
    )


def hazard_samples(count=2, batch=8, seed=1):
    """x standard normal; mask 0/1 with the first row fully masked (padding)."""
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(count):
        mask = (rng.random((batch, 8)) > 0.3).astype(np.float32)
        mask[0] = 0.0
        samples.append({"x": rng.standard_normal((batch, 16)).astype(np.float32), "mask": mask})
    return samples


def cancellation(seed=0):
    rng = np.random.default_rng(seed)
    f32 = np.float32
    a = rng.standard_normal((16, 16)).astype(f32)
    inits = [
        init("W0", (rng.standard_normal((16, 16)) * 0.5).astype(f32)),
        init("b0", (rng.standard_normal(16) * 0.1).astype(f32)),
        init("A", a),
        init("A2", (a + 1e-3 * rng.standard_normal((16, 16))).astype(f32)),
        init("C", (rng.standard_normal((16, 16)) * 30).astype(f32)),
        init("W3", (rng.standard_normal((16, 10)) * 0.3).astype(f32)),
    ]
    nodes = [
        node("MatMul", ["x", "W0"], ["p0"], name="in/MatMul"),
        node("Add", ["p0", "b0"], ["p1"], name="in/Add"),
        node("Relu", ["p1"], ["p2"], name="in/Relu"),
        node("MatMul", ["p2", "A"], ["u"], name="diff/u"),
        node("MatMul", ["p2", "A2"], ["v"], name="diff/v"),
        node("Sub", ["v", "u"], ["d"], name="diff/Sub"),
        node("MatMul", ["d", "C"], ["e"], name="out/MatMul"),
        node("Tanh", ["e"], ["t"], name="out/Tanh"),
        node("MatMul", ["t", "W3"], ["logits"], name="out/logits"),
    ]
    return make_model(nodes, [tensor("x", ["batch", 16])], [tensor("logits", ["batch", 10])], inits)


def naive_lists(model):
    """Every op type of the model in the allow list: a whole-model float16 conversion."""
    return sorted({n.op_type for n in model.graph.node})
