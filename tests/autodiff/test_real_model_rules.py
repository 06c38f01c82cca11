"""The gradients real exports need (Resize, LSTM, GRU, If, ORT's fused contrib ops) against torch
autograd, in float32 and after the float16 rewrite a training step gets.

Each model is the op between a trainable input side and loss = sum(y * R) with a fixed random R,
built by hand as the exporters write it, run in ONNX Runtime CPU. float32: max |onnx - torch| <=
1e-4 * max(1, max |torch|). float16: the gradient graph rewritten as the Trainer rewrites a step
graph (training lists, nodes the CPU provider refuses in float16 kept float32) stays within 2e-2 of
float32 relative to max(1, max |g|). Finite differences for the same rules run in test_rules.py.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from amp_rewrite.autodiff import build_gradient_graph
from helpers import IR_VERSION, session

torch = pytest.importorskip("torch")
F = torch.nn.functional
FLOAT = TensorProto.FLOAT


def loss_model(nodes, inputs, weights, out_shape, opset=17, seed=5, elem=FLOAT):
    """nodes -> y, then loss = sum(y * R); returns the model and R."""
    r = np.random.default_rng(seed).standard_normal(out_shape).astype(np.float32)
    nodes = [
        *nodes,
        helper.make_node("Mul", ["y", "R"], ["yr"]),
        helper.make_node("ReduceSum", ["yr"], ["loss"], keepdims=0),
    ]
    np_type = helper.tensor_dtype_to_np_dtype(elem)
    weights = {k: v.astype(np_type) if v.dtype == np.float32 else v for k, v in {**weights, "R": r}.items()}
    inits = [numpy_helper.from_array(v, k) for k, v in weights.items()]
    graph = helper.make_graph(nodes, "m", inputs, [helper.make_tensor_value_info("loss", elem, [])], inits)
    domains = sorted({n.domain for n in nodes if n.domain})
    model = helper.make_model(
        graph,
        ir_version=IR_VERSION,
        opset_imports=[helper.make_opsetid("", opset), *(helper.make_opsetid(d, 1) for d in domains)],
    )
    if all(onnx.defs.has(n.op_type, n.domain) for n in nodes):  # ORT's fused ops have no ONNX schema
        onnx.checker.check_model(model, full_check=True)
    return model, torch.tensor(r)


def float16_outputs(grad_model, feeds):
    """Run the gradient graph as a float16 training step runs it on CPU."""
    from amp_rewrite import rewrite
    from amp_rewrite.training.cpu_refusals import refused_in
    from amp_rewrite.training.step_graph import precision_options

    result = rewrite(grad_model, precision_options("float16", refused_in(grad_model, "float16")))
    assert result.report.summary["nodes_low"] > 0
    names = [o.name for o in result.model.graph.output]
    return dict(zip(names, session(result.model).run(None, feeds)))


def check(model, feeds, wrt, torch_loss, float16=True):
    """Gradients of `wrt` (initializers or inputs) from ORT vs torch; returns the worst float32 and float16 errors."""
    grad_model = build_gradient_graph(model, "loss", wrt)
    onnx.checker.check_model(grad_model, full_check=not any(o.domain for o in grad_model.opset_import))
    names = [o.name for o in grad_model.graph.output]
    got = dict(zip(names, session(grad_model).run(None, feeds)))
    values = {**{i.name: numpy_helper.to_array(i) for i in model.graph.initializer}, **feeds}
    params = {k: torch.tensor(v, requires_grad=k in wrt) for k, v in values.items()}
    loss = torch_loss(params)
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-4, atol=1e-4)
    worst32 = worst16 = 0.0
    low = float16_outputs(grad_model, feeds) if float16 else None
    for name in wrt:
        grad = params[name].grad  # None: torch never read it (an If branch not taken)
        expected = np.zeros(params[name].shape, np.float32) if grad is None else grad.numpy()
        scale = max(1.0, float(np.abs(expected).max()))
        error = float(np.abs(got[f"{name}_grad"] - expected).max()) / scale
        assert error <= 1e-4, (name, error)
        worst32 = max(worst32, error)
        if low is not None:
            error16 = float(np.abs(low[f"{name}_grad"] - got[f"{name}_grad"]).max()) / scale
            assert error16 <= 2e-2, (name, error16)
            worst16 = max(worst16, error16)
    print(
        f"\nworst relative gradient error vs torch: float32 {worst32:.1e}, float16 vs float32 {worst16:.1e}"
    )
    return worst32, worst16


# -- Resize ------------------------------------------------------------------------------------------
RESIZE = {  # id: (ONNX attributes, scales, torch interpolate kwargs)
    "nearest": (
        dict(mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
        [1, 1, 2, 2],
        dict(scale_factor=2, mode="nearest"),
    ),
    "nearest-exact": (
        dict(mode="nearest", coordinate_transformation_mode="half_pixel", nearest_mode="round_prefer_ceil"),
        [1, 1, 1.5, 3],
        dict(scale_factor=(1.5, 3), mode="nearest-exact"),
    ),
    "bilinear": (
        dict(mode="linear", coordinate_transformation_mode="pytorch_half_pixel"),
        [1, 1, 2, 2],
        dict(scale_factor=2, mode="bilinear", align_corners=False),
    ),
    "bilinear-down": (
        dict(mode="linear", coordinate_transformation_mode="half_pixel"),
        [1, 1, 0.5, 0.75],
        dict(scale_factor=(0.5, 0.75), mode="bilinear", align_corners=False),
    ),
    "bilinear-align-corners": (
        dict(mode="linear", coordinate_transformation_mode="align_corners"),
        [1, 1, 2, 3],
        dict(scale_factor=(2, 3), mode="bilinear", align_corners=True),
    ),
    "bicubic": (
        dict(mode="cubic", coordinate_transformation_mode="half_pixel", cubic_coeff_a=-0.75),
        [1, 1, 2, 1.5],
        dict(scale_factor=(2, 1.5), mode="bicubic", align_corners=False),
    ),
    "bicubic-align-corners": (
        dict(mode="cubic", coordinate_transformation_mode="align_corners", cubic_coeff_a=-0.75),
        [1, 1, 2, 2],
        dict(scale_factor=2, mode="bicubic", align_corners=True),
    ),
}


@pytest.mark.parametrize("kind", RESIZE)
def test_resize_matches_torch(kind):
    attrs, scales, kwargs = RESIZE[kind]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 2, 6, 8)).astype(np.float32)
    w = (rng.standard_normal((3, 2, 3, 3)) * 0.5).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Resize", ["c", "", "scales"], ["y"], **attrs),
    ]
    out = [2, 3, int(6 * scales[2]), int(8 * scales[3])]
    inputs = [helper.make_tensor_value_info("x", FLOAT, ["N", 2, "H", "W"])]
    model, r = loss_model(nodes, inputs, {"w": w, "scales": np.array(scales, np.float32)}, out)

    def reference(p):
        return (F.interpolate(F.conv2d(p["x"], p["w"], padding=1), **kwargs) * r).sum()

    check(model, {"x": x}, ["w", "x"], reference)


# -- MaxPool ties -------------------------------------------------------------------------------------
MAX_POOL = {  # id: (kernel, strides, pads, input shape, windows tile the input)
    "tiled-2x2": ([2, 2], [2, 2], [0, 0, 0, 0], (2, 3, 8, 6), True),
    "tiled-3x2": ([3, 2], [3, 2], [0, 0, 0, 0], (2, 2, 6, 8), True),
    "tiled-1d": ([3], [3], [0, 0], (2, 3, 9), True),
    "overlapping-padded": ([3, 3], [2, 2], [1, 1, 1, 1], (2, 2, 7, 6), False),
    "untiled-odd-size": ([2, 2], [2, 2], [0, 0, 0, 0], (2, 2, 7, 5), False),
}


@pytest.mark.parametrize("kind", MAX_POOL)
def test_max_pool_ties_go_to_the_first_maximum_like_torch(kind):
    """Inputs full of ties (ReLU zeros, values on a 0.5 grid, exact in float16): dY goes to each
    window's first maximum in scan order, as torch routes it. Tiling windows use the mask form (no
    Indices output, no scatter); the others keep Indices + ScatterElements."""
    kernel, strides, pads, shape, tiled = MAX_POOL[kind]
    x = np.maximum(np.round(np.random.default_rng(3).standard_normal(shape) * 2) / 2, 0).astype(np.float32)
    x[0, 0, : kernel[0]] = 1.5  # whole windows of equal non-zero values
    channels = shape[1]  # a diagonal 1x1 Conv in front (exact on the grid) so float16 has work
    w = (
        np.diag(np.arange(1, channels + 1) / 2)
        .reshape(channels, channels, *[1] * len(kernel))
        .astype(np.float32)
    )
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"]),
        helper.make_node("MaxPool", ["c"], ["y"], kernel_shape=kernel, strides=strides, pads=pads),
    ]
    out = [*shape[:2], *((s + 2 * p - k) // st + 1 for s, p, k, st in zip(shape[2:], pads, kernel, strides))]
    inputs = [helper.make_tensor_value_info("x", FLOAT, ["N", *shape[1:]])]
    model, r = loss_model(nodes, inputs, {"w": w}, out)
    conv, pool = (F.conv1d, F.max_pool1d) if len(kernel) == 1 else (F.conv2d, F.max_pool2d)

    def reference(p):
        return (pool(conv(p["x"], p["w"]), kernel, strides, padding=pads[: len(kernel)]) * r).sum()

    check(model, {"x": x}, ["x", "w"], reference)
    grad = build_gradient_graph(model, "loss", ["x"])
    ops = {n.op_type for n in grad.graph.node}
    pool_outputs = [len([o for o in n.output if o]) for n in grad.graph.node if n.op_type == "MaxPool"]
    assert ("ScatterElements" in ops) is not tiled and (pool_outputs[0] == 2) is not tiled, (
        ops,
        pool_outputs,
    )


# -- LSTM / GRU ----------------------------------------------------------------------------------------
T, B, I, H = 4, 3, 2, 3  # noqa: E741 - the ONNX spec's names
TORCH_ORDER = {
    "LSTM": [0, 2, 3, 1],
    "GRU": [1, 0, 2],
}  # torch's gate blocks (ifgo, rzn) from ONNX's (iofc, zrh)
RECURRENT = {  # id: (op, direction, sequence lengths or None, initial states, attributes)
    "lstm-forward": ("LSTM", "forward", None, ("h0", "c0"), {}),
    "lstm-reverse-lengths": ("LSTM", "reverse", [4, 2, 3], (), {}),
    "lstm-bidirectional-lengths-states": ("LSTM", "bidirectional", [1, 4, 3], ("h0", "c0"), {}),
    "gru-forward-lengths": ("GRU", "forward", [2, 4, 1], ("h0",), {"linear_before_reset": 1}),
    "gru-bidirectional": ("GRU", "bidirectional", None, (), {"linear_before_reset": 1}),
    "gru-reverse-lengths-state": ("GRU", "reverse", [3, 4, 2], ("h0",), {"linear_before_reset": 1}),
}


def _torch_weight(w, op):
    """[D, G*H, K] in ONNX gate order -> list per direction in torch's order."""
    return [torch.cat([w[d, k * H : (k + 1) * H] for k in TORCH_ORDER[op]]) for d in range(w.shape[0])]


