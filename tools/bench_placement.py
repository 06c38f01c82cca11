"""What each placement and tool leaves the model to do at run time: casts, bytes moved, float16 share.

amp-rewrite with `tf` and `cost` placement, each without and with calibration, plus `tf` with the
lists as shipped at bf991a5 (LayerNormalization and Softmax moved into deny), beside
onnxconverter-common and ONNX Runtime's float16 converter (given the same op block list as in
bench_rewrite.py, so they keep the same ops float32) and, when installed in a venv of its own,
NVIDIA ModelOpt AutoCast (`--modelopt-python`, or AMP_MODELOPT_PYTHON), without and with the same
calibration samples. Every amp-rewrite row names its placement: the shipped defaults may change.
The "+tolerance" row is `--calibrate --tolerance`: accuracy-guided fallback pins nodes float32
until the validate column's rule holds (at most 10 validation runs, as the CLI), so it shows what that
rule costs in float16 share.

Cases: the small exported BERT and CNN (tools/exported.py), with `--exports full` also BERT-base,
GPT-2 small and ViT-S/16 exported from transformers configs with random weights (torch and
transformers needed; nothing is downloaded), and the synthetic stacks (`--sizes`).

Every output is measured the same way, from onnx shape inference on the output model with the
graph inputs' symbolic dims set to those of the samples run (a shape still unknown counts 1):
- casts: Cast nodes added (net: a tool that removes casts gets a negative count);
- cast MB: bytes the Cast nodes added read and write (net, as casts);
- MB moved: bytes every node reads and writes (Constant nodes left out), casts included;
- vs tf old: cast MB and MB moved over those of the "amp-rewrite tf, old lists" row;
- float16 share: float-computing nodes (Cast, Constant, Identity and shape-only ops left out)
  whose outputs are float16;
- max rel err, cosine: ONNX Runtime CPU, output vs the float32 original on the seeded samples (all
  of them): max |error| / max |float32 output|, and the smallest cosine over the outputs;
- validate: `amp-rewrite --validate`'s rule (checks/validate.compare) with its default rtol/atol:
  "ok" when every element is within atol + rtol x |float32|, else how many are not;
- seconds: the conversion, plus the calibration run for calibrated amp-rewrite rows (and the
  fallback's validation runs for "+tolerance"); AutoCast's is its subprocess (Python start and
  imports included).

    python tools/bench_placement.py [--exports none|small|full] [--sizes 1k,10k] [--tools PREFIX] [--markdown]
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

TOOLS_DIR = Path(__file__).resolve().parent
sys.path[:0] = [str(TOOLS_DIR.parent), str(TOOLS_DIR)]

import bench_rewrite  # noqa: E402
import exported  # noqa: E402
import synthetic  # noqa: E402
from amp_rewrite.checks import calibrate as cal  # noqa: E402
from amp_rewrite.checks import validate as val  # noqa: E402
from amp_rewrite.checks.check_options import CheckOptions  # noqa: E402
from amp_rewrite.deployment import Deployment  # noqa: E402
from amp_rewrite.io.skeleton import inference_skeleton  # noqa: E402
from amp_rewrite.ir import sort_graphs  # noqa: E402
from amp_rewrite.runtime import open_session  # noqa: E402

ELEM_BYTES = {
    TensorProto.FLOAT: 4,
    TensorProto.FLOAT16: 2,
    TensorProto.BFLOAT16: 2,
    TensorProto.DOUBLE: 8,
    TensorProto.INT64: 8,
    TensorProto.INT32: 4,
    TensorProto.BOOL: 1,
    TensorProto.INT8: 1,
    TensorProto.UINT8: 1,
}
NOT_COMPUTE = {
    "Cast",
    "Constant",
    "Identity",
    "Shape",
    "Reshape",
    "Unsqueeze",
    "Squeeze",
    "Flatten",
    "Transpose",
    "Gather",
    "Concat",
    "Slice",
    "Expand",
    "Size",
    "ConstantOfShape",
    "Split",
}
# today's tolerance: what `amp-rewrite --validate` uses unless told otherwise
RTOL, ATOL = CheckOptions.rtol, CheckOptions.atol
OLD_DENY = ("LayerNormalization", "Softmax")  # moved out of deny after bf991a5
OLD_BEHAVIOUR = {"pointwise_check": False, "fold_noop_casts": False}  # both came after bf991a5 too
BASELINE = "amp-rewrite tf, old lists"
AUTOCAST = "modelopt autocast"
MAX_IR_VERSION = exported.MAX_IR_VERSION
HEAD = [
    "model",
    "tool",
    "casts",
    "cast MB",
    "cast vs tf old",
    "MB moved",
    "moved vs tf old",
    "float16 share",
    "max rel err",
    "cosine",
    "validate",
    "seconds",
]


class ToolFailed(Exception):
    """A tool could not convert a case: the message becomes the row's cell."""


