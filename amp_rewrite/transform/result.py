"""What a rewrite hands back, `RewriteResult`, and the two checks of it the pipeline and the
accuracy fallback share: the bytes-moved estimate for the report and onnx.checker on the result."""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from amp_rewrite.analysis import paint
from amp_rewrite.io import checker_target
from amp_rewrite.options import RewriteOptions
from amp_rewrite.report import report as report_mod


@dataclass(repr=False)
class RewriteResult:
    """What `rewrite()` returns. Its repr is one line and, in a notebook, a summary card: the
    model and report themselves are far too big to print."""

    model: onnx.ModelProto  # checker-valid, IR version and opsets kept
    report: report_mod.Report  # every decision and why
    changed: bool

    def __repr__(self) -> str:
        s = self.report.summary
        return (
            f"<RewriteResult {self.report.target}: {s['nodes_low']} of {s['nodes_float']} float nodes "
            f"({s['nodes_mixed']} mixed), {s['casts_inserted']} casts inserted, "
            f"{s['bytes_before'] / 1e6:.2f} MB -> {s['bytes_after'] / 1e6:.2f} MB"
            f"{'' if self.changed else ', unchanged'}>"
        )

    def _repr_html_(self) -> str:
        from amp_rewrite.report.html import summary_card

        return summary_card(self.report)


def bytes_moved(
    cg, plan, options: RewriteOptions, dims_used: bool = True, low_io: frozenset = frozenset(), figures=None
) -> dict:
    """Estimated bytes moved (analysis.placement.estimate) all in float32 and as coloured, for the
    report, with the symbolic dims the sizes used (`dims`: empty when none were); `figures`: the
    two, where the colouring already estimated them (paint.never_worse)."""
    from amp_rewrite.analysis import placement

    if figures is None:
        low = {v for v, c in plan.colour.items() if c == paint.LOW}
        figures = placement.estimates(cg, (set(), low), low_io)
    return {
        "placement": options.placement,
        "bytes_moved_float32": figures[0],
        "bytes_moved": figures[1],
        "dims": dict(options.dims) if dims_used else {},
    }


def check_valid(model: onnx.ModelProto, data_bytes: int | None = None, *, skeleton: bool = False) -> None:
    """Refuse to hand back an invalid model: that would be a bug of ours, said plainly (also for
    the accuracy fallback, which checks only the candidate it keeps)."""
    try:  # a big model is checked as a data-free skeleton: the checker serialises what it gets
        onnx.checker.check_model(checker_target(model, data_bytes, skeleton=skeleton))
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "invalid model"
        raise RuntimeError(f"amp-rewrite produced an invalid model ({first}); please report this") from exc
