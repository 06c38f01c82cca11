"""The rewrite pipeline, as a list of stages over one `Work` record.

    load -> working copy -> inline functions -> scopes -> element types -> [scaling] -> colouring graph
         -> constant scan -> paint -> FLOPs -> materialise -> sort -> check -> report

Each stage is a small function that reads what earlier stages left in `Work` and adds its own
result; STAGES declares, per stage, the fields it reads and writes (checked as it runs, `run_stage`)
and the module that does its work. ARCHITECTURE.md has the picture.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import time
from dataclasses import dataclass, field

import onnx

from amp_rewrite import flops, ir
from amp_rewrite.analysis import evidence, graph, paint, pointwise
from amp_rewrite.analysis.elemtypes import SHAPE_INFERENCE_NODE_LIMIT, check_dims, sizes_dims, tensor_types
from amp_rewrite.analysis.kernels import newer_opset_advice
from amp_rewrite.analysis.oplists import check_named_ops
from amp_rewrite.errors import UsageError
from amp_rewrite.io import LoadedModel, byte_size, load, working_copy
from amp_rewrite.onnx_facts import opsets
from amp_rewrite.options import RewriteOptions
from amp_rewrite.progress import Progress
from amp_rewrite.report import node_flops as report_flops
from amp_rewrite.report import report as report_mod
from amp_rewrite.transform import colour_as, converters, fuse, range_run, weights
from amp_rewrite.transform import materialise as materialise_mod
from amp_rewrite.transform import scaling as scaling_mod
from amp_rewrite.transform.result import RewriteResult, bytes_moved, check_valid


@dataclass
class Work:
    """What the stages hand on to each other."""

    loaded: LoadedModel
    options: RewriteOptions
    lists: object  # analysis.oplists.OpLists
    started: float
    kernel_check: object = None  # analysis.kernels' check for the deployment (None: provider "any")
    model: onnx.ModelProto = None  # the proto being rewritten in place
    low_io: frozenset = frozenset()  # main-graph inputs and outputs that take the target type
    borrowed: dict = field(default_factory=dict)
    nested: bool = True
    weights_before: int | None = None
    bytes_before: int = 0
    scopes: list = None
    types: dict = None
    shapes: dict = None
    scaling: scaling_mod.Scaling = None  # with calibration: the regions computed on scaled values
    cg: graph.ColouringGraph = None
    constants: weights.Scan = None
    plan: paint.Plan = None
    flops: dict = None
    materialised: materialise_mod.Materialised = None
    result: RewriteResult = None
    range_note: str | None = None  # what the range check of cost placement measured (analysis.evidence)
    moved: tuple | None = None  # bytes moved in float32 and as coloured, where colour estimated them
    fuse_note: str | None = None  # what --fuse fused (transform.fuse)


def take_working_copy(w: Work) -> None:
    """A model read from a file here is nobody else's: rewritten in place. The caller's model is
    copied, its big weights borrowed (read, never changed)."""
    if w.options.opset is not None and opsets(w.loaded.model).get("") != w.options.opset:
        w.model, w.borrowed = converters.convert_opset(w.loaded.model, w.options.opset), {}  # new: ours
    elif w.loaded.owned:
        w.model, w.borrowed = w.loaded.model, {}
    else:
        w.model, w.borrowed = working_copy(w.loaded.model)
    if w.options.fuse is not None:
        if w.loaded.lazy:
            raise UsageError("fuse needs the model's weights in memory: load it without lazy_weights")
        source = w.loaded.model if w.borrowed else w.model  # the optimizer reads the weights
        w.model, w.fuse_note = fuse.fused(source, w.options.fuse)
        w.borrowed = {}
    memo = w.loaded.memo
    if "bytes" not in memo:  # the input is never changed here: its size is the same every rewrite
        memo["bytes"] = byte_size(w.loaded.model, w.loaded.data_bytes)
    w.bytes_before = memo["bytes"]
    w.nested, w.weights_before = w.loaded.nested, w.loaded.float_bytes


def choose_low_io(w: Work) -> None:
    """Which graph inputs and outputs take the target type (`low_precision_io`, `keep_io_types`):
    a pattern that matches none fails here, before any work."""
    w.low_io = w.options.low_io_names(w.model.graph)


def inline_local_functions(w: Work) -> None:
    """Model-local functions (dynamo exporter) are inlined, then coloured as any graph."""
    if w.model.functions:
        w.model = converters.inline_functions(w.model)
        w.nested, w.weights_before = True, None  # bodies may bring subgraphs


def read_scopes(w: Work) -> None:
    w.scopes = ir.read_scopes(w.model.graph, w.nested)


def infer_types(w: Work) -> None:
    """`dims` size the inputs' symbolic dims for shape inference: estimates only, never the model.
    Before scaling changes the graph, the types are those of every rewrite of the same input with
    the same opset and dims: read once (the accuracy fallback rewrites it ten times); each rewrite
    gets its own copy, which graph.build completes."""
    key = ("types", w.options.opset, tuple(sorted(dict(w.options.dims or {}).items())))
    found = w.loaded.memo.get(key) if w.scaling is None else None
    if found is None:
        found = tensor_types(w.model, scopes=w.scopes, dims=w.options.dims)
        if w.scaling is None:
            w.loaded.memo[key] = found
    w.types, w.shapes = dict(found[0]), dict(found[1])


def scale_activations(w: Work) -> None:
    """With calibration: linear regions over the limit compute on values x 2^-k (transform.scaling);
    the graph changed, so its scopes and types are read again. Nothing runs without calibration."""
    if w.options.calibration is None or not w.options.scale_activations:
        return
    w.scaling = scaling_mod.scale(w.model, w.options.calibration, w.types, w.options.target, w.borrowed)
    if w.scaling.regions:
        read_scopes(w)
        infer_types(w)


def build_colouring_graph(w: Work) -> None:
    """Deny ops relaxed to infer: by exhaustion of their pointwise chain (no data needed), and by
    calibration's measured ranges (its reason wins where both apply)."""
    relax = (
        pointwise.relieved(w.scopes, w.lists, w.types, opsets(w.model), w.borrowed)
        if w.options.pointwise_check
        else {}
    )
    relax.update(w.options.relaxed_deny())
    w.cg = graph.build(
        w.model,
        w.lists,
        types=w.types,
        shapes=w.shapes,
        keep_fp32_nodes=w.options.keep_fp32_nodes,
        force_fp32=w.options.deny_roots(w.scaling),
        borrowed=w.borrowed,
        scopes=w.scopes,
        kernel_check=w.kernel_check,
        relax=relax,
    )


