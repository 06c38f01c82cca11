"""The public rewrite API: `rewrite()`, with `RewriteOptions` (options.py) and `RewriteResult`
(the pipeline's). The checked run (calibrate, validate, fallback) is `driver.check`; the toggles
for export pipelines are in toggles.py.
"""

from __future__ import annotations

from amp_rewrite.options import RewriteOptions
from amp_rewrite.transform.pipeline import run
from amp_rewrite.transform.result import RewriteResult

__all__ = ["RewriteOptions", "RewriteResult", "rewrite"]


def rewrite(model, options: RewriteOptions | None = None, **fields) -> RewriteResult:
    """Rewrite `model` (a path or ModelProto; never modified) for mixed precision.

    `fields` are `RewriteOptions`' (options.py says what each does; an unknown one is a
    UsageError), e.g. `target="bfloat16"`, `deny=["Gelu"]`, `keep_fp32_nodes=["head/.*"]`,
    `provider="cpu"` (where the model will run: a group that provider has no target kernel for
    stays float32), `dims={"batch": 8}`; onnxconverter-common's `op_block_list` and
    `node_block_list` are accepted. `options` (a RewriteOptions) is the starting point the fields
    change. Returns a `RewriteResult`; raises AmpRewriteError subclasses on bad input.
    """
    if options is None:
        options = RewriteOptions.of(**fields)
    elif fields:
        options = options.replace(**fields)
    return run(model, options)
