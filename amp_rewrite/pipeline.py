"""The pipeline and the public API: load -> classify -> colour -> materialise -> order -> report.

Also the toggles, after TensorFlow's enable/disable_mixed_precision_graph_rewrite: export
pipelines call `maybe_rewrite(model)`, which rewrites only while the rewrite is enabled.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import re
import time
import warnings
from dataclasses import dataclass

import networkx as nx
import onnx

from amp_rewrite import casts, graph, model as model_io, paint, report as report_mod
from amp_rewrite.errors import UsageError
from amp_rewrite.oplists import TARGETS, load_op_lists


@dataclass
class RewriteResult:
    model: onnx.ModelProto
    report: report_mod.Report
    changed: bool


def _as_list(value) -> list:
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)):
        return [value]
    return list(value)


def _check_patterns(patterns) -> None:
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise UsageError(f"keep_fp32_nodes: {pattern!r} is not a valid regular expression ({exc})") from None


def _gc_paused(function):
    """The passes allocate millions of small containers and free them as they go; the cyclic
    collector would rescan them all every few thousand allocations (~15% of a big rewrite)."""

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


@_gc_paused
def rewrite(
    model,
    *,
    target: str = "float16",
    keep_io_types: bool = True,
    op_lists=None,
    allow=(),
    deny=(),
    infer=(),
    clear=(),
    keep_fp32_nodes=(),
    clamp: bool = False,
    check: bool = True,
    op_block_list=None,
    node_block_list=None,
    force_fp32=None,
    calibration=None,
) -> RewriteResult:
    """Rewrite `model` (a path or ModelProto; never modified) for mixed precision in `target`.

    `op_lists` names YAML files of user overrides; `allow`/`deny`/`infer`/`clear` move op types
    between lists; `keep_fp32_nodes` pins nodes by name or full-match regex. The
    onnxconverter-common names are accepted: `op_block_list` adds to `deny`, `node_block_list`
    to `keep_fp32_nodes`. `force_fp32` ({node name: reason}) and `calibration` (a
    `calibrate.CalibrationResult`) make nodes deny roots: float32 spreads from them as from a deny
    op, and the report gives the reason. Raises AmpRewriteError subclasses on bad input.
    """
    started = time.perf_counter()
    if target not in TARGETS:
        raise UsageError(f"unknown target {target!r}: choose one of {', '.join(TARGETS)}")
    keep_fp32_nodes = _as_list(keep_fp32_nodes) + _as_list(node_block_list)
    _check_patterns(keep_fp32_nodes)
    lists = load_op_lists(target, user_files=_as_list(op_lists), allow=_as_list(allow),
                          deny=_as_list(deny) + _as_list(op_block_list), infer=_as_list(infer),
                          clear=_as_list(clear))
    # onnx.checker runs once, on the result (`_check`); the input gets it only when anything fails,
    # to tell a bad input (one ModelError line) from a bug of ours, or up front when nothing is checked
    loaded = model_io.load(model, checker=not check)
    try:
        return _rewrite_loaded(loaded, lists, started, target=target, keep_io_types=keep_io_types,
                               keep_fp32_nodes=keep_fp32_nodes, clamp=clamp, check=check,
                               force_fp32=force_fp32, calibration=calibration)
    except Exception:
        loaded.validate_in_full()
        raise


def _rewrite_loaded(loaded, lists, started, *, target, keep_io_types, keep_fp32_nodes, clamp, check, force_fp32,
                    calibration) -> RewriteResult:
    if loaded.owned:  # read from a file here: nobody else holds it, so no second copy in memory
        work, borrowed = loaded.model, {}
    else:  # the caller's model: copied, its big weights borrowed (read, never changed)
        work, borrowed = model_io.working_copy(loaded.model)
    bytes_before = model_io.byte_size(loaded.model, loaded.data_bytes)
    nested, weights_before = loaded.nested, loaded.float_bytes
    if work.functions:  # model-local functions (dynamo exporter): inlined, then coloured as any graph
        work, nested, weights_before = inline_functions(work), True, None  # bodies may bring subgraphs, weights
    scopes = graph.read_scopes(work.graph, nested)
    types, shapes = model_io.tensor_types(work, scopes=scopes)
    forced = dict(force_fp32 or {})
    if calibration is not None:
        forced = {**calibration.force_fp32(target), **forced}
    cg = graph.build(work, lists, types=types, shapes=shapes, keep_fp32_nodes=keep_fp32_nodes, clamp=clamp,
                     force_fp32=forced, borrowed=borrowed, scopes=scopes)
    plan = paint.colour(cg, keep_io_types=keep_io_types)
    flops = report_mod.flops_by_node(cg)
    if weights_before is None:
        weights_before = report_mod.weight_bytes(scope.graph for scope in cg.scopes)
    materialised = casts.materialise(work, cg, plan, keep_io_types=keep_io_types, clamp=clamp)
    if cg.unsorted:  # casts go right after their producers, so a sorted input stays sorted
        sort_graphs(work)
    data_after = loaded.data_bytes + materialised.weight_bytes_delta
    if check:
        _check(work, data_after, skeleton=loaded.lazy)
    rep = report_mod.build(cg, plan, materialised, bytes_before=bytes_before,
                           bytes_after=model_io.byte_size(work, data_after),
                           seconds=time.perf_counter() - started, weights_before=weights_before,
                           weights_after=weights_before + materialised.weight_bytes_delta, node_flops=flops)
    changed = bool(materialised.casts or not keep_io_types or paint.LOW in plan.colour.values())
    return RewriteResult(work, rep, changed)


def inline_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its model-local functions inlined (onnx.inliner), so every op is coloured."""
    import onnx.inliner

    inlined = onnx.inliner.inline_local_functions(model)
    del inlined.functions[:]
    return inlined


