"""No file is clobbered, and a model never meets another run's data (issue 24, findings 2, 4, 7).

The output plan compares every path a run writes with every path it reads (the model and its data
files) by identity, before any work; existing outputs need --force. The output pair writes the
data under a name unique to the run and renames the model last, so a kill or a second writer
never leaves a model with another run's data; SIGTERM removes the temporaries.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
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
    return subprocess.Popen(
        [
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
        ],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )


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


def test_two_writers_interleaved_never_mix_model_and_data(tmp_path):
    """A links its data, then waits before renaming its model; B (another model's weights) runs
    whole; then A renames: out.onnx is A's with A's data, never A's model with B's data."""
    path, other = tmp_path / "model.onnx", tmp_path / "other.onnx"
    path.write_bytes(_big_model().SerializeToString())
    other.write_bytes(_big_model(seed=2).SerializeToString())
    out = tmp_path / "out.onnx"
    go = tmp_path / "go"
    a = _start(path, out, f"between:@{go}")
    _wait_for(
        lambda: any(re.fullmatch(r"out\.onnx\.[0-9a-f]{8}\.data", p.name) for p in tmp_path.iterdir()),
        a,
        "its data link",
    )
    b = subprocess.run(
        [
            sys.executable,
            "-m",
            "amp_rewrite",
            str(other),
            "-o",
            str(out),
            "--force",
            "--quiet",
            "--external-data",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert b.returncode == 0, b.stderr
    _check_pair(out, _big_model(seed=2))  # while A waits, readers see B's pair
    go.touch()
    assert a.wait(60) == 0, a.stderr.read()
    _check_pair(out, _big_model())


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
