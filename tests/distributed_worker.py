"""One rank of the data-parallel tests: `mpiexec -n N python tests/distributed_worker.py SCENARIO OUT`.

Every rank writes what it saw to OUT/<name>-rank<r>.npz; tests/training/test_distributed.py
compares that with a single-process Trainer on the same global batches.
"""

from __future__ import annotations

import os
import signal
import sys

import numpy as np
from onnx import TensorProto

from amp_rewrite.training import SGD, AdamW, Trainer
from amp_rewrite.training.distributed import shard
from helpers import init, make_model, node, tensor
from training_models import mlp

FEATURES, HIDDEN, CLASSES, GLOBAL_BATCH, STEPS = 6, 16, 4, 8, 4
# name -> (optimizer factory, loss kind, bucket_mb); tiny buckets make several Allreduce calls.
EQUIVALENCE = {
    "sgd-mean": (lambda: SGD(0.1, momentum=0.9, max_grad_norm=0.05), "mean", 0.0005),
    "adamw-mean": (lambda: AdamW(0.01, max_grad_norm=0.05), "mean", 25.0),
    "sgd-sum": (lambda: SGD(0.01, momentum=0.9, max_grad_norm=0.5), "sum", 25.0),
    "adamw-sum": (lambda: AdamW(0.01, max_grad_norm=0.5), "sum", 0.0005),
}


def sse_model(seed=0):
    """MLP whose own output is the loss: the sum over samples of squared errors."""
    rng = np.random.default_rng(seed)
    w0 = rng.uniform(-0.4, 0.4, (FEATURES, HIDDEN)).astype(np.float32)
    w1 = rng.uniform(-0.25, 0.25, (HIDDEN, CLASSES)).astype(np.float32)
    nodes = [
        node("Gemm", ["x", "w0", "b0"], ["h_pre"], name="fc0"),
        node("Relu", ["h_pre"], ["h"], name="relu0"),
        node("Gemm", ["h", "w1", "b1"], ["pred"], name="fc1"),
        node("Sub", ["pred", "targets"], ["err"], name="err"),
        node("Mul", ["err", "err"], ["sq"], name="sq"),
        node("ReduceSum", ["sq"], ["sse"], name="sse", keepdims=0),
    ]
    inits = [
        init("w0", w0),
        init("b0", np.zeros(HIDDEN, np.float32)),
        init("w1", w1),
        init("b1", np.zeros(CLASSES, np.float32)),
    ]
    return make_model(
        nodes,
        [tensor("x", ["N", FEATURES]), tensor("targets", ["N", CLASSES])],
        [tensor("sse", [], TensorProto.FLOAT)],
        inits,
        opset=17,
    )


def model_and_loss(kind):
    return (mlp((FEATURES, HIDDEN, CLASSES)), "cross_entropy") if kind == "mean" else (sse_model(), "sse")


def global_batches(kind, count=STEPS, seed=3):
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(count):
        x = rng.standard_normal((GLOBAL_BATCH, FEATURES)).astype(np.float32)
        if kind == "mean":
            batches.append({"x": x, "labels": rng.integers(0, CLASSES, GLOBAL_BATCH).astype(np.int64)})
        else:
            batches.append(
                {"x": x, "targets": rng.standard_normal((GLOBAL_BATCH, CLASSES)).astype(np.float32)}
            )
    return batches


def equivalence(out, rank):
    for name, (make_optimizer, kind, bucket_mb) in EQUIVALENCE.items():
        model, loss = model_and_loss(kind)
        trainer = Trainer(
            model,
            loss=loss,
            optimizer=make_optimizer(),
            precision="float32",
            provider="cpu",
            distributed="mpi",
            loss_reduction=kind,
            bucket_mb=bucket_mb,
        )
        results = [trainer.step(shard(b)) for b in global_batches(kind)]
        np.savez(
            os.path.join(out, f"{name}-rank{rank}.npz"),
            losses=[r.loss for r in results],
            buckets=len(trainer.engine.reduction.buckets.flat),
            **{f"state/{k}": v for k, v in trainer.state().items()},
        )


def nonfinite_and_checkpoint(out, rank):
    """float16 step; an Inf in rank 1's share of step 2 only; then save, go on, load, go on again."""
    trainer = Trainer(
        mlp((FEATURES, HIDDEN, CLASSES)),
        optimizer=AdamW(0.01),
        precision="float16",
        provider="cpu",
        distributed="mpi",
    )
    batches = [shard(b) for b in global_batches("mean", count=7)]
    if rank == 1:
        batches[2]["x"] = batches[2]["x"].copy()
        batches[2]["x"][0, 0] = np.inf
    record = {}
    results = []
    for i, batch in enumerate(batches[:4]):
        if i == 2:
            record.update({f"before/{k}": v for k, v in trainer.state().items()})
        results.append(trainer.step(batch))
        if i == 2:
            record.update({f"after/{k}": v for k, v in trainer.state().items()})
    trainer.save(os.path.join(out, "ckpt.npz"))
    first = [trainer.step(b) for b in batches[4:]]
    trainer.load(os.path.join(out, "ckpt.npz"))
    again = [trainer.step(b) for b in batches[4:]]
    trainer.export(os.path.join(out, "trained.onnx"))
    np.savez(
        os.path.join(out, f"nonfinite-rank{rank}.npz"),
        skipped=[r.skipped for r in results],
        scales=[r.loss_scale for r in results],
        first=[r.loss for r in first],
        again=[r.loss for r in again],
        **record,
    )


def fault(out, rank, how):
    """Rank 1 dies (SIGKILL) or raises at step 5; rank 0 checkpoints every step and would go on forever."""
    trainer = Trainer(
        mlp((FEATURES, HIDDEN, CLASSES)),
        optimizer=SGD(0.1),
        precision="float32",
        provider="cpu",
        distributed="mpi",
    )
    batch = shard(global_batches("mean", count=1)[0])
    step = 0
    while True:
        if rank == 1 and step == 5:
            print("rank 1 fails now", flush=True)
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError("injected failure")
        trainer.step(batch)
        trainer.save(os.path.join(out, "ckpt.npz"))
        step += 1


def mismatch(out, rank):
    """Rank 1 configures another momentum: a different step graph."""
    Trainer(
        mlp((FEATURES, HIDDEN, CLASSES)),
        optimizer=SGD(0.1, momentum=0.9 if rank == 0 else 0.8),
        precision="float32",
        provider="cpu",
        distributed="mpi",
    )
    print("built", flush=True)


def uneven(out, rank):
    """Rank 1 gets a batch fewer than rank 0."""
    trainer = Trainer(
        mlp((FEATURES, HIDDEN, CLASSES)),
        optimizer=SGD(0.1),
        precision="float32",
        provider="cpu",
        distributed="mpi",
    )
    batches = [shard(b) for b in global_batches("mean", count=4)]
    trainer.fit(batches[:3] if rank == 1 else batches, progress=False)
    print("trained", flush=True)


if __name__ == "__main__":
    scenario, out = sys.argv[1], sys.argv[2]
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    {
        "equivalence": equivalence,
        "nonfinite": nonfinite_and_checkpoint,
        "mismatch": mismatch,
        "uneven": uneven,
        "kill": lambda o, r: fault(o, r, "kill"),
        "raise": lambda o, r: fault(o, r, "raise"),
    }[scenario](out, rank)
