"""Write the two example models that ship in examples/ (opset 17, IR 8, seeded weights).

    python examples/make_examples.py        # rewrites tiny_transformer.onnx and tiny_cnn.onnx

tiny_transformer.onnx is a 2-layer pre-LN stack from tools/synthetic.py (LayerNormalization,
attention with Softmax, Erf GELU): every op is an allow, infer or clear op, so all 69 float nodes
go float16 ("deny ops: 0"); `--deny Softmax` shows deny ops kept float32 inside a float16 graph.
tiny_cnn.onnx is built node by node here (Conv, BatchNormalization, Relu, MaxPool, Conv,
GlobalAveragePool, Flatten, Gemm): the case where the whole graph goes float16.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).resolve().parent


def _load_synthetic():
    """tools/synthetic.py, loaded from its file (tools/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("synthetic", HERE.parent / "tools" / "synthetic.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


synthetic = _load_synthetic()

OPSET = 17
IR_VERSION = 8
TRANSFORMER_NODES = 2 * synthetic.NODES_PER_LAYER + synthetic.FINAL_NODES


def tiny_transformer() -> onnx.ModelProto:
    """Two layers, hidden 32, 4 heads: about 100 KB of weights, small enough to commit."""
    return synthetic.transformer_stack(TRANSFORMER_NODES, hidden=32, heads=4, seed=0)


def _weights(rng: np.random.Generator, name: str, shape) -> onnx.TensorProto:
    fan_in = int(np.prod(shape[1:])) or 1
    return numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32), name)


def _batch_norm_params(rng: np.random.Generator, prefix: str, channels: int) -> list[onnx.TensorProto]:
    """Non-trivial statistics, so the affine map BatchNormalization applies is visible in outputs."""
    values = {
        "scale": 1.0 + 0.1 * rng.standard_normal(channels),
        "bias": 0.1 * rng.standard_normal(channels),
        "mean": 0.1 * rng.standard_normal(channels),
        "var": 1.0 + 0.1 * rng.random(channels),
    }
    return [numpy_helper.from_array(v.astype(np.float32), f"{prefix}.{k}") for k, v in values.items()]


def tiny_cnn(classes: int = 10, seed: int = 0) -> onnx.ModelProto:
    """image [batch, 3, 16, 16] -> logits [batch, classes]."""
    rng = np.random.default_rng(seed)
    inits = [
        _weights(rng, "conv1.w", (8, 3, 3, 3)),
        numpy_helper.from_array(np.zeros(8, np.float32), "conv1.b"),
        *_batch_norm_params(rng, "bn1", 8),
        _weights(rng, "conv2.w", (16, 8, 3, 3)),
        numpy_helper.from_array(np.zeros(16, np.float32), "conv2.b"),
        _weights(rng, "fc.w", (classes, 16)),
        numpy_helper.from_array(np.zeros(classes, np.float32), "fc.b"),
    ]
    nodes = [
        helper.make_node("Conv", ["image", "conv1.w", "conv1.b"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node(
            "BatchNormalization", ["c1", "bn1.scale", "bn1.bias", "bn1.mean", "bn1.var"], ["b1"], name="bn1"
        ),
        helper.make_node("Relu", ["b1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], name="pool1", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "conv2.w", "conv2.b"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["c2"], ["g"], name="global_pool"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc.w", "fc.b"], ["logits"], name="fc", transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_cnn",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, 16, 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])],
        inits,
    )
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        ir_version=IR_VERSION,
        producer_name="amp-rewrite examples/make_examples.py",
    )


EXAMPLES = {"tiny_transformer.onnx": tiny_transformer, "tiny_cnn.onnx": tiny_cnn}


def main() -> int:
    for filename, build in EXAMPLES.items():
        model = build()
        onnx.checker.check_model(model, full_check=True)
        path = HERE / filename
        onnx.save(model, str(path))
        print(f"{path.relative_to(HERE.parent)}: {len(model.graph.node)} nodes, {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