def scan_constants(w: Work) -> None:
    w.constants = weights.scan_constants(w.cg, w.options.clamp)


def colour(w: Work) -> None:
    """Cost placement's ops that TF's rule keeps float32 need range evidence (analysis.evidence):
    a data-free bound, or one float32 run on synthesised inputs within the work budget
    (transform.range_run). Not with calibration, whose measured ranges already made the
    out-of-range ops deny roots."""

    def run(placement):
        return paint.colour(w.cg, low_io=w.low_io, placement=placement)

    if w.options.placement != "cost" or w.options.calibration is not None:
        plan = run(w.options.placement)
    else:
        # the float32 model: the caller's where the working copy borrowed its weights (neither changed yet)
        source = w.loaded.model if w.borrowed else w.model
        largest = functools.partial(range_run.largest_values, source, types=w.types, dims=w.options.dims)
        budget = range_run.over_budget(w.scopes, w.bytes_before, w.loaded.lazy)
        plan, w.range_note = evidence.settle(w.cg, run, largest, budget, w.low_io)
    plan = colour_as.follow(w.cg, plan, w.options.colour_as)
    if w.options.placement == "cost" and w.options.calibration is None and w.options.never_worse:
        plan, note, w.moved = paint.never_worse(w.cg, plan, w.low_io)
        w.range_note = "; ".join(filter(None, [w.range_note, note])) or None
    w.plan = plan


