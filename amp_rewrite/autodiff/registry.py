"""The gradient rules: one table from (domain, op type) to its rule, built here in one place (as
the op lists are), from the rule functions of the families under rules/.

A rule receives a `GradContext` (context.py) and returns one gradient name, or None ("zero"), per
input. `register_gradient` adds a user's rule for an op the table lacks (or replaces one).
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx

from amp_rewrite.autodiff.context import GradientRule
from amp_rewrite.autodiff.rules import (
    control,
    elementwise,
    linalg,
    loss_ops,
    nn,
    norm,
    quantize,
    recurrent,
    reduce,
    resize,
    shape,
)

ALL = None  # every floating-point input can carry a gradient

# op type (default domain) -> (rule, the input slots that can carry a gradient: indices, shapes and
# axes never do)
TABLE = {
    # elementwise
    "Add": (elementwise.add_grad, ALL),
    "Sub": (elementwise.sub_grad, ALL),
    "Mul": (elementwise.mul_grad, ALL),
    "Div": (elementwise.div_grad, ALL),
    "Pow": (elementwise.pow_grad, ALL),
    "Log": (elementwise.log_grad, ALL),
    "Sin": (elementwise.sin_grad, ALL),
    "Sinh": (elementwise.sinh_grad, ALL),
    "Cosh": (elementwise.cosh_grad, ALL),
    "Abs": (elementwise.abs_grad, ALL),
    "Softplus": (elementwise.softplus_grad, ALL),
    "Exp": (elementwise.exp_grad, ALL),
    "Sqrt": (elementwise.sqrt_grad, ALL),
    "Reciprocal": (elementwise.reciprocal_grad, ALL),
    "Tanh": (elementwise.tanh_grad, ALL),
    "Sigmoid": (elementwise.sigmoid_grad, ALL),
    "Erf": (elementwise.erf_grad, ALL),
    "Cos": (elementwise.cos_grad, ALL),
    "Tan": (elementwise.tan_grad, ALL),
    "Atan": (elementwise.atan_grad, ALL),
    "Softsign": (elementwise.softsign_grad, ALL),
    "Mish": (elementwise.mish_grad, ALL),
    "Relu": (elementwise.relu_grad, ALL),
    "LeakyRelu": (elementwise.leaky_relu_grad, ALL),
    "Elu": (elementwise.elu_grad, ALL),
    "Selu": (elementwise.selu_grad, ALL),
    "Celu": (elementwise.celu_grad, ALL),
    "ThresholdedRelu": (elementwise.thresholded_relu_grad, ALL),
    "HardSigmoid": (elementwise.hard_sigmoid_grad, ALL),
    "HardSwish": (elementwise.hard_swish_grad, ALL),
    "PRelu": (elementwise.prelu_grad, ALL),
    "Gelu": (elementwise.gelu_grad, ALL),
    "Neg": (elementwise.neg_grad, ALL),
    "Identity": (elementwise.identity_grad, ALL),
    "Cast": (elementwise.cast_grad, ALL),
    "Floor": (elementwise.zero_grad, ALL),
    "Ceil": (elementwise.zero_grad, ALL),
    "Round": (elementwise.zero_grad, ALL),
    "Sign": (elementwise.zero_grad, ALL),
    "Clip": (elementwise.clip_grad, (0,)),
    "Min": (elementwise.select_grads, ALL),
    "Max": (elementwise.select_grads, ALL),
    "Sum": (elementwise.sum_grad, ALL),
    "Mean": (elementwise.mean_grad, ALL),
    "Where": (elementwise.where_grad, (1, 2)),
    # linalg
    "MatMul": (linalg.matmul_grad, ALL),
    "Gemm": (linalg.gemm_grad, ALL),
    "Einsum": (linalg.einsum_grad, ALL),
    # reduce
    "ReduceSum": (reduce.reduce_sum_grad, (0,)),
    "ReduceMean": (reduce.reduce_mean_grad, (0,)),
    "ReduceSumSquare": (reduce.reduce_sum_square_grad, (0,)),
    "ReduceL1": (reduce.reduce_l1_grad, (0,)),
    "ReduceL2": (reduce.reduce_l2_grad, (0,)),
    "ReduceLogSumExp": (reduce.reduce_log_sum_exp_grad, (0,)),
    "ReduceLogSum": (reduce.reduce_log_sum_grad, (0,)),
    "ReduceProd": (reduce.reduce_prod_grad, (0,)),
    "ReduceMax": (reduce.select_reduce_grad, (0,)),
    "ReduceMin": (reduce.select_reduce_grad, (0,)),
    "CumSum": (reduce.cumsum_grad, (0,)),
    # shape
    "Reshape": (shape.back_to_input_shape, (0,)),
    "Flatten": (shape.back_to_input_shape, (0,)),
    "Squeeze": (shape.back_to_input_shape, (0,)),
    "Unsqueeze": (shape.back_to_input_shape, (0,)),
    "Transpose": (shape.transpose_grad, ALL),
    "Expand": (shape.expand_grad, (0,)),
    "Tile": (shape.tile_grad, (0,)),
    "Concat": (shape.concat_grad, ALL),
    "Split": (shape.split_grad, (0,)),
    "Slice": (shape.slice_grad, (0,)),
    "Gather": (shape.gather_grad, (0,)),
    "GatherElements": (shape.gather_elements_grad, (0,)),
    "GatherND": (shape.gather_nd_grad, (0,)),
    "ScatterElements": (shape.scatter_elements_grad, (0, 2)),
    "ScatterND": (shape.scatter_nd_grad, (0, 2)),
    "Pad": (shape.pad_grad, (0,)),
    # nn
    "Softmax": (nn.softmax_grad, ALL),
    "LogSoftmax": (nn.log_softmax_grad, ALL),
    "Conv": (nn.conv_grad, ALL),
    "ConvTranspose": (nn.conv_transpose_grad, ALL),
    "MaxPool": (nn.max_pool_grad, ALL),
    "AveragePool": (nn.average_pool_grad, ALL),
    "GlobalAveragePool": (nn.global_average_pool_grad, ALL),
    "GlobalMaxPool": (nn.global_max_pool_grad, ALL),
    # norm
    "LayerNormalization": (norm.layer_norm_grad, ALL),
    "BatchNormalization": (norm.batch_norm_grad, (0, 1, 2)),
    "InstanceNormalization": (norm.instance_norm_grad, (0, 1, 2)),
    "GroupNormalization": (norm.group_norm_grad, ALL),
    # nn
    "Dropout": (nn.dropout_grad, (0,)),
    # losses
    "NegativeLogLikelihoodLoss": (loss_ops.nll_loss_grad, (0,)),
    "SoftmaxCrossEntropyLoss": (loss_ops.softmax_cross_entropy_grad, (0,)),
    # resize
    "Resize": (resize.resize_grad, (0,)),
    # recurrent
    "LSTM": (recurrent.lstm_grad, (0, 1, 2, 3, 5, 6)),
    "GRU": (recurrent.gru_grad, (0, 1, 2, 3, 5)),
    # control
    "If": (control.if_grad, ALL),
    # quantization: the straight-through estimator to the QuantizeLinear's x (slot 3, past DQ's own)
    "DequantizeLinear": (quantize.dequantize_grad, (quantize.STE_SLOT,)),
}

# com.microsoft ops a pre-pass writes (`gelu_fusion`); the rest of ORT's fused ops are decomposed
CONTRIB_TABLE = {
    "Gelu": (elementwise.gelu_grad, ALL),
    "FastGelu": (elementwise.fast_gelu_grad, (0,)),
}

REGISTRY: dict[tuple[str, str], GradientRule] = {
    **{("", op): GradientRule(fn, slots) for op, (fn, slots) in TABLE.items()},
    **{("com.microsoft", op): GradientRule(fn, slots) for op, (fn, slots) in CONTRIB_TABLE.items()},
}


def register_gradient(op_type: str, domain: str = "", differentiable: Sequence[int] | None = None):
    """Decorator: register `fn(ctx) -> [grad per input]` as the gradient of `domain::op_type`.

    `differentiable` lists the input slots that can carry a gradient (indices, shapes and axes
    never do); leave it None when every floating-point input can.
    """

    def decorate(fn):
        REGISTRY[(domain, op_type)] = GradientRule(
            fn, None if differentiable is None else tuple(differentiable)
        )
        return fn

    return decorate


def lookup(node: onnx.NodeProto) -> GradientRule | None:
    domain = "" if node.domain == "ai.onnx" else node.domain
    return REGISTRY.get((domain, node.op_type))
