"""One deployment value (provider, target, dims), resolved once against what ONNX Runtime loads;
options written once (the CLI's flags checked against RewriteOptions' fields); the driver."""

from __future__ import annotations

import dataclasses
import logging
import sys
import types

import numpy as np
import onnx
import pytest

import amp_rewrite
from amp_rewrite import cli, cli_parser, driver, runtime
from amp_rewrite.analysis.oplists import TARGETS
from amp_rewrite.deployment import PROVIDERS, Deployment
from amp_rewrite.errors import UsageError
from amp_rewrite.options import PLACEMENTS, RewriteOptions, option_names
from helpers import ROOT, init, make_model, node, random_feeds, run_ort, tensor

TINY_CNN = ROOT / "examples" / "tiny_cnn.onnx"


@pytest.fixture
def fresh_runtime():
    """The probe and the notice are once per process: cleared around a test that fakes ORT."""
    caches = (runtime.ort, runtime.cuda_loads, runtime.say_cpu_fallback_once)
    for cached in caches:
        cached.cache_clear()
    yield
    for cached in caches:
        cached.cache_clear()


def _mlp() -> onnx.ModelProto:
    rng = np.random.default_rng(5)
    return make_model(
        [
            node("MatMul", ["x", "w1"], ["h"], name="mm1"),
            node("Relu", ["h"], ["r"], name="relu"),
            node("MatMul", ["r", "w2"], ["y"], name="mm2"),
        ],
        [tensor("x", ["batch", 8])],
        [tensor("y", ["batch", 4])],
        [
            init("w1", rng.standard_normal((8, 8)).astype(np.float32) / 3),
            init("w2", rng.standard_normal((8, 4)).astype(np.float32) / 3),
        ],
    )


def test_every_option_has_one_flag_or_is_api_only_and_defaults_come_from_options():
    fields = {f.name for f in dataclasses.fields(RewriteOptions)} | {
        f.name for f in dataclasses.fields(Deployment)
    }
    flags = cli_parser.option_flags()
    assert set(flags) | set(cli_parser.API_ONLY) == fields and not set(flags) & set(cli_parser.API_ONLY)
    parser = cli_parser.build_parser()
    actions = {a.dest: a for a in parser._actions}
    assert set(flags.values()) <= set(actions)  # every option not API-only has its flag
    assert not set(cli_parser.API_ONLY) & set(actions)  # and an API-only option none
    args = parser.parse_args(["m.onnx"])
    assert all(getattr(args, dest) is None for dest in flags.values())  # no second default
    assert cli.rewrite_options(args) == RewriteOptions()
    assert tuple(actions["target"].choices) == TARGETS and tuple(actions["provider"].choices) == PROVIDERS
    assert tuple(actions["placement"].choices) == PLACEMENTS
    given = parser.parse_args(
        [
            "m.onnx",
            "--provider",
            "cpu",
            "--placement",
            "tf",
            "--dim",
            "batch=2",
            "--no-pointwise-check",
            "--relax-margin",
            "0",
            "--clamp",
            "--no-keep-io-types",
        ]
    )
    assert cli.rewrite_options(given) == RewriteOptions.of(
        provider="cpu",
        placement="tf",
        dims={"batch": 2},
        pointwise_check=False,
        relax_margin=0.0,
        clamp=True,
        keep_io_types=False,
    )


def test_rewrite_takes_options_fields_and_says_did_you_mean():
    model = _mlp()
    with pytest.raises(UsageError, match="unknown rewrite option 'placment'; did you mean 'placement'"):
        amp_rewrite.rewrite(model, placment="tf")
    with pytest.raises(UsageError, match="unknown rewrite option 'zzz' \\(known: deployment, keep_io_types"):
        amp_rewrite.rewrite(model, zzz=1)
    assert set(option_names()) >= {"provider", "target", "dims", "op_block_list", "deny"}
    base = RewriteOptions.of(deny=["Relu"])
    changed = amp_rewrite.rewrite(model, base, target="bfloat16", provider="any")  # fields change the options
    by_keywords = amp_rewrite.rewrite(model, deny=["Relu"], target="bfloat16", provider="any")
    assert changed.model.SerializeToString() == by_keywords.model.SerializeToString()
    assert (
        changed.report.node("relu")["precision"] == "float32"
        and changed.report.node("mm1")["precision"] == "bfloat16"
    )


def test_the_deployment_is_one_frozen_value_in_one_vocabulary():
    options = RewriteOptions.of(provider="cpu", target="bfloat16", dims={"batch": 4})
    assert options.deployment == Deployment(provider="cpu", target="bfloat16", dims={"batch": 4})
    assert (options.provider, options.target, dict(options.dims)) == ("cpu", "bfloat16", {"batch": 4})
    assert options.replace(target="float16").deployment.provider == "cpu"
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.deployment.provider = "cuda"
    assert [Deployment(provider=p).kernels for p in PROVIDERS] == ["cuda", "cuda", "cpu", None]
    assert Deployment(provider="cpu").device == "cpu"
    for bad, message in [
        ({"provider": "tpu"}, "unknown provider 'tpu': choose one of auto, cuda, cpu, any"),
        ({"target": "float8"}, "unknown target"),
        ({"dims": {"b": 0}}, "at least 1"),
    ]:
        with pytest.raises(UsageError, match=message):
            Deployment(**bad)