# --- the cases -------------------------------------------------------------------------------------


@dataclass
class Case:
    label: str
    model: onnx.ModelProto
    samples: list  # [{input name: array}], seeded: calibration and the error measurement both run them
    folder: Path  # where AutoCast's files go
    path: Path | None = None  # the model on disk, when it was exported there
    _calibration: object = None
    calibration_seconds: float = 0.0

    def calibration(self):
        """amp-rewrite's calibration on the samples (as `--calibrate` runs it on CPU), run once."""
        if self._calibration is None:
            started = time.perf_counter()
            self._calibration = cal.calibrate(self.model, self.samples, deployment=Deployment(provider="cpu"))
            self.calibration_seconds = time.perf_counter() - started
        return self._calibration

    def saved(self) -> Path:
        if self.path is None:
            self.path = self.folder / f"{_slug(self.label)}.onnx"
            onnx.save(self.model, str(self.path))
        return self.path


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text)


def samples_for(model: onnx.ModelProto, dims: dict, count: int) -> list:
    """`count` seeded samples: floats standard normal, masks ones, other integers token ids < 1000."""
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(count):
        feeds = {}
        for value in val.feed_inputs(model):
            t = value.type.tensor_type
            shape = [
                d.dim_value if d.HasField("dim_value") else dims.get(d.dim_param, 1) for d in t.shape.dim
            ]
            dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
            if t.elem_type == TensorProto.FLOAT:
                feeds[value.name] = rng.standard_normal(shape).astype(dtype)
            elif "mask" in value.name:
                feeds[value.name] = np.ones(shape, dtype)
            else:
                feeds[value.name] = rng.integers(0, 1000, shape).astype(dtype)
        samples.append(feeds)
    return samples


