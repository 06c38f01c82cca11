"""Models and a hand-written gradient shared by the training tests.

`softmax_regression_gradient` has `build_gradient_graph`'s signature but knows only one model
(logits = Gemm(x, W, b) under the built-in cross-entropy): it checks the step-graph assembly
independently of the autodiff package.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from amp_rewrite.training import SGD, Adam, AdamW
from helpers import init, make_model, node, tensor


def softmax_regression(features=4, classes=3, seed=0, opset=17):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((features, classes)) * 0.5).astype(np.float32)
    b = (rng.standard_normal(classes) * 0.1).astype(np.float32)
    return make_model(
        [node("Gemm", ["x", "W", "b"], ["logits"], name="fc")],
        [tensor("x", ["N", features])],
        [tensor("logits", ["N", classes])],
        [init("W", w), init("b", b)],
        opset=opset,
    )


def mlp(sizes=(64, 32, 10), seed=0, opset=17):
    """Gemm/Relu stack with torch.nn.Linear's default init (weights stored [in, out])."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    current = "x"
    for i, (fan_in, fan_out) in enumerate(zip(sizes, sizes[1:])):
        bound = 1 / np.sqrt(fan_in)
        inits += [
            init(f"w{i}", rng.uniform(-bound, bound, (fan_in, fan_out)).astype(np.float32)),
            init(f"b{i}", rng.uniform(-bound, bound, fan_out).astype(np.float32)),
        ]
        out = "logits" if i == len(sizes) - 2 else f"h{i}"
        nodes.append(
            node(
                "Gemm",
                [current, f"w{i}", f"b{i}"],
                [out + ("_pre" if out != "logits" else "")],
                name=f"fc{i}",
            )
        )
        if out != "logits":
            nodes.append(node("Relu", [out + "_pre"], [out], name=f"relu{i}"))
        current = out
    return make_model(
        nodes, [tensor("x", ["N", sizes[0]])], [tensor("logits", ["N", sizes[-1]])], inits, opset=opset
    )


def softmax_regression_gradient(model, loss, wrt=None, *, grad_output=None, **_):
    """d(loss)/dW and d(loss)/db for Gemm + cross-entropy, seeded by `grad_output` (the loss scale)."""
    model_copy = onnx.ModelProto()
    model_copy.CopyFrom(model)
    g = model_copy.graph
    seed = grad_output or "grad/seed"
    batch = "grad/batch"
    g.node.extend(
        [
            helper.make_node("Softmax", ["logits"], ["grad/probs"], name="grad/softmax", axis=-1),
            helper.make_node("Shape", ["logits"], ["grad/logits_shape"], name="grad/logits_shape"),
            helper.make_node(
                "Gather", ["grad/logits_shape", "grad/last"], ["grad/classes"], name="grad/classes"
            ),
            helper.make_node(
                "OneHot",
                ["labels", "grad/classes", "grad/off_on"],
                ["grad/one_hot"],
                name="grad/one_hot",
                axis=-1,
            ),
            helper.make_node("Sub", ["grad/probs", "grad/one_hot"], ["grad/residual"], name="grad/residual"),
            helper.make_node("Shape", ["x"], ["grad/x_shape"], name="grad/x_shape", end=1),
            helper.make_node(
                "Cast", ["grad/x_shape"], ["grad/batch_vec"], name="grad/batch_cast", to=TensorProto.FLOAT
            ),
            helper.make_node("Squeeze", ["grad/batch_vec"], [batch], name="grad/batch"),
            helper.make_node("Div", [seed, batch], ["grad/seed_per_sample"], name="grad/seed_per_sample"),
            helper.make_node(
                "Mul", ["grad/residual", "grad/seed_per_sample"], ["grad/logits"], name="grad/logits"
            ),
            helper.make_node("Gemm", ["x", "grad/logits"], ["W_grad"], name="grad/W", transA=1),
            helper.make_node(
                "ReduceSum", ["grad/logits", "grad/axis0"], ["b_grad"], name="grad/b", keepdims=0
            ),
        ]
    )
    g.initializer.append(helper.make_tensor("grad/axis0", TensorProto.INT64, [1], [0]))
    g.initializer.append(helper.make_tensor("grad/off_on", TensorProto.FLOAT, [2], [0.0, 1.0]))
    g.initializer.append(helper.make_tensor("grad/last", TensorProto.INT64, [], [-1]))
    if grad_output is None:
        g.initializer.append(helper.make_tensor(seed, TensorProto.FLOAT, [], [1.0]))
    else:
        g.input.append(helper.make_tensor_value_info(seed, TensorProto.FLOAT, []))
    g.output.extend(
        [
            helper.make_tensor_value_info("W_grad", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("b_grad", TensorProto.FLOAT, None),
        ]
    )
    return model_copy


def classification_batches(features=4, classes=3, batch=8, count=5, seed=1):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.standard_normal((batch, features)).astype(np.float32),
            "labels": rng.integers(0, classes, batch).astype(np.int64),
        }
        for _ in range(count)
    ]


# Every optimizer form the update engines must agree on (host update, flat update), built fresh.
OPTIMIZERS = {
    "sgd": lambda: SGD(0.1),
    "sgd-nesterov-l2": lambda: SGD(0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam-l2": lambda: Adam(0.01, weight_decay=1e-3),
    "adamw-warmup": lambda: AdamW(0.01, warmup_steps=3),
    "adamw-clip": lambda: AdamW(0.01, max_grad_norm=0.05),
}
