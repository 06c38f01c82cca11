"""The API toggles (enable/disable/maybe_rewrite) follow TensorFlow's auto-mixed-precision switch."""

import warnings

import onnx
import pytest

import amp_rewrite
from helpers import assert_close, mlp, random_feeds, run_ort


def test_toggles_follow_tensorflow_semantics():
    model = mlp()
    assert not amp_rewrite.is_enabled()
    assert amp_rewrite.maybe_rewrite(model) is model
    amp_rewrite.enable(target="bfloat16")
    try:
        assert amp_rewrite.is_enabled()
        out = amp_rewrite.maybe_rewrite(model)
        assert any(t.data_type == onnx.TensorProto.BFLOAT16 for t in out.graph.initializer)
    finally:
        amp_rewrite.disable()
    assert not amp_rewrite.is_enabled()
    with pytest.warns(UserWarning, match="already disabled"):
        amp_rewrite.disable()
    with amp_rewrite.enabled():
        out = amp_rewrite.maybe_rewrite(model)
        assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in out.graph.initializer)
    assert not amp_rewrite.is_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with amp_rewrite.enabled(False):
            assert amp_rewrite.maybe_rewrite(model) is model
    feeds = random_feeds(model)
    assert_close(run_ort(out, feeds), run_ort(model, feeds))
