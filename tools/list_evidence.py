"""Evidence for the op lists: what computing one op type in float16 costs in accuracy, measured.

For each model and each candidate op type (default: the deny ops the model holds):
- per node: the node's float32 inputs, captured from an ONNX Runtime run of the float32 model,
  are rounded to the target type and the node alone is run in `onnx.reference` (numpy: every step
  in the target type, the pessimistic reading) and, where the schema fixes an internal precision
  (a `stash_type` attribute: LayerNormalization, RMSNormalization), as the spec says (statistics in float32). Its error is
  relative to the largest float32 output of that node: the worst node is shown;
- whole model: the rewrite (cost placement) with that op type moved from deny to infer (the other
  candidates denied), then with all of them infer, run in ORT CPU against the float32 original:
  casts added, max error relative to the largest output, cosine, and the output elements outside
  `--validate`'s default tolerance (rtol 1e-2, atol 1e-3).

    python tools/list_evidence.py model.onnx [more.onnx ...] [--ops LayerNormalization,Softmax]
        [--dim batch=1 --dim sequence=64] [--target float16] [--markdown]

Symbolic input dims come from --dim (else 1 for the first, 64 for the others); integer inputs are
token ids in [0, 1000), masks (name containing "mask") ones with the last position masked.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

import amp_rewrite
import bench_placement  # sibling script: the bench's seeded samples
import bench_rewrite
from amp_rewrite.analysis.oplists import load_op_lists
from amp_rewrite.checks import validate
from amp_rewrite.deployment import Deployment
from amp_rewrite.runtime import open_session

LOW_DTYPE = {"float16": np.float16}


def feeds_for(model: onnx.ModelProto, dims: dict) -> dict:
    """bench_placement's seeded sample, unsized dims 1 (the first) and 64 (the rest), and the last
    position of every mask masked, so the mask's large negative values reach the Softmax."""
    sized = dict(dims)
    for value in validate.feed_inputs(model):
        for i, d in enumerate(value.type.tensor_type.shape.dim):
            if d.dim_param:
                sized.setdefault(d.dim_param, 1 if i == 0 else 64)
    [feeds] = bench_placement.samples_for(model, sized, 1)
    for name, array in feeds.items():
        if "mask" in name:
            array[..., -1] = 0
    return feeds


