"""Real exports for the fine-tuning tests: each `export_<name>()` returns (ONNX model, batches,
parameter names by hand). torch and transformers are imported inside, so importing this module
never needs them.

The objectives are real: scikit-learn's 8x8 digits classified by the MLP, CNN, ViT and BERT (pixel
intensities as 17 tokens), and next-token prediction on a short text for GPT-2 and Llama, on a
fixed fine-tuning batch (ROUNDS) for STEPS steps. `LR` is each model's AdamW learning rate.
"""

from __future__ import annotations

import numpy as np
import onnx

import torch_exports as exports

TEXT = (
    "the quick brown fox jumps over the lazy dog. a stitch in time saves nine. "
    "all that glitters is not gold. the early bird catches the worm. "
    "actions speak louder than words. practice makes perfect. "
) * 2
BATCH = 16
SEQ = 16
STEPS = 30
ROUNDS = 1  # distinct batches, cycled (1: fine-tune on one fixed batch); the loss is compared between the first and last round


def digits():
    """scikit-learn's 8x8 digits, intensities 0..16 (int), labels 0..9."""
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.images.astype(np.int64), data.target.astype(np.int64)


def digit_batches(kind: str, steps: int = STEPS, seed: int = 0):
    """`steps` batches of digits as floats [N,64] ("flat"), images [N,1,8,8] ("image") or tokens
    ("tokens"): ROUNDS batches of a fixed subset, cycled (epochs over a small fine-tuning set)."""
    images, labels = digits()
    rng = np.random.default_rng(seed)
    picks = [rng.choice(len(images), BATCH, replace=False) for _ in range(ROUNDS)]
    batches = []
    for step in range(steps):
        pick = picks[step % ROUNDS]
        x = images[pick]
        if kind == "flat":
            x = x.reshape(BATCH, 64).astype(np.float32) / 16
        elif kind == "image":
            x = x.reshape(BATCH, 1, 8, 8).astype(np.float32) / 16
        else:
            x = x.reshape(BATCH, 64)
        batches.append((x, labels[pick]))
    return batches


def text_batches(steps: int = STEPS, seed: int = 0):
    """`steps` batches of (ids [N,SEQ], next ids [N,SEQ]) from TEXT, characters as tokens, ROUNDS
    fixed batches cycled."""
    vocab = sorted(set(TEXT))
    ids = np.array([vocab.index(c) for c in TEXT], np.int64)
    rng = np.random.default_rng(seed)
    picks = [rng.integers(0, len(ids) - SEQ - 1, BATCH) for _ in range(ROUNDS)]
    batches = []
    for step in range(steps):
        starts = picks[step % ROUNDS]
        x = np.stack([ids[s : s + SEQ] for s in starts])
        y = np.stack([ids[s + 1 : s + SEQ + 1] for s in starts])
        batches.append((x, y))
    return batches, len(vocab)


def _feeds(model: onnx.ModelProto, batches):
    name = model.graph.input[0].name
    return [{name: x, "labels": y} for x, y in batches]


def _torchscript(module, args, input_names, opset=17, dynamic_axes=None):
    return exports.torchscript(module, args, input_names, opset, dynamic_axes, output_names=["logits"])


def _dynamo(module, args, opset=18):
    return exports.dynamo(module, args, ["input_ids"], opset, output_names=["logits"])


def _hand(module):
    """The module, so a test can find its parameters in the export by hand (`by_hand`)."""
    return module


def by_hand(model: onnx.ModelProto, module) -> set[str]:
    """The float initializers or Constant values holding one of the module's parameters (as stored
    or transposed, as exporters write MatMul weights, in any shape): what a user would list by hand."""
    from onnx import numpy_helper

    wanted = set()
    for _, parameter in module.named_parameters():
        array = parameter.detach().numpy()
        wanted.add(array.tobytes())
        if array.ndim == 2:
            wanted.add(np.ascontiguousarray(array.T).tobytes())
    tensors = list(model.graph.initializer)
    tensors += [
        a.t for n in model.graph.node if n.op_type == "Constant" for a in n.attribute if a.name == "value"
    ]
    found = set()
    for tensor in tensors:
        array = numpy_helper.to_array(tensor)
        if array.dtype == np.float32 and array.size > 1 and array.tobytes() in wanted:
            found.add(tensor.name if tensor.name else "")
    return found


def _perturb(module):
    """Make every parameter distinct (a fine-tuning start, not a fresh init): the TorchScript
    exporter merges equal initializers (all-ones LayerNorm scales, all-zero biases) into one
    shared tensor, which would tie them in training."""
    import torch

    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter += 0.02 * torch.randn(parameter.shape, generator=generator)
    return module


def export_mlp():
    import torch
    from torch import nn

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    model = _torchscript(module, (torch.zeros(BATCH, 64),), ["x"])
    return model, _feeds(model, digit_batches("flat")), _hand(module)


def export_cnn():
    """Conv, ReLU, BatchNorm (after the ReLU so the exporter cannot fold it into the Conv), MaxPool."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    module = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.BatchNorm2d(8),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64, 10),
    )
    model = _torchscript(module, (torch.zeros(BATCH, 1, 8, 8),), ["x"])
    return model, _feeds(model, digit_batches("image")), _hand(module)


def export_vit():
    import torch
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(
        image_size=8,
        patch_size=2,
        num_channels=1,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=10,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    module = _perturb(ViTForImageClassification(config))
    model = _torchscript(exports.logits_only(module), (torch.zeros(BATCH, 1, 8, 8),), ["pixel_values"])
    return model, _feeds(model, digit_batches("image")), _hand(module)


def export_bert():
    """BERT classifying digits read as 64 tokens (pixel intensity 0..16)."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=17,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=10,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    module = _perturb(BertForSequenceClassification(config))
    model = _torchscript(
        exports.logits_only(module), (torch.zeros(BATCH, 64, dtype=torch.int64),), ["input_ids"]
    )
    return model, _feeds(model, digit_batches("tokens")), _hand(module)


def export_gpt2():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    batches, vocab = text_batches()
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    module = _perturb(GPT2LMHeadModel(config))
    model = _dynamo(exports.logits_only(module), (torch.zeros(BATCH, SEQ, dtype=torch.int64),))
    return model, _feeds(model, batches), _hand(module)


def export_llama():
    """Llama through the dynamo exporter: model-local functions, GQA (4 heads, 2 KV heads), RoPE, RMSNorm."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    batches, vocab = text_batches()
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        use_cache=False,
    )
    module = _perturb(LlamaForCausalLM(config))
    model = _dynamo(exports.logits_only(module), (torch.zeros(BATCH, SEQ, dtype=torch.int64),))
    return model, _feeds(model, batches), _hand(module)


def export_constant_weights():
    """An MLP at opset 11 whose weights are Constant nodes, as PaddlePaddle writes them."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
    model = _torchscript(module, (torch.zeros(BATCH, 64),), ["x"], opset=11)
    graph = model.graph
    constants = [
        onnx.helper.make_node("Constant", [], [t.name], name=f"const/{t.name}", value=t)
        for t in graph.initializer
    ]
    nodes = constants + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.initializer[:]
    return model, _feeds(model, digit_batches("flat")), _hand(module)


LR = {"cnn": 5e-3, "bert": 5e-3}  # others 3e-3
EXPORTS = {
    "mlp": export_mlp,
    "cnn": export_cnn,
    "vit": export_vit,
    "bert": export_bert,
    "gpt2": export_gpt2,
    "llama": export_llama,
    "constant_weights": export_constant_weights,
}
