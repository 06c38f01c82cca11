"""Sparse weights keep their zeros: a fine-tune moves a weight's values, not its structure.

A weight of at least MIN_VALUES values, at least MIN_ZERO_SHARE of them exact zeros and not all of
them (an all-zero bias is only initialised so), holds its zeros as structure: a pruned layer, a mel
filterbank, the recurrence half of an LSTM bias its framework never had. Adam moves every value that
has a gradient by about the rate at once, so each zero would leave its place at the first step
(openWakeWord's filterbank, 97% zeros ahead of Clip and Log, then made negative energies: its loss
rose 16.6 -> 96 in 6 steps). The gradient is masked where the weight is zero, so the moments stay
zero there and so does the weight (decoupled decay of a zero is zero). `Trainer(keep_sparsity=False)`
trains them dense.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

MIN_VALUES = 64
MIN_ZERO_SHARE = 0.5
PREFIX = "grad/keep_zeros/"


def sparse_weights(model: onnx.ModelProto, names) -> dict[str, np.ndarray]:
    """weight -> where it is nonzero (bool), for the `names` whose zeros are structure."""
    wanted = set(names)
    found = {}
    for tensor in model.graph.initializer:
        if tensor.name not in wanted or np.prod(tensor.dims) < MIN_VALUES:
            continue
        nonzero = numpy_helper.to_array(tensor) != 0
        if 0 < nonzero.mean() <= 1 - MIN_ZERO_SHARE:
            found[tensor.name] = nonzero
    return found


def keeping_zeros(build, nonzero: dict[str, np.ndarray]):
    """The gradient builder `build` (autodiff's signature), its `<weight>_grad` outputs zero where
    `nonzero` says the weight is zero (no change when `nonzero` is empty)."""
    if not nonzero:
        return build

    def masked(model: onnx.ModelProto, loss_name: str, trainable, **options) -> onnx.ModelProto:
        result = build(model, loss_name, trainable, **options)
        mask_gradients(result.graph, nonzero)
        return result

    return masked


def mask_gradients(graph: onnx.GraphProto, nonzero: dict[str, np.ndarray]) -> None:
    """`Where(nonzero, dense, 0)` in front of each masked weight's `<weight>_grad` output, in place:
    the dense gradient is renamed, and every node that read it reads it under its new name."""
    outputs = {o.name for o in graph.output}
    renamed = {f"{w}_grad": f"{PREFIX}{w}/dense" for w in nonzero if f"{w}_grad" in outputs}
    produced = {name for node in graph.node for name in node.output if name in renamed}
    renamed = {old: new for old, new in renamed.items() if old in produced}
    if not renamed:
        return
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renamed:
                node.input[i] = renamed[name]
        for i, name in enumerate(node.output):
            if name in renamed:
                node.output[i] = renamed[name]
    zero = PREFIX + "zero"
    graph.initializer.append(numpy_helper.from_array(np.array(0, np.float32), zero))
    for gradient, dense in renamed.items():
        weight = gradient.removesuffix("_grad")
        mask = f"{PREFIX}{weight}/nonzero"
        graph.initializer.append(numpy_helper.from_array(nonzero[weight], mask))
        graph.node.append(
            helper.make_node("Where", [mask, dense, zero], [gradient], name=f"{PREFIX}{weight}")
        )


def summary(kept: dict[str, float]) -> str:
    """'; 1 sparse keeps its zeros (1.melW 97%)' for the Trainer's line ('' when none)."""
    if not kept:
        return ""
    shown = ", ".join(f"{w} {share:.0%}" for w, share in list(kept.items())[:3])
    more = f" and {len(kept) - 3} more" if len(kept) > 3 else ""
    verb = "keeps its" if len(kept) == 1 else "keep their"
    return f"; {len(kept)} sparse {verb} zeros ({shown}{more})"
