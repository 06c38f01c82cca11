"""Small models exported from PyTorch, so the benchmark also times graphs a real exporter wrote.

Exported graphs differ from the synthetic stacks in ways that matter to a rewrite: Constant nodes,
Shape/Gather/Unsqueeze chains, Gemm instead of MatMul, BatchNormalization folded or kept. torch is
optional: `available()` says whether it can be imported, and nothing here imports it before.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

OPSET = 17
MAX_IR_VERSION = 10  # ONNX Runtime 1.31 refuses newer


def to_onnx(module, args, names, *, dynamo: bool, axes=None):
    """`module` (one output, "out") as an ONNX model: TorchScript at opset 17, or the dynamo
    exporter at 18 (GPT-2: TorchScript has no aten::diff); IR version at most MAX_IR_VERSION."""
    import io

    import onnx
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            model = torch.onnx.export(
                module,
                args,
                dynamo=True,
                opset_version=18,
                verbose=False,
                input_names=names,
                output_names=["out"],
            ).model_proto
        else:
            buffer = io.BytesIO()
            torch.onnx.export(
                module,
                args,
                buffer,
                dynamo=False,
                opset_version=OPSET,
                input_names=names,
                output_names=["out"],
                dynamic_axes=axes,
            )
            model = onnx.load_from_string(buffer.getvalue())
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    return model


def available() -> bool:
    return importlib.util.find_spec("torch") is not None


def _bert_module(vocab: int, hidden: int, heads: int, layers: int, max_len: int):
    import torch
    from torch import nn

    class SelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(hidden, 3 * hidden)
            self.out = nn.Linear(hidden, hidden)

        def forward(self, x, mask_bias):
            batch, seq, _ = x.shape
            q, k, v = self.qkv(x).reshape(batch, seq, 3, heads, hidden // heads).permute(2, 0, 3, 1, 4)
            scores = q @ k.transpose(-1, -2) / (hidden // heads) ** 0.5 + mask_bias
            context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, hidden)
            return self.out(context)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.ln1, self.ln2 = SelfAttention(), nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

        def forward(self, x, mask_bias):
            x = self.ln1(x + self.attn(x, mask_bias))
            return self.ln2(x + self.mlp(x))

    class Encoder(nn.Module):
        """BERT-style: token + position embeddings, post-LN layers, pooled tanh head."""

        def __init__(self):
            super().__init__()
            self.tokens, self.positions = nn.Embedding(vocab, hidden), nn.Embedding(max_len, hidden)
            self.ln = nn.LayerNorm(hidden)
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            self.pool = nn.Linear(hidden, hidden)

        def forward(self, input_ids, attention_mask):
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            x = self.ln(self.tokens(input_ids) + self.positions(positions))
            mask_bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -10000.0
            for layer in self.layers:
                x = layer(x, mask_bias)
            return torch.tanh(self.pool(x[:, 0]))

    return Encoder()


def _cnn_module(classes: int):
    from torch import nn

    def stage(c_in, c_out):
        return [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(), nn.MaxPool2d(2)]

    return nn.Sequential(
        *stage(3, 16),
        *stage(16, 32),
        *stage(32, 64),
        nn.Conv2d(64, 64, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, classes),
    )


def _export(module, args, path: Path, input_names, dynamic_axes) -> Path:
    import torch

    torch.manual_seed(0)
    module.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(
            module,
            args,
            str(path),
            dynamo=False,
            opset_version=OPSET,
            input_names=input_names,
            output_names=["output"],
            dynamic_axes=dynamic_axes,
        )
    return path


def export_bert(path: Path, hidden: int = 64, heads: int = 4, layers: int = 4) -> Path:
    """A small BERT-style encoder with dynamic batch and sequence axes."""
    import torch

    torch.manual_seed(0)
    module = _bert_module(vocab=1000, hidden=hidden, heads=heads, layers=layers, max_len=128)
    ids = torch.randint(0, 1000, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.int64)
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}
    return _export(module, (ids, mask), path, ["input_ids", "attention_mask"], axes)


def export_cnn(path: Path, classes: int = 10) -> Path:
    """A small VGG-style CNN (Conv, BatchNorm, ReLU, MaxPool, global pool, Linear)."""
    import torch

    torch.manual_seed(0)
    module = _cnn_module(classes)
    return _export(module, (torch.randn(2, 3, 32, 32),), path, ["image"], {"image": {0: "batch"}})
