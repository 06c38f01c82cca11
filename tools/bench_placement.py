"""What each placement leaves the model to do at run time: casts, estimated bytes moved, float16 share.

amp-rewrite with `--placement tf` and `--placement cost`, beside onnxconverter-common and ONNX
Runtime's float16 converter (given the same op block list as in bench_rewrite.py, so every tool
keeps the same ops float32), on the exported BERT and CNN (tools/exported.py, torch optional) and
synthetic stacks. Every output is measured the same way, from onnx shape inference on the output
model (a symbolic dim counts 1):
- casts: Cast nodes added;
- MB moved: bytes every node reads and writes (Constant nodes left out), casts included;
- float16 share: float-computing nodes (Cast, Constant, Identity and shape-only ops left out)
  whose outputs are float16;
- max rel err: ONNX Runtime CPU, output vs the float32 original on seeded inputs.

    python tools/bench_placement.py [--sizes 1k,10k] [--markdown]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto

TOOLS_DIR = Path(__file__).resolve().parent
sys.path[:0] = [str(TOOLS_DIR.parent), str(TOOLS_DIR)]

import bench_rewrite  # noqa: E402
import exported  # noqa: E402
import synthetic  # noqa: E402

ELEM_BYTES = {TensorProto.FLOAT: 4, TensorProto.FLOAT16: 2, TensorProto.BFLOAT16: 2, TensorProto.DOUBLE: 8,
              TensorProto.INT64: 8, TensorProto.INT32: 4, TensorProto.BOOL: 1, TensorProto.INT8: 1, TensorProto.UINT8: 1}
NOT_COMPUTE = {"Cast", "Constant", "Identity", "Shape", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Transpose",
               "Gather", "Concat", "Slice", "Expand", "Size", "ConstantOfShape", "Split"}


def _facts(model: onnx.ModelProto):
    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    info = {}
    for v in [*g.input, *g.output, *g.value_info]:
        t = v.type.tensor_type
        info[v.name] = (t.elem_type, math.prod(d.dim_value if d.dim_value > 0 else 1 for d in t.shape.dim))
    for t in g.initializer:
        info[t.name] = (t.data_type, math.prod(t.dims))
    return g, info


def measure(model: onnx.ModelProto, original: onnx.ModelProto) -> dict:
    g, info = _facts(model)
    moved = 0
    low = compute = 0
    for node in g.node:
        if node.op_type == "Constant":
            continue
        for x in [*node.input, *node.output]:
            if x in info:
                elem, size = info[x]
                moved += ELEM_BYTES.get(elem, 4) * size
        outs = [info[o][0] for o in node.output if o in info]
        if node.op_type not in NOT_COMPUTE and any(e in (TensorProto.FLOAT, TensorProto.FLOAT16) for e in outs):
            compute += 1
            low += any(e == TensorProto.FLOAT16 for e in outs)
    casts = bench_rewrite.count_casts(model) - bench_rewrite.count_casts(original)
    return {"casts": casts, "moved": moved, "share": low / compute if compute else 0.0}


def max_rel_error(model: onnx.ModelProto, original: onnx.ModelProto, feeds: dict) -> float:
    def run(m):
        options = ort.SessionOptions()
        options.log_severity_level = 3
        return ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)

    worst = 0.0
    for got, expected in zip(run(model), run(original)):
        got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
        worst = max(worst, float(np.max(np.abs(got - expected)) / (np.max(np.abs(expected)) or 1.0)))
    return worst


def feeds_for(model: onnx.ModelProto) -> dict:
    rng = np.random.default_rng(0)
    feeds = {}
    for value in model.graph.input:
        t = value.type.tensor_type
        shape = [d.dim_value if d.dim_value > 0 else 2 for d in t.shape.dim]
        if t.elem_type == TensorProto.INT64:
            feeds[value.name] = rng.integers(0, 50, shape).astype(np.int64)
        else:
            feeds[value.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def tools():
    import amp_rewrite

    yield "amp-rewrite tf", lambda m, blocked: amp_rewrite.rewrite(m, placement="tf").model
    yield "amp-rewrite cost", lambda m, blocked: amp_rewrite.rewrite(m, placement="cost").model
    for name in (bench_rewrite.OCC, bench_rewrite.ORT):
        if bench_rewrite.tool_missing(name) is None:
            yield name, bench_rewrite.converter(name)


def cases(sizes: list[int], folder: Path):
    for label, path, _ in bench_rewrite.exported_cases(folder):
        yield label, onnx.load(str(path))
    for size in sizes:
        yield f"stack {bench_rewrite.size_label(size)}", synthetic.transformer_stack(size)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1k,10k", help="synthetic stack sizes (default 1k,10k)")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    head = ["model", "tool", "casts", "MB moved", "vs tf", "float16 share", "max rel err", "seconds"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="amp_place_") as tmp:
        for label, model in cases(bench_rewrite.parse_sizes(args.sizes), Path(tmp)):
            feeds = synthetic.sample_feeds(model) if label.startswith("stack") else feeds_for(model)
            blocked = bench_rewrite.block_list(model)
            tf_moved = None
            for tool, convert in tools():
                fresh = onnx.ModelProto()
                fresh.CopyFrom(model)
                started = time.perf_counter()
                try:
                    out = convert(fresh, blocked)
                except Exception as exc:  # an anchor that cannot convert this model: say so, go on
                    rows.append([label, tool, f"failed: {type(exc).__name__}", "", "", "", "", ""])
                    continue
                seconds = time.perf_counter() - started
                m = measure(out, model)
                tf_moved = m["moved"] if tool == "amp-rewrite tf" else tf_moved
                try:
                    err = f"{max_rel_error(out, model, feeds):.2e}"
                except Exception as exc:  # e.g. an anchor's output ORT refuses to load
                    err = f"ORT: {type(exc).__name__}"
                rows.append([label, tool, str(m["casts"]), f"{m['moved'] / 1e6:.3f}",
                             f"{m['moved'] / tf_moved:.3f}" if tf_moved else "",
                             f"{100 * m['share']:.1f}%", err, f"{seconds:.2f}"])
                print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    if args.markdown:
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        print("\n".join("| " + " | ".join(r) + " |" for r in rows))
    else:
        print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
        print("\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
