"""No file is clobbered, and a model never meets another run's data (issue 24, findings 2, 4, 7).

The output plan compares every path a run writes with every path it reads (the model and its data
files) by identity, before any work; existing outputs need --force. The output pair writes the
data under a name unique to the run and renames the model last, so a kill or a second writer
never leaves a model with another run's data; SIGTERM removes the temporaries.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from amp_rewrite import errors
from amp_rewrite import io as model_io
from amp_rewrite.cli import main
from helpers import ROOT, load_script, run_ort

make_corpus = load_script("tests/hostile/make_corpus.py")


def _big_model(dim=512, seed=1) -> onnx.ModelProto:
    """x @ W1 -> Relu -> @ W2 with 8 KiB weights (external data from 1 KiB, float16 too)."""
    rng = np.random.default_rng(seed)
    model = make_corpus.valid_model()
    model.graph.initializer[0].CopyFrom(
        onnx.numpy_helper.from_array((rng.standard_normal((4, dim)) / 2).astype(np.float32), "W1")
    )
    model.graph.initializer[1].CopyFrom(
        onnx.numpy_helper.from_array((rng.standard_normal((dim, 4)) / 6).astype(np.float32), "W2")
    )
    return model


@pytest.fixture()
def external(tmp_path):
    """model.onnx with its weights in weights.bin."""
    path = tmp_path / "model.onnx"
    onnx.save(
        _big_model(),
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="weights.bin",
        size_threshold=256,
    )
    return path, tmp_path / "weights.bin"


def _files(folder: Path) -> dict:
    return {p.name: p.read_bytes() if p.is_file() else "special" for p in sorted(folder.iterdir())}


def _refused(capsys, code, expected_code, fragment):
    err = capsys.readouterr().err.strip()
    assert code == expected_code, err
    assert len(err.splitlines()) == 1 and err.startswith("amp-rewrite: error: ") and fragment in err, err


@pytest.mark.parametrize(
    "flags",
    [
        ["-o", "{data}", "--force"],
        ["--report", "{data}", "--force"],
        ["--html", "{data}", "--force"],
        ["--report", "{data}", "--dry-run", "--force"],
        ["--html", "{data}", "--dry-run", "--force"],
    ],
)
def test_no_write_lands_on_an_input_data_file(flags, external, capsys):
    path, data = external
    before = _files(path.parent)
    args = [a.replace("{data}", str(data)) for a in flags]
    if "-o" not in args:
        args += ["-o", str(path.parent / "out.onnx")]
    _refused(capsys, main([str(path), *args]), 5, "is a data file of the input model")
    assert _files(path.parent) == before
    _refused(capsys, main([str(path), "--report", str(data)]), 5, "already exists")  # without --force


def test_a_data_file_named_like_the_outputs_is_never_replaced(tmp_path, capsys):
    """The input's data file is out.onnx.data: -o out.onnx used to replace it without --force."""
    path = tmp_path / "model.onnx"
    onnx.save(
        _big_model(), str(path), save_as_external_data=True, location="out.onnx.data", size_threshold=256
    )
    data = (tmp_path / "out.onnx.data").read_bytes()
    out = tmp_path / "out.onnx"
    for extra in (
        [],
        ["--force"],
    ):  # the second run replaces out.onnx, whose data it may remove: never an input
        assert main([str(path), "-o", str(out), "--quiet", *extra]) == 0, capsys.readouterr().err
        assert (tmp_path / "out.onnx.data").read_bytes() == data
    feeds = {"x": np.ones((2, 4), np.float32)}
    np.testing.assert_allclose(
        run_ort(onnx.load(str(out)), feeds)[0], run_ort(_big_model(), feeds)[0], rtol=1e-2, atol=1e-2
    )


