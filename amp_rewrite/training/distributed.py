"""Data-parallel mixed-precision training over MPI (mpi4py), launched as `mpiexec -n N python train.py`.

TensorFlow's MirroredStrategy with a LossScaleOptimizer is the model, with Horovod's fused
buffers: every rank runs forward and backward on its share of the batch (a mean loss pre-scaled
by 1/N, so the sum over ranks is the gradient of the global mean), the unscaled gradients land in
a few flat float32 buckets, each bucket is summed across ranks in one `Allreduce` together with the
local loss and non-finite flag, and then every rank applies the same gated update with the global
flag. So a non-finite gradient on one rank skips the step everywhere and the loss scales stay
equal. The one step graph is cut in two for this (`split_step.py`,
run by `split_runner.SplitRunner` with `MpiReduction` between its halves, as the single-process
Trainer runs it on CPU without).

Start: weights, optimizer slots and loss-scale state are broadcast from rank 0, after every rank
has checked that it built the same step graph. `save`/`export` write on rank 0 only, `load` reads
on rank 0 and broadcasts, `fit` draws its progress line on rank 0 only. An uncaught exception on
any rank prints one line naming the rank and aborts the whole job, so no rank waits forever.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import numpy as np

from amp_rewrite.errors import AmpRewriteError, TrainingError

DEFAULT_BUCKET_MB = 25.0  # torch DDP's default bucket size
MEAN_LOSSES = ("cross_entropy", "mse")
REDUCTIONS = ("mean", "sum")
_TAIL = 2  # loss and non-finite count, reduced with the last bucket


def mpi():
    """mpi4py's MPI module (importing it initialises MPI), or one line saying how to get it."""
    try:
        from mpi4py import MPI
    except ImportError as error:
        raise TrainingError(
            f"distributed='mpi' needs mpi4py and an MPI ({error}): pip install 'amp-rewrite[mpi]'"
        ) from None
    return MPI


ABORT_GRACE_S = 0.5  # seconds between our failure line and MPI's Abort


