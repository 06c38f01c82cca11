"""The ONNX node conformance suite, rewritten to float16 and bfloat16 (issue 3).

`tools/conformance.py` does the work and documents the rules (scope, modes, tolerances,
exceptions). CI runs a deterministic sample: every case whose name hashes to 0 mod SAMPLE_EVERY,
plus every case of the families that broke rewriters before (control flow, sequences, Resize,
Range, TopK, Cast, attention, function ops), minus a few cases that take over 10 s in
onnx.reference. `AMP_CONFORMANCE_FULL=1` runs all of them; `python tools/conformance.py` is the
full run with a table of failures. Counts are reported as a warning (shown without -s).

Every sampled case must pass: in both modes none may fail, and in `force` mode (every op of the
case in the allow list) a case either is converted and matches the expected outputs, or is one of
conformance.EXCEPTIONS (each with its reason), or is left float32 for one of the reasons in
FLOAT32_BY_RULE, each a rule that forbids the conversion (the schema, the graph's interface).
A case left float32 for any other reason fails the test.
"""

from __future__ import annotations

import os
import re
import warnings
import zlib

import pytest

from helpers import load_tool

conformance = load_tool("conformance")

SAMPLE_EVERY = 8
ALWAYS = re.compile(
    r"test_(if|loop|scan|sequence_map|split_to_sequence|resize_upsample|range|top_k|cast_FLOAT_|bitcast|"
    r"attention_4d_attn_mask|layer_normalization_2d|mvn|sce_mean$|matmul_2d|gemm_default|conv_with|"
    r"lstm|gru|affine_grid_2d_expanded|ai_onnx_ml_tree_ensemble)"
)
# Why forcing every op into allow may rightly convert nothing: the report's reason, and the rule.
FLOAT32_BY_RULE = {
    r"schema \S+ does not allow \w+ for \w+": "the op's type constraint at the case's opset has no such type",
    r"schema \S+ inference refuses \w+": "the schema's own inference or function body rejects the type "
    "(BitCast's bit width, MeanVarianceNormalization-13's float epsilon)",
    r"sequence '.*' is a graph output": "a sequence graph output keeps its declared element type (the graph's "
    "interface), and so does every op the sequence ties to it (ties.py)",
    r"tied by a sequence to .*, which stays float32 \(schema": "tied by a sequence to an op its schema keeps float32",
    r"schema \S+ ties tensor types to sequence/optional elements": "sequence element types are not retyped "
    "(a documented limit of the rewrite)",
    r"output typed by an attribute: .* not a graph output": "a Cast-like output that is a graph output keeps "
    "its declared type (keep_io_types)",
    r"If boundary keeps the declared types of its bodies": "an If whose outputs are graph outputs and whose "
    "branches hold nothing to convert",
}
SLOW = re.compile(
    r"test_(averagepool|lppool|maxpool)_3d_default|test_arg(max|min)_.*random_select_last_index"
)


def _sample(cases):
    if os.environ.get("AMP_CONFORMANCE_FULL"):
        return cases
    return [
        c
        for c in cases
        if not SLOW.search(c[0]) and (ALWAYS.match(c[0]) or zlib.crc32(c[0].encode()) % SAMPLE_EVERY == 0)
    ]


@pytest.fixture(scope="module")
def cases():
    return _sample(conformance.load_cases())


@pytest.mark.parametrize("target", conformance.TARGETS)
@pytest.mark.parametrize("mode", conformance.MODES)
def test_conformance(cases, target, mode):
    results = conformance.run(cases, (target,), (mode,), jobs=1)
    c = conformance.counts(results, (target,), (mode,))[(target, mode)]
    text = (
        f"{target} {mode}: {len(results)} cases sampled, {c['considered']} considered, {c['passed']} passed "
        f"({c['passed_ort']} ORT, {c['passed_reference']} onnx.reference), {c['float32']} left float32 with "
        f"a reason, {c['failing']} failing, {c['exception']} listed exceptions"
    )
    warnings.warn(UserWarning("conformance counts: " + text), stacklevel=1)  # shown without -s
    print(text)
    assert c["considered"] > 0
    assert c["failing"] == 0, text + "\n" + conformance.summary_text(results, (target,), (mode,))
    considered = [r for r in results if r["baseline"] is None]
    for r in considered:  # every case left float32 says why
        if r[(target, mode)][0] == "float32":
            assert r[(target, mode)][1], r["name"]
    if mode == "force":  # forcing the case's ops into allow converts every case no rule forbids
        unexplained = [
            f"{r['name']}: {r[(target, mode)][0]}: {r[(target, mode)][1]}"
            for r in considered
            if not _passes(*r[(target, mode)][:2])
        ]
        assert not unexplained, text + "\n" + "\n".join(unexplained)


def _passes(status: str, detail: str) -> bool:
    if status in ("passed", "exception"):  # exceptions: conformance.EXCEPTIONS, each with its reason
        return True
    return status == "float32" and any(re.match(rule, detail) for rule in FLOAT32_BY_RULE)