@pytest.mark.parametrize("kind", RECURRENT)
def test_recurrent_matches_torch(kind):
    """torch.nn.LSTM/GRU (packed sequences for lengths) with the ONNX weights; loss reads Y, Y_h (and Y_c)."""
    op, direction, lengths, initial, attrs = RECURRENT[kind]
    rng = np.random.default_rng(3)
    d, gates = (2 if direction == "bidirectional" else 1), (4 if op == "LSTM" else 3)
    weights = {
        "w": rng.standard_normal((d, gates * H, I)).astype(np.float32) * 0.6,
        "r": rng.standard_normal((d, gates * H, H)).astype(np.float32) * 0.6,
        "b": rng.standard_normal((d, 2 * gates * H)).astype(np.float32) * 0.3,
    }
    if lengths:
        weights["lens"] = np.array(lengths, np.int32)
    feeds = {"x": rng.standard_normal((T, B, I)).astype(np.float32)}
    feeds.update({s: rng.standard_normal((d, B, H)).astype(np.float32) * 0.5 for s in initial})
    states = ["yh", "yc"] if op == "LSTM" else ["yh"]
    slots = [
        "x",
        "w",
        "r",
        "b",
        "lens" if lengths else "",
        "h0" if "h0" in initial else "",
        "c0" if "c0" in initial else "",
    ]
    nodes = [
        helper.make_node(
            op,
            slots[: 7 if op == "LSTM" else 6],
            ["ys", *states],
            hidden_size=H,
            direction=direction,
            **attrs,
        ),
        *[helper.make_node("Reshape", [t, "flat"], [f"{t}_flat"]) for t in ["ys", *states]],
        helper.make_node("Concat", [f"{t}_flat" for t in ["ys", *states]], ["y"], axis=0),
    ]
    inputs = [helper.make_tensor_value_info(k, FLOAT, list(v.shape)) for k, v in feeds.items()]
    size = T * d * B * H + len(states) * d * B * H
    model, r = loss_model(nodes, inputs, {**weights, "flat": np.array([-1], np.int64)}, [size])

    def reference(p):
        module = getattr(torch.nn, op)(I, H, bidirectional=d == 2)
        names = {}
        for k in range(d):
            suffix = "_l0" + ("_reverse" if k == 1 else "")
            names[f"weight_ih{suffix}"] = _torch_weight(p["w"], op)[k]
            names[f"weight_hh{suffix}"] = _torch_weight(p["r"], op)[k]
            bias = p["b"][k].reshape(2, gates * H, 1)
            names[f"bias_ih{suffix}"] = _torch_weight(bias[0:1], op)[0].reshape(-1)
            names[f"bias_hh{suffix}"] = _torch_weight(bias[1:2], op)[0].reshape(-1)
        x = p["x"]
        if direction == "reverse":  # torch has no reverse-only RNN: flip each sequence within its length
            x = _flip(x, lengths)
        h0 = p.get("h0", torch.zeros(d, B, H))
        start = (h0, p.get("c0", torch.zeros(d, B, H))) if op == "LSTM" else h0
        if lengths:
            x = torch.nn.utils.rnn.pack_padded_sequence(x, torch.tensor(lengths), enforce_sorted=False)
        out, final = torch.func.functional_call(module, names, (x, start))
        if lengths:
            out = torch.nn.utils.rnn.pad_packed_sequence(out, total_length=T)[0]
        if direction == "reverse":
            out = _flip(out, lengths)
        finals = list(final) if op == "LSTM" else [final]
        ys = out.reshape(T, B, d, H).permute(0, 2, 1, 3)
        return (torch.cat([t.reshape(-1) for t in [ys, *finals]]) * r).sum()

    check(model, feeds, ["w", "r", "b", "x", *initial], reference)


