"""The hostile-input corpus through the CLI and the API: one line, the right exit code or exception
class, no traceback, no output file, input untouched. Also: an interrupted write leaves the previous
file intact, and a valid model still rewrites after all the checks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest

import amp_rewrite
from amp_rewrite import errors
from amp_rewrite import io as model_io
from amp_rewrite.cli import main
from helpers import ROOT, load_script

make_corpus = load_script("tests/hostile/make_corpus.py")  # also a script: writes the corpus to a folder

EXCEPTION = {2: errors.UsageError, 3: errors.ModelError, 4: errors.OpListError, 5: errors.OutputError}
CASES = {case.name: case for case in make_corpus.CASES}


def _snapshot(folders) -> dict:
    found = {}
    for folder in folders:
        for path in sorted(Path(folder).rglob("*")):
            if path.is_symlink() or path.is_dir():
                found[str(path)] = "link" if path.is_symlink() else "dir"
            else:
                found[str(path)] = path.read_bytes()
    return found


def _build(case, tmp_path):
    built = case.build(tmp_path)
    watch = built.watch or [tmp_path]
    return built, watch, _snapshot(watch)


def test_corpus_is_big_enough():
    assert len(CASES) >= 40
    assert {c.code for c in CASES.values()} == {2, 3, 4, 5}


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_cli(name, tmp_path, capsys, monkeypatch):
    case = CASES[name]
    built, watch, before = _build(case, tmp_path)
    if built.patch == "enospc":
        monkeypatch.setattr(os, "fsync", make_corpus.enospc_write)
    code = main(built.cli)
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code == case.code, (code, err)
    assert len(err.splitlines()) == 1 and err.startswith("amp-rewrite: error: "), err
    assert case.message in err, err
    assert "Traceback" not in err and captured.out == ""
    assert _snapshot(watch) == before  # no output file, no temp files, input unchanged


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_api(name, tmp_path, monkeypatch):
    case = CASES[name]
    built, watch, before = _build(case, tmp_path)
    if built.api is None:
        pytest.skip("CLI-only case (flags or output paths)")
    if built.patch == "enospc":
        monkeypatch.setattr(os, "fsync", make_corpus.enospc_write)
    with pytest.raises(EXCEPTION[case.code]) as info:
        built.api()
    message = str(info.value)
    assert isinstance(info.value, amp_rewrite.AmpRewriteError)
    assert case.message in message and "\n" not in message, message
    assert _snapshot(watch) == before


@pytest.mark.parametrize("name", ["truncated_model", "external_data_dotdot", "yaml_alias_bomb"])
def test_hostile_subprocess(name, tmp_path):
    """The real command: exit code, one stderr line, nothing written."""
    case = CASES[name]
    built, watch, before = _build(case, tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "amp_rewrite", *built.cli],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == case.code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and case.message in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert _snapshot(watch) == before


def test_in_memory_model_with_external_references_asks_for_a_path(tmp_path):
    built = CASES["external_data_missing"].build(tmp_path)
    model = onnx.load(built.cli[0], load_external_data=False)
    with pytest.raises(errors.ModelError, match="pass its path"):
        amp_rewrite.rewrite(model)


def test_unsorted_but_valid_model_is_accepted():
    model = make_corpus.valid_model()
    nodes = list(model.graph.node)[::-1]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    result = amp_rewrite.rewrite(model)
    onnx.checker.check_model(result.model, full_check=True)


def _interrupted_run(tmp_path, stage, extra=()):
    """Run the CLI with a pause at `stage` of its write, SIGKILL it there, return the folder listing."""
    model_path = tmp_path / "model.onnx"
    model_path.write_bytes(make_corpus.valid_model().SerializeToString())
    out = tmp_path / "out.onnx"
    out.write_bytes(b"previous output")
    env = dict(os.environ, AMP_REWRITE_TEST_PAUSE=f"{stage}:30")
    proc = subprocess.Popen(
        [sys.executable, "-m", "amp_rewrite", str(model_path), "-o", str(out), "--force", "--quiet", *extra],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 60
    while time.time() < deadline:  # wait until the temp file is complete and the process sleeps
        temps = [p for p in tmp_path.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp")]
        if temps and all(p.stat().st_size > 0 for p in temps) and proc.poll() is None:
            time.sleep(0.3)
            break
        time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("the write never reached its pause")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return out


def test_interrupted_write_leaves_previous_output(tmp_path):
    out = _interrupted_run(tmp_path, "rename")
    assert out.read_bytes() == b"previous output"
    visible = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert visible == ["model.onnx", "out.onnx"]  # any leftover is a hidden .tmp, never an output


def test_interrupted_external_data_write_leaves_previous_output(tmp_path):
    out = _interrupted_run(tmp_path, "rename", ["--external-data"])
    assert out.read_bytes() == b"previous output"
    assert not (tmp_path / "out.onnx.data").exists()


def test_failed_write_leaves_previous_output_and_no_temp(tmp_path, monkeypatch, capsys):
    model_path = tmp_path / "model.onnx"
    model_path.write_bytes(make_corpus.valid_model().SerializeToString())
    out = tmp_path / "out.onnx"
    out.write_bytes(b"previous output")
    monkeypatch.setattr(os, "fsync", make_corpus.enospc_write)
    assert main([str(model_path), "-o", str(out), "--force", "--external-data"]) == 5
    assert out.read_bytes() == b"previous output"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "out.onnx"]


def test_yaml_is_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    lists = tmp_path / "l.yaml"
    lists.write_text(f"allow: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(errors.OpListError):
        amp_rewrite.rewrite(make_corpus.valid_model(), op_lists=[str(lists)])
    assert not marker.exists()


def test_save_leaves_the_model_unchanged(tmp_path):
    model = amp_rewrite.rewrite(make_corpus.valid_model()).model
    before = model.SerializeToString()
    model_io.save(model, tmp_path / "m.onnx", external_data=True)
    assert model.SerializeToString() == before


def test_checker_runs_on_the_rewrite_and_blames_a_bad_input_only_when_it_fails(tmp_path, monkeypatch):
    """rewrite() runs onnx.checker once, on its result; a failure sends the input through full
    validation, so a bad input still gets its one ModelError line and a bug of ours stays one."""
    built = CASES["unknown_attribute"].build(tmp_path)
    path = built.cli[0]
    assert not model_io.load(path, checker=False).checked  # the cheap checks pass: only the checker sees it
    with pytest.raises(errors.ModelError, match="bogus") as from_file:  # rewritten in place, read again
        amp_rewrite.rewrite(path)
    assert str(path) in str(from_file.value)
    with pytest.raises(errors.ModelError, match="bogus"):  # in memory: the caller's model, never changed
        amp_rewrite.rewrite(onnx.load(path))
    with pytest.raises(errors.ModelError, match="bogus"):  # nothing checks the result: checked up front
        amp_rewrite.rewrite(path, check=False)

    from amp_rewrite.transform import materialise as casts

    def broken(*args, **kwargs):
        raise KeyError("a bug of ours")

    monkeypatch.setattr(casts, "materialise", broken)
    with pytest.raises(KeyError, match="a bug of ours"):  # the input is valid: the error is ours
        amp_rewrite.rewrite(str(ROOT / "examples" / "tiny_cnn.onnx"))
