"""The report: every decision a reason chain a user can follow, the summary figures, --explain."""

import json

import onnx

from amp_rewrite import rewrite
from amp_rewrite.cli import main
from helpers import assert_close, deny_chain_model, random_feeds, run_ort, run_reference


def test_reason_is_a_chain_a_user_can_follow_and_numbers_hold():
    model = deny_chain_model()
    result = rewrite(model)
    why = {n["name"]: n["because"] for n in result.report.nodes}
    assert why["a"] == (
        "Add 'a' kept float32: infer op downstream of deny op ReduceMean 'ln/ReduceMean' through Reshape 'r1'"
    )
    assert why["m1"].startswith("MatMul 'm1' in float16: allow list")
    assert "<- ReduceMean 'ln/ReduceMean': deny list" in result.report.node("a")["groups"]["T"]["reason"]
    feeds = random_feeds(model)
    expected = run_ort(model, feeds)
    assert_close(run_ort(result.model, feeds), expected)
    assert_close(run_reference(result.model, feeds), expected)


def test_summary_figures():
    model = deny_chain_model()
    s = rewrite(model).report.summary
    assert s["nodes_float"] == 5 and s["nodes_low"] == 2 and s["low_by_list"] == {"allow": 2}
    assert s["deny_ops"] == 1 and s["deny_blocked"] == 2  # r1 and a
    assert s["flops_total"] == 2 * 4 * 16 * 32 + 2 * 4 * 32 * 8 and s["flops_share"] == 1.0
    assert (
        s["weight_bytes_before"] == (16 * 32 + 32 * 8) * 4
        and s["weight_bytes_after"] == (16 * 32 + 32 * 8) * 2
    )
    assert s["casts_inserted"] >= 2
    from amp_rewrite import flops
    from amp_rewrite import io as model_io

    assert model_io.load(model).float_bytes == flops.weight_bytes([model.graph])  # counted while validating
    feeds = random_feeds(model)
    assert_close(run_reference(rewrite(model).model, feeds), run_ort(model, feeds))


def test_explain_prints_one_nodes_chain(tmp_path, capsys):
    path = tmp_path / "m.onnx"
    onnx.save(deny_chain_model(), path)
    assert main(["explain", str(path), "a"]) == 0
    out = capsys.readouterr().out
    assert "downstream of deny op ReduceMean 'ln/ReduceMean' through Reshape 'r1'" in out
    assert not (tmp_path / "m.fp16.onnx").exists()  # explaining writes nothing
    assert main([str(path), "--explain", "ln/ReduceMen"]) == 2
    assert "did you mean 'ln/ReduceMean'" in capsys.readouterr().err
    report = tmp_path / "r.json"
    assert main([str(path), "--dry-run", "--quiet", "--report", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["summary"]["low_by_list"] == {"allow": 2}
    feeds = random_feeds(deny_chain_model())
    result = rewrite(str(path))
    assert_close(run_ort(result.model, feeds), run_ort(deny_chain_model(), feeds))