def _flip(x, lengths):
    """Reverse each batch entry's first `length` steps (ONNX ReverseSequence)."""
    lengths = lengths or [T] * B
    return torch.stack([torch.cat([x[:n, b].flip(0), x[n:, b]]) for b, n in enumerate(lengths)], dim=1)


@pytest.mark.parametrize(
    ("op", "attrs", "words"),
    [
        ("LSTM", {"clip": 1.0}, "clip is not supported"),
        ("LSTM", {"activations": ["Relu", "Tanh", "Tanh"]}, "only the default activations"),
        ("GRU", {"layout": 1}, "layout=1"),
        ("Resize", {"coordinate_transformation_mode": "tf_crop_and_resize"}, "tf_crop_and_resize"),
    ],
)
def test_unsupported_attributes_are_one_line(op, attrs, words):
    from amp_rewrite.errors import GradientError

    if op == "Resize":
        node = helper.make_node("Resize", ["x", "", "scales"], ["y"], name="up", **attrs)
        weights, shape = {"scales": np.array([1, 1, 2, 2], np.float32)}, [1, 2, 4, 4]
        inputs = [helper.make_tensor_value_info("x", FLOAT, [1, 2, 2, 2])]
    else:
        gates = 4 if op == "LSTM" else 3
        node = helper.make_node(op, ["x", "w", "r"], ["y"], name="rnn", hidden_size=H, **attrs)
        weights = {"w": np.zeros((1, gates * H, I), np.float32), "r": np.zeros((1, gates * H, H), np.float32)}
        shape, inputs = [T, 1, B, H], [helper.make_tensor_value_info("x", FLOAT, [T, B, I])]
    model, _ = loss_model([node], inputs, weights, shape)
    with pytest.raises(GradientError) as caught:
        build_gradient_graph(model, "loss", ["x"])
    message = str(caught.value)
    assert words in message and "\n" not in message and message.startswith(f"cannot differentiate {op} node")