def _first_output(module):
    import torch

    class FirstOutput(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = module

        def forward(self, *args):
            return self.inner(*args, return_dict=False)[0]

    return FirstOutput().eval()


def _hf_module(name: str):
    """(module, example args, input names, dynamic axes) from a transformers config, random weights."""
    import torch
    import transformers as tr

    torch.manual_seed(0)
    if name == "bert-base":
        module = tr.BertModel(tr.BertConfig(attn_implementation="eager"), add_pooling_layer=False)
        args = (torch.zeros(1, 128, dtype=torch.int64), torch.ones(1, 128, dtype=torch.int64))
        names = ["input_ids", "attention_mask"]
        return module, args, names, {name: {0: "batch", 1: "seq"} for name in names}
    if name == "vit-s16":
        config = tr.ViTConfig(
            hidden_size=384,
            num_hidden_layers=12,
            num_attention_heads=6,
            intermediate_size=1536,
            attn_implementation="eager",
        )
        return (
            tr.ViTModel(config, add_pooling_layer=False),
            (torch.zeros(1, 3, 224, 224),),
            ["pixel_values"],
            {"pixel_values": {0: "batch"}},
        )
    return (
        tr.GPT2Model(tr.GPT2Config(use_cache=False)),
        (torch.zeros(1, 128, dtype=torch.int64),),
        ["input_ids"],
        None,
    )


def export_hf(name: str, path: Path) -> Path:
    """BERT-base and ViT-S/16 through the TorchScript exporter at opset 17; GPT-2 small through the
    dynamo exporter at opset 18 (TorchScript fails on aten::diff). IR version at most 10."""

    module, args, names, axes = _hf_module(name)
    model = exported.to_onnx(_first_output(module), args, names, dynamo=name == "gpt2", axes=axes)
    onnx.save(model, str(path))
    return path


HF_EXPORTS = ("bert-base", "gpt2", "vit-s16")
SMALL_DIMS = {"batch": 2, "seq": 16}  # symbolic dims of the small exports' samples
HF_DIMS = {"batch": 1, "seq": 128}


def cases(args, folder: Path):
    """(label, build) per case: build() -> Case, called when the case is reached (a failure is a row)."""
    count = args.samples
    exports = (
        (
            ("bert (export)", exported.export_bert, SMALL_DIMS),
            ("cnn (export)", exported.export_cnn, SMALL_DIMS),
        )
        if args.exports != "none"
        else ()
    )
    exports += tuple(
        (f"{name} (export)", functools.partial(export_hf, name), HF_DIMS)
        for name in (HF_EXPORTS if args.exports == "full" else ())
    )
    if exports and not exported.available():
        print("torch is not installed: skipping the exported models", file=sys.stderr)
        exports = ()
    for label, export, dims in exports:
        yield label, functools.partial(_exported_case, label, export, folder, dims, count)
    for size in bench_rewrite.parse_sizes(args.sizes):
        yield f"stack {bench_rewrite.size_label(size)}", functools.partial(_stack_case, size, folder, count)


def _exported_case(label: str, export, folder: Path, dims: dict, count: int) -> Case:
    path = export(folder / f"{_slug(label.split()[0])}.onnx")
    model = onnx.load(str(path))
    return Case(label, model, samples_for(model, dims, count), folder, path)


def _stack_case(size: int, folder: Path, count: int) -> Case:
    model = synthetic.transformer_stack(size)
    samples = [synthetic.sample_feeds(model, seed=seed) for seed in range(count)]
    return Case(f"stack {bench_rewrite.size_label(size)}", model, samples, folder)


# --- the tools -------------------------------------------------------------------------------------


@dataclass
class Tool:
    name: str
    convert: object  # convert(case) -> ModelProto
    calibrated: bool = False
    missing: str | None = None  # why it cannot run here


def _amp(placement: str, calibrated: bool = False, deny=()):
    import amp_rewrite

    def convert(case: Case) -> onnx.ModelProto:
        calibration = case.calibration() if calibrated else None
        return amp_rewrite.rewrite(
            case.model,
            placement=placement,
            deny=deny,
            calibration=calibration,
            **(OLD_BEHAVIOUR if deny else {}),
        ).model

    return convert


def _amp_tolerance(case: Case) -> onnx.ModelProto:
    """`--calibrate --tolerance` (cost placement): pin nodes float32 until `--validate`'s rule holds on
    the case's own samples, on ONNX Runtime CPU as the validate column measures (onnx.reference off)."""
    from amp_rewrite.checks import fallback

    fitted = fallback.fit(
        case.model,
        case.samples,
        rtol=RTOL,
        atol=ATOL,
        calibration=case.calibration(),
        reference=False,
        progress=False,
    )
    if not fitted.passed:
        raise ToolFailed(
            f"still over tolerance after {fitted.runs} validation runs ({len(fitted.pinned)} pinned)"
        )
    return fitted.result.model


def _anchor(name: str):
    def convert(case: Case) -> onnx.ModelProto:
        fresh = onnx.ModelProto()
        fresh.CopyFrom(case.model)  # the converters change their input
        return bench_rewrite.converter(name)(fresh, bench_rewrite.block_list(case.model))

    return convert


def modelopt_python(given: str | None) -> str | None:
    """The Python of ModelOpt's venv: `--modelopt-python`, else AMP_MODELOPT_PYTHON, else None."""
    return given if given is not None else os.environ.get("AMP_MODELOPT_PYTHON")


def _autocast(python: str, timeout: int, calibrated: bool):
    def convert(case: Case) -> onnx.ModelProto:
        source = case.saved()
        out = case.folder / f"{source.stem}.autocast{'_cal' if calibrated else ''}.onnx"
        command = [
            python,
            "-m",
            "modelopt.onnx.autocast",
            "--onnx_path",
            str(source),
            "--output_path",
            str(out),
            "--low_precision_type",
            "fp16",
            "--keep_io_types",
            "--providers",
            "cpu",
        ]
        if calibrated:
            command += ["--calibration_data", str(_calibration_samples(case))]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ToolFailed(f"timeout > {timeout} s") from None
        if done.returncode or not out.exists():
            raise ToolFailed(_last_error_line(done.stderr + done.stdout))
        return onnx.load(str(out))

    return convert


def _calibration_samples(case: Case) -> Path:
    """The case's samples for AutoCast: a folder of .npz files, one per sample (its multi-batch form)."""
    folder = case.folder / f"{_slug(case.label)}.samples"
    if not folder.exists():
        folder.mkdir()
        for index, feeds in enumerate(case.samples):
            np.savez(folder / f"{index:03d}.npz", **feeds)
    return folder


def tools(args) -> list[Tool]:
    found = [
        Tool(BASELINE, _amp("tf", deny=OLD_DENY)),
        Tool("amp-rewrite tf", _amp("tf")),
        Tool("amp-rewrite cost", _amp("cost")),
        Tool("amp-rewrite tf +calibrate", _amp("tf", True), calibrated=True),
        Tool("amp-rewrite cost +calibrate", _amp("cost", True), calibrated=True),
        Tool("amp-rewrite cost +calibrate +tolerance", _amp_tolerance, calibrated=True),
    ]
    for name in (bench_rewrite.OCC, bench_rewrite.ORT):
        found.append(Tool(name, _anchor(name), missing=bench_rewrite.tool_missing(name)))
    python = modelopt_python(args.modelopt_python)
    missing = None if python and Path(python).exists() else "not installed (--modelopt-python)"
    for calibrated in (False, True):
        found.append(
            Tool(
                AUTOCAST + (" +calibrate" if calibrated else ""),
                _autocast(python, args.autocast_timeout, calibrated),
                missing=missing,
            )
        )
    if args.tools:  # only the rows asked for, e.g. --tools amp-rewrite
        found = [tool for tool in found if tool.name.startswith(tuple(args.tools))]
    return found


# --- measuring an output ---------------------------------------------------------------------------


def _facts(model: onnx.ModelProto, shapes: dict):
    """(graph, {tensor: (element type, elements)}) by shape inference, graph inputs set to `shapes`."""
    skeleton = inference_skeleton(model)
    del skeleton.graph.value_info[:]  # a tool's own (e.g. symbolic dims it wrote) would hide inferred sizes
    sort_graphs(skeleton)  # ORT's converter appends its input casts last; inference reads nodes in order
    for value in skeleton.graph.input:
        if value.name in shapes:
            dims = value.type.tensor_type.shape.dim
            for dim, size in zip(dims, shapes[value.name]):
                dim.dim_value = size
    inferred = onnx.shape_inference.infer_shapes(skeleton, data_prop=True)
    g = inferred.graph
    info = {}
    for v in [*g.input, *g.output, *g.value_info]:
        t = v.type.tensor_type
        info[v.name] = (t.elem_type, math.prod(d.dim_value if d.dim_value > 0 else 1 for d in t.shape.dim))
    for t in model.graph.initializer:
        info[t.name] = (t.data_type, math.prod(t.dims))
    return g, info


def _bytes(names, info) -> int:
    return sum(ELEM_BYTES.get(info[x][0], 4) * info[x][1] for x in names if x in info)


def measure(model: onnx.ModelProto, shapes: dict) -> dict:
    """casts, cast bytes, bytes moved and float16 share of `model` (absolute; subtract the original's)."""
    g, info = _facts(model, shapes)
    moved = cast_bytes = casts = low = compute = 0
    for node in g.node:
        if node.op_type == "Constant":
            continue
        node_bytes = _bytes([*node.input, *node.output], info)
        moved += node_bytes
        if node.op_type == "Cast":
            casts += 1
            cast_bytes += node_bytes
        outs = [info[o][0] for o in node.output if o in info]
        if node.op_type not in NOT_COMPUTE and any(
            e in (TensorProto.FLOAT, TensorProto.FLOAT16) for e in outs
        ):
            compute += 1
            low += any(e == TensorProto.FLOAT16 for e in outs)
    return {
        "casts": casts,
        "cast_bytes": cast_bytes,
        "moved": moved,
        "share": low / compute if compute else 0.0,
    }


def expected_outputs(case: Case):
    """(output names, float32 outputs per sample) of the original on ONNX Runtime CPU."""
    names, outputs, _ = val.reference_outputs(case.model, case.samples, Deployment(provider="cpu"))
    return names, outputs


def accuracy(model: onnx.ModelProto, case: Case, expected) -> dict:
    """max rel err, cosine and within-tolerance of `model` vs the float32 original, as --validate figures them."""
    names, reference = expected
    if model.ir_version > MAX_IR_VERSION:
        model.ir_version = MAX_IR_VERSION  # an anchor's onnx may write a newer IR than ORT loads
    sess, _ = open_session(model, "cpu")
    got = val.run_samples(sess, case.samples, outputs=names)
    worst, cosine, outside, total, passed = 0.0, 1.0, 0, 0, True
    for i, name in enumerate(names):
        want, have = [r[i] for r in reference], [g[i] for g in got]
        stats = val.compare(want, have, rtol=RTOL, atol=ATOL, name=name)
        worst = max(worst, stats["max_abs"] / (max(float(np.max(np.abs(w))) for w in want) or 1.0))
        cosine, passed = min(cosine, stats["cosine"]), passed and stats["passed"]
        for w, h in zip(want, have):  # NaN compares False: a new NaN is outside
            w, h = np.asarray(w, np.float64), np.asarray(h, np.float64)
            outside += (
                int(np.sum(~(np.abs(h - w) <= ATOL + RTOL * np.abs(w)))) if w.shape == h.shape else w.size
            )
            total += w.size
    return {"max_rel": worst, "cosine": cosine, "passed": passed, "outside": outside, "elements": total}


# --- rows ------------------------------------------------------------------------------------------


@dataclass
class Row:
    model: str
    tool: str
    note: str = ""  # why there are no figures
    figures: dict = field(default_factory=dict)  # measure() less the original's, accuracy(), seconds
    accuracy_note: str = ""


def run_tool(tool: Tool, case: Case, base: dict, shapes: dict, expected) -> Row:
    row = Row(case.label, tool.name)
    if tool.missing:
        row.note = tool.missing
        return row
    try:
        if tool.calibrated:
            case.calibration()
        started = time.perf_counter()
        out = tool.convert(case)
        seconds = time.perf_counter() - started + (case.calibration_seconds if tool.calibrated else 0.0)
        figures = measure(out, shapes)
    except Exception as exc:  # a tool that cannot convert this case: say so, go on
        row.note = "failed: " + (str(exc) if isinstance(exc, ToolFailed) else _one_line(exc))
        return row
    row.figures = {key: figures[key] - base[key] for key in ("casts", "cast_bytes")}
    row.figures.update(moved=figures["moved"], share=figures["share"], seconds=seconds)
    try:
        row.figures.update(accuracy(out, case, expected))
    except Exception as exc:  # e.g. an output ORT refuses to load
        row.accuracy_note = "ORT: " + _ort_message(exc)
    return row


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:80]}" if text else type(exc).__name__