def mpiexec_environment(env: dict | None = None) -> dict:
    """The environment to start `mpiexec` with: `env` (default os.environ), plus what Open MPI's
    mpiexec needs to do what MPICH's does by default (MPICH ignores them): as root, the two
    variables without which it refuses to run at all (containers, CI); and more ranks than cores
    (a 2-core CI machine, a laptop), which Open MPI 5 (PRRTE) and 4 refuse unless told."""
    env = dict(os.environ if env is None else env)
    env.setdefault("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def install_abort_hook(comm=None) -> None:
    """Make an uncaught exception on this rank end the whole job: one line naming the rank, then
    `Abort`, since the other ranks would otherwise wait in their next collective forever. Called by
    the MpiReduction; call it first thing in a script to cover the code before it too."""
    comm = comm or mpi().COMM_WORLD
    if getattr(sys.excepthook, "amp_rewrite_abort", False):
        return
    previous = sys.excepthook

    def abort(kind, error, traceback):
        if not issubclass(kind, AmpRewriteError):
            previous(kind, error, traceback)  # an unexpected error keeps its traceback
        sys.stderr.write(
            f"amp-rewrite: rank {comm.Get_rank()} of {comm.Get_size()} failed: "
            f"{kind.__name__}: {error}; aborting all ranks\n"
        )
        sys.stderr.flush()
        # Abort kills every rank at once, and the launcher drops what it has not yet forwarded
        # from our stderr pipe: give it a moment, so the one line reaches the user on a busy machine.
        time.sleep(ABORT_GRACE_S)
        comm.Abort(1)

    abort.amp_rewrite_abort = True
    sys.excepthook = abort


def shard(data, rank: int | None = None, size: int | None = None):
    """This rank's share of `data`. A dict of arrays (one batch, or a whole dataset) is cut along
    its first axis into `size` equal contiguous blocks; a sequence (of batches) is dealt
    round-robin. A remainder that cannot go to every rank is dropped: a rank with one step more
    than the others would wait for them forever."""
    if rank is None or size is None:
        world = mpi().COMM_WORLD
        rank, size = world.Get_rank() if rank is None else rank, world.Get_size() if size is None else size
    if not (isinstance(size, int) and size >= 1 and isinstance(rank, int) and 0 <= rank < size):
        raise TrainingError(f"shard needs 0 <= rank < size, got rank {rank!r} of size {size!r}")
    if isinstance(data, dict):
        lengths = {len(v) for v in data.values()}
        if len(lengths) != 1:
            raise TrainingError(f"shard: the arrays' first dimensions differ ({sorted(lengths)})")
        per_rank = lengths.pop() // size
        return {k: v[rank * per_rank : (rank + 1) * per_rank] for k, v in data.items()}
    items = list(data)
    return items[rank : len(items) // size * size : size]


def plan_buckets(sizes: dict[str, int], bucket_elements: int) -> list[list[str]]:
    """Consecutive gradients grouped into buckets of at most `bucket_elements` (a bigger gradient
    gets a bucket of its own): one Allreduce call per bucket."""
    buckets: list[list[str]] = [[]]
    filled = 0
    for name, size in sizes.items():
        if buckets[-1] and filled + size > bucket_elements:
            buckets.append([])
            filled = 0
        buckets[-1].append(name)
        filled += size
    return buckets


class GradientBuckets:
    """Flat float32 buffers the gradient session writes into and the apply session reads from;
    `views[grad]` is the gradient's slice, `tail` the (loss, non-finite count) pair in the last."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], bucket_bytes: int):
        sizes = {name: int(np.prod(shape, dtype=np.int64)) for name, shape in shapes.items()}
        groups = plan_buckets(sizes, max(1, bucket_bytes // 4))
        self.flat: list[np.ndarray] = []
        self.views: dict[str, np.ndarray] = {}
        for i, group in enumerate(groups):
            flat = np.zeros(sum(sizes[n] for n in group) + (_TAIL if i == len(groups) - 1 else 0), np.float32)
            offset = 0
            for name in group:
                self.views[name] = flat[offset : offset + sizes[name]].reshape(shapes[name])
                offset += sizes[name]
            self.flat.append(flat)
        self.tail = self.flat[-1][-_TAIL:]


class MpiReduction:
    """The reduction step of one rank of a data-parallel job (`Trainer(..., distributed="mpi")`, see
    the module doc), between the halves of the split engine (split_runner.SplitRunner: the gradient
    session, the Allreduce, then the update: numpy's host update on CPU, an apply session on CUDA).

    Each rank feeds its own share of every batch (`shard`). `loss_reduction`: "mean" (the
    built-in losses; the default for a named loss output) or "sum" (a loss summed over samples,
    whose rank sums add up to the global sum). `bucket_mb`: Allreduce bucket size. `device_id`:
    CUDA device (default: the rank's index on its node); on CPU the node's cores are split between
    its ranks unless `threads` says. `comm`: an mpi4py communicator (default COMM_WORLD).
    `timings` adds up the seconds spent in the gradient session, the Allreduce and the update.
    """

    def __init__(
        self,
        loss: str,
        threads: int = 0,
        loss_reduction: str | None = None,
        bucket_mb: float = DEFAULT_BUCKET_MB,
        device_id: int | None = None,
        comm=None,
    ):
        self.loss_reduction = _check_reduction(loss, loss_reduction)
        if not (isinstance(bucket_mb, (int, float)) and bucket_mb > 0):
            raise TrainingError(f"bucket_mb must be a number > 0, got {bucket_mb!r}")
        self.bucket_bytes = int(bucket_mb * 2**20)
        self._mpi = mpi()
        self.comm = comm or self._mpi.COMM_WORLD
        install_abort_hook(self.comm)
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.primary = self.rank == 0
        local = self.comm.Split_type(self._mpi.COMM_TYPE_SHARED, key=self.rank)
        local_rank, local_size = local.Get_rank(), local.Get_size()
        local.Free()
        self.device_id = local_rank if device_id is None else int(device_id)
        if not threads and hasattr(os, "sched_getaffinity"):
            threads = max(1, len(os.sched_getaffinity(0)) // local_size)
        self.threads = threads
        self.timings = {"gradient": 0.0, "allreduce": 0.0, "apply": 0.0}
        self.loss_share = 1.0 / self.size if self.loss_reduction == "mean" else 1.0
        self.flag = np.zeros((), np.bool_)  # the global skip flag the update reads
        self.buckets: GradientBuckets | None = None
        self.description = f"the gradients summed over {self.size} MPI ranks"

    def gradient_arrays(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        """The arrays the gradient session writes into: views of the flat buckets."""
        self.buckets = GradientBuckets(shapes, self.bucket_bytes)
        self.description += f" ({len(self.buckets.flat)} buckets)"
        return self.buckets.views

    def attach(self, engine) -> None:
        """Checks that every rank built the same step, then gives every rank rank 0's state."""
        self._check_same_step_graph(engine.split)
        self.share_state(engine.state)

    def reduce(self, loss: np.ndarray, skipped: np.ndarray) -> tuple[float, bool]:
        """The buckets, loss and flag summed over ranks; the global flag set for the update."""
        tail = self.buckets.tail
        tail[0] = loss * np.float32(self.loss_share)
        tail[1] = 1.0 if skipped else 0.0
        for flat in self.buckets.flat:
            self.comm.Allreduce(self._mpi.IN_PLACE, flat, op=self._mpi.SUM)
        self.flag[...] = tail[1] > 0
        return float(tail[0]), bool(self.flag)

    def timed(self, phase: str, action, *arguments):
        started = time.perf_counter()
        result = action(*arguments)
        self.timings[phase] += time.perf_counter() - started
        return result

    def _check_same_step_graph(self, split) -> None:
        """Every rank must run the same step, or the Allreduce sizes differ and the job hangs."""
        digest = hashlib.sha256()
        for part in (split.gradient, split.apply):
            digest.update(part.SerializeToString(deterministic=True))
        config = {"bucket_bytes": self.bucket_bytes, "reduction": self.loss_reduction}
        digest.update(json.dumps(config, sort_keys=True).encode())
        mine = np.frombuffer(digest.digest(), np.uint8)
        everyone = np.empty((self.size, mine.size), np.uint8)
        self.comm.Allgather(mine, everyone)
        differing = [r for r in range(self.size) if not np.array_equal(everyone[r], everyone[0])]
        if differing:
            raise TrainingError(
                f"rank {differing[0]} built a different step graph than rank 0 (model, loss, optimizer, "
                "precision or trainer options differ): every rank must run the same training script"
            )

    def share_state(self, state) -> None:
        """Weights, optimizer slots, step count, loss-scale state and learning rate from rank 0."""
        names = sorted(state.values)
        arrays = {name: state.read(name) for name in names}
        for name in names:
            self.comm.Bcast(arrays[name], root=0)
        lr = np.array(state.lr.numpy(), np.float32)
        self.comm.Bcast(lr, root=0)
        state.write(arrays)
        state.lr.update_inplace(lr)

    def check_batch_count(self, count: int) -> None:
        """Every rank must take as many steps, or the last ones wait for the others forever."""
        counts = self.comm.allgather(count)
        if len(set(counts)) > 1:
            raise TrainingError(
                f"ranks got different numbers of batches ({', '.join(map(str, counts))}): "
                "each would wait for the others' last steps forever; deal them with shard()"
            )

    def on_primary(self, action) -> None:
        """Run `action` on rank 0; a failure there is raised on every rank, so none waits alone."""
        error = None
        if self.rank == 0:
            try:
                action()
            except Exception as failure:  # re-raised below on every rank
                error = (
                    f"{type(failure).__name__}: {failure}"
                    if not isinstance(failure, AmpRewriteError)
                    else str(failure)
                )
        error = self.comm.bcast(error, root=0)
        if error is not None:
            raise TrainingError(error if self.rank == 0 else f"on rank 0: {error}") from None


def _check_reduction(loss: str, reduction: str | None) -> str:
    """How the loss combines over samples: built-in losses are means; a named loss says."""
    if reduction is None:
        return "mean"
    if reduction not in REDUCTIONS:
        raise TrainingError(f"loss_reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    if loss in MEAN_LOSSES and reduction != "mean":
        raise TrainingError(
            f"the built-in loss {loss!r} is a mean over samples: loss_reduction must be 'mean'"
        )
    return reduction