# -- If -------------------------------------------------------------------------------------------------
def _if_model(cond: bool):
    """then: tanh(x @ W1 + b) with W1 a branch initializer, b captured from the main graph;
    else: (x @ W2) * g with W2 a Constant node inside the branch and g captured (a VAD model's layout)."""
    rng = np.random.default_rng(7)
    w1, w2 = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((4, 3)).astype(np.float32)
    then = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W1"], ["t0"]),
            helper.make_node("Add", ["t0", "b"], ["t1"]),
            helper.make_node("Tanh", ["t1"], ["t"]),
        ],
        "then",
        [],
        [helper.make_tensor_value_info("t", FLOAT, None)],
        [numpy_helper.from_array(w1, "W1")],
    )
    other = helper.make_graph(
        [
            helper.make_node("Constant", [], ["W2"], value=numpy_helper.from_array(w2)),
            helper.make_node("MatMul", ["x", "W2"], ["e0"]),
            helper.make_node("Mul", ["e0", "g"], ["e"]),
        ],
        "else",
        [],
        [helper.make_tensor_value_info("e", FLOAT, None)],
    )
    nodes = [helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)]
    weights = {
        "b": rng.standard_normal(3).astype(np.float32),
        "g": rng.standard_normal(3).astype(np.float32),
        "cond": np.array(cond),
    }
    inputs = [helper.make_tensor_value_info("x", FLOAT, ["N", 4])]
    model, r = loss_model(nodes, inputs, weights, [5, 3])
    return model, r, {"W1": w1, "W2": w2}


