"""The command line: one line per error, exit codes, never over the input, usual file permissions."""

import json
import subprocess
import sys

import onnx
import pytest

from amp_rewrite.cli import main
from helpers import assert_close, mlp, random_feeds, run_ort


@pytest.fixture()
def model_file(tmp_path):
    path = tmp_path / "net.onnx"
    onnx.save(mlp(), path)
    return path


def test_cli_writes_default_output_beside_input_and_report(model_file, capsys):
    report = model_file.parent / "r.json"
    assert main([str(model_file), "--report", str(report)]) == 0
    out_path = model_file.parent / "net.fp16.onnx"
    printed = capsys.readouterr().out
    assert "casts inserted: 2" in printed and str(out_path) in printed
    original, rewritten = onnx.load(model_file), onnx.load(out_path)
    onnx.checker.check_model(rewritten, full_check=True)
    feeds = random_feeds(original)
    assert_close(run_ort(rewritten, feeds), run_ort(original, feeds))
    data = json.loads(report.read_text())
    assert data["summary"]["casts_inserted"] == 2
    assert {n["name"]: n["precision"] for n in data["nodes"]}["sm"] == "float32"


def test_cli_refuses_existing_output_without_force_and_never_the_input(model_file, capsys):
    before = model_file.read_bytes()
    assert main([str(model_file)]) == 0
    assert main([str(model_file)]) == 5
    assert "already exists" in capsys.readouterr().err
    assert main([str(model_file), "--force"]) == 0
    assert main([str(model_file), "-o", str(model_file), "--force"]) == 5
    assert "is the input" in capsys.readouterr().err
    assert model_file.read_bytes() == before


def test_cli_dry_run_writes_nothing(model_file):
    assert main([str(model_file), "--dry-run", "--quiet"]) == 0
    assert sorted(p.name for p in model_file.parent.iterdir()) == ["net.onnx"]


def test_cli_flags_move_ops_and_pin_nodes(model_file, tmp_path):
    report = tmp_path / "r.json"
    assert (
        main(
            [
                str(model_file),
                "--allow",
                "LogSoftmax",
                "--keep-fp32-node",
                "mm2",
                "--report",
                str(report),
                "--dry-run",
                "--quiet",
            ]
        )
        == 0
    )
    precision = {n["name"]: n["precision"] for n in json.loads(report.read_text())["nodes"]}
    assert precision["sm"] == "float16" and precision["mm2"] == "float32"


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["missing.onnx"], 3, "no such file"),
        (["--target", "float8", "X"], 2, "invalid choice"),
        (["X", "--allow", "Softmax", "--deny", "Softmax"], 4, "both"),
        (["X", "--keep-fp32-node", "("], 2, "regular expression"),
        (["X", "--op-lists", "nope.yaml"], 4, "cannot read op list"),
        (["X", "--dim", "N"], 2, "expected NAME=SIZE"),
        (["X", "--dim", "N=-1"], 2, "expected NAME=SIZE"),
        (["X", "--dim", "N=0"], 2, "at least 1"),
        (
            ["X", "--dim", "N=8", "--dim", "batch=8"],
            2,
            "'batch': not a symbolic dim of the model's inputs (its inputs' symbolic dims are N)",
        ),
    ],
)
def test_cli_errors_are_one_line_with_exit_code(model_file, capsys, args, code, message):
    args = [str(model_file) if a == "X" else a for a in args]
    assert main(args) == code
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_cli_rejects_non_model_files_without_traceback(tmp_path):
    for name, data in [
        ("empty.onnx", b""),
        ("text.onnx", b"hello world\n"),
        ("random.onnx", bytes(range(256)) * 4),
    ]:
        path = tmp_path / name
        path.write_bytes(data)
        done = subprocess.run(
            [sys.executable, "-m", "amp_rewrite", str(path)], capture_output=True, text=True
        )
        assert done.returncode == 3, done.stderr
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
        assert not (tmp_path / name.replace(".onnx", ".fp16.onnx")).exists()


def test_written_files_get_the_usual_permissions_not_mkstemps(model_file):
    """Outputs go through a temporary file (mkstemp makes it 0600) but end with 0666 less umask."""
    import os
    import stat

    mask = os.umask(0o022)
    try:
        assert main([str(model_file), "--quiet", "--report", str(model_file.parent / "r.json")]) == 0
    finally:
        os.umask(mask)
    for name in ("net.fp16.onnx", "r.json"):
        assert stat.S_IMODE((model_file.parent / name).stat().st_mode) == 0o644, name


def test_cli_dim_sizes_the_estimates_not_the_model(model_file, tmp_path, capsys):
    """--dim N=32: the report's figures use the size; under TF's placement (which reads no sizes)
    the written model is the same bytes."""
    plain, sized, report = tmp_path / "plain.onnx", tmp_path / "sized.onnx", tmp_path / "r.json"
    assert main([str(model_file), "-o", str(plain), "--quiet", "--placement", "tf"]) == 0
    assert (
        main(
            [str(model_file), "-o", str(sized), "--dim", "N=32", "--report", str(report), "--placement", "tf"]
        )
        == 0
    )
    assert "(tf placement, N=32)" in capsys.readouterr().out
    assert plain.read_bytes() == sized.read_bytes()
    assert json.loads(report.read_text())["summary"]["dims"] == {"N": 32}
