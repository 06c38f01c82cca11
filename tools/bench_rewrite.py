"""Time amp-rewrite against onnxconverter-common and onnxruntime's float16 converter, at equal work.

Equal work: the anchors get `op_block_list` = exactly the op types that our float16 lists keep
float32 and that appear in the model (Softmax and LayerNormalization in the synthetic stacks), so
every tool leaves the same ops in float32; comparing against converters with nothing blocked would
time a different job. Each tool runs in its own subprocess (a slow anchor is cut off at
`--anchor-timeout` instead of hanging the run) on a fresh copy of the model; load, copy and the
output checks are not timed.

    python tools/bench_rewrite.py                 # 1k, 10k, 27k, 100k nodes + exported models
    python tools/bench_rewrite.py --quick         # 1k only, one run each: a smoke test
    python tools/bench_rewrite.py --sizes 1k,3k --repeat 5 --markdown
    PYTHONPATH=/tmp/old-checkout python tools/bench_rewrite.py --sizes 100k   # time another checkout

amp_rewrite is the installed one (an editable install times the checkout it points to).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from onnx import TensorProto

# Siblings in tools/: Python puts a script's own folder first on sys.path.
import exported
import synthetic

AMP = "amp-rewrite"
OCC = "onnxconverter-common"
ORT = "onnxruntime float16"
TOOL_ORDER = (AMP, OCC, ORT)
HEAVY_OPS = ("MatMul", "Gemm", "Conv")
LOAD_GRACE_S = 180  # the worker's load, copies and output checks, on top of the conversion timeout


# --- what each tool is asked to do ----------------------------------------------------------------


def block_list(model: onnx.ModelProto) -> list[str]:
    """Op types in `model` that amp-rewrite's float16 lists keep float32: deny, or in no list.

    Constant is left out: it is a source of values, not an op any tool computes in float32."""
    from amp_rewrite.analysis.oplists import load_op_lists

    lists = load_op_lists("float16")
    kept = set()
    for node in all_nodes(model.graph):
        entry = lists.classify(node.domain, node.op_type)
        if node.op_type != "Constant" and (entry is None or entry.list == "deny"):
            kept.add(node.op_type)
    return sorted(kept)


def converter(tool: str):
    """`convert(model, blocked) -> ModelProto` for `tool`, imported here so imports are not timed."""
    if tool == AMP:
        import amp_rewrite

        return lambda model, blocked: amp_rewrite.rewrite(model, keep_io_types=True).model
    if tool == OCC:
        from onnxconverter_common import float16
    else:
        from onnxruntime.transformers import float16
    return lambda model, blocked: float16.convert_float_to_float16(
        model, keep_io_types=True, op_block_list=blocked
    )


def tool_missing(tool: str) -> str | None:
    """Why `tool` cannot run here, or None (onnxconverter-common is only in the [bench] extra)."""
    module = {AMP: "amp_rewrite", OCC: "onnxconverter_common", ORT: "onnxruntime.transformers.float16"}[tool]
    try:
        __import__(module)
    except Exception as exc:  # an optional dependency: any import failure means "cannot run"
        return f"not installed ({type(exc).__name__})"
    return None


# --- measuring an output --------------------------------------------------------------------------


def all_nodes(graph: onnx.GraphProto):
    """Every node, subgraphs (If/Loop/Scan bodies) included."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from all_nodes(sub)


def count_casts(model: onnx.ModelProto) -> int:
    return sum(node.op_type == "Cast" for node in all_nodes(model.graph))


def heavy_low_share(model: onnx.ModelProto) -> tuple[int, int]:
    """(MatMul/Gemm/Conv nodes whose output is float16 or bfloat16, all of them), from shape inference
    so the anchors' outputs, which may carry no value_info, are read the same way as ours."""
    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.output, *g.value_info]}
    heavy = [node for node in g.node if node.op_type in HEAVY_OPS]
    low = sum(types.get(node.output[0]) in (TensorProto.FLOAT16, TensorProto.BFLOAT16) for node in heavy)
    return low, len(heavy)


def checker_verdict(model: onnx.ModelProto) -> str:
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        return "invalid: " + (str(exc).strip().splitlines() or ["?"])[0][:60]
    return "valid"