def test_an_unrelated_data_file_beside_the_output_is_left_alone(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(_big_model().SerializeToString())
    (tmp_path / "out.onnx.data").write_bytes(b"someone else's")
    assert main([str(path), "-o", str(tmp_path / "out.onnx"), "--external-data", "--quiet"]) == 0
    assert (tmp_path / "out.onnx.data").read_bytes() == b"someone else's"


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["-o", "{out}", "--report", "{out}"], "name the same file"),
        (["--report", "{r}", "--html", "{r}", "--dry-run"], "name the same file"),
        (["-o", "{out}", "--report", "{old}"], "already exists"),
        (["-o", "{out}", "--html", "{old}"], "already exists"),
        (["-o", "{npz}", "--force", "--validate", "--inputs", "{npz}"], "is the --inputs file"),
        (["-o", "{yaml}", "--force", "--op-lists", "{yaml}"], "is an --op-lists file"),
        (["-o", "{model}", "--force"], "is the input model"),
        (["-o", "{link}", "--force"], "is the input model"),
        (["-o", "{fifo}", "--force"], "is not a regular file"),
        (["--report", "{fifo}", "--force", "--dry-run"], "is not a regular file"),
    ],
)
def test_output_plan_clashes_are_one_line(flags, fragment, tmp_path, capsys):
    path = tmp_path / "model.onnx"
    path.write_bytes(make_corpus.valid_model().SerializeToString())
    np.savez(tmp_path / "s.npz", x=np.ones((2, 4), np.float32))
    (tmp_path / "l.yaml").write_text("allow: [Relu]\n")
    (tmp_path / "old.json").write_text("{}")
    os.symlink(path, tmp_path / "link.onnx")  # the input by another name
    os.mkfifo(tmp_path / "pipe")  # a device or FIFO is never replaced, even with --force
    names = {
        "out": tmp_path / "out.onnx",
        "r": tmp_path / "r.json",
        "old": tmp_path / "old.json",
        "npz": tmp_path / "s.npz",
        "yaml": tmp_path / "l.yaml",
        "model": path,
        "link": tmp_path / "link.onnx",
        "fifo": tmp_path / "pipe",
    }
    before = _files(tmp_path)
    args = [re.sub(r"\{(\w+)\}", lambda m: str(names[m.group(1)]), a) for a in flags]
    _refused(capsys, main([str(path), *args]), 5, fragment)
    assert _files(tmp_path) == before


def test_force_replaces_report_and_html(tmp_path, capsys):
    path = tmp_path / "model.onnx"
    path.write_bytes(make_corpus.valid_model().SerializeToString())
    (tmp_path / "r.json").write_text("old")
    assert main([str(path), "--dry-run", "--report", str(tmp_path / "r.json"), "--force", "--quiet"]) == 0
    assert (tmp_path / "r.json").read_text().startswith("{")


def test_over_tolerance_writes_nothing_unless_asked(tmp_path, capsys):
    """Finding 7: exit 6 left the output and printed 'wrote'; the README says a refusal writes nothing."""
    path = tmp_path / "model.onnx"
    path.write_bytes(_big_model().SerializeToString())
    outs = [
        "-o",
        str(tmp_path / "out.onnx"),
        "--report",
        str(tmp_path / "r.json"),
        "--html",
        str(tmp_path / "r.html"),
    ]
    strict = ["--validate", "--rtol", "0", "--atol", "0", "--provider", "any", "--reference", "never"]
    assert main([str(path), *outs, *strict]) == 6
    captured = capsys.readouterr()
    assert "over tolerance: nothing written" in captured.out and "wrote" not in captured.out
    assert len(captured.err.strip().splitlines()[-1:]) == 1 and "over tolerance" in captured.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]
    assert main([str(path), *outs, *strict, "--keep-failed"]) == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "out.onnx", "r.html", "r.json"]


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--validate", "--samples", "0"], "samples 0 must be"),
        (["--calibrate", "--samples", "-2"], "samples -2 must be"),
        (["--calibrate", "--safety", "0"], "safety 0.0 must be a positive number"),
        (["--calibrate", "--safety", "nan"], "safety nan must be"),
        (["--validate", "--rtol", "-1"], "rtol -1.0 must be"),
        (["--tolerance", "--max-runs", "0"], "max runs 0 must be"),
    ],
)
def test_check_values_that_cannot_work_are_usage_errors(flags, fragment, tmp_path, capsys):
    path = tmp_path / "model.onnx"
    path.write_bytes(make_corpus.valid_model().SerializeToString())
    _refused(capsys, main([str(path), "--dry-run", *flags]), 2, fragment)