@pytest.mark.parametrize("cond", [True, False])
def test_if_trains_weights_inside_and_outside_branches(cond):
    """Every weight of both branches gets a gradient (zeros for the branch not taken), the default
    trainable set included the branch-local ones, and the numbers match torch."""
    model, r, inner = _if_model(cond)
    feeds = {"x": np.random.default_rng(8).standard_normal((5, 4)).astype(np.float32)}
    grad_model = build_gradient_graph(model, "loss")
    assert {o.name for o in grad_model.graph.output} >= {"W1_grad", "W2_grad", "b_grad", "g_grad"}

    def reference(p):
        w1, w2 = torch.tensor(inner["W1"], requires_grad=True), torch.tensor(inner["W2"], requires_grad=True)
        reference.inner = (w1, w2)
        y = torch.tanh(p["x"] @ w1 + p["b"]) if cond else (p["x"] @ w2) * p["g"]
        return (y * r).sum()

    check(model, feeds, ["b", "g", "x"], reference)
    got = dict(zip([o.name for o in grad_model.graph.output], session(grad_model).run(None, feeds)))
    taken, other = ("W1", "W2") if cond else ("W2", "W1")
    expected = reference.inner[0 if cond else 1].grad.numpy()
    np.testing.assert_allclose(got[f"{taken}_grad"], expected, rtol=1e-5, atol=1e-6)
    assert not np.any(got[f"{other}_grad"])


# -- ONNX Runtime's fused transformer ops (decomposed before differentiation) ---------------------------
S, D, HEADS, VOCAB = 4, 8, 2, 11


def _layer_norm(x, p, eps=1e-12):
    return F.layer_norm(x, (D,), p["gamma"], p["beta"], eps=eps)


def _rms_norm(x, gamma, eps=1e-6):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * gamma


