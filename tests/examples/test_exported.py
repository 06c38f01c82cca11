"""Real exported models: a small CNN, a BERT-style encoder and a GPT-2-style decoder, exported by
PyTorch's TorchScript exporter (dynamo=False) and its dynamo exporter (dynamo=True, needs
onnxscript) at opsets 17 and 18. The rewrite must put every MatMul/Gemm/Conv in the target type
and keep the numbers close to float32 in ONNX Runtime. torch (and onnxscript, for the dynamo
exporter) are optional: skipped without them; any other error, an export's included, fails.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest

from amp_rewrite import rewrite
from helpers import run_ort, run_reference
from kernel_facts import uncovered_low_nodes

torch = pytest.importorskip("torch")
nn = torch.nn

HEAVY = {"MatMul", "Gemm", "Conv"}


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, 5),
        )

    def forward(self, x):
        return self.body(x)


class Block(nn.Module):
    def __init__(self, hidden, heads, causal):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = (
            self.qkv(self.ln1(x) if self.causal else x)
            .reshape(b, t, 3, self.heads, h // self.heads)
            .permute(2, 0, 3, 1, 4)
        )
        scores = q @ k.transpose(-1, -2) / (h // self.heads) ** 0.5
        if self.causal:
            mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
            scores = scores.masked_fill(mask, float("-inf"))
        ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, h)
        if self.causal:  # GPT-2: pre-LN
            x = x + self.proj(ctx)
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x + self.proj(ctx))  # BERT: post-LN
        return self.ln2(x + self.mlp(x))


class Encoder(nn.Module):
    def __init__(self, causal, vocab=50, hidden=16, heads=2, layers=2, max_len=8):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(max_len, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, causal) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


MODELS = {
    "cnn": (CNN, lambda: torch.randn(2, 3, 8, 8)),
    "bert": (lambda: Encoder(causal=False), lambda: torch.randint(0, 50, (2, 8))),
    "gpt2": (lambda: Encoder(causal=True), lambda: torch.randint(0, 50, (2, 8))),
}


def _export(module, example, opset, dynamo):
    if dynamo:
        pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript")
    buffer = io.BytesIO()
    with warnings.catch_warnings():  # an export error fails the test: only a missing exporter skips
        warnings.simplefilter("ignore")
        if dynamo:
            program = torch.onnx.export(module, (example,), dynamo=True, opset_version=opset, verbose=False)
            model = program.model_proto
        else:
            torch.onnx.export(
                module,
                (example,),
                buffer,
                dynamo=False,
                opset_version=opset,
                input_names=["x"],
                output_names=["y"],
            )
            model = onnx.load_from_string(buffer.getvalue())
    if model.ir_version > 10:
        model.ir_version = 10  # ORT 1.31 loads up to IR 10 here; nothing newer is used
    return model


def _schema_refuses_bf16(report_node):
    """Conv admits bfloat16 only from opset 22: before, the schema keeps it float32 (and says so)."""
    return all("does not allow bfloat16" in g["reason"] for g in report_node["groups"].values())


def _heavy_nodes(model):
    stack, found = [model.graph], []
    while stack:
        g = stack.pop()
        for n in g.node:
            if n.op_type in HEAVY:
                found.append(n)
            for a in n.attribute:
                if a.HasField("g"):
                    stack.append(a.g)
                stack.extend(a.graphs)
    return found


CASES = [
    ("float16", name, opset, dynamo) for name in MODELS for opset in (17, 18) for dynamo in (False, True)
]
CASES += [("bfloat16", name, 18, True) for name in MODELS]  # bfloat16: one exporter, to keep CI short


@pytest.mark.parametrize(
    "target,name,opset,dynamo",
    CASES,
    ids=[f"{t}-{n}-{o}-{'dynamo' if d else 'torchscript'}" for t, n, o, d in CASES],
)
def test_exported_model(name, opset, dynamo, target):
    torch.manual_seed(0)
    make, example_fn = MODELS[name]
    module = make().eval()
    example = example_fn()
    model = _export(module, example, opset, dynamo)
    result = rewrite(model, target=target)
    onnx.checker.check_model(result.model, full_check=True)
    assert uncovered_low_nodes(result.model, target) == []  # every low node has a CUDA kernel at its opset
    heavy = [n for n in result.report.nodes if n["op_type"] in HEAVY]
    assert heavy and len(heavy) == len(_heavy_nodes(result.model))
    not_low = [
        (n["name"], n["precision"])
        for n in heavy
        if n["precision"] != target and not (target == "bfloat16" and _schema_refuses_bf16(n))
    ]
    assert not not_low, not_low
    feeds = {model.graph.input[0].name: example.numpy()}
    expected = run_ort(model, feeds)
    if target == "float16":
        got = run_ort(result.model, feeds)
        tol = 2e-2
    else:  # ORT CPU lacks most bfloat16 kernels: the model must still load; numbers from onnx.reference
        got = run_reference(result.model, feeds)
        tol = 8e-2
    for a, e in zip(got, expected):
        scale = float(np.max(np.abs(e)))
        np.testing.assert_allclose(a, e, rtol=tol, atol=tol * scale)


def test_eager_vit_export_loses_its_softmax_casts():
    """transformers' eager attention exports `softmax(..., dtype=float32).to(query.dtype)`: two
    Cast(to=FLOAT) on float32 tensors after each Softmax (ViT-S/16 holds 24). With Softmax in
    float16 they would take it to float32 and back: both are removed (transform/noop_casts.py), so
    the rewrite holds fewer Casts than the export (as bench_placement measures on ViT-S/16)."""
    tr = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = tr.ViTConfig(
        image_size=8,
        patch_size=2,
        num_channels=1,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        attn_implementation="eager",
    )
    vit = tr.ViTModel(config, add_pooling_layer=False).eval()

    class Hidden(nn.Module):
        def __init__(self):
            super().__init__()
            self.vit = vit

        def forward(self, x):
            return self.vit(x, return_dict=False)[0]

    example = torch.randn(2, 1, 8, 8)
    model = _export(Hidden().eval(), example, 17, dynamo=False)
    before = [n for n in model.graph.node if n.op_type == "Cast"]
    assert len(before) == 2 * config.num_hidden_layers  # the export's own, Cast(to=FLOAT) on float32
    result = rewrite(model)
    onnx.checker.check_model(result.model, full_check=True)
    after = [n for n in result.model.graph.node if n.op_type == "Cast"]
    s = result.report.summary
    assert s["casts_removed"] == len(before) and {n.name for n in after}.isdisjoint(n.name for n in before)
    assert len(after) - len(before) == s["casts_inserted"] - s["casts_removed"] < 0
    feeds = {model.graph.input[0].name: example.numpy()}
    expected = run_ort(model, feeds)
    for got in (run_ort(result.model, feeds), run_reference(result.model, feeds)):
        for a, e in zip(got, expected):
            np.testing.assert_allclose(a, e, rtol=2e-2, atol=2e-2 * float(np.max(np.abs(e))))
