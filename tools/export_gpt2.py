"""A GPT-2-small-sized ONNX export for timing the checks (tools/bench_checks.py --model).

    python tools/export_gpt2.py gpt2.onnx

transformers' GPT2Model with the default config (12 layers, hidden 768: GPT-2 small's shapes;
random weights, nothing downloaded), input_ids [1, 128], through torch.onnx's dynamo exporter
(TorchScript's fails on aten::diff) at opset 17, IR version at most 10 (what ONNX Runtime 1.31
reads). About 500 MB: keep it out of git.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import onnx

OPSET = 17
MAX_IR_VERSION = 10


def export(path: str, seq: int = 128) -> onnx.ModelProto:
    import torch
    import transformers as tr

    torch.manual_seed(0)
    module = tr.GPT2Model(tr.GPT2Config(use_cache=False)).eval()

    class LastHidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = module

        def forward(self, input_ids):
            return self.inner(input_ids=input_ids).last_hidden_state

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch.onnx.export(
            LastHidden(),
            (torch.zeros(1, seq, dtype=torch.int64),),
            dynamo=True,
            opset_version=OPSET,
            verbose=False,
            input_names=["input_ids"],
            output_names=["out"],
        ).model_proto
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    onnx.save(model, path)
    return model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path", help="where to write the .onnx")
    p.add_argument("--seq", type=int, default=128, help="sequence length of input_ids [1, SEQ]")
    args = p.parse_args(argv)
    model = export(args.path, args.seq)
    opset = {o.domain: o.version for o in model.opset_import}.get("", 0)
    print(f"{args.path}: {len(model.graph.node)} nodes, opset {opset}, IR {model.ir_version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
