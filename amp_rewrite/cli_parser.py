"""The CLI's flags: the argparse parser and its help text, and which `RewriteOptions` field each
option flag sets (`option_flags`; an option without a flag is `API_ONLY`); the checks' flags are
`CheckOptions`' own (checks/check_options.py)."""

from __future__ import annotations

import argparse

from amp_rewrite.analysis.oplists import TARGETS
from amp_rewrite.checks.check_options import CheckOptions
from amp_rewrite.deployment import PROVIDERS
from amp_rewrite.errors import UsageError
from amp_rewrite.options import ALIASES, PLACEMENTS, RewriteOptions, option_names

DEFAULT = RewriteOptions()  # every option's default is written once, in options.py
API_ONLY = (
    "deployment",
    "check",
    "force_fp32",
    "colour_as",
    "calibration",
    "fold_noop_casts",
)  # options without a flag
FLAG_DESTS = {"keep_fp32_nodes": "keep_fp32_node", "dims": "dim"}  # where a flag's name is not its field's


def option_flags() -> dict:
    """RewriteOptions field -> the argparse dest of its flag: the field's own name unless FLAG_DESTS
    says otherwise. Each such flag defaults to None (not given), so an option the user did not
    name keeps RewriteOptions' default; a test checks this against the fields and the parser."""
    return {
        name: FLAG_DESTS.get(name, name)
        for name in option_names()
        if name not in API_ONLY and name not in ALIASES
    }


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, no usage dump
        raise UsageError(message)


EPILOG = """commands:
  amp-rewrite explain MODEL.onnx NODE [options]
                        why NODE got its precision, as a chain (the same as MODEL.onnx --explain NODE)

exit codes: 0 ok, 2 bad arguments, 3 bad model, 4 bad op list, 5 output not writable,
6 validation over tolerance, 1 anything else refused, 130/143 interrupted"""