def _attention_reference(p, causal, mask=None):
    qkv = p["x"] @ p["W"] + p["b"]
    q, k, v = (t.reshape(B, S, HEADS, D // HEADS).transpose(1, 2) for t in qkv.split(D, dim=-1))
    scores = q @ k.transpose(-1, -2) / np.sqrt(D // HEADS)
    if mask is not None:
        scores = scores + (1 - torch.tensor(mask, dtype=torch.float32))[:, None, None, :] * -10000.0
    if causal:
        scores = scores + torch.triu(torch.full((S, S), -10000.0), diagonal=1)
    return (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(B, S, D)


def _contrib_cases():
    rng = np.random.default_rng(11)
    f = lambda *shape: (rng.standard_normal(shape) * 0.5).astype(np.float32)  # noqa: E731
    ids = rng.integers(0, VOCAB, (B, S)).astype(np.int32)
    segments = rng.integers(0, 2, (B, S)).astype(np.int32)
    mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], np.int32)
    ln = {"gamma": 1 + f(D) * 0.2, "beta": f(D)}
    ms = lambda op, ins, outs=("y",), **a: helper.make_node(op, ins, list(outs), domain="com.microsoft", **a)  # noqa: E731
    return {  # id: (nodes, feeds, weights, wrt, torch reference)
        "FastGelu": (
            [ms("FastGelu", ["x", "bias"])],
            {"x": f(B, S, D)},
            {"bias": f(D)},
            ["x", "bias"],
            lambda p: F.gelu(p["x"] + p["bias"], approximate="tanh"),
        ),
        "BiasGelu": (
            [ms("BiasGelu", ["x", "bias"])],
            {"x": f(B, S, D)},
            {"bias": f(D)},
            ["x", "bias"],
            lambda p: F.gelu(p["x"] + p["bias"]),
        ),
        "Gelu": ([ms("Gelu", ["x"])], {"x": f(B, S, D)}, {}, ["x"], lambda p: F.gelu(p["x"])),
        "SkipLayerNormalization": (
            [
                ms(
                    "SkipLayerNormalization",
                    ["x", "skip", "gamma", "beta", "bias"],
                    ["y", "", "", "sum"],
                    epsilon=1e-5,
                )
            ],
            {"x": f(B, S, D), "skip": f(B, S, D)},
            {**ln, "bias": f(D)},
            ["x", "skip", "gamma", "beta", "bias"],
            lambda p: _layer_norm(p["x"] + p["skip"] + p["bias"], p, 1e-5),
        ),
        "EmbedLayerNormalization": (
            [
                ms(
                    "EmbedLayerNormalization",
                    ["ids", "segments", "word", "position", "segment", "gamma", "beta", "mask"],
                    ["y", "mask_index"],
                    epsilon=1e-12,
                )
            ],
            {},
            {
                "ids": ids,
                "segments": segments,
                "mask": mask,
                "word": f(VOCAB, D),
                "position": f(6, D),
                "segment": f(2, D),
                **ln,
            },
            ["word", "position", "segment", "gamma", "beta"],
            lambda p: _layer_norm(
                p["word"][p["ids"].long()] + p["position"][:S] + p["segment"][p["segments"].long()], p
            ),
        ),
        "Attention-bert-mask": (
            [ms("Attention", ["x", "W", "b", "mask"], num_heads=HEADS)],
            {"x": f(B, S, D)},
            {"W": f(D, 3 * D), "b": f(3 * D), "mask": mask},
            ["x", "W", "b"],
            lambda p: _attention_reference(p, False, mask),
        ),
        "Attention-gpt2-causal-present": (
            [ms("Attention", ["x", "W", "b", "mask"], ["y", "present"], num_heads=HEADS, unidirectional=1)],
            {"x": f(B, S, D)},
            {"W": f(D, 3 * D), "b": f(3 * D), "mask": np.ones((B, S), np.int32)},
            ["x", "W", "b"],
            lambda p: _attention_reference(p, True),
        ),
        "FusedMatMul": (
            [ms("FusedMatMul", ["x", "W"], transB=1, alpha=0.5)],
            {"x": f(B, S, D)},
            {"W": f(5, D)},
            ["x", "W"],
            lambda p: 0.5 * p["x"] @ p["W"].T,
        ),
        "QuickGelu": (
            [ms("QuickGelu", ["x"], alpha=1.5)],
            {"x": f(B, S, D)},
            {},
            ["x"],
            lambda p: p["x"] * torch.sigmoid(1.5 * p["x"]),
        ),
        "SkipSimplifiedLayerNormalization": (
            [ms("SkipSimplifiedLayerNormalization", ["x", "skip", "gamma", "bias"], epsilon=1e-6)],
            {"x": f(B, S, D), "skip": f(B, S, D)},
            {"gamma": ln["gamma"], "bias": f(D)},
            ["x", "skip", "gamma", "bias"],
            lambda p: _rms_norm(p["x"] + p["skip"] + p["bias"], p["gamma"]),
        ),
        "SimplifiedLayerNormalization": (
            [helper.make_node("SimplifiedLayerNormalization", ["x", "gamma"], ["y"], epsilon=1e-6, axis=-1)],
            {"x": f(B, S, D)},
            {"gamma": ln["gamma"]},
            ["x", "gamma"],
            lambda p: _rms_norm(p["x"], p["gamma"]),
        ),
    }


CONTRIB = _contrib_cases()


def _contrib_model(kind, elem=FLOAT):
    """The fused node, its output projected by a fixed Q (as the next layer's MatMul reads it, which
    gives the float16 rewrite a compute-heavy op to lower), then the loss."""
    nodes, feeds, weights, _, reference = CONTRIB[kind]
    fused = onnx.NodeProto()
    fused.CopyFrom(nodes[0])
    fused.output[0] = "fused"
    width = reference({k: torch.tensor(v) for k, v in {**feeds, **weights}.items()}).shape
    q = np.random.default_rng(12).standard_normal((width[-1], 3)).astype(np.float32)
    inputs = [helper.make_tensor_value_info(k, elem, list(v.shape)) for k, v in feeds.items()]
    model, r = loss_model(
        [fused, helper.make_node("MatMul", ["fused", "Q"], ["y"])],
        inputs,
        {**weights, "Q": q},
        [*width[:-1], 3],
        elem=elem,
    )
    return model, r, torch.tensor(q)


@pytest.mark.parametrize("kind", CONTRIB)
def test_contrib_decomposition_matches_ort_kernel(kind):
    """The decomposed forward equals ONNX Runtime's fused kernel within float32 rounding (every output)."""
    from amp_rewrite.autodiff.contrib import decompose_contrib_ops

    model, _, _ = _contrib_model(kind)
    feeds = CONTRIB[kind][1]
    fused_outputs = [o for o in model.graph.node[0].output if o]
    del model.graph.output[:]
    model.graph.output.extend(
        helper.make_tensor_value_info(o, TensorProto.INT32 if o == "mask_index" else FLOAT, None)
        for o in fused_outputs
    )
    decomposed = onnx.ModelProto()
    decomposed.CopyFrom(model)
    assert decompose_contrib_ops(decomposed) == 1
    assert not any(n.domain for n in decomposed.graph.node)
    for fused, plain in zip(session(model).run(None, feeds), session(decomposed).run(None, feeds)):
        assert fused.shape == plain.shape and fused.dtype == plain.dtype
        np.testing.assert_allclose(plain, fused, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(fused).max())))


