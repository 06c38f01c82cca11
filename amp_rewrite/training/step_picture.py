"""The HTML picture of a training step graph's rewrite report (`Trainer.report`).

The report is the one the Trainer's own rewrite made (`StepGraph.report`); the picture draws the
float32 step graph with one region per phase: forward, loss, backward (`grad/`), loss scale
(`scale/`) and optimizer (`opt/`).
"""

from __future__ import annotations

from pathlib import Path

import onnx

from amp_rewrite.errors import TrainingError


def step_report(step_model: onnx.ModelProto, report, precision: str, html=None, title: str = "training step"):
    """`report` (the rewrite's of the float32 `step_model`); with `html`, the page written there (atomically)."""
    if precision == "float32" or report is None:
        raise TrainingError("precision float32: the step graph is not rewritten, so there is no report")
    from amp_rewrite.io import atomic_write_bytes
    from amp_rewrite.report import html as html_report

    if html is not None:
        page = html_report.render(report, step_model, title)
        atomic_write_bytes(Path(html), page.encode())
    return report
