"""`amp-rewrite model.onnx`: argparse front end. Every user error is one line and an exit code.

Exit codes (README's table): 0 ok; 2 bad arguments; 3 bad model; 4 bad op list; 5 output not
writable; 6 validation over tolerance (nothing written unless --keep-failed); 1 anything else
amp-rewrite refuses; 130/143 interrupted (SIGINT/SIGTERM: temporaries removed). Only a bug of
ours exits 70 (one line; --debug shows the traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

from amp_rewrite import driver
from amp_rewrite.analysis.oplists import TARGETS
from amp_rewrite.checks import validate
from amp_rewrite.deployment import PROVIDERS
from amp_rewrite.errors import AmpRewriteError, UsageError, one_line
from amp_rewrite.io import OutputPlan, atomic_write_bytes, save
from amp_rewrite.options import ALIASES, PLACEMENTS, RewriteOptions, option_names

SUFFIX = {"float16": "fp16", "bfloat16": "bf16"}
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
        "--opset",
        type=int,
        metavar="N",
        help="convert the model to opset N first (onnx.version_converter): ops whose kernels need a newer "
        "opset (CUDA's float16 Clip from 12) then run in the target type; the summary says when it would help",
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
    g.add_argument(
        "--validate", action="store_true", help="run both models in ONNX Runtime and compare outputs"
    )
    g.add_argument(
        "--calibrate",
        action="store_true",
        help="measure float32 tensor ranges on the samples; overflowing producers/readers stay float32",
    )
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
        "--tolerance",
        action="store_true",
        help="after calibration, pin nodes float32 where the error enters until --rtol/--atol pass",
    )
    g.add_argument("--inputs", metavar="FILE.npz", help="sample inputs: keys NAME, or I/NAME for sample I")
    g.add_argument("--samples", type=int, default=1, metavar="N", help="synthesised samples (default 1)")
    g.add_argument("--rtol", type=float, default=1e-2, help="relative tolerance (default 1e-2)")
    g.add_argument("--atol", type=float, default=1e-3, help="absolute tolerance (default 1e-3)")
    g.add_argument(
        "--safety", type=float, default=4.0, help="calibration margin: limit is max/SAFETY (default 4)"
    )
    g.add_argument(
        "--reference",
        nargs="?",
        const="always",
        choices=("auto", "always", "never"),
        default="auto",
        help="also run onnx.reference on CPU, which keeps float16 (--reference alone: always; auto: "
        "when its estimated work is small, about 20 s)",
    )
    g.add_argument("--max-runs", type=int, default=10, help="validation runs the --tolerance search may use")
    g.add_argument(
        "--progress", action="store_true", default=None, help="progress bars even when not a terminal"
    )


def default_output(model_path: Path, target: str) -> Path:
    return model_path.with_name(f"{model_path.stem}.{SUFFIX[target]}{model_path.suffix or '.onnx'}")


def rewrite_options(args) -> RewriteOptions:
    """The rewrite's options, built once from the flags the user gave (the rest: their defaults)."""
    given = {
        field: getattr(args, dest)
        for field, dest in option_flags().items()
        if getattr(args, dest) is not None
    }
    if "dims" in given:
        given["dims"] = validate.parse_dims(given["dims"])
    return RewriteOptions.of(**given)


def output_plan(args, source: Path, output: Path) -> OutputPlan:
    """Every path this run writes, checked before any work against each other and every path it
    reads (the model now; its data files as the loader finds them, before reading one)."""
    data = None
    if isinstance(args.external_data, str) and not args.dry_run:
        name = args.external_data
        if not name or name in (".", "..") or "/" in name or os.sep in name or "\0" in name:
            raise UsageError(
                f"--external-data {name!r}: give a file name, without a folder (it goes beside the output)"
            )
        data = output.parent / name
    writes = {
        "-o": None if args.dry_run else output,
        "--external-data": data,
        "--report": args.report,
        "--html": args.html,
    }
    plan = OutputPlan(writes, reads=[source], force=args.force)
    if args.inputs:
        plan.check_reads([Path(args.inputs)], label="the --inputs file")
    plan.check_reads([Path(f) for f in args.op_lists or ()], label="an --op-lists file")
    return plan


