"""amp-rewrite as one step of an export pipeline, right after torch.onnx.export.

    pip install torch        # optional: without it this script says so and exits 0
    python examples/export_pipeline.py [--out DIR]

The pipeline calls `amp_rewrite.maybe_rewrite(model)` unconditionally; whether it rewrites is
decided by the caller turning the rewrite on (`amp_rewrite.enabled(...)` here, or
`amp_rewrite.enable()` / AMP_REWRITE_ENABLED=1), so one export script serves float32 and
mixed-precision builds. Both models are run in ONNX Runtime and their outputs compared.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

import amp_rewrite


def tiny_classifier():
    """Linear -> GELU -> LayerNorm -> Linear -> Softmax: allow, infer and deny ops in eight lines."""
    from torch import nn

    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4), nn.Softmax(-1))


def export(module, example, path: Path) -> onnx.ModelProto:
    import torch

    module.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(
            module,
            (example,),
            str(path),
            dynamo=False,
            opset_version=17,
            input_names=["x"],
            output_names=["probs"],
            dynamic_axes={"x": {0: "batch"}, "probs": {0: "batch"}},
        )
    return onnx.load(str(path))


def pipeline(module, example, out: Path) -> Path:
    """Export, then the (possibly disabled) mixed-precision step, then save: what a build script does."""
    model = export(module, example, out / "model.onnx")
    model = amp_rewrite.maybe_rewrite(model)
    path = out / "model.amp.onnx"
    onnx.save(model, str(path))
    return path


def run(path: Path, feeds: dict) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="folder for the exported models (default: a temporary one)")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("torch") is None:
        print("torch is not installed: this example exports a torch model; `pip install torch` to run it")
        return 0
    import torch

    torch.manual_seed(0)
    module, example = tiny_classifier(), torch.randn(8, 16)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        with amp_rewrite.enabled(target="float16"):
            amp_path = pipeline(module, example, out)
        feeds = {"x": example.numpy()}
        reference, mixed = run(out / "model.onnx", feeds), run(amp_path, feeds)
        with torch.no_grad():
            eager = module(example).numpy()
        print(f"float32 ONNX vs torch:        max abs diff {np.abs(reference - eager).max():.2e}")
        print(f"float16 ONNX vs float32 ONNX: max abs diff {np.abs(mixed - reference).max():.2e}")
        casts = sum(node.op_type == "Cast" for node in onnx.load(str(amp_path)).graph.node)
        print(f"Cast nodes in the rewritten model: {casts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