@pytest.mark.parametrize("kind", CONTRIB)
def test_contrib_gradient_matches_torch_and_finite_differences(kind):
    """float32 (and float16) against torch; the same rule in float64 against central differences."""
    from amp_rewrite.autodiff.contrib import decompose_contrib_ops
    from amp_rewrite.autodiff.gradcheck import max_gradient_error, numeric_gradients

    _, feeds, weights, wrt, reference = CONTRIB[kind]
    model, r, q = _contrib_model(kind)
    check(model, feeds, wrt, lambda p: ((reference(p) @ q) * r).sum())
    model64, _, _ = _contrib_model(kind, TensorProto.DOUBLE)
    decompose_contrib_ops(model64)
    values = {
        k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in {**feeds, **weights}.items()
    }
    grad64 = build_gradient_graph(model64, "loss", wrt)
    from onnx.reference import ReferenceEvaluator

    analytic = dict(
        zip(wrt, ReferenceEvaluator(grad64).run([f"{w}_grad" for w in wrt], {k: values[k] for k in feeds}))
    )
    as_inputs = _weights_as_inputs(model64, {k: values[k] for k in wrt})
    # onnx.reference computes Erf in float32 only: a wider step and tolerance where the decomposition has one
    erf = any(node.op_type == "Erf" for node in model64.graph.node)
    numeric = numeric_gradients(
        as_inputs,
        "loss",
        {k: values[k] for k in [*feeds, *wrt]},
        wrt,
        eps=1e-3 if erf else 1e-6,
        max_coords=24,
    )
    assert max_gradient_error(numeric, analytic) < (2e-3 if erf else 1e-5)