def estimate_flops(w: Work) -> None:
    """Before materialising, which moves nodes."""
    w.flops = report_flops.flops_by_node(w.cg)
    if w.weights_before is None:
        w.weights_before = flops.weight_bytes(scope.graph for scope in w.cg.scopes)


def materialise(w: Work) -> None:
    w.materialised = materialise_mod.materialise(
        w.model,
        w.cg,
        w.plan,
        w.constants,
        low_io=w.low_io,
        clamp=w.options.clamp,
        fold_casts=w.options.fold_noop_casts,
    )


def sort(w: Work) -> None:
    """Casts go right after their producers, so a sorted input stays sorted: only an unsorted one is sorted."""
    if w.cg.unsorted:
        ir.sort_graphs(w.model)


def check(w: Work) -> None:
    if w.options.check:
        check_valid(w.model, w.loaded.data_bytes + w.materialised.weight_bytes_delta, skeleton=w.loaded.lazy)


def report(w: Work) -> None:
    delta = w.materialised.weight_bytes_delta
    rep = report_mod.build(
        w.cg,
        w.plan,
        w.materialised,
        bytes_before=w.bytes_before,
        bytes_after=byte_size(w.model, w.loaded.data_bytes + delta),
        seconds=time.perf_counter() - w.started,
        weights_before=w.weights_before,
        weights_after=w.weights_before + delta,
        node_flops=w.flops,
        moved=functools.partial(bytes_moved, w.cg, w.plan, w.options, sizes_dims(w.model), w.low_io, w.moved),
        coloured_for=w.kernel_check.provider if w.kernel_check is not None else None,
    )
    rep.notes.extend(w.loaded.notes)
    if w.fuse_note:
        rep.notes.append(w.fuse_note)
    if w.options.dims and not sizes_dims(w.model):
        rep.notes.append(
            f"dims {_dims_text(w.options.dims)} not used: shape inference is skipped above "
            f"{SHAPE_INFERENCE_NODE_LIMIT} nodes, so symbolic dims count 1 in the size estimates"
        )
    if w.range_note:
        rep.notes.append(w.range_note)
    if w.kernel_check is not None:
        rep.notes.extend(newer_opset_advice(w.cg, w.kernel_check, opsets(w.model)))
    if w.scaling is not None and w.scaling.regions:
        scaling_mod.add_to_report(rep, w.scaling)
    changed = bool(
        w.materialised.casts
        or w.materialised.removed_casts
        or w.low_io
        or paint.LOW in w.plan.colour.values()
        or (w.scaling is not None and bool(w.scaling.regions))
    )
    w.result = RewriteResult(w.model, rep, changed)


def annotate(w: Work) -> None:
    """--annotate: each node's precision and reason into the result (off by default: bytes unchanged)."""
    if w.options.annotate:
        from amp_rewrite.report.annotate import annotate as write_notes

        write_notes(w.result.model, w.result.report)


@dataclass(frozen=True)
class Stage:
    """One step of the pipeline: the `Work` fields it reads and the ones it (re)assigns (names
    separated by spaces), checked by `run_stage` each time it runs, and the module doing its work."""

    function: object
    reads: str
    writes: str
    module: str

    @property
    def name(self) -> str:
        return self.function.__name__


