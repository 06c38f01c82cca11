"""Fuzz the rewrite: many random valid graphs (tools/strategies.py's onnx_graphs), report what breaks.

    python tools/fuzz.py [--examples 10000] [--seed 0] [--max-ops 16]

Runs `check_rewrite` on `--examples` random models (both keep_io_types settings), counts distinct
failures (by message), and for each prints the first failing model's ops; with --shrink, hypothesis
then shrinks the first failure to a minimal graph. Exit status 1 when anything failed.
"""

from __future__ import annotations

import argparse
import collections
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hyp_seed
from hypothesis import strategies as st

import strategies  # a sibling in tools/: Python puts a script's own folder first on sys.path


def _describe(model) -> str:
    return " ".join(f"{n.op_type}({','.join(n.input)})->{','.join(n.output)}" for n in model.graph.node)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-ops", type=int, default=16)
    parser.add_argument("--shrink", action="store_true", help="shrink the first failure with hypothesis")
    args = parser.parse_args(argv)
    failures: collections.Counter = collections.Counter()
    first: dict = {}
    count = [0, 0]  # examples, examples where the rewrite changed something
    started = time.perf_counter()

    @hyp_seed(args.seed)
    @settings(
        max_examples=args.examples, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(strategies.onnx_graphs(max_ops=args.max_ops), st.booleans())
    def run(model, keep_io_types):
        count[0] += 1
        if count[0] % 500 == 0:
            print(
                f"{count[0]} examples, {sum(failures.values())} failures, {time.perf_counter() - started:.0f} s",
                flush=True,
            )
        try:
            strategies.check_rewrite(model, keep_io_types)
        except Exception as exc:  # noqa: BLE001 - every failure is a finding
            message = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[
                :300
            ]
            failures[message] += 1
            first.setdefault(message, (model, keep_io_types))

    run()
    print(
        f"\n{count[0]} examples in {time.perf_counter() - started:.0f} s; "
        f"{len(failures)} distinct failures ({sum(failures.values())} failing examples)"
    )
    for message, n in failures.most_common():
        model, keep = first[message]
        print(f"\n[{n}x] {message}\n  keep_io_types={keep}: {_describe(model)}")
    if failures and args.shrink:

        @settings(
            max_examples=args.examples, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        @given(strategies.onnx_graphs(max_ops=args.max_ops), st.booleans())
        def shrink(model, keep_io_types):
            strategies.check_rewrite(model, keep_io_types)

        try:
            shrink()
        except Exception as exc:  # noqa: BLE001
            print(f"\nshrunk: {type(exc).__name__}: {exc}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