def _check(model: onnx.ModelProto, data_bytes: int | None = None, *, skeleton: bool = False) -> None:
    """Refuse to hand back an invalid model: that would be a bug of ours, said plainly."""
    try:  # a big model is checked as a data-free skeleton: the checker serialises what it gets
        onnx.checker.check_model(model_io.checker_target(model, data_bytes, skeleton=skeleton))
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "invalid model"
        raise RuntimeError(f"amp-rewrite produced an invalid model ({first}); please report this") from exc


def _is_sorted(g: onnx.GraphProto) -> bool:
    produced = {name for node in g.node for name in node.output if name}
    seen = set()
    for node in g.node:
        if any(name in produced and name not in seen for name in node.input if name):
            return False
        seen.update(node.output)
    return True


def sort_graphs(model: onnx.ModelProto) -> None:
    """Topologically sort every graph that is not sorted, keeping the original order otherwise."""
    for scope in graph.collect_scopes(model.graph):
        g = scope.graph
        if _is_sorted(g):
            continue
        producer = {name: i for i, node in enumerate(g.node) for name in node.output if name}
        deps = nx.DiGraph()
        deps.add_nodes_from(range(len(g.node)))
        deps.add_edges_from((producer[x], i) for i, node in enumerate(g.node) for x in node.input if x in producer)
        try:
            order = list(nx.lexicographical_topological_sort(deps))
        except nx.NetworkXUnfeasible:
            raise model_io.ModelError(f"graph {g.name or '(main)'} has a cycle") from None
        nodes = [g.node[i] for i in order]
        del g.node[:]
        g.node.extend(nodes)


# --- toggles --------------------------------------------------------------------------------------

_state = {"enabled": os.environ.get("AMP_REWRITE_ENABLED", "").lower() in ("1", "true", "yes"), "options": {}}


def enable(**options) -> None:
    """Turn the rewrite on for `maybe_rewrite`; `options` become its default keyword arguments."""
    _state["enabled"] = True
    _state["options"] = dict(options)


def disable() -> None:
    """Turn the rewrite off for `maybe_rewrite` (warns if it was already off)."""
    if not _state["enabled"]:
        warnings.warn("amp_rewrite.disable(): the rewrite is already disabled", stacklevel=2)
    _state["enabled"] = False


def is_enabled() -> bool:
    return _state["enabled"]


@contextlib.contextmanager
def enabled(on: bool = True, **options):
    """Context manager: the rewrite is on (or off) inside, as before outside."""
    saved = dict(_state)
    _state["enabled"] = on
    _state["options"] = dict(options) if on else saved["options"]
    try:
        yield
    finally:
        _state.update(saved)


def maybe_rewrite(model, **options):
    """Rewrite when enabled and return the new ModelProto; otherwise return `model` untouched."""
    if not _state["enabled"]:
        return model if isinstance(model, onnx.ModelProto) else model_io.load(model).model
    return rewrite(model, **{**_state["options"], **options}).model