STAGES = (
    Stage(
        take_working_copy,
        "loaded options",
        "model borrowed bytes_before nested weights_before fuse_note",
        "io.working_copy, transform.converters (--opset), transform.fuse (--fuse)",
    ),
    Stage(choose_low_io, "model options", "low_io", "options (low_precision_io, keep_io_types)"),
    Stage(inline_local_functions, "model", "model nested weights_before", "transform.converters"),
    Stage(read_scopes, "model nested", "scopes", "ir"),
    Stage(infer_types, "model options scopes loaded scaling", "types shapes", "analysis.elemtypes"),
    Stage(
        scale_activations,
        "model options types borrowed nested loaded scaling",
        "scaling scopes types shapes",
        "transform.scaling (only with calibration)",
    ),
    Stage(
        build_colouring_graph,
        "model lists types shapes options scaling borrowed scopes kernel_check",
        "cg",
        "analysis.graph, analysis.pointwise",
    ),
    Stage(scan_constants, "cg options", "constants", "transform.weights"),
    Stage(
        colour,
        "cg low_io options loaded borrowed model types scopes bytes_before",
        "plan range_note moved",
        "analysis.paint, analysis.placement, analysis.evidence, transform.range_run",
    ),
    Stage(estimate_flops, "cg weights_before", "flops weights_before", "report.node_flops, flops"),
    Stage(materialise, "model cg plan constants low_io options", "materialised", "transform.materialise"),
    Stage(sort, "cg model", "", "ir"),
    Stage(check, "options model loaded materialised", "", "onnx.checker"),
    Stage(
        report,
        "cg plan materialised bytes_before started weights_before flops options model low_io loaded "
        "range_note scaling kernel_check moved fuse_note",
        "result",
        "report.report",
    ),
    Stage(annotate, "options result", "", "report.annotate"),
)
GIVEN = (
    "loaded",
    "options",
    "lists",
    "started",
    "kernel_check",
    "scaling",
    "range_note",
)  # set before any stage
# (scaling and range_note: None says "none", a value of its own)


def run_stage(stage: Stage, w: Work, written: set) -> None:
    """Run `stage` on `w`, holding it to its declaration: it reads only fields some earlier stage
    wrote (or `GIVEN`) and assigns only the fields it declares. A breach is our own bug."""
    missing = [name for name in stage.reads.split() if name not in written]
    if missing:
        raise RuntimeError(f"pipeline stage {stage.name} reads {missing}, which no earlier stage writes")
    before = {f.name: getattr(w, f.name) for f in dataclasses.fields(w)}
    stage.function(w)
    changed = [name for name, value in before.items() if getattr(w, name) is not value]
    undeclared = sorted(set(changed) - set(stage.writes.split()))
    if undeclared:
        raise RuntimeError(f"pipeline stage {stage.name} assigned {undeclared}, which it does not declare")
    written.update(stage.writes.split())


def _gc_paused(function):
    """The passes allocate millions of small containers and free them as they go; the cyclic
    collector would rescan them all every few thousand allocations, for nothing: no cycles are made."""

    @functools.wraps(function)
    def paused(*args, **kwargs):
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return function(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()

    return paused


def preflight(loaded: LoadedModel, options: RewriteOptions, lists=None) -> None:
    """The options' names checked against the model before any work: every --dim names a symbolic
    dim, every op type a list moves exists. Once per model and set of names, however many rewrites
    follow (the checked run calls it before calibrating, the accuracy fallback rewrites ten times)."""
    key = ("preflight", options.target, options.op_lists, options.allow, options.deny, options.infer)
    key += (options.clear, tuple(sorted(dict(options.dims or {}).items())))
    if key in loaded.memo:
        return
    check_dims(loaded.model.graph, options.dims)
    check_named_ops(lists or options.lists(), loaded.model)
    loaded.memo[key] = True


@_gc_paused
def run(model, options: RewriteOptions, progress=None) -> RewriteResult:
    """Rewrite `model` (a path, ModelProto or LoadedModel) as `options` say; see `api.rewrite`.
    `progress` (the checked run's): a bar over the stages, as progress.Progress draws it."""
    started = time.perf_counter()
    lists = options.lists()
    # onnx.checker runs once, on the result (`check`); the input gets it only when anything fails,
    # to tell a bad input (one ModelError line) from a bug of ours, or up front when nothing is checked
    loaded = load(model, checker=not options.check)
    preflight(loaded, options, lists)
    w = Work(loaded, options, lists, started, options.kernel_check())
    try:
        written = set(GIVEN)
        with Progress(len(STAGES), "rewrite", progress) as bar:
            for stage in STAGES:
                run_stage(stage, w, written)
                bar.step()
    except Exception:
        loaded.validate_in_full()
        raise
    return w.result


def _dims_text(dims) -> str:
    return ", ".join(f"{name}={size}" for name, size in dims.items())
