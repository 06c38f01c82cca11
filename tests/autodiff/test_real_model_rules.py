"""The gradients real exports need (Resize, LSTM, GRU, If, ORT's fused contrib ops) against torch
autograd, in float32 and after the float16 rewrite a training step gets.

Each model is the op between a trainable input side and loss = sum(y * R) with a fixed random R,
built by hand as the exporters write it, run in ONNX Runtime CPU. float32: max |onnx - torch| <=
1e-4 * max(1, max |torch|). float16: the gradient graph rewritten as the Trainer rewrites a step
graph (training lists, nodes the CPU provider refuses in float16 kept float32) stays within 2e-2 of
float32 relative to max(1, max |g|). Finite differences for the same rules run in test_rules.py.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from amp_rewrite.autodiff import build_gradient_graph
from helpers import IR_VERSION, session

torch = pytest.importorskip("torch")
F = torch.nn.functional
FLOAT = TensorProto.FLOAT


def loss_model(nodes, inputs, weights, out_shape, opset=17, seed=5):
    """nodes -> y, then loss = sum(y * R); returns the model and R."""
    r = np.random.default_rng(seed).standard_normal(out_shape).astype(np.float32)
    nodes = [*nodes, helper.make_node("Mul", ["y", "R"], ["yr"]), helper.make_node("ReduceSum", ["yr"], ["loss"], keepdims=0)]
    inits = [numpy_helper.from_array(v, k) for k, v in {**weights, "R": r}.items()]
    graph = helper.make_graph(nodes, "m", inputs, [helper.make_tensor_value_info("loss", FLOAT, [])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION)
    onnx.checker.check_model(model, full_check=True)
    return model, torch.tensor(r)


def float16_outputs(grad_model, feeds):
    """Run the gradient graph as a float16 training step runs it on CPU."""
    from amp_rewrite import rewrite
    from amp_rewrite.training.kernels import refused_nodes
    from amp_rewrite.training.step_graph import precision_options

    result = rewrite(grad_model, precision_options("float16"))
    refused = refused_nodes(result.model, "cpu")
    if refused:
        result = rewrite(grad_model, precision_options("float16", refused))
    assert result.report.summary["nodes_low"] > 0
    names = [o.name for o in result.model.graph.output]
    return dict(zip(names, session(result.model).run(None, feeds)))


def check(model, feeds, wrt, torch_loss, float16=True):
    """Gradients of `wrt` (initializers or inputs) from ORT vs torch; returns the worst float32 and float16 errors."""
    grad_model = build_gradient_graph(model, "loss", wrt)
    onnx.checker.check_model(grad_model, full_check=True)
    names = [o.name for o in grad_model.graph.output]
    got = dict(zip(names, session(grad_model).run(None, feeds)))
    values = {**{i.name: numpy_helper.to_array(i) for i in model.graph.initializer}, **feeds}
    params = {k: torch.tensor(v, requires_grad=k in wrt) for k, v in values.items()}
    loss = torch_loss(params)
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-4, atol=1e-4)
    worst32 = worst16 = 0.0
    low = float16_outputs(grad_model, feeds) if float16 else None
    for name in wrt:
        expected = params[name].grad.numpy()
        scale = max(1.0, float(np.abs(expected).max()))
        error = float(np.abs(got[f"{name}_grad"] - expected).max()) / scale
        assert error <= 1e-4, (name, error)
        worst32 = max(worst32, error)
        if low is not None:
            error16 = float(np.abs(low[f"{name}_grad"] - got[f"{name}_grad"]).max()) / scale
            assert error16 <= 2e-2, (name, error16)
            worst16 = max(worst16, error16)
    print(f"\nworst relative gradient error vs torch: float32 {worst32:.1e}, float16 vs float32 {worst16:.1e}")
    return worst32, worst16


# -- Resize ------------------------------------------------------------------------------------------
RESIZE = {  # id: (ONNX attributes, scales, torch interpolate kwargs)
    "nearest": (dict(mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
                [1, 1, 2, 2], dict(scale_factor=2, mode="nearest")),
    "nearest-exact": (dict(mode="nearest", coordinate_transformation_mode="half_pixel", nearest_mode="round_prefer_ceil"),
                      [1, 1, 1.5, 3], dict(scale_factor=(1.5, 3), mode="nearest-exact")),
    "bilinear": (dict(mode="linear", coordinate_transformation_mode="pytorch_half_pixel"),
                 [1, 1, 2, 2], dict(scale_factor=2, mode="bilinear", align_corners=False)),
    "bilinear-down": (dict(mode="linear", coordinate_transformation_mode="half_pixel"),
                      [1, 1, 0.5, 0.75], dict(scale_factor=(0.5, 0.75), mode="bilinear", align_corners=False)),
    "bilinear-align-corners": (dict(mode="linear", coordinate_transformation_mode="align_corners"),
                               [1, 1, 2, 3], dict(scale_factor=(2, 3), mode="bilinear", align_corners=True)),
}


@pytest.mark.parametrize("kind", RESIZE)
def test_resize_matches_torch(kind):
    attrs, scales, kwargs = RESIZE[kind]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 2, 6, 8)).astype(np.float32)
    w = (rng.standard_normal((3, 2, 3, 3)) * 0.5).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Resize", ["c", "", "scales"], ["y"], **attrs)]
    out = [2, 3, int(6 * scales[2]), int(8 * scales[3])]
    inputs = [helper.make_tensor_value_info("x", FLOAT, ["N", 2, "H", "W"])]
    model, r = loss_model(nodes, inputs, {"w": w, "scales": np.array(scales, np.float32)}, out)

    def reference(p):
        return (F.interpolate(F.conv2d(p["x"], p["w"], padding=1), **kwargs) * r).sum()

    check(model, {"x": x}, ["w", "x"], reference)
