"""Which forward nodes to recompute: segments named by regexes, or checkpoints chosen automatically.

`recompute=` takes three forms:
- a list of regular expressions matched in full against main-graph node names. Each pattern
  makes one segment per distinct *key*: its first capturing group when it has one, else (for a
  pattern ending in `.*`) the text matched by the part before that `.*`, else the pattern itself.
  So `r"layer\\.\\d+/.*"` makes one segment per layer. A node matched by several patterns goes to
  the first; every pattern must match a node.
- `"auto"`: Chen et al. 2016. Candidate checkpoints are the tensors that alone cut the forward
  graph between its inputs and the loss (one live activation on the differentiable path at that
  point of the node order). Segments between chosen checkpoints are sized so that kept
  activations grow as about sqrt(n): the split that minimises (kept bytes + largest segment).
- a number: a byte budget for the estimated activation peak. Among the splits above (and with
  segments left un-recomputed greedily, cheapest memory per FLOP first) the one with the fewest
  recomputed FLOPs whose estimate fits; none fits -> GradientError with the smallest estimate.

Sizes are activation bytes from shape inference (a symbolic dim counts as 1, so a dynamic batch
scales every tensor alike); with an unknown shape every node counts 1. A budget needs static shapes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import onnx

from amp_rewrite.errors import GradientError
from amp_rewrite.flops import estimate_flops

ELEM_BYTES = {
    onnx.TensorProto.FLOAT: 4,
    onnx.TensorProto.DOUBLE: 8,
    onnx.TensorProto.FLOAT16: 2,
    onnx.TensorProto.BFLOAT16: 2,
}
GRID = 48  # thresholds tried between the smallest block and the whole graph


def regex_groups(patterns, names: list[str]) -> list[tuple[str, list[int]]]:
    """(segment key, node indices) per distinct key, in order of first node."""
    compiled = []
    for p in patterns:
        if not isinstance(p, str):
            raise GradientError(f"recompute patterns must be strings, got {p!r}")
        try:
            compiled.append((p, re.compile(p), _head(p)))
        except re.error as error:
            raise GradientError(
                f"recompute pattern {p!r} is not a valid regular expression: {error}"
            ) from None
    groups: dict[str, list[int]] = {}
    used = set()
    for n, name in enumerate(names):
        for p, rx, head in compiled:
            m = rx.fullmatch(name)
            if m is None:
                continue
            used.add(p)
            if rx.groups:
                key = m.group(1) or p
            elif head is not None:
                key = head.match(name).group(0)
            else:
                key = p
            groups.setdefault(key, []).append(n)
            break
    for p, _, _ in compiled:
        if p not in used:
            raise GradientError(f"recompute pattern {p!r} matches no node of the main graph")
    return list(groups.items())


def _head(pattern: str):
    """The pattern without a trailing `.*`, or None."""
    if pattern.endswith(".*") and not pattern.endswith("\\.*") and len(pattern) > 2:
        try:
            return re.compile(pattern[:-2])
        except re.error:
            return None
    return None


@dataclass
class Block:
    """Forward nodes up to and including one candidate checkpoint's producer."""

    nodes: list[int]
    bytes: int  # bytes of the block's activations the backward reads, plus its checkpoint
    out_bytes: int  # the checkpoint's bytes
    flops: int  # estimated FLOPs of the block's nodes (MatMul/Gemm/Conv; one per element otherwise)


def auto_groups(
    forward, on_path: set[str], saved: set[str], loss_node: int, info, budget: int | None
) -> list[tuple[str, list[int]]]:
    """Segments for "auto" (budget None) or for a byte budget. `saved`: tensors the backward reads."""
    blocks, tail_bytes = _blocks(forward, on_path, saved, loss_node, info, budget is not None)
    if not blocks:
        if budget is not None and tail_bytes > budget:
            raise GradientError(
                f"recompute budget {budget} bytes is below reach: the forward graph has no "
                f"checkpoint candidate; smallest estimated activation peak {tail_bytes} bytes"
            )
        return []
    # the last segment is never recomputed: its backward starts at once, while it is still alive
    plans = [(segs, frozenset({len(segs) - 1})) for segs in (_greedy(blocks, t) for t in _thresholds(blocks))]
    if budget is None:
        best = min(plans, key=lambda p: (_peak(blocks, *p, tail_bytes), len(p[0])))
    else:
        fitting = [
            p
            for p in (_trim(blocks, segs, tail_bytes, budget) for segs, _ in plans)
            if _peak(blocks, *p, tail_bytes) <= budget
        ]
        if not fitting:
            low = min(_peak(blocks, *p, tail_bytes) for p in plans)
            raise GradientError(
                f"recompute budget {budget} bytes is below reach: the smallest estimated "
                f"activation peak is {low} bytes"
            )
        best = min(fitting, key=lambda p: (_flops(blocks, *p), _peak(blocks, *p, tail_bytes)))
    segments, kept = best
    chosen = [seg for k, seg in enumerate(segments) if k not in kept]
    return [(f"auto/{k}", [n for j in seg for n in blocks[j].nodes]) for k, seg in enumerate(chosen)]


