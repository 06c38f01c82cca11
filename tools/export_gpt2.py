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

import numpy as np
import onnx
import onnx.numpy_helper

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
    _split_sizes_as_input(model)
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return model


def _split_sizes_as_input(model: onnx.ModelProto) -> None:
    """The exporter converts its opset 18 graph down to 17 but leaves Split's `num_outputs` (new in
    18): opset 17 takes the sizes as an input, here from the shapes the exporter declares."""
    declared = {v.name: v.type.tensor_type.shape for v in model.graph.value_info}
    for node in model.graph.node:
        count = next((a.i for a in node.attribute if a.name == "num_outputs"), None)
        if node.op_type != "Split" or count is None:
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        length = declared[node.input[0]].dim[axis].dim_value
        sizes = f"{node.name or node.output[0]}_sizes"
        model.graph.initializer.append(
            onnx.numpy_helper.from_array(np.full(count, length // count, np.int64), sizes)
        )
        kept = [a for a in node.attribute if a.name != "num_outputs"]
        del node.attribute[:]
        node.attribute.extend(kept)
        node.input.append(sizes)


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