def capture(model: onnx.ModelProto, nodes: list, feeds: dict) -> dict:
    """Every tensor the nodes read or write, from one float32 ORT run (extra graph outputs)."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    have = {o.name for o in probe.graph.output} | {i.name for i in probe.graph.initializer} | set(feeds)
    wanted = {x for n in nodes for x in [*n.input, *n.output] if x and x not in have}
    probe.graph.output.extend(helper.make_empty_tensor_value_info(x) for x in sorted(wanted))
    names = [o.name for o in probe.graph.output]
    values = dict(zip(names, open_session(probe, "cpu")[0].run(None, feeds)))
    values.update(feeds)
    values.update((i.name, numpy_helper.to_array(i)) for i in model.graph.initializer)
    return values


def stashes(op_type: str, domain: str, opsets: dict) -> bool:
    """The op's schema computes its statistics in `stash_type` (float32 unless set) whatever the
    input type (LayerNormalization, RMSNormalization): onnx.reference ignores it, so it is measured
    both ways."""
    version = opsets.get(domain or "")
    return version is not None and "stash_type" in onnx.defs.get_schema(op_type, version, domain).attributes


def node_error(node: onnx.NodeProto, values: dict, opsets, low_dtype, spec: bool) -> float:
    """Max |low - float32| / max |float32| of the node's first output, run alone in onnx.reference;
    `spec`: inputs rounded to the low type but the statistics computed in float32 (stash_type)."""
    from onnx.reference import ReferenceEvaluator

    inputs = [values[x] if x else None for x in node.input]
    low_inputs = [x.astype(low_dtype) if x is not None and x.dtype == np.float32 else x for x in inputs]
    if spec:
        low_inputs = [
            x.astype(np.float32) if x is not None and x.dtype == low_dtype else x for x in low_inputs
        ]
    names = [f"i{k}" if x is not None else "" for k, x in enumerate(low_inputs)]
    one = helper.make_node(node.op_type, names, ["y"], domain=node.domain)
    one.attribute.extend(node.attribute)
    graph = helper.make_graph(
        [one],
        "one",
        [
            helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)
            for n, x in zip(names, low_inputs)
            if n
        ],
        [helper.make_empty_tensor_value_info("y")],
    )
    single = helper.make_model(graph, opset_imports=opsets, ir_version=8)
    with np.errstate(all="ignore"):
        got = ReferenceEvaluator(single).run(None, {n: x for n, x in zip(names, low_inputs) if n})[0]
    if spec:
        got = got.astype(low_dtype)  # the output is in the input's type
    expected = values[node.output[0]].astype(np.float64)
    got = got.astype(np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.max(np.abs(got - expected)) / (np.max(np.abs(expected)) or 1.0))


def model_error(rewritten: onnx.ModelProto, expected, feeds: dict) -> tuple[float, float, str]:
    """(max |error| / max |float32 output|, smallest cosine, "k/n" output elements outside
    `--validate`'s default rtol/atol) over the outputs; `expected` is `validate.reference_outputs`
    of the original, run once per model."""
    names, [reference], _ = expected
    [got] = validate.run_samples(open_session(rewritten, "cpu")[0], [feeds], outputs=names)
    stats = [
        validate.compare([r], [g], rtol=bench_placement.RTOL, atol=bench_placement.ATOL)
        for r, g in zip(reference, got)
    ]
    err = max(st["max_abs"] / (float(np.max(np.abs(r))) or 1.0) for st, r in zip(stats, reference))
    outside = sum(
        int(np.sum(~(np.abs(np.float64(g) - r) <= bench_placement.ATOL + bench_placement.RTOL * np.abs(r))))
        for r, g in zip(reference, got)
    )  # a new NaN compares False: outside
    return err, min(st["cosine"] for st in stats), f"{outside}/{sum(np.size(r) for r in reference)}"


def evidence(path: Path, ops: list | None, dims: dict, target: str) -> list:
    model = onnx.load(str(path))
    low_dtype = LOW_DTYPE[target]
    deny = set(load_op_lists(target).ops("deny"))
    present = sorted({n.op_type for n in model.graph.node if n.domain in ("", "ai.onnx")})
    candidates = ops or [op for op in present if op in deny]
    feeds = feeds_for(model, dims)
    by_type = {op: [n for n in model.graph.node if n.op_type == op] for op in candidates}
    values = capture(model, [n for nodes in by_type.values() for n in nodes], feeds)
    expected = validate.reference_outputs(model, [feeds], Deployment(provider="cpu"))
    opsets = list(model.opset_import)
    versions = {o.domain or "": o.version for o in opsets}
    casts_before = bench_rewrite.count_casts(model)

    def casts_added(rewritten) -> str:
        return str(bench_rewrite.count_casts(rewritten) - casts_before)

    rows = []
    base = amp_rewrite.rewrite(model, placement="cost", deny=candidates).model
    base_err, base_cos, base_out = model_error(base, expected, feeds)
    rows.append(
        [
            path.stem,
            "(all deny)",
            "",
            "",
            "",
            casts_added(base),
            f"{base_err:.2e}",
            f"{base_cos:.7f}",
            base_out,
        ]
    )
    for op in candidates:
        nodes = by_type[op]
        if not nodes:
            continue
        numpy_worst = max(node_error(n, values, opsets, low_dtype, spec=False) for n in nodes)
        spec_worst = (
            max(node_error(n, values, opsets, low_dtype, spec=True) for n in nodes)
            if stashes(op, nodes[0].domain, versions)
            else None
        )
        others = [o for o in candidates if o != op]
        moved = amp_rewrite.rewrite(model, placement="cost", deny=others, infer=[op]).model
        err, cos, out = model_error(moved, expected, feeds)
        rows.append(
            [
                path.stem,
                op,
                str(len(nodes)),
                f"{numpy_worst:.2e}",
                f"{spec_worst:.2e}" if spec_worst is not None else "",
                casts_added(moved),
                f"{err:.2e}",
                f"{cos:.7f}",
                out,
            ]
        )
    if len(candidates) > 1:
        together = amp_rewrite.rewrite(model, placement="cost", infer=candidates).model
        err, cos, out = model_error(together, expected, feeds)
        rows.append(
            [path.stem, "all of them", "", "", "", casts_added(together), f"{err:.2e}", f"{cos:.7f}", out]
        )
    return rows


HEAD = [
    "model",
    "op moved to infer",
    "nodes",
    "node err (numpy f16)",
    "node err (spec)",
    "casts",
    "model err (ORT)",
    "model cosine",
    "outside tolerance",
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", type=Path)
    p.add_argument("--ops", type=lambda s: [x.strip() for x in s.split(",") if x.strip()])
    p.add_argument("--dim", action="append", default=[])
    p.add_argument("--target", default="float16", choices=sorted(LOW_DTYPE))
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    rows = [
        row
        for path in args.models
        for row in evidence(path, args.ops, validate.parse_dims(args.dim), args.target)
    ]
    if args.markdown:
        print("| " + " | ".join(HEAD) + " |\n|" + "---|" * len(HEAD))
        print("\n".join("| " + " | ".join(r) + " |" for r in rows))
    else:
        widths = [max(len(r[i]) for r in [HEAD, *rows]) for i in range(len(HEAD))]
        print("\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in [HEAD, *rows]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