def _ort_message(exc: BaseException) -> str:
    """ONNX Runtime's own words from its '[ONNXRuntimeError] : 1 : FAIL : <words>' line."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return lines[0].rpartition(" : ")[2][:70]


def _last_error_line(text: str) -> str:
    """The line of a subprocess's output that says what failed (the last traceback line, else the last)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "Exception" in line]
    return ((errors or lines or ["no output"])[-1])[:100]


def _verdict(f: dict) -> str:
    return "ok" if f["passed"] else f"FAIL ({f['outside']}/{f['elements']} out)"


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}" if base else ""


def cells(row: Row, baseline: Row | None) -> list[str]:
    if row.note:
        return [row.model, row.tool, row.note] + [""] * (len(HEAD) - 3)
    f = row.figures
    b = baseline.figures if baseline is not None and baseline.figures else {}
    accuracy_cells = (
        [f"{f['max_rel']:.2e}", f"{f['cosine']:.6f}", _verdict(f)]
        if "passed" in f
        else [row.accuracy_note, "", "FAIL"]
    )
    return [
        row.model,
        row.tool,
        str(f["casts"]),
        f"{f['cast_bytes'] / 1e6:.3f}",
        _ratio(f["cast_bytes"], b.get("cast_bytes", 0)),
        f"{f['moved'] / 1e6:.3f}",
        _ratio(f["moved"], b.get("moved", 0)),
        f"{100 * f['share']:.1f}%",
        *accuracy_cells,
        f"{f['seconds']:.2f}",
    ]


