"""amp-rewrite: automatic mixed precision for ONNX models.

    import amp_rewrite
    result = amp_rewrite.rewrite("model.onnx", target="float16")
    result.model            # onnx.ModelProto, valid, float32 I/O kept by default
    result.report.to_dict() # every decision and why

Export pipelines call `amp_rewrite.maybe_rewrite(model)` and flip `enable()` / `disable()`.
"""

from amp_rewrite.api import RewriteOptions, RewriteResult, rewrite
from amp_rewrite.errors import AmpRewriteError, ModelError, OpListError, OutputError, UsageError
from amp_rewrite.toggles import disable, enable, enabled, is_enabled, maybe_rewrite

__version__ = "0.1.0"

__all__ = [
    "AmpRewriteError",
    "ModelError",
    "OpListError",
    "OutputError",
    "UsageError",
    "RewriteOptions",
    "RewriteResult",
    "rewrite",
    "maybe_rewrite",
    "enable",
    "disable",
    "enabled",
    "is_enabled",
]