def _blocks(forward, on_path, saved, loss_node, info, need_static):
    """Cut the node order at every tensor that is the only live activation on the path."""
    last = {}
    for t, readers in forward.readers.items():
        last[t] = max(readers)
    for t in forward.graph_outputs:
        last[t] = len(forward.nodes)
    sizes = {}
    use_bytes = True

    def size(t):
        nonlocal use_bytes
        if t not in sizes:
            sizes[t] = _bytes(t, info, need_static)
            use_bytes = use_bytes and sizes[t] is not None
        return sizes[t]

    blocks, current, live = [], [], 0
    ending: dict[int, int] = {}
    for i in range(min(loss_node, len(forward.nodes))):
        node = forward.nodes[i]
        current.append(i)
        made = [t for t in node.output if t and t in on_path and t in forward.data and last.get(t, -1) > i]
        for t in made:
            size(t)
            live += 1
            ending[last[t]] = ending.get(last[t], 0) + 1
        live -= ending.pop(i, 0)
        if live == 1 and len(made) == 1:
            blocks.append(current)
            current = []
    tail = current + list(range(loss_node, len(forward.nodes)))
    out = []
    for nodes in blocks:
        made = [t for n in nodes for t in forward.nodes[n].output if t in sizes and t in saved]
        weight = (lambda t: sizes[t]) if use_bytes else (lambda t: 1)
        ckpt = [t for t in forward.nodes[nodes[-1]].output if t in sizes][0]
        flops = sum(_node_flops(forward.nodes[n], info) for n in nodes)
        out.append(
            Block(nodes, sum(weight(t) for t in made if t != ckpt) + weight(ckpt), weight(ckpt), flops)
        )
    tail_bytes = sum(
        (sizes.get(t) or 1) if use_bytes else 1
        for n in tail
        for t in forward.nodes[n].output
        if t in saved and t in forward.data
    )
    return out, tail_bytes


def _bytes(t, info, need_static) -> int | None:
    dims = info.dims.get(t)
    if dims is None or any(d is None for d in dims):
        if need_static:
            raise GradientError(
                f"a recompute budget needs known shapes; tensor '{t}' has none (declare input shapes)"
            )
        return None
    if need_static and any(isinstance(d, str) for d in dims):
        raise GradientError(f"a recompute budget needs static shapes; tensor '{t}' has symbolic dims {dims}")
    return ELEM_BYTES.get(info.elem.get(t, onnx.TensorProto.FLOAT), 4) * math.prod(
        d if isinstance(d, int) else 1 for d in dims
    )


def _node_flops(node, info) -> int:
    out = info.dims.get(node.output[0]) if node.output else None
    if not out or any(not isinstance(d, int) for d in out):
        return 1
    flops = estimate_flops(node, dims=lambda name: _static(info.dims.get(name)))  # MatMul, Gemm, Conv...
    return flops if flops is not None else math.prod(out)


def _static(dims):
    return list(dims) if dims and all(isinstance(d, int) and d > 0 for d in dims) else None


def _thresholds(blocks: list[Block]) -> list[int]:
    low = min(b.bytes for b in blocks)
    high = sum(b.bytes for b in blocks)
    if high <= low:
        return [high]
    ratio = (high / low) ** (1 / GRID)
    return sorted({int(low * ratio**k) for k in range(GRID + 1)} | {high})


def _greedy(blocks: list[Block], threshold: int) -> list[list[int]]:
    """Chen's greedy: close a segment when the next block would take its internal bytes over threshold."""
    segments, current, inside = [], [], 0
    for j, b in enumerate(blocks):
        if current and inside + b.bytes > threshold:
            segments.append(current)
            current, inside = [], 0
        current.append(j)
        inside += b.bytes
    segments.append(current)
    return segments


def _peak(blocks, segments, kept, tail_bytes) -> int:
    """Estimated activation peak: everything kept, plus the largest segment's recomputed inside."""
    total, biggest = tail_bytes, 0
    for k, seg in enumerate(segments):
        inner = sum(blocks[j].bytes for j in seg)
        if k in kept:
            total += inner
        else:
            total += blocks[seg[-1]].out_bytes
            biggest = max(biggest, inner - blocks[seg[-1]].out_bytes)
    return total + biggest


def _flops(blocks, segments, kept) -> int:
    return sum(blocks[j].flops for k, seg in enumerate(segments) if k not in kept for j in seg)


def _trim(blocks, segments, tail_bytes, budget):
    """Keep segments whole (no recompute), most FLOPs per byte first, while the estimate fits."""

    def density(k):
        return -sum(blocks[j].flops for j in segments[k]) / max(1, sum(blocks[j].bytes for j in segments[k]))

    kept = frozenset({len(segments) - 1})
    for k in sorted(range(len(segments) - 1), key=density):
        if _peak(blocks, segments, kept | {k}, tail_bytes) <= budget:
            kept = kept | {k}
    return segments, kept
