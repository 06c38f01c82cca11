"""The cross-entropy of a language-model head computed over row chunks (`training.chunked_loss`):
its gradients equal torch autograd's, the chunked step graph is chosen only for such a head, and
float16 training and recompute still run on it."""

from __future__ import annotations

import numpy as np
import pytest

from amp_rewrite.training import SGD, Trainer
from amp_rewrite.training.chunked_loss import CHUNK_CLASSES, CHUNKS
from amp_rewrite.training.losses import CrossEntropy
from helpers import TF32_RTOL, init, make_model, node, on_cuda, tensor

HIDDEN, CLASSES, BATCH, SEQ = 8, CHUNK_CLASSES, 5, 7  # 35 rows + 16 zero-weight rows: 16 chunks of 3 or 4
LR = 1e4
PLAIN = {"optimizer": SGD(0.1), "precision": "float32", "provider": "cpu", "verbose": False}


def lm_head(classes=CLASSES, bias=True, flat=False, seed=0):
    """x [N, SEQ, HIDDEN] -> Tanh(x W0) -> (h W + b) [-> Reshape [-1, classes]]: the logits."""
    rng = np.random.default_rng(seed)
    weights = {
        "W0": rng.normal(0, 0.5, (HIDDEN, HIDDEN)).astype(np.float32),
        "W": rng.normal(0, 0.5, (HIDDEN, classes)).astype(np.float32),
    }
    nodes = [
        node("MatMul", ["x", "W0"], ["h0"], name="inner"),
        node("Tanh", ["h0"], ["h"], name="act"),
        node("MatMul", ["h", "W"], ["mm" if bias or flat else "logits"], name="decoder"),
    ]
    if bias:
        weights["b"] = rng.normal(0, 0.5, classes).astype(np.float32)
        nodes.append(node("Add", ["b", "mm"], ["biased" if flat else "logits"], name="decoder_bias"))
    out = ["N", SEQ, classes]
    if flat:
        weights["flat_shape"] = np.array([-1, classes], np.int64)
        nodes.append(node("Reshape", ["biased" if bias else "mm", "flat_shape"], ["logits"], name="flatten"))
        out = ["M", classes]
    return make_model(
        nodes,
        [tensor("x", ["N", SEQ, HIDDEN])],
        [tensor("logits", out)],
        [init(k, v) for k, v in weights.items()],
    ), weights


def feeds(flat=False, seed=1):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, (BATCH, SEQ))
    labels[0, :3] = labels[3, 5] = -100
    return {
        "x": rng.standard_normal((BATCH, SEQ, HIDDEN)).astype(np.float32),
        "labels": labels.reshape(-1) if flat else labels,
    }


def chunk_matmuls(model):
    return [n for n in model.graph.node if n.name.startswith("loss/chunk_") and n.op_type == "MatMul"]


@pytest.mark.parametrize(
    "options, bias, flat",
    [({}, True, False), ({"label_smoothing": 0.1}, True, False), ({}, False, True)],
    ids=["plain", "smoothing", "no-bias-reshaped"],
)
def test_chunked_cross_entropy_gradients_match_torch(options, bias, flat):
    """One SGD step with a large rate (so w's own rounding is negligible) gives (w - w') / lr = dw
    for W, b and W0 (through the hidden states' gradient): each equals torch autograd's through
    F.cross_entropy, with ignored labels and chunks of uneven sizes (35 rows in 16 chunks)."""
    torch = pytest.importorskip("torch", reason="the reference is torch's autograd")
    model, weights = lm_head(bias=bias, flat=flat)
    batch = feeds(flat)
    t = Trainer(model, loss=CrossEntropy(**options), optimizer=SGD(LR), precision="float32", verbose=False)
    assert len(chunk_matmuls(t.step_graph.model)) == CHUNKS
    loss = t.step(batch).loss
    params = {k: torch.tensor(v, requires_grad=True) for k, v in weights.items() if v.dtype == np.float32}
    h = torch.tanh(torch.tensor(batch["x"]) @ params["W0"])
    logits = h @ params["W"] + (params["b"] if bias else 0)
    expected = torch.nn.functional.cross_entropy(
        logits.reshape(-1, CLASSES), torch.tensor(batch["labels"]).reshape(-1), **options
    )
    expected.backward()
    rtol = TF32_RTOL if on_cuda() else 1e-5  # CUDA's float32 MatMul runs TF32 by default
    assert loss == pytest.approx(expected.item(), rel=TF32_RTOL if on_cuda() else 1e-6)
    trained = t.weights()
    for name, p in params.items():
        grad = (weights[name].astype(np.float64) - trained[name]) / LR
        expected_grad = p.grad.numpy()
        np.testing.assert_allclose(
            grad, expected_grad, rtol=rtol, atol=rtol / 10 * np.abs(expected_grad).max()
        )


def test_only_a_head_with_many_classes_is_chunked():
    """The head's MatMul moves into the loss (no node makes the whole logits); a head with few
    classes keeps the unchunked loss, which reads the model's logits."""
    chunked = Trainer(lm_head()[0], **PLAIN).step_graph.model
    names = {n.name for n in chunked.graph.node}
    assert "decoder" not in names and "decoder_bias" not in names
    assert not any("logits" == o for n in chunked.graph.node for o in n.output)
    few = Trainer(lm_head(classes=CHUNK_CLASSES - 1)[0], **PLAIN).step_graph.model
    assert not chunk_matmuls(few)
    loss_ops = ("ReduceLogSumExp", "LogSoftmax")  # on CPU the step computes it by LogSoftmax
    assert any(n.input[0] == "logits" for n in few.graph.node if n.op_type in loss_ops)


def test_chunked_loss_trains_in_float16_and_with_recompute():
    """The loss region (its chunks included) stays float32 under float16; recompute="auto" runs
    and gives the plain step's loss."""
    batch = feeds()
    plain = Trainer(lm_head()[0], **PLAIN)
    expected = plain.step(batch).loss
    half = Trainer(lm_head()[0], **(PLAIN | {"precision": "float16"}))
    assert half.step(batch).loss == pytest.approx(expected, rel=1e-2)
    recomputed = Trainer(lm_head()[0], recompute="auto", **PLAIN)
    assert recomputed.step(batch).loss == pytest.approx(expected, rel=1e-6)
