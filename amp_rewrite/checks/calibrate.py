"""Calibration: measure every intermediate float tensor of the float32 model, decide from ranges.

The float32 model runs once per sample in ONNX Runtime with every main-graph float32 tensor added
as a graph output (on a copy). Per tensor we keep the largest finite |x| and how many non-zero
values would flush to zero in the target type. A tensor whose largest value exceeds the target's
largest finite value divided by `safety` makes its producer and its readers deny roots (see
`force_fp32`), so float32 spreads from them through the usual passes, and the report names the
tensor and the value that decided it. With power-of-two scaling (transform/scaling.py, on by
default) the nodes of linear regions are exempt: they compute on values x 2^-k instead.

This decides from measured float32 ranges, not from running the rewritten model: ONNX Runtime's
CPU provider computes most float16 ops in float32 and would hide the overflow.

Sentinels are not overflow. Exporters write "as large as the type allows" as finfo(float32).min
or .max (the dynamo exports' attention mask is `Where(keep, 0, -3.4028235e38)`; float32 then
absorbs it: `s + -3.4e38 == -3.4e38`, so every `scores + mask` holds it too), and float32 itself
makes +-inf. Values exactly +-finfo(float32).max are counted per tensor (`sentinels`), left out
of its largest |x| and so of the overflow test and of scaling; +-inf already were (`nonfinite`).
What the rewrite then does with them is what it does without data: a constant holding one is out
of float16's range, so its readers stay float32 (transform.weights), and the Cast after them
turns the sentinel into -inf, which behaves as float32's sentinel does (s + -inf = -inf, exp of
it is 0) with one exception: a row made only of sentinels. float32 subtracts equal sentinels to 0
(a fully masked Softmax row is uniform), float16 subtracts -inf from -inf, NaN. So a tensor with
such a row along its last axis (`sentinel_rows`, e.g. a query that may see no key) still forces
its producer and readers float32, as overflow did, and power-of-two scaling does not exempt them.
A relaxable deny op (`relaxed`) that reads or writes sentinels is not relaxed. Calibration's
figures name the tensors that held sentinels (`to_dict()["sentinels"]`, `to_text`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto

from amp_rewrite import ir
from amp_rewrite.analysis.elemtypes import tensor_types
from amp_rewrite.analysis.oplists import shipped_table
from amp_rewrite.checks import validate as val
from amp_rewrite.checks.check_options import CheckOptions
from amp_rewrite.checks.pieces import open_checked
from amp_rewrite.deployment import DEFAULT, Deployment
from amp_rewrite.io import load
from amp_rewrite.transform.weights import LIMITS

# Non-zero values below half the smallest subnormal round to zero.
FLUSH = {"float16": float(np.finfo(np.float16).smallest_subnormal) / 2, "bfloat16": 9.183549615799121e-41 / 2}
SENTINEL = float(np.finfo(np.float32).max)  # +-this: "as large as float32 allows", see above
DEFAULT_SAFETY = CheckOptions.safety  # written once, in check_options.py
DEFAULT_RELAX_MARGIN = 16.0


@functools.cache
def relaxable_ops() -> frozenset:
    """Deny ops calibration may relax (`op_lists/range_relax.yaml`, which says why these)."""
    return frozenset(shipped_table("range_relax.yaml")["relax"])


@dataclass
class TensorRange:
    name: str
    producer: str | None  # node key (name, or first output for unnamed nodes); None for graph inputs
    op_type: str | None
    max_abs: float = 0.0
    count: int = 0
    nonzero: int = 0
    flushed: int = 0  # non-zero values that become 0 in the target type
    nonfinite: int = 0  # already NaN/Inf in float32
    sentinels: int = 0  # values exactly +-finfo(float32).max: not in max_abs, not overflow
    sentinel_rows: int = 0  # slices along the last axis made only of sentinels (and +-inf), one finite

    @property
    def flushed_share(self) -> float:
        return self.flushed / self.nonzero if self.nonzero else 0.0

    def to_dict(self) -> dict:
        return {
            "tensor": self.name,
            "producer": self.producer,
            "op_type": self.op_type,
            "max_abs": self.max_abs,
            "flushed_share": round(self.flushed_share, 6),
            "nonfinite": self.nonfinite,
            "sentinels": self.sentinels,
            "sentinel_rows": self.sentinel_rows,
        }


@dataclass
class CalibrationResult:
    target: str
    samples: int
    safety: float
    ranges: dict  # tensor name -> TensorRange
    consumers: dict  # tensor name -> [(node key, op type)]
    provider: str = ""
    notes: list = field(default_factory=list)

    @property
    def threshold(self) -> float:
        return LIMITS[self.target] / self.safety

    def culprits(self, target: str | None = None) -> list[TensorRange]:
        """Tensors over the limit, largest first."""
        limit = LIMITS[target or self.target] / self.safety
        return sorted((r for r in self.ranges.values() if r.max_abs > limit), key=lambda r: -r.max_abs)

    def with_sentinels(self) -> list[TensorRange]:
        """Tensors that held +-finfo(float32).max sentinels, in measuring order."""
        return [r for r in self.ranges.values() if r.sentinels]

    def force_fp32(self, target: str | None = None, exempt=frozenset()) -> dict:
        """{node key: reason} for producers and readers of tensors over the limit, but those in
        `exempt` (nodes of regions that power-of-two scaling runs on scaled values), and of tensors
        with rows of sentinels only (exempt or not: float16 would make those rows NaN)."""
        target = target or self.target
        limit = LIMITS[target] / self.safety
        bound = f"{limit:.6g} ({LIMITS[target]:.6g}/{self.safety:g})"
        forced: dict = {}
        for r in self.culprits(target):  # largest first: the first reason a node gets is its largest value
            if r.producer is not None:
                forced.setdefault(
                    r.producer, f"calibrated: output {r.name!r} reaches {r.max_abs:.4g} > {bound}"
                )
            for key, _ in self.consumers.get(r.name, []):
                forced.setdefault(key, f"calibrated: input {r.name!r} reaches {r.max_abs:.4g} > {bound}")
        if exempt:
            forced = {key: reason for key, reason in forced.items() if key not in exempt}
        for r in self.with_sentinels():
            if not r.sentinel_rows:
                continue
            said = (
                f"has {r.sentinel_rows} row(s) of only +-{SENTINEL:.8g} sentinels (fully masked): "
                f"in {target} they are inf and such a row becomes NaN (-inf - -inf)"
            )
            if r.producer is not None:
                forced.setdefault(r.producer, f"calibrated: output {r.name!r} {said}")
            for key, _ in self.consumers.get(r.name, []):
                forced.setdefault(key, f"calibrated: input {r.name!r} {said}")
        return forced

    def relaxed(self, target: str | None = None, margin: float = DEFAULT_RELAX_MARGIN) -> dict:
        """{node key: (reason, measured maxima)} for range-deny ops (`relaxable_ops`) whose every
        measured input and output stays within LIMIT/margin, none flushed to zero, non-finite or a sentinel."""
        if not margin or margin <= 0:
            return {}
        bound = LIMITS[target or self.target] / margin
        ops = relaxable_ops()
        seen: dict = {}  # node key -> (op type, [(role, TensorRange)])
        for r in self.ranges.values():
            if r.op_type in ops:
                seen.setdefault(r.producer, (r.op_type, []))[1].append(("output", r))
            for key, op_type in self.consumers.get(r.name, []):
                if op_type in ops:
                    seen.setdefault(key, (op_type, []))[1].append(("input", r))
        relaxed = {}
        for key, (op_type, measured) in seen.items():
            if not any(role == "output" for role, _ in measured):
                continue
            if all(
                r.count and r.max_abs <= bound and not r.flushed and not r.nonfinite and not r.sentinels
                for _, r in measured
            ):
                maxima = {f"{role} {r.name!r}": r.max_abs for role, r in measured}
                said = ", ".join(f"{k} reaches {v:.4g}" for k, v in maxima.items())
                relaxed[key] = (
                    f"calibrated: {op_type} relaxed from deny to infer, {said} <= {bound:.6g} "
                    f"({LIMITS[target or self.target]:.6g}/{margin:g}), none flushed to zero",
                    maxima,
                )
        return relaxed

    def to_dict(self, target: str | None = None, exempt=frozenset(), relax_margin: float = 0.0) -> dict:
        forced = self.force_fp32(target, exempt)
        relaxed = {key: v for key, v in self.relaxed(target, relax_margin).items() if key not in forced}
        largest = sorted(self.ranges.values(), key=lambda r: -r.max_abs)[:10]
        flushing = sorted((r for r in self.ranges.values() if r.flushed), key=lambda r: -r.flushed_share)[:10]
        return {
            "samples": self.samples,
            "provider": self.provider,
            "tensors": len(self.ranges),
            "safety": self.safety,
            "threshold": self.threshold,
            "culprits": [r.to_dict() for r in self.culprits(target)],
            "forced": [{"node": k, "reason": v} for k, v in forced.items()],
            **(
                {
                    "relax_margin": relax_margin,
                    "relaxed": [{"node": k, "reason": v[0], "maxima": v[1]} for k, v in relaxed.items()],
                }
                if relax_margin
                else {}
            ),
            "largest": [r.to_dict() for r in largest],
            "flush_to_zero": [r.to_dict() for r in flushing],
            "sentinels": [r.to_dict() for r in self.with_sentinels()],
            "notes": self.notes,
        }

    def to_text(self) -> str:
        lines = [
            f"calibration: {self.samples} sample(s) on {self.provider}, {len(self.ranges)} float tensors; "
            f"limit {self.threshold:.6g}"
        ]
        for r in self.culprits()[:20]:
            lines.append(f"  {r.name!r} from {r.op_type} '{r.producer}' reaches {r.max_abs:.4g}")
        held = self.with_sentinels()
        if held:
            lines.append(f"sentinels (+-{SENTINEL:.8g}, not overflow) in {len(held)} tensor(s):")
            for r in held[:20]:
                rows = (
                    f", {r.sentinel_rows} row(s) of only sentinels: kept float32" if r.sentinel_rows else ""
                )
                lines.append(
                    f"  {r.name!r} from {r.op_type} '{r.producer}': {r.sentinels} value(s), "
                    f"others reach {r.max_abs:.4g}{rows}"
                )
        return "\n".join(lines)


def _node_key(node: onnx.NodeProto) -> str:
    return node.name or (node.output[0] if node.output else "")


def _measured_tensors(model: onnx.ModelProto, types: dict):
    """Main-graph float32 tensors to measure: graph inputs and node outputs (not constants)."""
    producers = {}
    for node in model.graph.node:
        if node.op_type == "Constant":
            continue
        for out in node.output:
            if out and types.get(out) == TensorProto.FLOAT:
                producers[out] = (_node_key(node), node.op_type)
    initializers = {i.name for i in model.graph.initializer}
    for value in model.graph.input:
        if value.name not in initializers and types.get(value.name) == TensorProto.FLOAT:
            producers.setdefault(value.name, (None, None))
    return producers


def calibrate(
    model, samples=None, *, deployment: Deployment = DEFAULT, safety: float = DEFAULT_SAFETY, progress=None
) -> CalibrationResult:
    """Run the float32 `model` on `samples` (synthesised if None, at the deployment's dims) on the
    deployment's device and measure every float tensor against its target's range."""
    CheckOptions(safety=safety)  # a safety it cannot divide by is a UsageError, before any work
    model = load(model).model if not isinstance(model, onnx.ModelProto) else model
    if samples is None:
        samples = val.synthesise(model, dims=deployment.dims)
    with val.Progress(2, "calibrate: element types and readers", progress) as bar:
        types, _ = tensor_types(model)
        producers = _measured_tensors(model, types)
        bar.step()
        nodes = model.graph.node
        consumers = {
            name: [(_node_key(nodes[i]), nodes[i].op_type) for i in rows]
            for name, rows in ir.readers(node.input for node in nodes).items()
            if name in producers
        }
        bar.step()
    sess, used = open_checked(
        model, deployment.device, expose=list(producers), progress=progress, label="calibrate"
    )
    names = [o.name for o in sess.get_outputs() if o.name in producers]
    ranges = {n: TensorRange(n, *producers[n]) for n in names}
    target = deployment.target
    flush = FLUSH[target]
    for values in val.run_samples(sess, samples, outputs=names, progress=progress, label="calibrate"):
        _accumulate_all([ranges[n] for n in names], values, flush)
    result = CalibrationResult(target, len(samples), safety, ranges, consumers, used)
    if len(val.feed_inputs(model)) and len(samples) == 1:
        result.notes.append(
            "one sample: ranges on real data can be larger (use --inputs with several samples)"
        )
    if any(a.HasField("g") or a.graphs for n in model.graph.node for a in n.attribute):
        result.notes.append("tensors inside If/Loop/Scan bodies are not measured")
    return result


CHUNK = 1 << 22  # elements measured at once by `_accumulate_all` (its temporaries: ~20 bytes each)


def _accumulate_all(ranges: list, arrays: list, flush: float) -> None:
    """`_accumulate` for each (range, array) pair, the float32 ones measured together: one numpy
    pass per CHUNK elements instead of ten calls per tensor (100k small tensors: 6 s -> under 1).
    A tensor whose largest value is a sentinel is measured again on its own, by `_accumulate`."""
    batch: list = []
    size = 0
    for r, array in zip(ranges, arrays):
        array = np.asarray(array)
        if array.dtype != np.float32 or not array.size:
            continue
        batch.append((r, array))
        size += array.size
        if size >= CHUNK:
            _accumulate_batch(batch, flush)
            batch, size = [], 0
    if batch:
        _accumulate_batch(batch, flush)


def _accumulate_batch(batch: list, flush: float) -> None:
    sizes = np.array([a.size for _, a in batch])
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    a = np.abs(np.concatenate([x.ravel() for _, x in batch]))
    finite = np.isfinite(a)
    values = np.where(finite, a, np.float32(0))
    tops = np.maximum.reduceat(values, starts)
    nonfinite = sizes - np.add.reduceat(finite, starts)
    nonzero = values > 0
    counts = np.add.reduceat(nonzero, starts)
    flushed = np.add.reduceat(nonzero & (values < flush), starts)
    for i, (r, array) in enumerate(batch):
        top = float(tops[i])
        if top == SENTINEL:
            _accumulate(r, array, flush)
            continue
        r.count += int(sizes[i])
        r.nonfinite += int(nonfinite[i])
        r.max_abs = max(r.max_abs, top)
        r.nonzero += int(counts[i])
        r.flushed += int(flushed[i])


def _accumulate(r: TensorRange, array: np.ndarray, flush: float) -> None:
    """Add one sample's values of `r`'s tensor: largest finite |x| but sentinels, counts."""
    if array.dtype != np.float32 or not array.size:
        return
    a = np.abs(array)
    finite = np.isfinite(a)
    r.count += a.size
    nonfinite = int(a.size - np.count_nonzero(finite))
    r.nonfinite += nonfinite
    values = a[finite] if nonfinite else a
    top = float(values.max()) if values.size else 0.0
    if top == SENTINEL:  # rare: only then a second look
        sentinel = values == SENTINEL
        r.sentinels += int(np.count_nonzero(sentinel))
        values = values[~sentinel]
        top = float(values.max()) if values.size else 0.0
        rows = a.reshape(-1, a.shape[-1] if a.ndim else 1)
        finite_sentinel = rows == SENTINEL
        r.sentinel_rows += int(
            np.count_nonzero((finite_sentinel | np.isinf(rows)).all(axis=1) & finite_sentinel.any(axis=1))
        )
    if values.size:
        r.max_abs = max(r.max_abs, top)
        nonzero = values > 0
        r.nonzero += int(nonzero.sum())
        r.flushed += int((nonzero & (values < flush)).sum())
