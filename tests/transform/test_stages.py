"""The pipeline's stage contract (transform/pipeline.py): each stage reads only what an earlier
stage wrote and assigns only what it declares, held over real rewrites, and a stage that breaks
its declaration is caught as it runs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from onnx import helper

import amp_rewrite
from amp_rewrite.transform import pipeline
from helpers import mlp, random_feeds, run_ort


@pytest.mark.parametrize(
    "options",
    [{}, {"placement": "tf"}, {"target": "bfloat16"}, {"keep_io_types": False}, {"annotate": True}],
    ids=["default", "tf", "bfloat16", "low-io", "annotate"],
)
def test_every_stage_keeps_to_its_declaration_on_a_real_rewrite(options, monkeypatch):
    ran = []
    real = pipeline.run_stage

    def recording(stage, w, written):
        real(stage, w, written)
        ran.append(stage.name)

    monkeypatch.setattr(pipeline, "run_stage", recording)
    model = mlp()
    result = amp_rewrite.rewrite(model, provider="cpu", **options)  # a model ONNX Runtime's CPU runs
    assert ran == [stage.name for stage in pipeline.STAGES]
    feeds = random_feeds(model)
    declared = {
        v.name: helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type)
        for v in result.model.graph.input
    }
    got = run_ort(result.model, {k: v.astype(declared[k]) for k, v in feeds.items()})
    for a, b in zip(got, run_ort(model, feeds)):
        np.testing.assert_allclose(a.astype(np.float32), b, rtol=0.05, atol=0.05)


def test_every_declared_field_is_a_field_of_work():
    fields = {f.name for f in dataclasses.fields(pipeline.Work)}
    for stage in pipeline.STAGES:
        assert set(stage.reads.split()) | set(stage.writes.split()) <= fields, stage.name
    assert set(pipeline.GIVEN) <= fields


def _swap(monkeypatch, name, **changes):
    stages = [dataclasses.replace(s, **changes) if s.name == name else s for s in pipeline.STAGES]
    monkeypatch.setattr(pipeline, "STAGES", tuple(stages))


def test_a_stage_reading_what_no_earlier_stage_writes_is_caught(monkeypatch):
    colour = next(s for s in pipeline.STAGES if s.name == "colour")
    _swap(monkeypatch, "colour", reads=colour.reads + " materialised")  # written two stages later
    with pytest.raises(RuntimeError, match=r"stage colour reads \['materialised'\]"):
        amp_rewrite.rewrite(mlp())


def test_a_stage_assigning_what_it_does_not_declare_is_caught(monkeypatch):
    _swap(monkeypatch, "infer_types", writes="types")  # it also assigns shapes
    with pytest.raises(RuntimeError, match=r"stage infer_types assigned \['shapes'\]"):
        amp_rewrite.rewrite(mlp())


def test_the_names_are_checked_once_per_model_however_many_rewrites(monkeypatch):
    """driver.check checked the op names and dims before calibrating, then each rewrite did again
    (the accuracy fallback: up to ten); and the kernel check was built twice per rewrite."""
    from amp_rewrite import driver
    from amp_rewrite.options import RewriteOptions

    calls = {"names": 0, "kernels": 0}
    real_names, real_kernels = pipeline.check_named_ops, RewriteOptions.kernel_check

    def names(*args):
        calls["names"] += 1
        return real_names(*args)

    def kernels(self):
        calls["kernels"] += 1
        return real_kernels(self)

    monkeypatch.setattr(pipeline, "check_named_ops", names)
    monkeypatch.setattr(RewriteOptions, "kernel_check", kernels)
    checked = driver.check(mlp(), validate=True, tolerance=True, provider="cpu", rtol=1e-6, atol=1e-6)
    assert checked.fallback is not None and checked.validation is not None  # several rewrites ran
    assert calls["names"] == 1
    calls["kernels"] = 0
    amp_rewrite.rewrite(mlp())
    assert calls["kernels"] == 1
