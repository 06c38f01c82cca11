"""When and how `onnx.reference` runs the rewritten model (validate.py, fallback.py).

ORT's CPU provider computes most float16 ops in float32 and drops the casts in between, so it hides
overflow; `onnx.reference` keeps float16 tensors float16, as a GPU does, but computes in numpy and
is slow. `use_reference` decides whether it runs ("auto": on CPU when `reference_work`, its
estimated work at the samples' sizes, is within REFERENCE_WORK_LIMIT); `run_reference` runs it.
"""

from __future__ import annotations

import numpy as np
import onnx

from amp_rewrite.analysis.elemtypes import tensor_types
from amp_rewrite.io.samples import feed_inputs
from amp_rewrite.progress import Progress
from amp_rewrite.runtime import CPU

# onnx.reference computes float16 in numpy, which has no float16 kernels: about 1e7 elements or
# 4e7 multiply-adds a second on this project's CPUs. Automatic only below about 20 s of that.
REFERENCE_WORK_LIMIT = 2e8
NODE_WORK = 2000  # its per-node overhead, in the same units (10k-node stack: about 0.5 ms a node)
CPU_NOTE = (
    "ORT CPU computes many float16 ops in float32 and can hide overflow; "
    "pass reference=True (--reference) to also run onnx.reference"
)


def run_reference(model: onnx.ModelProto, samples, *, outputs=None, progress=None, label="reference") -> list:
    from onnx.reference import ReferenceEvaluator

    evaluator = ReferenceEvaluator(model)
    results = []
    with Progress(len(samples), label, progress) as bar, np.errstate(all="ignore"):
        for feeds in samples:
            results.append(list(evaluator.run(outputs, feeds)))
            bar.step()
    return results


def sample_dims(model: onnx.ModelProto, samples) -> dict:
    """{symbolic dim: size} as the first sample has them."""
    dims: dict = {}
    feeds = samples[0] if len(samples) else {}
    for value in feed_inputs(model):
        array = feeds.get(value.name)
        for i, d in enumerate(value.type.tensor_type.shape.dim):
            if d.dim_param and array is not None and i < np.ndim(array):
                dims.setdefault(d.dim_param, int(np.shape(array)[i]))
    return dims


def reference_work(model: onnx.ModelProto, samples, repeats: int = 1) -> float:
    """Estimated work of onnx.reference on `samples`: per node its output elements (its
    multiply-adds for MatMul/Gemm/Conv) plus NODE_WORK, from shapes inferred at the samples'
    sizes; an output of unknown shape counts as large as the largest known tensor. Beyond
    shape inference's node limit the estimate is infinite."""
    from amp_rewrite.analysis.elemtypes import sizes_dims
    from amp_rewrite.flops import _dims, estimate_flops

    runs = max(len(samples), 1) * repeats
    if not sizes_dims(model):
        return float("inf")
    floor = len(model.graph.node) * NODE_WORK * runs
    if floor > REFERENCE_WORK_LIMIT:  # over already: no shape inference needed to say so
        return floor
    _, shapes = tensor_types(model, shape_inference=True, dims=sample_dims(model, samples))
    sizes = {name: int(np.prod(d)) for name in shapes if (d := _dims(shapes, name)) is not None}
    largest = max(sizes.values(), default=1)
    work = 0.0
    for node in model.graph.node:
        flops = estimate_flops(node, shapes)
        work += NODE_WORK + (flops / 2 if flops else sum(sizes.get(o, largest) for o in node.output if o))
    return work * runs


def use_reference(
    model: onnx.ModelProto, provider_used: str, reference, samples=(), notes=None, repeats: int = 1
) -> bool:
    """Whether onnx.reference runs: True/False, or "auto": on CPU when `reference_work` (over
    `repeats` runs of the samples: the fallback's search) is within REFERENCE_WORK_LIMIT (a skip
    is said in `notes`)."""
    if reference != "auto":
        return bool(reference)
    if provider_used != CPU:
        return False
    work = reference_work(model, samples, repeats)
    if work <= REFERENCE_WORK_LIMIT:
        return True
    if notes is not None:
        size = (
            "beyond shape inference's node limit"
            if work == float("inf")
            else f"about {work:.2g} element operations"
        )
        notes.append(
            f"onnx.reference skipped: {size}, over the automatic limit {REFERENCE_WORK_LIMIT:.0e} "
            "(--reference runs it anyway)"
        )
    return False