def _version() -> str:
    """The installed distribution's version (the package root is above the CLI's layer)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("amp-rewrite")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    from amp_rewrite.analysis.oplists import default_list_path

    p = _Parser(
        prog="amp-rewrite",
        description="Rewrite an ONNX model for mixed precision (float16/bfloat16).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"amp-rewrite {_version()}")
    p.add_argument("model", help="input .onnx file (never modified)")
    p.add_argument("-o", "--output", help="output file (default: MODEL.fp16.onnx beside the input)")
    p.add_argument("--target", choices=TARGETS, help=f"low-precision type (default {DEFAULT.target})")
    p.add_argument("--force", action="store_true", help="replace an existing output file")
    p.add_argument("--dry-run", action="store_true", help="decide and report, write no model")
    p.add_argument(
        "--keep-failed",
        action="store_true",
        help="with --validate/--tolerance: write the outputs even when over tolerance (exit 6 still)",
    )
    p.add_argument("--report", metavar="FILE.json", help="write every decision and the summary as JSON")
    p.add_argument(
        "--no-keep-io-types",
        dest="keep_io_types",
        action="store_const",
        const=False,
        help="graph inputs/outputs become the target type too (default: keep float32)",
    )
    p.add_argument(
        "--low-precision-io",
        action="append",
        metavar="REGEX",
        help="graph inputs/outputs whose names fully match REGEX take the target type, the rest follow "
        "--no-keep-io-types (repeatable; e.g. 'past_key_values\\..*' 'present\\..*' for a "
        "decoder's KV cache); a REGEX matching no float32 input or output is an error",
    )
    for name in ("allow", "deny", "infer", "clear"):
        p.add_argument(
            f"--{name}",
            action="append",
            metavar="OP",
            help=f"put op type OP in the {name} list (repeatable; 'domain:Op' for other domains)",
        )
    p.add_argument(
        "--op-lists",
        action="append",
        metavar="FILE.yaml",
        help=f"YAML file of list overrides (same format as the shipped {default_list_path('float16')})",
    )
    p.add_argument(
        "--keep-fp32-node",
        action="append",
        metavar="NAME_OR_REGEX",
        help="keep nodes whose name equals or fully matches this regex in float32 (one that matches "
        "no node is an error)",
    )
    p.add_argument(
        "--clamp",
        action="store_const",
        const=True,
        help="clamp constants outside the target range instead of keeping their consumers float32",
    )
    p.add_argument(
        "--annotate",
        action="store_const",
        const=True,
        help="write each node's precision and reason into the output model (doc_string; Netron shows it)",
    )
    p.add_argument(
        "--provider",
        choices=PROVIDERS,
        help="where the model will run (ONNX Runtime provider): ops it has no target-type kernel for "
        "stay float32, and --validate/--calibrate run on it. cuda/auto (default): CUDA's "
        "kernels, checks on CUDA when it loads, else CPU; cpu: CPU's kernels and CPU; any: "
        "no kernel check",
    )
    p.add_argument(
        "--placement",
        choices=PLACEMENTS,
        help="infer/clear ops no deny op reaches: cost (default) colours them by one minimum cut of "
        "the estimated bytes moved (fewer bytes on every model measured); tf paints them low "
        "only between allow ops (TensorFlow's rule, a little faster on very large graphs)",
    )
    p.add_argument(
        "--even-if-worse",
        dest="never_worse",
        action="store_const",
        const=False,
        help="rewrite even where cost placement's estimate says the low-precision model moves more "
        "bytes than float32 (default: such a model stays float32, and the summary says so)",
    )
    p.add_argument(
        "--opset",
        type=int,
        metavar="N",
        help="convert the model to opset N first (onnx.version_converter): ops whose kernels need a newer "
        "opset (CUDA's float16 Clip from 12) then run in the target type; the summary says when it would help",
    )
    p.add_argument(
        "--fuse",
        nargs="?",
        const="auto",
        metavar="TYPE",
        help="run ONNX Runtime's transformer optimizer first (its Python fusions: SkipLayerNormalization, "
        "BiasGelu, Attention, ...), then colour the fused graph; TYPE is its model type (bert, gpt2, vit, ...), "
        "auto (the default when TYPE is left out) reads it from the graph",
    )
    p.add_argument(
        "--dim",
        action="append",
        metavar="NAME=SIZE",
        help="size of the inputs' symbolic dim NAME (repeatable): shape inference uses it for the size "
        "estimates (cost placement, bytes moved, FLOPs) and --validate for synthesised inputs; "
        "the model's declared shapes are unchanged",
    )
    p.add_argument(
        "--pointwise-check",
        action=argparse.BooleanOptionalAction,
        help="a range-deny op (Exp, Pow, Reciprocal, Sinh, Cosh) whose pointwise chain from one tensor "
        "agrees with float32 on every float16 value becomes an infer op, no data needed "
        "(default on; --no-pointwise-check: the lists alone decide)",
    )
    p.add_argument(
        "--external-data",
        nargs="?",
        const=True,
        default=False,
        metavar="NAME",
        help="save weights as external data, in one file beside the output (NAME, a file name; "
        "default: <output>.<run>.data, unique to the run). Models over 2 GB, and models "
        "whose input had external data, get it unasked",
    )
    _add_check_arguments(p)
    p.add_argument("--quiet", action="store_true", help="print nothing on success")
    p.add_argument("--debug", action="store_true", help="show tracebacks of internal errors")
    return p


def _add_check_arguments(p) -> None:
    g = p.add_argument_group("explain, validate, calibrate")
    g.add_argument(
        "--explain", metavar="NODE", help="print why NODE got its precision, as a chain; write nothing"
    )
    g.add_argument(
        "--html", metavar="FILE.html", help="write a self-contained HTML report (summary, op table, graph)"
    )
    CheckOptions.add_arguments(g)  # --validate ... --tf32: the checks' flags, owned by CheckOptions
    g.add_argument(
        "--scale-activations",
        action=argparse.BooleanOptionalAction,
        help="with --calibrate: a linear region (MatMul/Gemm/Conv and the ops around them) over the "
        "limit computes in the target type on inputs x 2^-k, its output x 2^k in float32, "
        "instead of staying float32 (default on; --no-scale-activations: float32 as before)",
    )
    g.add_argument(
        "--relax-margin",
        type=float,
        metavar="M",
        help="with --calibrate: an elementwise range-deny op (Exp, Pow, Reciprocal, Sinh, Cosh) whose "
        f"measured inputs and outputs stay within max/M (default {DEFAULT.relax_margin:g}; 0: never) "
        "becomes an infer op",
    )
    g.add_argument(
        "--progress", action="store_true", default=None, help="progress bars even when not a terminal"
    )
