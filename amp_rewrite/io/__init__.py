"""Stage 1, in and out: load (external data, input checks), the working copy, atomic saves.

Knows nothing of colouring, rewriting, reports or training.
"""

from amp_rewrite.io.input_checks import Validated, ort_limits, validate
from amp_rewrite.io.loader import LoadedModel, load
from amp_rewrite.io.save import atomic_write, atomic_write_bytes, check_output_path, save
from amp_rewrite.io.skeleton import byte_size, checker_target
from amp_rewrite.io.working_copy import restore_borrowed, working_copy

__all__ = ["LoadedModel", "Validated", "atomic_write", "atomic_write_bytes", "byte_size", "check_output_path",
           "checker_target", "load", "ort_limits", "restore_borrowed", "save", "validate", "working_copy"]