def table(rows: list[Row], markdown: bool) -> str:
    baselines = {row.model: row for row in rows if row.tool == BASELINE}
    body = [cells(row, baselines.get(row.model)) for row in rows]
    if markdown:
        return "\n".join(
            ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
            + ["| " + " | ".join(r) + " |" for r in body]
        )
    widths = [max(len(r[i]) for r in [HEAD, *body]) for i in range(len(HEAD))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [HEAD, *body])


def bench_case(case: Case, tool_list: list[Tool]) -> list[Row]:
    shapes = {name: list(array.shape) for name, array in case.samples[0].items()}
    base = measure(case.model, shapes)
    expected = expected_outputs(case)
    rows = []
    for tool in tool_list:
        rows.append(run_tool(tool, case, base, shapes, expected))
        print(" | ".join(cells(rows[-1], None)), file=sys.stderr, flush=True)
    return rows


# --- command line ----------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--exports",
        choices=("none", "small", "full"),
        default="small",
        help="exported models: none, the small BERT and CNN (default), or those plus BERT-base, "
        "GPT-2 small and ViT-S/16 (minutes to export)",
    )
    p.add_argument("--sizes", default="1k,10k", help="synthetic stack sizes (default 1k,10k; '' for none)")
    p.add_argument(
        "--samples", type=int, default=3, help="seeded samples per case, for calibration and error"
    )
    p.add_argument(
        "--modelopt-python",
        default=None,
        help="Python of a venv with nvidia-modelopt (default: $AMP_MODELOPT_PYTHON; unset: no AutoCast)",
    )
    p.add_argument("--autocast-timeout", type=int, default=900, help="seconds one AutoCast run may take")
    p.add_argument(
        "--tools",
        action="append",
        metavar="PREFIX",
        help="only the tools whose row name starts with PREFIX (repeatable), e.g. 'amp-rewrite' for "
        "our six rows (default: every tool)",
    )
    p.add_argument("--markdown", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    tool_list = tools(args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="amp_place_") as tmp:
        for label, build in cases(args, Path(tmp)):
            try:
                case = build()
                rows += bench_case(case, tool_list)  # each tool's failure is already its row's cell
            except Exception as exc:  # the export, or the float32 model itself, failed: one row says so
                rows.append(Row(label, "float32 original", note="failed: " + _one_line(exc)))
                print(" | ".join(cells(rows[-1], None)), file=sys.stderr, flush=True)
    print(table(rows, args.markdown))
    print(f"\nvalidate: ONNX Runtime CPU, rtol {RTOL:g} atol {ATOL:g}, {args.samples} sample(s) per model")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
