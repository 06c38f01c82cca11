"""torch.onnx exports shared by the test corpora (`corpus.py`, `exported_training.py`): one copy of
the exporter calls, with warnings silenced and the IR version lowered to what ONNX Runtime 1.31
loads. torch is imported inside each function, so importing this module never needs it."""

from __future__ import annotations

import io
import warnings

import onnx


def finish(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model at an IR version ORT 1.31 loads (it refuses onnx 1.23's default, 14)."""
    model.ir_version = min(model.ir_version, 10)
    return model


def torchscript(module, args, input_names, opset=17, dynamic_axes=None, output_names=None):
    """The TorchScript exporter (dynamo=False), the one most exported models in the wild came from."""
    import torch

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module.eval(),
            args,
            buffer,
            dynamo=False,
            opset_version=opset,
            input_names=input_names,
            output_names=output_names,
            dynamic_axes=dynamic_axes,
        )
    return finish(onnx.load_from_string(buffer.getvalue()))


def dynamo(module, args, input_names, opset=18, output_names=None):
    """The dynamo exporter (torch.export + onnxscript), torch's default since 2.9."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module.eval(),
            args,
            dynamo=True,
            opset_version=opset,
            verbose=False,
            input_names=input_names,
            output_names=output_names,
        )
    return finish(program.model_proto)


def logits_only(module):
    """A transformers model wrapped to return its first output (the logits) as a plain tensor."""
    import torch

    class LogitsOnly(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = module

        def forward(self, *args):
            return self.inner(*args, return_dict=False)[0]

    return LogitsOnly()
