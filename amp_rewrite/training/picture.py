"""The rewrite report of a training step graph, and its HTML picture (`Trainer.report`).

The step graph is rewritten again with the same pins as `step_graph.apply_precision` (the rewrite
is deterministic, so this is the model the trainer runs) and drawn with one region per phase:
forward, loss, backward (`grad/`), loss scale (`amp/`) and optimizer (`opt/`).
"""

from __future__ import annotations

from pathlib import Path

import onnx

from amp_rewrite.errors import TrainingError
from amp_rewrite.training.step_graph import precision_options


def step_report(step_model: onnx.ModelProto, precision: str, html=None, title: str = "training step",
                force_fp32: dict[str, str] | None = None):
    """The Report of rewriting the float32 `step_model` to `precision` (`force_fp32`: the nodes the
    provider refuses, with their reasons); with `html`, the page written there (atomically)."""
    if precision == "float32":
        raise TrainingError("precision float32: the step graph is not rewritten, so there is no report")
    from amp_rewrite.api import rewrite
    from amp_rewrite.io import atomic_write_bytes
    from amp_rewrite.report import html as html_report

    result = rewrite(step_model, precision_options(precision, force_fp32))
    if html is not None:
        page = html_report.render(result.report, step_model, title)
        atomic_write_bytes(Path(html), page.encode())
    return result.report