# --- the worker: one tool on one model, in its own process ----------------------------------------


class _Timeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise _Timeout


def _save(path: Path, result: dict) -> None:
    path.write_text(json.dumps(result))


def run_worker(
    tool: str, model_path: Path, result_path: Path, repeat: int, timeout: int, single_run_above: float
) -> None:
    """Convert `repeat` times (once when a run is slower than `single_run_above`), then measure the
    last output. Writes the result file after every step so a killed worker still leaves its times."""
    model = onnx.load(str(model_path))
    blocked = block_list(model)
    result = {"times": [], "blocked": blocked, "timed_out": False}
    convert = converter(tool)
    signal.signal(signal.SIGALRM, _on_alarm)
    output = None
    for _ in range(repeat):
        fresh = onnx.ModelProto()
        fresh.CopyFrom(model)
        output = None  # freed before the clock starts: no run pays for freeing its predecessor's output
        signal.alarm(timeout)
        started = time.perf_counter()
        try:
            output = convert(fresh, blocked)
        except _Timeout:
            result["timed_out"] = True
            break
        finally:
            signal.alarm(0)
        result["times"].append(time.perf_counter() - started)
        _save(result_path, result)
        if result["times"][-1] > single_run_above:
            break
    if output is not None:
        low, heavy = heavy_low_share(output)
        result.update(
            casts=count_casts(output) - count_casts(model),
            heavy_low=low,
            heavy=heavy,
            checker=checker_verdict(output),
        )
    _save(result_path, result)


# --- the driver ------------------------------------------------------------------------------------


@dataclass
class Row:
    case: str
    nodes: int
    tool: str
    times: list = field(default_factory=list)
    note: str = ""
    casts: int | None = None
    heavy_low: int | None = None
    heavy: int | None = None
    checker: str = ""

    @property
    def median(self) -> float | None:
        return statistics.median(self.times) if self.times else None


def run_tool(tool: str, case: str, model_path: Path, nodes: int, args) -> Row:
    row = Row(case, nodes, tool)
    missing = tool_missing(tool)
    if missing:
        row.note = missing
        return row
    timeout = args.anchor_timeout if tool != AMP else 0  # alarm(0): no limit for our own tool
    result_path = model_path.with_suffix(f".{tool.replace(' ', '_')}.json")
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        tool,
        "--model",
        str(model_path),
        "--result",
        str(result_path),
        "--repeat",
        str(args.repeat),
        "--timeout",
        str(timeout),
        "--single-run-above",
        str(args.single_run_above),
    ]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=(timeout + LOAD_GRACE_S) if timeout else None
        )
        if done.returncode:
            row.note = "failed: " + (done.stderr.strip().splitlines() or ["?"])[-1][:60]
    except subprocess.TimeoutExpired:
        row.note = f"killed after {timeout + LOAD_GRACE_S} s"
    result = json.loads(result_path.read_text()) if result_path.exists() else {}
    row.times = result.get("times", [])
    if result.get("timed_out"):
        row.note = f"timeout > {timeout} s"
    row.casts, row.heavy_low, row.heavy = result.get("casts"), result.get("heavy_low"), result.get("heavy")
    row.checker = result.get("checker", "")
    return row


def synthetic_cases(sizes: list[int], hidden: int, folder: Path):
    """(label, path, node count) per size; each model is built, saved and dropped in turn."""
    for size in sizes:
        model = synthetic.transformer_stack(size, hidden=hidden)
        path = folder / f"stack_{size}.onnx"
        onnx.save(model, str(path))
        yield size_label(size), path, len(model.graph.node)


def exported_cases(folder: Path):
    if not exported.available():
        print("torch is not installed: skipping the exported models", file=sys.stderr)
        return
    for label, export in (("bert (export)", exported.export_bert), ("cnn (export)", exported.export_cnn)):
        path = export(folder / f"{label.split()[0]}.onnx")
        yield label, path, len(onnx.load(str(path)).graph.node)


def size_label(size: int) -> str:
    return f"{size // 1000}k" if size % 1000 == 0 else str(size)


