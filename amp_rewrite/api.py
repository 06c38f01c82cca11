"""The public rewrite API: `rewrite()`, with `RewriteOptions` (options.py) and `RewriteResult`
(the pipeline's). The toggles for export pipelines are in toggles.py.
"""

from __future__ import annotations

from amp_rewrite.options import RewriteOptions
from amp_rewrite.transform.pipeline import RewriteResult, run

__all__ = ["RewriteOptions", "RewriteResult", "rewrite"]


def rewrite(model, options: RewriteOptions | None = None, *, target: str = "float16", keep_io_types: bool = True,
            op_lists=None, allow=(), deny=(), infer=(), clear=(), keep_fp32_nodes=(), clamp: bool = False,
            check: bool = True, op_block_list=None, node_block_list=None, force_fp32=None, calibration=None,
            annotate: bool = False, provider: str = "cuda", placement: str = "cost", scale_activations: bool = True,
            relax_margin: float = 16.0, dims=None, pointwise_check: bool = True, fold_noop_casts: bool = True,
            low_precision_io=(), opset: int | None = None):
    """Rewrite `model` (a path or ModelProto; never modified) for mixed precision in `target`.

    `op_lists` names YAML files of user overrides; `allow`/`deny`/`infer`/`clear` move op types
    between lists; `keep_fp32_nodes` pins nodes by name or full-match regex. The
    onnxconverter-common names are accepted: `op_block_list` adds to `deny`, `node_block_list`
    to `keep_fp32_nodes`. `force_fp32` ({node name: reason}) and `calibration` (a
    `checks.calibrate.CalibrationResult`) make nodes deny roots: float32 spreads from them as from
    a deny op, and the report gives the reason. `annotate` writes each node's precision and reason
    into the result's doc strings (`report.annotate`). `provider` ("cuda", "cpu", "any") is where
    the model will run: a group that provider has no `target` kernel for stays float32
    (analysis/kernels.py). `placement`: "cost" (default) colours the infer/clear ops no deny op
    reaches by one minimum cut of the estimated bytes moved (analysis/placement.py); "tf" paints
    them low only between allow ops (TF's rule). `scale_activations` (with `calibration`): linear regions over the
    limit compute on values x 2^-k instead of staying float32 (transform/scaling.py);
    `relax_margin` (with `calibration`): elementwise range-deny ops measured within max/margin
    become infer ops (op_lists/range_relax.yaml; 0: never). `dims` ({symbolic dim: size}, of the
    graph inputs) sizes those dims for shape inference: the size estimates (cost placement, bytes
    moved, FLOPs) use them; the model's declarations do not change. `pointwise_check`: a range-deny
    op (Exp, Pow, ...) whose pointwise chain from one tensor agrees with float32 on every float16
    value becomes an infer op, no data needed (analysis/pointwise.py). `fold_noop_casts`: the
    model's own Casts that convert nothing in the result are removed (transform/noop_casts.py).
    `low_precision_io` (full-match regexes): graph inputs and outputs whose names match take
    `target` (a decoder's `past_key_values.*` and `present.*`), the rest follow `keep_io_types`;
    a pattern that matches no float32 input or output is a `UsageError`. `opset`: the model is
    converted to that default-domain opset first (onnx.version_converter).
    `options` (a RewriteOptions) replaces all keyword options. Returns a `RewriteResult`; raises AmpRewriteError subclasses on bad input.
    """
    if options is None:
        options = RewriteOptions.of(target=target, keep_io_types=keep_io_types, op_lists=op_lists, allow=allow,
                                    deny=deny, infer=infer, clear=clear, keep_fp32_nodes=keep_fp32_nodes,
                                    clamp=clamp, check=check, op_block_list=op_block_list,
                                    node_block_list=node_block_list, force_fp32=force_fp32,
                                    calibration=calibration, annotate=annotate,
                                    provider=provider, placement=placement, scale_activations=scale_activations,
                                    relax_margin=relax_margin, dims=dims, pointwise_check=pointwise_check,
                                    fold_noop_casts=fold_noop_casts, low_precision_io=low_precision_io,
                                    opset=opset)
    return run(model, options)
