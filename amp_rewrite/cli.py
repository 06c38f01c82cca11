"""`amp-rewrite model.onnx`: argparse front end (the flags: cli_parser.py). Every user error is one
line and an exit code.

Exit codes (README's table): 0 ok; 2 bad arguments; 3 bad model; 4 bad op list; 5 output not
writable; 6 validation over tolerance (nothing written unless --keep-failed); 1 anything else
amp-rewrite refuses; 130/143 interrupted (SIGINT/SIGTERM: temporaries removed). Only a bug of
ours exits 70 (one line; --debug shows the traceback).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

from amp_rewrite import driver
from amp_rewrite.checks import validate
from amp_rewrite.checks.check_options import CheckOptions
from amp_rewrite.cli_parser import build_parser, option_flags
from amp_rewrite.errors import AmpRewriteError, UsageError, one_line
from amp_rewrite.io import OutputPlan, atomic_write_bytes, save
from amp_rewrite.options import RewriteOptions

SUFFIX = {"float16": "fp16", "bfloat16": "bf16"}


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
    checks = driver.check_values(options, CheckOptions.from_args(args))
    source = Path(args.model)
    output = Path(args.output) if args.output else default_output(source, options.target)
    if args.explain is not None:
        args.dry_run, args.report, args.html = True, None, None  # --explain writes nothing
    plan = output_plan(args, source, output)
    checked = driver.check(
        source,
        checks=checks,
        progress=args.progress,
        options=options,
        keep_original=bool(args.html),
        outputs=plan,
        # only rewriting and saving: big external weights can stay on disk until written (memory);
        # --fuse's optimizer reads them
        lazy_weights=not (args.html or args.explain is not None or options.fuse is not None),
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