def _weights_as_inputs(model, trainable):
    """A copy whose `trainable` initializers are graph inputs, so the differences can move them."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    kept = [t for t in out.graph.initializer if t.name not in trainable]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    out.graph.input.extend(
        helper.make_tensor_value_info(k, TensorProto.DOUBLE, list(v.shape))
        for k, v in trainable.items()
        if k not in {i.name for i in out.graph.input}
    )
    return out


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
def test_torchscript_export_of_a_two_layer_bidirectional_rnn_matches_torch(cell):
    """What the exporter writes (per-layer nodes, reordered weight initializers, Squeeze/Transpose
    between layers) differentiates to torch's gradients."""
    import io
    import warnings

    torch.manual_seed(0)
    module = getattr(torch.nn, cell)(3, 4, num_layers=2, bidirectional=True)
    x = torch.randn(5, 2, 3)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module, (x,), buffer, dynamo=False, opset_version=17, input_names=["x"], output_names=["y"]
        )
    model = onnx.load_from_string(buffer.getvalue())
    assert {n.op_type for n in model.graph.node} >= {cell}
    r = torch.randn(5, 2, 8)
    graph = model.graph
    del graph.output[1:]
    graph.initializer.append(numpy_helper.from_array(r.numpy(), "R"))
    graph.node.extend(
        [
            helper.make_node("Mul", ["y", "R"], ["yr"]),
            helper.make_node("ReduceSum", ["yr"], ["loss"], keepdims=0),
        ]
    )
    graph.output.append(helper.make_tensor_value_info("loss", FLOAT, []))
    grad_model = build_gradient_graph(model, "loss", ["x"])
    got = dict(
        zip([o.name for o in grad_model.graph.output], session(grad_model).run(None, {"x": x.numpy()}))
    )
    x.requires_grad_(True)
    (module(x)[0] * r).sum().backward()
    np.testing.assert_allclose(got["x_grad"], x.grad.numpy(), rtol=1e-4, atol=1e-5)
    weights = build_gradient_graph(
        model, "loss"
    )  # every float initializer: the exporter's copies of the weights
    names = [f"{n.input[slot]}_grad" for n in model.graph.node if n.op_type == cell for slot in (1, 2, 3)]
    assert len(names) == 6
    values = dict(
        zip([o.name for o in weights.graph.output], session(weights).run(None, {"x": x.detach().numpy()}))
    )
    total = sum(float(np.abs(values[n]).sum()) for n in names)
    expected = sum(float(p.grad.abs().sum()) for p in module.parameters())
    assert abs(total - expected) <= 1e-4 * expected  # same gradients, reordered into ONNX's gate layout


def test_a_loop_reading_a_weight_is_refused_by_name():
    """A Loop body that reads a weight on the loss path has no rule: one line names it (before, the
    captured weight was silently left without its gradient)."""
    from amp_rewrite.errors import GradientError

    body = helper.make_graph(
        [helper.make_node("Mul", ["h", "w"], ["h2"]), helper.make_node("Identity", ["c"], ["c2"])],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
            helper.make_tensor_value_info("h", FLOAT, [3]),
        ],
        [
            helper.make_tensor_value_info("c2", TensorProto.BOOL, []),
            helper.make_tensor_value_info("h2", FLOAT, [3]),
        ],
    )
    loop = helper.make_node("Loop", ["n", "", "x"], ["y"], name="repeat", body=body)
    inputs = [helper.make_tensor_value_info("x", FLOAT, [3])]
    model, _ = loss_model([loop], inputs, {"w": np.ones(3, np.float32), "n": np.array(2, np.int64)}, [3])
    with pytest.raises(GradientError, match="no gradient rule for op Loop \\(node 'repeat'\\)"):
        build_gradient_graph(model, "loss", ["w"])
