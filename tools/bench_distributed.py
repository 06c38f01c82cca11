"""Data-parallel training throughput: 1 and 2 MPI ranks on the same global batch, against the
single-process Trainer (its one-graph step), with the share of step time spent in the Allreduce.

    python tools/bench_distributed.py                    # CPU, float32, MLP widths 512 and 2048
    python tools/bench_distributed.py --provider cuda    # one GPU per rank (device = local rank)
    python tools/bench_distributed.py --quick            # smoke run

Needs the [mpi] extra (mpi4py + mpich's mpiexec). Each rank trains on global_batch / ranks
samples per step; samples/s = global batch / median step time on rank 0. Scaling efficiency =
samples/s with N ranks / (N x samples/s of the single-process Trainer), which the 1-rank run times
round-robin with its own step (so list 1 first in --ranks). Launches of 1 and 2 ranks alternate
`--rounds` times and the fastest of each is shown, since a shared machine's load drifts. On CPU the node's cores
are split between the ranks (a 2-core VM gives each of 2 ranks one core), so the CPU figure says
how well the split step + Allreduce use the same cores, not what more machines would give.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from amp_rewrite.training import SGD, Trainer
from bench_train import make_feeds, mlp  # a sibling in tools/: Python puts a script's folder on sys.path


def timed_steps(trainers: dict, feeds, warmup, repeat, barrier=None):
    """Per trainer: median step time (s), mean step time, and the mean seconds per step spent in
    each phase after warm-up. Several trainers are timed round-robin, so load drift hits all alike."""
    for i in range(warmup):
        for trainer in trainers.values():
            trainer.step(feeds[i % len(feeds)])
    if barrier:
        barrier()
    for trainer in trainers.values():
        for key in getattr(getattr(trainer.engine, "reduction", None), "timings", {}):
            trainer.engine.reduction.timings[key] = 0.0
    times = {name: [] for name in trainers}
    for i in range(repeat):
        for name, trainer in trainers.items():
            start = time.perf_counter()
            trainer.step(feeds[i % len(feeds)])
            times[name].append(time.perf_counter() - start)
    return {
        name: {
            "median": statistics.median(t),
            "mean": sum(t) / repeat,
            "phases": {
                k: v / repeat
                for k, v in getattr(getattr(trainers[name].engine, "reduction", None), "timings", {}).items()
            },
        }
        for name, t in times.items()
    }


def make_trainer(args, **options):
    model, _, _ = mlp(width=args.width)
    return Trainer(
        model, optimizer=SGD(0.01, momentum=0.9), precision=args.precision, provider=args.provider, **options
    )


def worker(args) -> int:
    """One rank: print (on rank 0) a JSON line with step times; a lone rank also times the
    single-process Trainer, round-robin with itself."""
    from amp_rewrite.training.distributed import shard

    trainers = {"mpi": make_trainer(args, distributed="mpi", bucket_mb=args.bucket_mb)}
    comm = trainers["mpi"].engine.reduction.comm
    if comm.Get_size() == 1:
        trainers["single"] = make_trainer(args)
    feeds = [shard(f) for f in make_feeds((784,), args.global_batch)]
    results = timed_steps(trainers, feeds, args.warmup, args.repeat, comm.Barrier)
    if comm.Get_rank() == 0:
        results["device"] = trainers["mpi"].device
        results["params"] = int(sum(v.size for v in trainers["mpi"].weights().values()))
        print(json.dumps(results), flush=True)
    return 0


def launch(args, ranks):
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    mpiexec = mpiexec if os.path.exists(mpiexec) else shutil.which("mpiexec")
    if mpiexec is None:
        raise SystemExit("no mpiexec: pip install -e '.[mpi]'")
    command = [
        mpiexec,
        "-n",
        str(ranks),
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        *_forwarded(args),
    ]
    from amp_rewrite.training.distributed import mpiexec_environment

    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=mpiexec_environment())
    if done.returncode != 0:
        raise SystemExit(f"{ranks} ranks failed:\n{done.stdout}{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _forwarded(args):
    return [
        "--width",
        str(args.width),
        "--global-batch",
        str(args.global_batch),
        "--warmup",
        str(args.warmup),
        "--repeat",
        str(args.repeat),
        "--precision",
        args.precision,
        "--provider",
        args.provider,
        "--bucket-mb",
        str(args.bucket_mb),
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", default="cpu", choices=["cpu", "cuda", "auto"])
    parser.add_argument("--precision", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--widths", default="512,2048")
    parser.add_argument("--width", type=int, default=512, help=argparse.SUPPRESS)
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument(
        "--rounds", type=int, default=3, help="launch each rank count this often; keep the fastest"
    )
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps (a smoke run)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.quick:
        args.widths, args.global_batch, args.warmup, args.repeat, args.rounds = "64", 16, 1, 3, 1
    print(
        f"MLP 784-w-w-10, SGD(momentum), {args.precision}, {args.provider}, global batch {args.global_batch}, "
        f"median of {args.repeat} steps after {args.warmup} warm-up, fastest of {args.rounds} launches, "
        f"buckets of {args.bucket_mb:g} MB"
    )
    print("| width | params | runner | device | step ms | samples/s | Allreduce share | scaling efficiency |")
    print("|---|---|---|---|---|---|---|---|")
    for width in [int(w) for w in args.widths.split(",")]:
        args.width = width
        base = None
        rank_counts = [int(r) for r in args.ranks.split(",")]
        rounds = [
            {ranks: launch(args, ranks) for ranks in rank_counts} for _ in range(args.rounds)
        ]  # interleaved
        for ranks in rank_counts:
            result = min((r[ranks] for r in rounds), key=lambda r: r["mpi"]["median"])
            params = f"{result['params'] / 1e6:.2f}M"
            if "single" in result:
                single = min(r[ranks]["single"]["median"] for r in rounds)
                base = args.global_batch / single
                print(
                    f"| {width} | {params} | one process (one-graph step) | {result['device']} "
                    f"| {1e3 * single:.2f} | {base:.0f} | - | 1.00 |"
                )
            mpi, rate = result["mpi"], args.global_batch / result["mpi"]["median"]
            share = mpi["phases"]["allreduce"] / mpi["mean"]
            efficiency = f"{rate / (ranks * base):.2f}" if base else "n/a"
            print(
                f"| {width} | {params} | {ranks} rank{'s' if ranks > 1 else ''} x {args.global_batch // ranks} "
                f"| {result['device']} | {1e3 * mpi['median']:.2f} | {rate:.0f} | {100 * share:.1f} % | {efficiency} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
