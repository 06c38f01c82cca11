"""The command line behaves like the tools people like: --version, explain in --help, typos refused
with "did you mean", a regex that matches nothing refused, a closed pipe ends quietly, a short repr."""

import json
import os
import subprocess
import sys

import onnx
import pytest

import amp_rewrite
from amp_rewrite.analysis.oplists import default_list_path
from amp_rewrite.cli import main
from helpers import mlp


@pytest.fixture()
def model_file(tmp_path):
    path = tmp_path / "net.onnx"
    onnx.save(mlp(), path)
    return path


def test_version_and_help_name_explain(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"amp-rewrite {amp_rewrite.__version__}"
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "amp-rewrite explain MODEL.onnx NODE" in out
    shipped = default_list_path("float16")  # the installed file, not a checkout's op_lists/ folder
    assert shipped.is_file() and str(shipped) in "".join(out.split())


@pytest.mark.parametrize(
    "args, code, expected",
    [
        (["--deny", "MatMull"], 2, "--deny: unknown op type 'MatMull'"),
        (["--allow", "matmul"], 2, "did you mean 'MatMul'?"),
        (["--infer", "Sofmax"], 2, "did you mean 'Softmax'"),
        (
            ["--keep-fp32-node", "nosuchnode"],
            2,
            "--keep-fp32-node 'nosuchnode' names or fully matches no node",
        ),
        (["--keep-fp32-node", "mm"], 2, "did you mean 'mm"),
    ],
)
def test_typos_are_refused_with_did_you_mean(model_file, capsys, args, code, expected):
    assert main([str(model_file), "--dry-run", *args]) == code
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1


def test_typo_in_an_op_list_file_is_refused(model_file, tmp_path, capsys):
    lists = tmp_path / "lists.yaml"
    lists.write_text("allow:\n  MatMull: fast\n")
    assert main([str(model_file), "--dry-run", "--op-lists", str(lists)]) == 4
    err = capsys.readouterr().err
    assert "lists.yaml: allow: unknown op type 'MatMull'" in err and "did you mean 'MatMul'" in err
    lists.write_text("deny:\n  - com.microsoft:Attention\n  - MatMul\n")  # contrib and ONNX ops are known
    assert main([str(model_file), "--dry-run", "--quiet", "--op-lists", str(lists)]) == 0


def test_op_types_present_in_the_model_are_known(tmp_path):
    model = mlp()
    model.graph.node[0].domain, model.graph.node[0].op_type = "my.domain", "Custom"
    model.opset_import.add(domain="my.domain", version=1)
    with pytest.raises(amp_rewrite.UsageError, match="did you mean 'my.domain:Custom'"):
        amp_rewrite.rewrite(model, deny=["my.domain:Custon"], check=False)


def test_keep_fp32_regex_that_matches_pins(model_file):
    assert main([str(model_file), "--dry-run", "--quiet", "--keep-fp32-node", "mm.*"]) == 0


def test_closed_pipe_ends_quietly(model_file):
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line, as `| head -0` leaves it
    try:
        done = subprocess.run(
            [sys.executable, "-m", "amp_rewrite", str(model_file), "--dry-run"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert done.returncode == 0 and done.stderr == ""


def test_result_repr_is_one_line_and_html_a_card():
    result = amp_rewrite.rewrite(mlp())
    text = repr(result)
    assert "\n" not in text and len(text) < 200 and text.startswith("<RewriteResult float16: ")
    assert "\n" not in repr(result.report) and len(repr(result.report)) < 200
    card = result._repr_html_()
    assert "MatMul" in card and "casts inserted" in card and len(card) < 5000


def test_reference_flag_alone_and_validation_rule(model_file, capsys):
    assert main([str(model_file), "--dry-run", "--validate", "--reference"]) == 0
    out = capsys.readouterr().out
    assert "  reference " in out  # onnx.reference ran
    assert "RMS error <= atol + rtol x RMS(float32)" in out and "max rel is shown, not judged" in out


def test_fallback_text_shows_ten_pins_report_keeps_all(model_file, tmp_path):
    result = amp_rewrite.rewrite(mlp())
    pins = {f"node{i}": f"accuracy fallback (run {i})" for i in range(15)}
    result.report.sections["fallback"] = {
        "passed": True,
        "validation_runs": 5,
        "pinned": list(pins),
        "reasons": pins,
        "history": [],
    }
    text = result.report.to_text()
    assert "15 node(s) pinned float32, the first 10" in text
    assert sum(1 for line in text.splitlines() if line.startswith("  node")) == 10
    assert len(json.loads(json.dumps(result.report.to_dict()))["fallback"]["pinned"]) == 15
