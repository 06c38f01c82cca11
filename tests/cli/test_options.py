"""RewriteOptions: built once, frozen, checked; the CLI and the API build the same object."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import amp_rewrite
from amp_rewrite.cli import rewrite_options
from amp_rewrite.cli_parser import build_parser
from amp_rewrite.errors import UsageError
from amp_rewrite.options import RewriteOptions
from helpers import init, make_model, node, random_feeds, run_ort, tensor


def test_options_are_frozen_and_normalised():
    options = RewriteOptions.of(deny="Gelu", op_block_list=["Softmax"], node_block_list="head/.*")
    assert options.deny == ("Gelu", "Softmax") and options.keep_fp32_nodes == ("head/.*",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.target = "bfloat16"
    changed = options.replace(target="bfloat16")
    assert changed.target == "bfloat16" and changed.deny == options.deny and options.target == "float16"
    sized = RewriteOptions.of(dims={"batch": 8})
    with pytest.raises(TypeError):
        sized.dims["batch"] = 2
    assert sized.replace(target="bfloat16").dims == {"batch": 8}


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"target": "float8"}, "unknown target"),
        ({"keep_fp32_nodes": ["("]}, "not a valid regular expression"),
        ({"keep_io": True}, "unknown rewrite option"),
        ({"dims": {"batch": 0}}, "at least 1"),
        ({"dims": {"batch": 2.5}}, "at least 1"),
        ({"dims": {"batch": True}}, "at least 1"),
    ],
)
def test_bad_options_are_one_usage_error(bad, message):
    with pytest.raises(UsageError, match=message):
        RewriteOptions.of(**bad)


WAYS_IN = {
    "of": lambda **bad: RewriteOptions.of(**bad),
    "constructor": lambda **bad: RewriteOptions(**bad),
    "replace": lambda **bad: RewriteOptions().replace(**bad),
    "dataclasses.replace": lambda **bad: dataclasses.replace(RewriteOptions(), **bad),
    "rewrite(options=...)": lambda **bad: amp_rewrite.rewrite(_tiny(), options=RewriteOptions(**bad)),
}


def _tiny():
    return make_model([node("Relu", ["x"], ["y"])], [tensor("x", [2])], [tensor("y", [2])])


@pytest.mark.parametrize("way", list(WAYS_IN))
@pytest.mark.parametrize(
    "bad, message",
    [
        ({"placement": "bogus"}, "unknown placement"),
        ({"relax_margin": 0.5}, "relax margin"),
        ({"opset": 0}, "opset"),
        ({"low_precision_io": ["("]}, "not a valid regular expression"),
        ({"target": "float8"}, "unknown target"),
    ],
)
def test_every_way_in_checks_the_values(way, bad, message):
    """RewriteOptions(placement="bogus") used to run: only `of()` checked."""
    with pytest.raises(UsageError, match=message):
        WAYS_IN[way](**bad)


def test_every_way_in_normalises():
    options = RewriteOptions(deny=["Gelu"], keep_fp32_nodes="head/.*", force_fp32={"n": "why"})
    assert options.deny == ("Gelu",) and options.keep_fp32_nodes == ("head/.*",)
    with pytest.raises(TypeError):
        options.force_fp32["m"] = "changed"
    assert options == RewriteOptions.of(deny="Gelu", node_block_list=["head/.*"], force_fp32={"n": "why"})


def test_cli_and_api_build_the_same_options_and_the_same_model(tmp_path):
    rng = np.random.default_rng(7)
    model = make_model(
        [
            node("MatMul", ["x", "w"], ["h"], name="mm"),
            node("Gelu", ["h"], ["g"], name="gelu", domain=""),
            node("MatMul", ["g", "w2"], ["y"], name="mm2"),
        ],
        [tensor("x", [2, 8])],
        [tensor("y", [2, 4])],
        [
            init("w", rng.standard_normal((8, 8)).astype(np.float32)),
            init("w2", rng.standard_normal((8, 4)).astype(np.float32)),
        ],
        opset=20,
    )
    args = build_parser().parse_args(
        ["m.onnx", "--deny", "Gelu", "--keep-fp32-node", "mm2", "--target", "bfloat16"]
    )
    from_cli = rewrite_options(args)
    assert from_cli == RewriteOptions.of(target="bfloat16", deny=["Gelu"], keep_fp32_nodes=["mm2"])
    sized = rewrite_options(build_parser().parse_args(["m.onnx", "--dim", "batch=8", "--dim", "seq=128"]))
    assert sized == RewriteOptions.of(dims={"batch": 8, "seq": 128})
    by_options = amp_rewrite.rewrite(model, from_cli)
    by_keywords = amp_rewrite.rewrite(model, target="bfloat16", deny=["Gelu"], keep_fp32_nodes=["mm2"])
    assert by_options.model.SerializeToString() == by_keywords.model.SerializeToString()
    assert by_options.report.node("gelu")["precision"] == "float32"
    feeds = random_feeds(model, seed=3)
    expected = run_ort(model, feeds)
    # bfloat16 has no CPU MatMul kernel in ORT: check the float16 rewrite of the same options numerically
    got = run_ort(amp_rewrite.rewrite(model, from_cli.replace(target="float16")).model, feeds)
    np.testing.assert_allclose(got[0], expected[0], rtol=2e-2, atol=2e-2)


def test_the_constructor_still_takes_the_deployment_fields():
    """Before the Deployment value, target/provider/dims were RewriteOptions fields of their own."""
    options = RewriteOptions(target="bfloat16", provider="cpu", dims={"batch": 2}, keep_io_types=False)
    assert (options.target, options.provider, dict(options.dims)) == ("bfloat16", "cpu", {"batch": 2})
    assert (
        options.deployment
        == RewriteOptions.of(target="bfloat16", provider="cpu", dims={"batch": 2}).deployment
    )
    assert not options.keep_io_types and RewriteOptions().target == "float16"