def test_a_target_the_device_cannot_run_is_a_usage_error_before_any_work(
    tmp_path, capsys, monkeypatch, fresh_runtime
):
    """bfloat16 coloured for CUDA, validated on ORT's CPU provider (NOT_IMPLEMENTED Gemm, exit 6
    before): exit 2 naming the provider to use, before the model is even read."""
    monkeypatch.setattr(runtime, "cuda_loads", lambda: False)
    missing = tmp_path / "not_read.onnx"  # a model it read would be ModelError, exit 3
    for flag in ("--validate", "--tolerance"):
        assert cli.main([str(missing), "--target", "bfloat16", flag]) == 2
        err = capsys.readouterr().err
        assert "cannot run a bfloat16 model coloured for CUDA's kernels: use --provider cpu" in err
        assert err.count("\n") == 1 + err.count("CUDA provider did not load")
    with pytest.raises(UsageError, match="use --provider cpu"):
        driver.check(_mlp(), target="bfloat16", provider="any", validate=True)
    out = tmp_path / "cnn.onnx"  # the provider named: CPU's bfloat16 kernels decide, and it validates
    assert (
        cli.main(
            [
                str(TINY_CNN),
                "-o",
                str(out),
                "--target",
                "bfloat16",
                "--provider",
                "cpu",
                "--validate",
                "--reference",
                "never",
                "--quiet",
            ]
        )
        == 0
    )
    assert cli.main([str(TINY_CNN), "--target", "bfloat16", "--calibrate", "--dry-run", "--quiet"]) == 0


def test_cuda_notice_once_per_process_and_never_for_cpu(caplog, monkeypatch, fresh_runtime):
    monkeypatch.setattr(runtime, "lists_cuda", lambda: True)  # onnxruntime-gpu on a machine without CUDA
    monkeypatch.setattr(runtime, "cuda_loads", lambda: False)
    with caplog.at_level(logging.WARNING, logger="amp_rewrite"):
        assert Deployment(provider="cpu").device == "cpu"
        assert not caplog.records
        model = _mlp()
        for _ in range(2):  # calibration, rewrite and validation, twice: one notice
            checked = driver.check(model, calibrate=True, validate=True, reference=False)
            assert checked.passed and checked.validation.provider == runtime.CPU
    notices = [r for r in caplog.records if "CUDA provider did not load" in r.getMessage()]
    assert len(notices) == 1


def _ort_without(*names) -> types.ModuleType:
    import onnxruntime

    stub = types.ModuleType("onnxruntime")
    for name in dir(onnxruntime):
        if name not in names and not name.startswith("__"):
            setattr(stub, name, getattr(onnxruntime, name))
    return stub


def test_plain_onnxruntime_without_cuda_or_its_provider_list(tmp_path, capsys, monkeypatch, fresh_runtime):
    """Plain onnxruntime (no CUDA; here also no get_available_providers): no AttributeError."""
    monkeypatch.setitem(sys.modules, "onnxruntime", _ort_without("get_available_providers"))
    assert not runtime.lists_cuda() and not runtime.cuda_loads() and Deployment().device == "cpu"
    assert cli.main([str(TINY_CNN), "--validate", "--dry-run", "--reference", "never"]) == 0
    captured = capsys.readouterr()
    assert "validation on CPUExecutionProvider" in captured.out and "CUDA" not in captured.err
    model = _mlp()
    feeds = random_feeds(model, seed=1)
    got = driver.check(model, samples=[feeds], validate=True, provider="cuda", reference=False)
    assert any("CUDA provider did not load" in n for n in got.validation.notes)
    np.testing.assert_allclose(
        run_ort(got.result.model, feeds)[0], run_ort(model, feeds)[0], rtol=2e-2, atol=2e-2
    )


@pytest.mark.parametrize(
    "broken, message",
    [(None, "ONNX Runtime does not import"), (types.ModuleType("onnxruntime"), "installed only in part")],
    ids=["import-fails", "empty-shell"],
)
def test_a_broken_onnxruntime_is_one_clear_line(broken, message, capsys, monkeypatch, fresh_runtime):
    monkeypatch.setitem(sys.modules, "onnxruntime", broken)
    assert cli.main([str(TINY_CNN), "--validate", "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("amp-rewrite: error: ") and message in err and err.count("\n") == 1
    assert amp_rewrite.rewrite(str(TINY_CNN)).changed  # a plain rewrite needs no ONNX Runtime