def parse_sizes(text: str) -> list[int]:
    """'1k,10k,27000' -> [1000, 10000, 27000]."""
    return [
        int(float(part[:-1]) * 1000) if part.lower().endswith("k") else int(part)
        for part in text.split(",")
        if part.strip()
    ]


# --- the table -------------------------------------------------------------------------------------

HEADER = (
    "size",
    "nodes",
    "tool",
    "median s",
    "runs",
    "vs amp-rewrite",
    "casts",
    "low MatMul/Gemm/Conv",
    "checker",
)


def _cells(row: Row, ours: Row | None) -> tuple:
    median = row.median
    ratio = ""
    if median is not None and ours is not None and ours.median:
        ratio = f"{median / ours.median:.1f}x"
    share = f"{row.heavy_low}/{row.heavy}" if row.heavy else ("-" if row.heavy == 0 else "")
    return (
        row.case,
        str(row.nodes),
        row.tool,
        f"{median:.3f}" if median is not None else row.note,
        str(len(row.times)),
        ratio,
        "" if row.casts is None else str(row.casts),
        share,
        row.checker,
    )


def table(rows: list[Row], markdown: bool) -> str:
    ours = {row.case: row for row in rows if row.tool == AMP}
    body = [_cells(row, ours.get(row.case)) for row in rows]
    if markdown:
        lines = ["| " + " | ".join(HEADER) + " |", "|" + "|".join("---" for _ in HEADER) + "|"]
        return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in body])
    widths = [max(len(line[i]) for line in [HEADER, *body]) for i in range(len(HEADER))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)) for line in [HEADER, *body])


def growth(rows: list[Row]) -> str:
    """amp-rewrite's time per node at each synthetic size relative to the smallest: ~1.0 is linear."""
    ours = [row for row in rows if row.tool == AMP and row.median and not row.case.endswith("(export)")]
    if not ours:
        return ""
    base = ours[0].median / ours[0].nodes
    parts = [
        f"{row.case}: {row.median / row.nodes * 1e6:.1f} us/node ({row.median / row.nodes / base:.2f}x)"
        for row in ours
    ]
    return "amp-rewrite time per node relative to " + ours[0].case + ": " + ", ".join(parts)


# --- command line ----------------------------------------------------------------------------------


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default=parse_sizes("1k,10k,27k,100k"),
        help="synthetic stack sizes in nodes, e.g. 1k,10k,27k,100k",
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per tool and size; the median is shown")
    parser.add_argument(
        "--anchor-timeout",
        type=int,
        default=300,
        help="seconds one anchor conversion may take before it is marked as timed out",
    )
    parser.add_argument(
        "--single-run-above",
        type=float,
        default=60.0,
        help="run a tool only once at a size where one run takes longer than this",
    )
    parser.add_argument("--hidden", type=int, default=64, help="hidden size of the synthetic stacks")
    parser.add_argument("--no-exported", action="store_true", help="skip the models exported from torch")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 1k nodes, one run, no exported models"
    )
    parser.add_argument(
        "--tools",
        type=lambda text: [t.strip() for t in text.split(",")],
        default=list(TOOL_ORDER),
        help=f"comma-separated tools to time (default: all of {', '.join(TOOL_ORDER)})",
    )
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--worker", choices=TOOL_ORDER, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [t for t in args.tools if t not in TOOL_ORDER]
    if unknown:
        parser.error(f"unknown tool(s) {', '.join(unknown)}: choose from {', '.join(TOOL_ORDER)}")
    if args.quick:
        args.sizes, args.repeat, args.no_exported = [1000], 1, True
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(args.worker, args.model, args.result, args.repeat, args.timeout, args.single_run_above)
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="amp_bench_") as tmp:
        cases = list(synthetic_cases(args.sizes, args.hidden, Path(tmp)))
        if not args.no_exported:
            cases += list(exported_cases(Path(tmp)))
        for label, path, nodes in cases:
            for tool in (t for t in TOOL_ORDER if t in args.tools):
                rows.append(run_tool(tool, label, path, nodes, args))
                print(
                    f"{label:>14} {tool:<22} {rows[-1].median or rows[-1].note}", file=sys.stderr, flush=True
                )
    print(table(rows, args.markdown))
    print()
    print(growth(rows))
    return 0 if all(row.median is not None or row.tool != AMP for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