def run(args) -> int:
    options = rewrite_options(args)  # bad option values fail before anything is read
    checks = {
        "validate": args.validate,
        "calibrate": args.calibrate or args.tolerance,
        "tolerance": args.tolerance,
    }
    numbers = {
        "samples_count": args.samples,
        "safety": args.safety,
        "rtol": args.rtol,
        "atol": args.atol,
        "max_runs": args.max_runs,
    }
    driver.check_values(options, **numbers, **checks)
    source = Path(args.model)
    output = Path(args.output) if args.output else default_output(source, options.target)
    if args.explain is not None:
        args.dry_run, args.report, args.html = True, None, None  # --explain writes nothing
    plan = output_plan(args, source, output)
    checked = driver.check(
        source,
        inputs=args.inputs,
        **numbers,
        **checks,
        reference={"auto": "auto", "always": True, "never": False}[args.reference],
        progress=args.progress,
        options=options,
        keep_original=bool(args.html),
        outputs=plan,
        # only rewriting and saving: big external weights can stay on disk until written (memory)
        lazy_weights=not (args.html or args.explain is not None),
    )
    loaded = checked.loaded
    result = checked.result
    if args.explain is not None:
        print(driver.explain_text(result.report, args.explain))
        return 0
    # over tolerance: a refusal, so nothing is written unless asked (--keep-failed)
    writes = checked.passed or args.keep_failed
    if writes and not args.dry_run:
        save(
            result.model,
            output,
            external_data=args.external_data or loaded.had_external_data,
            keep_model=False,
            keep=plan.reads,
        )
    if writes and args.report:
        atomic_write_bytes(Path(args.report), json.dumps(result.report.to_dict(), indent=1).encode())
    if writes and args.html:
        from amp_rewrite.report import html as html_report

        atomic_write_bytes(
            Path(args.html), html_report.render(result.report, loaded.model, source.name).encode()
        )
    if not args.quiet:
        print(result.report.to_text())
        print(result.report.table_text())
        if checked.validation is not None:
            print(checked.validation.to_text())
        if args.dry_run:
            print("dry run: no model written")
        else:
            print(
                f"wrote {output}" if writes else "over tolerance: nothing written (--keep-failed writes it)"
            )
    if checked.validation is not None:
        checked.validation.raise_if_failed()
    return 0


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so Python's flush at exit does not report the closed pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is no file (a test's capture): nothing to flush at exit
        pass


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is, so every write on the way out removes its temporaries."""


def _terminate(signum, frame):
    raise Terminated()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) >= 3 and argv[0] == "explain":  # `amp-rewrite explain model.onnx NODE` = --explain NODE
        argv = [argv[1], "--explain", argv[2], *argv[3:]]
    debug = "--debug" in argv
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main_thread else None
    try:
        return run(build_parser().parse_args(argv))
    except BrokenPipeError:  # `amp-rewrite ... | head`: the reader left, which is no error of ours
        _quiet_stdout()
        return 0
    except SystemExit as exc:  # --version, --help
        return exc.code if isinstance(exc.code, int) else 0
    except AmpRewriteError as exc:
        print(f"amp-rewrite: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Terminated:
        print("amp-rewrite: terminated; nothing written", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("amp-rewrite: interrupted; nothing written", file=sys.stderr)
        return 130
    except MemoryError:
        print("amp-rewrite: error: out of memory", file=sys.stderr)
        return 1
    except Exception as exc:  # a bug of ours: one line unless asked for more
        if debug:
            raise
        print(
            f"amp-rewrite: internal error: {type(exc).__name__}: {one_line(str(exc))} "
            f"(rerun with --debug for details)",
            file=sys.stderr,
        )
        return 70
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)
