"""Byte-identical rewrites: the SHA-256 of the rewritten model, pinned.

Every model in examples/ (both targets, keep_io_types on and off) and tools/synthetic.py stacks
at two sizes, with the default options and with TF's placement and the old float16 lists (those
pins were computed before the layout move, on commit 662a6e2). A refactor must leave them unchanged. A deliberate change of the rewrite's output updates the
pins in the same commit, saying why in the commit message. One pair also runs in ONNX Runtime
against the original, so a pin never holds a wrong model unnoticed.
"""

from __future__ import annotations

import hashlib

import pytest

import amp_rewrite
from helpers import assert_close, run_ort

EXAMPLE_PINS = {  # (example, target, keep_io_types) -> SHA-256 of result.model.SerializeToString()
    ("tiny_transformer", "float16", True): "b96435bf187d80eb785b2518a503448514df9405f7b6a2ae54851f0da0bc07a6",
    (
        "tiny_transformer",
        "float16",
        False,
    ): "46db5b00b8ba912b75555899d7cdbfe706d5bdc1eab71b3174ba60ac13cb79d6",
    (
        "tiny_transformer",
        "bfloat16",
        True,
    ): "b4e076510bdd98a5fe299a28ba2c23a27006ed377801d19ec44987acd5f1343b",
    (
        "tiny_transformer",
        "bfloat16",
        False,
    ): "98e27d71632cfa4ecf4d4e323991706d95c9a9d18921061c44172350feedbbb7",
    ("tiny_cnn", "float16", True): "d6e4bc5c26f20d20a59fa354f3b5d82be6792396293d9448eeb1ecd2c1f828a8",
    ("tiny_cnn", "float16", False): "217c010bf74d19ee6efbeeb8876c7818723cb592d553d9e6e717c6c496b5cfa7",
    ("tiny_cnn", "bfloat16", True): "94d45ac495301684f49fed852732ccd63386095249f95781636d69a3933ba710",
    ("tiny_cnn", "bfloat16", False): "d246a466e6da86cb513894c82859cb5517e86bc07fcf2b0b9726e450e818aeae",
}
STACK_PINS = {  # (synthetic.transformer_stack(num_nodes), target), keep_io_types=True -> SHA-256
    (1000, "float16"): "b822164dc87490718155fb2e9818850dd395be212b8974f49919945d8fccf454",
    (1000, "bfloat16"): "820e960fb67d5f0d458a165d58e4029d6b482343fbd4cf42dd7f93bdd313e4b2",
    (5000, "float16"): "21bce43e097d988142756992a464340ae2c2dd336560fe28731b8869b8ddc684",
    (5000, "bfloat16"): "c50447dd5759304c2553942a08a2901889dd1522158f57743d7df5e85c6256ea",
}
# The same rewrites under TF's placement with LayerNormalization and Softmax denied (the defaults
# before issue 16 moved both to infer and made cost placement the default), pinned on 662a6e2:
# the TF path itself must not move.
TF_EXAMPLE_PINS = {
    ("tiny_transformer", "float16", True): "817d791f6172a6ed133176a8a1a543e7179ac4824c5b17041c89d417db7c8f8d",
    (
        "tiny_transformer",
        "float16",
        False,
    ): "8de629fbd8df25b2115986025821faffc15e541a0f542a9fbd52baa6e17b66d2",
    (
        "tiny_transformer",
        "bfloat16",
        True,
    ): "58e96b2d891da94d2dbe0b653b87f8d631a9f4c655f73943d6ab164bf8656a0e",
    (
        "tiny_transformer",
        "bfloat16",
        False,
    ): "cb2515931a770872f0c41dadcac9f8a145694582dd0370a5e4753ce05e77adc1",
    ("tiny_cnn", "float16", True): "2f0a9cdc6aba811266f9d0ee907124b03a67ce7f718aad4f6a134265baf73520",
    ("tiny_cnn", "float16", False): "58c2abd0a47cd7d053e5b7e55a227f6aef7ccf53b245ce351234615e3b425eb5",
    ("tiny_cnn", "bfloat16", True): "94d45ac495301684f49fed852732ccd63386095249f95781636d69a3933ba710",
    ("tiny_cnn", "bfloat16", False): "d246a466e6da86cb513894c82859cb5517e86bc07fcf2b0b9726e450e818aeae",
}
TF_STACK_PINS = {
    (1000, "float16"): "5cf82aaa24cf85171d309b74eb8d16f64d2e76a42b4fb5a41ddc73de2bca3e78",
    (1000, "bfloat16"): "f687f737fb38e2cbae3f0293869d8ab51ddc4bb501891a654a348625f2133b67",
    (5000, "float16"): "152d6d15e7f647382d741a775f0b7869249b26603d6f71524f00877a088e461a",
    (5000, "bfloat16"): "5deab29445c494134d439a18059fc1380168e53d9e08a611b3f764b741f393dd",
}


def _tf_options(target: str) -> dict:
    """TF's placement and the float16 lists as they were (bfloat16's lists did not change)."""
    return {"placement": "tf", "deny": ["LayerNormalization", "Softmax"] if target == "float16" else []}


def _sha256(result) -> str:
    return hashlib.sha256(result.model.SerializeToString()).hexdigest()


def test_every_example_is_pinned(example_models):
    assert {name for name, _, _ in EXAMPLE_PINS} == set(example_models)


@pytest.mark.parametrize("name, target, keep_io_types", sorted(EXAMPLE_PINS))
def test_example_rewrite_is_byte_identical(example_models, name, target, keep_io_types):
    result = amp_rewrite.rewrite(example_models[name], target=target, keep_io_types=keep_io_types)
    assert _sha256(result) == EXAMPLE_PINS[name, target, keep_io_types]


@pytest.fixture(scope="module")
def stacks(synthetic):
    return {size: synthetic.transformer_stack(size) for size in sorted({size for size, _ in STACK_PINS})}


@pytest.mark.parametrize("size, target", sorted(STACK_PINS))
def test_synthetic_stack_rewrite_is_byte_identical(stacks, size, target):
    assert _sha256(amp_rewrite.rewrite(stacks[size], target=target)) == STACK_PINS[size, target]


def test_a_pinned_rewrite_runs_like_the_original(stacks, synthetic):
    """The 1000-node stack's float16 rewrite (pinned above) in ONNX Runtime against float32."""
    model = stacks[1000]
    result = amp_rewrite.rewrite(model, target="float16")
    assert _sha256(result) == STACK_PINS[1000, "float16"]
    feeds = synthetic.sample_feeds(model, batch=2, seq=8, seed=3)
    assert_close(run_ort(result.model, feeds), run_ort(model, feeds), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name, target, keep_io_types", sorted(TF_EXAMPLE_PINS))
def test_example_rewrite_under_tf_placement_is_byte_identical(example_models, name, target, keep_io_types):
    result = amp_rewrite.rewrite(
        example_models[name], target=target, keep_io_types=keep_io_types, **_tf_options(target)
    )
    assert _sha256(result) == TF_EXAMPLE_PINS[name, target, keep_io_types]


@pytest.mark.parametrize("size, target", sorted(TF_STACK_PINS))
def test_synthetic_stack_rewrite_under_tf_placement_is_byte_identical(stacks, size, target):
    assert (
        _sha256(amp_rewrite.rewrite(stacks[size], target=target, **_tf_options(target)))
        == TF_STACK_PINS[size, target]
    )
