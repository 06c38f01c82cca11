"""A Llama-style decoder (GQA, RoPE, RMSNorm) exported by torch's dynamo exporter with its KV cache
as graph I/O, rewritten with the cache in float16 (examples/decoder_kv_cache.py): 32 greedy steps
in ONNX Runtime feed the float16 cache back with no Cast on its path, and the logits stay within
cosine 0.999 of float32's at every step; onnx.reference agrees on the first steps."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from onnx import TensorProto
from onnx.reference import ReferenceEvaluator

from helpers import load_script

ABSENT = [name for name in ("torch", "transformers", "onnxscript") if importlib.util.find_spec(name) is None]
pytestmark = pytest.mark.skipif(
    bool(ABSENT),
    reason=f"the decoder is exported from transformers by torch's dynamo "
    f"exporter: {', '.join(ABSENT)} not installed",
)
STEPS, PROMPT = 32, [1, 5, 9, 2]


@pytest.fixture(scope="module")
def decoder():
    """(float32 export, float16 rewrite, float32's greedy tokens and logits): exported once per session."""
    example = load_script("examples/decoder_kv_cache.py")
    float32 = example.export()
    half = example.rewrite(float32).model
    tokens, logits, _ = example.decode(example.session_runner(float32), float32, PROMPT, STEPS)
    return example, float32, half, tokens, logits


def test_cache_is_float16_at_the_edge_and_the_rest_keeps_its_type(decoder):
    example, float32, half, _, _ = decoder
    types = {v.name: v.type.tensor_type.elem_type for v in (*half.graph.input, *half.graph.output)}
    past, present = example.cache_names(2)
    assert {types[name] for name in past + present} == {TensorProto.FLOAT16}
    assert (
        types["input_ids"] == types["attention_mask"] == TensorProto.INT64
        and types["logits"] == TensorProto.FLOAT
    )
    producers = {o: n for n in half.graph.node for o in n.output}
    for p, q in zip(past, present):  # the exporter's Concat reads the past and writes the present, as is
        assert producers[q].op_type == "Concat" and producers[q].input[0] == p
    assert example.cache_casts(half) == []
    assert sum(n.op_type == "MatMul" for n in half.graph.node) > 0 and example.cache_casts(float32) == []


def test_greedy_decode_feeds_the_float16_cache_back_and_tracks_float32(decoder):
    example, _, half, tokens, expected = decoder
    _, got, dtypes = example.decode(example.session_runner(half), half, PROMPT, STEPS, follow=tokens)
    assert all(step == {np.dtype(np.float16)} for step in dtypes)  # present came out float16 every step
    cosines = [example.cosine(g, e) for g, e in zip(got, expected)]
    assert len(cosines) == STEPS and min(cosines) >= 0.999, cosines
    assert not np.allclose(got[-1], expected[-1], rtol=0, atol=1e-7)  # it did compute in float16


def test_onnx_reference_agrees_on_the_first_steps(decoder):
    example, _, half, tokens, expected = decoder
    reference = ReferenceEvaluator(half)
    steps = 3
    _, by_reference, dtypes = example.decode(
        lambda feeds: reference.run(None, feeds), half, PROMPT, steps, follow=tokens
    )
    _, by_ort, _ = example.decode(example.session_runner(half), half, PROMPT, steps, follow=tokens)
    assert all(step == {np.dtype(np.float16)} for step in dtypes)
    for r, o, e in zip(by_reference, by_ort, expected):
        assert example.cosine(r, o) >= 0.999 and example.cosine(r, e) >= 0.999
