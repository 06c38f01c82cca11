"""Autodiff: gradient graphs for ONNX models, built from standard ONNX ops only.

    grad_model = build_gradient_graph(model, loss="loss")          # every float initializer
    grad_model = build_gradient_graph(model, "loss", ["W"], grad_output="loss_scale")

The result computes the forward outputs plus `<name>_grad` for each differentiated tensor, runs in
any ONNX Runtime build (no training kernels), and keeps the model's IR version and opset.
"""

from __future__ import annotations

from amp_rewrite.autodiff.builder import build_gradient_graph
from amp_rewrite.autodiff.context import GradContext
from amp_rewrite.autodiff.registry import REGISTRY, register_gradient


def covered_ops() -> list[tuple[str, str]]:
    """Every (domain, op type) with a gradient rule, sorted."""
    return sorted(REGISTRY)


__all__ = ["GradContext", "build_gradient_graph", "covered_ops", "register_gradient"]