def test_a_newline_in_a_path_is_one_line(tmp_path, capsys):
    odd = tmp_path / "a\nb.onnx"
    _refused(capsys, main([str(odd)]), 3, "a\\nb.onnx: no such file")
    odd.write_bytes(b"not a model")
    _refused(capsys, main([str(odd)]), 3, "a\\nb.onnx: not an ONNX model")
    with pytest.raises(errors.ModelError) as info:
        model_io.load(odd)
    assert "\n" not in str(info.value)


# --- the pair under kills and a second writer ------------------------------------------------------


def _start(path, out, pause, *extra):
    env = dict(os.environ, AMP_REWRITE_TEST_PAUSE=pause)
    return subprocess.Popen(_cli(path, out, *extra), cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, proc, what):
    deadline = time.time() + 60
    while time.time() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            pytest.fail(f"the writer exited before {what}: {proc.stderr.read()}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"the writer never reached {what}")


def _check_pair(out: Path, source: onnx.ModelProto) -> None:
    """out.onnx loads with its own data and computes what `source` computes."""
    feeds = {"x": np.ones((2, 4), np.float32)}
    np.testing.assert_allclose(
        run_ort(onnx.load(str(out)), feeds)[0], run_ort(source, feeds)[0], rtol=2e-2, atol=2e-2
    )


def _cli(path, out, *extra):
    return [
        sys.executable,
        "-m",
        "amp_rewrite",
        str(path),
        "-o",
        str(out),
        "--force",
        "--quiet",
        "--external-data",
        *extra,
    ]


def _data_names(model: onnx.ModelProto) -> set:
    tensors = model_io.external.model_tensors(model)
    return {e.value for t in tensors for e in t.external_data if e.key == "location"}


def _digest(out: Path) -> str:
    """The weights out.onnx holds, read through the data file it names."""
    model = onnx.load(str(out))
    return hashlib.sha256(
        b"".join(onnx.numpy_helper.to_array(t).tobytes() for t in model.graph.initializer)
    ).hexdigest()


def _lone_digests(tmp_path, sources) -> dict:
    """{digest: source index} of each source rewritten alone."""
    digests = {}
    for i, source in enumerate(sources):
        out = tmp_path / f"lone{i}" / "out.onnx"
        out.parent.mkdir()
        assert main([str(source), "-o", str(out), "--external-data", "--quiet"]) == 0
        digests[_digest(out)] = i
    return digests


def _left(folder: Path) -> list[str]:
    """What the writers left beside out.onnx: its data files and any temporary."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(("out.onnx", ".out.onnx")))


def _observe(out: Path, seen: list, stop: threading.Event) -> None:
    """A reader: whenever it looks, out.onnx names data files that exist (unless out.onnx has been
    replaced in between: then it looks again)."""
    while not stop.is_set():
        try:
            data = out.read_bytes()
        except FileNotFoundError:
            continue
        model = onnx.ModelProto.FromString(data)
        missing = [n for n in _data_names(model) if not (out.parent / n).exists()]
        if missing and out.read_bytes() == data:
            seen.append(f"out.onnx names {missing}, which do not exist")
        seen.append(None)


def test_four_concurrent_writers_leave_one_pair_and_readers_never_see_a_missing_file(tmp_path):
    sources = [tmp_path / "a.onnx", tmp_path / "b.onnx"]
    for seed, source in enumerate(sources):
        source.write_bytes(_big_model(seed=seed + 5).SerializeToString())
    lone = _lone_digests(tmp_path, sources)
    out = tmp_path / "out.onnx"
    assert main([str(sources[0]), "-o", str(out), "--external-data", "--quiet"]) == 0  # a previous pair
    seen, stop = [], threading.Event()
    reader = threading.Thread(target=_observe, args=(out, seen, stop))
    reader.start()
    try:
        slow = dict(os.environ, AMP_REWRITE_TEST_PAUSE="rename:0.3")  # widen each run's renames
        writers = [
            subprocess.Popen(_cli(sources[i % 2], out), cwd=ROOT, env=slow, stderr=subprocess.PIPE, text=True)
            for i in range(4)
        ]
        for writer in writers:
            assert writer.wait(120) == 0, writer.stderr.read()
    finally:
        stop.set()
        reader.join()
    assert [s for s in seen if s is not None] == [] and len(seen) > 10
    assert _digest(out) in lone  # one run's weights, whole
    assert _left(tmp_path) == sorted(
        ["out.onnx", *_data_names(onnx.load(str(out), load_external_data=False))]
    )
    assert len(_left(tmp_path)) == 2  # the model and its one data file: no stale data accumulates


def test_a_second_writer_waits_for_the_first_to_finish_its_renames(tmp_path):
    """A places its data, then waits before renaming its model; B (another model's weights) takes
    its turn after A's renames: readers see the previous pair, then A's, then B's, never a model
    with another run's data, and B removes A's data with A's model."""
    path, other = tmp_path / "model.onnx", tmp_path / "other.onnx"
    path.write_bytes(_big_model().SerializeToString())
    other.write_bytes(_big_model(seed=2).SerializeToString())
    out = tmp_path / "out.onnx"
    assert main([str(other), "-o", str(out), "--external-data", "--quiet"]) == 0
    go = tmp_path / "go"
    a = _start(path, out, f"between:@{go}")
    _wait_for(lambda: Path(f"{go}.reached").exists(), a, "its renames")
    b = subprocess.Popen(_cli(other, out), cwd=ROOT, stderr=subprocess.PIPE, text=True)
    time.sleep(1.5)
    assert b.poll() is None  # waiting for A's renames
    _check_pair(out, _big_model(seed=2))  # while A waits, readers see the previous pair
    go.touch()
    assert a.wait(60) == 0, a.stderr.read()
    assert b.wait(60) == 0, b.stderr.read()
    _check_pair(out, _big_model(seed=2))
    assert len(_left(tmp_path)) == 2  # out.onnx and B's data; A's went with A's model


def test_a_run_killed_between_its_renames_leaves_an_orphan_the_next_run_removes(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(_big_model().SerializeToString())
    out = tmp_path / "out.onnx"
    assert main([str(path), "-o", str(out), "--external-data", "--quiet"]) == 0
    go = tmp_path / "go"
    proc = _start(path, out, f"between:@{go}")
    _wait_for(lambda: Path(f"{go}.reached").exists(), proc, "its renames")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    _check_pair(out, _big_model())  # the previous pair, whole
    assert len(list(tmp_path.glob("out.onnx.*.data"))) == 2  # its data, placed, named by no model
    path.write_bytes(_big_model(seed=4).SerializeToString())
    assert main([str(path), "-o", str(out), "--external-data", "--quiet", "--force"]) == 0
    _check_pair(out, _big_model(seed=4))
    assert len(list(tmp_path.glob("out.onnx.*.data"))) == 1  # the orphan went with the old pair


@pytest.mark.parametrize(
    "stage, sig, code",
    [
        ("load", signal.SIGINT, 130),
        ("rename", signal.SIGINT, 130),
        ("between", signal.SIGINT, 130),
        ("load", signal.SIGTERM, 143),
        ("rename", signal.SIGTERM, 143),
    ],
)
def test_an_interrupt_leaves_the_previous_pair_and_no_temporary(stage, sig, code, tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(_big_model().SerializeToString())
    out = tmp_path / "out.onnx"
    assert main([str(path), "-o", str(out), "--external-data", "--quiet"]) == 0
    before = _left(tmp_path)
    path.write_bytes(_big_model(seed=3).SerializeToString())  # the interrupted run writes other weights
    go = tmp_path / "go"
    proc = _start(path, out, f"{stage}:@{go}")
    _wait_for(lambda: Path(f"{go}.reached").exists(), proc, stage)
    proc.send_signal(sig)
    assert proc.wait(30) == code
    err = proc.stderr.read().strip().splitlines()
    assert len(err) == 1 and err[0].startswith("amp-rewrite: ") and "nothing written" in err[0], err
    assert _left(tmp_path) == before  # no temporary, no data of its own
    _check_pair(out, _big_model())


def test_a_kill_mid_write_leaves_a_hidden_temporary_the_next_run_ignores(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(_big_model().SerializeToString())
    out = tmp_path / "out.onnx"
    go = tmp_path / "go"
    proc = _start(path, out, f"rename:@{go}")
    _wait_for(lambda: Path(f"{go}.reached").exists(), proc, "its renames")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    hidden = [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.onnx.")]
    assert hidden and not out.exists()  # its temporaries, hidden; no output
    assert main([str(path), "-o", str(out), "--external-data", "--quiet"]) == 0
    _check_pair(out, _big_model())
    assert not set(_data_names(onnx.load(str(out), load_external_data=False))) & set(hidden)


@pytest.mark.parametrize("stage", ["rename", "between"])
def test_a_kill_mid_write_leaves_the_previous_pair(stage, tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(_big_model().SerializeToString())
    out = tmp_path / "out.onnx"
    assert main([str(path), "-o", str(out), "--external-data", "--quiet"]) == 0
    path.write_bytes(_big_model(seed=3).SerializeToString())  # the killed run writes other weights
    proc = _start(path, out, f"{stage}:30")
    _wait_for(
        lambda: (
            len([p for p in tmp_path.iterdir() if p.name.startswith(".")]) >= 1
            and (stage == "rename" or len(list(tmp_path.glob("out.onnx.*.data"))) == 2)
        ),
        proc,
        stage,
    )
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    _check_pair(out, _big_model())  # the previous run's model, with its own data


def test_sigterm_removes_temporaries(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(_big_model().SerializeToString())
    out = tmp_path / "out.onnx"
    out.write_bytes(b"previous output")
    proc = _start(path, out, "between:30")
    _wait_for(lambda: len(list(tmp_path.glob("out.onnx.*.data"))) == 1, proc, "its data link")
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM
    assert "terminated; nothing written" in proc.stderr.read()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "out.onnx"]
    assert out.read_bytes() == b"previous output"


def test_a_file_system_without_hard_links_still_gets_the_pair(tmp_path, monkeypatch):
    def no_links(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    out = tmp_path / "out.onnx"
    model_io.save(_big_model(), out, external_data=True)
    model_io.save(_big_model(seed=2), out, external_data=True)  # replaces the pair, removes the old data
    assert len(list(tmp_path.glob("out.onnx.*.data"))) == 1 and not list(tmp_path.glob(".*"))
    _check_pair(out, _big_model(seed=2))


def test_validating_on_no_samples_is_a_usage_error():
    """Finding 7's API side: zero samples compared nothing and reported PASSED."""
    from amp_rewrite import driver
    from amp_rewrite.checks import validate

    model = make_corpus.valid_model()
    with pytest.raises(errors.UsageError, match="no samples"):
        validate.validate(model, model, [])
    with pytest.raises(errors.UsageError, match="no samples"):
        driver.check(model, samples=[], validate=True)


def test_without_the_folder_lock_no_run_named_file_is_taken_for_an_orphan(tmp_path, monkeypatch):
    """Where flock is not to be had, another run may be between its renames: its placed data must
    not be removed as an orphan (only the data of the replaced model goes)."""
    import contextlib

    from amp_rewrite.io import output

    out = tmp_path / "out.onnx"
    model_io.save(_big_model(), out, external_data=True)
    in_flight = tmp_path / "out.onnx.0123abcd.data"  # another run's, placed, its model not yet renamed
    in_flight.write_bytes(b"another run's weights")
    monkeypatch.setattr(output, "_folder_lock", lambda folder: contextlib.nullcontext(False))
    model_io.save(_big_model(seed=2), out, external_data=True)
    assert in_flight.exists()
    _check_pair(out, _big_model(seed=2))
    monkeypatch.undo()
    model_io.save(_big_model(seed=3), out, external_data=True)  # with the lock: an orphan, removed
    assert not in_flight.exists()
    assert len(list(tmp_path.glob("out.onnx.*.data"))) == 1
    _check_pair(out, _big_model(seed=3))
