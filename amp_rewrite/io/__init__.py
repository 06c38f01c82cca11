"""Stage 1, in and out: load (external data, input checks), the working copy, atomic saves.

Knows nothing of colouring, rewriting, reports or training. `external` resolves every file a
model names; `output` plans what a run writes and replaces a model and its data as one pair.
"""

from amp_rewrite.io.input_checks import Validated, ort_limits, validate
from amp_rewrite.io.loader import LoadedModel, load
from amp_rewrite.io.output import OutputPair, OutputPlan
from amp_rewrite.io.save import atomic_write, atomic_write_bytes, save
from amp_rewrite.io.skeleton import byte_size, checker_target
from amp_rewrite.io.working_copy import restore_borrowed, working_copy

__all__ = [
    "LoadedModel",
    "OutputPair",
    "OutputPlan",
    "Validated",
    "atomic_write",
    "atomic_write_bytes",
    "byte_size",
    "checker_target",
    "load",
    "ort_limits",
    "restore_borrowed",
    "save",
    "validate",
    "working_copy",
]
