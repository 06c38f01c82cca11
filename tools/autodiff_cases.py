"""One small forward graph per gradient rule, shared by the rule tests and the coverage tool.

Each case names the op it covers, its differentiable inputs (shapes; a string is a dynamic dim,
fed as `OpCase.batch`) and any constant inputs. The harness appends loss = sum(out * R) with a
fixed random R, so every output element gets a different upstream gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from onnx import TensorProto, helper, numpy_helper

N = "N"  # a dynamic batch dim


@dataclass
class OpCase:
    id: str
    op: str
    nodes: list | Callable[[int], list]  # NodeProtos, or a function of the float element type
    inputs: dict[str, list]
    consts: dict[str, np.ndarray] = field(default_factory=dict)
    outputs: tuple[str, ...] = ("y",)
    opsets: tuple[int, ...] = (17, 18)
    positive: tuple[str, ...] = ()  # inputs drawn from (0.5, 2): logs, roots, powers
    batch: int = 3
    feeds: Callable[[np.random.Generator], dict] | None = None  # custom values for some inputs
    rtol: float = 1e-5
    fd_elem: int = TensorProto.DOUBLE  # FLOAT where onnx.reference lacks double (Erf runs in float32)
    eps: float = 1e-6
    reference_runs_gradient: bool = True  # False: onnx.reference mis-evaluates the backward ops


def float32_fd(case: OpCase) -> OpCase:
    """Finite differences in float32: a larger step and tolerance (smooth ops only)."""
    case.fd_elem, case.eps, case.rtol = TensorProto.FLOAT, 1e-2, 2e-3
    return case


def n(op, inputs, outputs=("y",), **attrs):
    return helper.make_node(op, list(inputs), list(outputs), name=f"{op}_{outputs[0]}", **attrs)


def i64(*values):
    return np.array(values, dtype=np.int64)


def unary(op, shape=(N, 4), positive=False, **attrs):
    return OpCase(
        f"{op}", op, [n(op, ["x"], **attrs)], {"x": list(shape)}, positive=("x",) if positive else ()
    )


def binary(op, a_shape, b_shape, tag, positive=()):
    return OpCase(
        f"{op}-{tag}", op, [n(op, ["a", "b"])], {"a": list(a_shape), "b": list(b_shape)}, positive=positive
    )


BROADCASTS = {"same": ([N, 3], [N, 3]), "row": ([N, 3], [3]), "col": ([N, 3], [N, 1]), "scalar": ([2, 3], [])}

CASES: list[OpCase] = []
for _tag, (_a, _b) in BROADCASTS.items():
    CASES += [binary("Add", _a, _b, _tag), binary("Sub", _b, _a, _tag), binary("Mul", _a, _b, _tag)]
    CASES += [binary("Div", _a, _b, _tag, positive=("b",))]
CASES += [
    # b's first dim is symbolic and 1 at run time: the broadcast axes are found from Shape(b)
    OpCase(
        "Add-runtime-broadcast",
        "Add",
        [n("Add", ["a", "b"])],
        {"a": [N, 3], "b": ["M", 3]},
        feeds=lambda rng: {"b": rng.standard_normal((1, 3))},
    ),
    OpCase(
        "Mul-runtime-broadcast-rank",
        "Mul",
        [n("Mul", ["a", "b"])],
        {"a": [N, 2, 3], "b": ["M", 1]},
        feeds=lambda rng: {"b": rng.standard_normal((1, 1))},
    ),
    binary("Pow", [N, 3], [3], "row", positive=("a",)),
    binary("Pow", [N, 3], [], "scalar", positive=("a", "b")),
    unary("Sqrt", positive=True),
    unary("Reciprocal", positive=True),
    unary("Exp"),
    unary("Log", positive=True),
    float32_fd(unary("Erf")),
    unary("Tanh"),
    unary("Sigmoid"),
    unary("Relu"),
    unary("LeakyRelu", alpha=0.2),
    unary("Elu", alpha=0.7),
    unary("Selu"),
    float32_fd(unary("Celu", alpha=1.3)),
    unary("ThresholdedRelu", alpha=0.3),
    unary("HardSigmoid", alpha=0.3, beta=0.4),
    unary("Softplus"),
    unary("Softsign"),
    unary("Sin"),
    unary("Cos"),
    unary("Tan"),
    unary("Atan"),
    unary("Sinh"),
    unary("Cosh"),
    unary("Abs"),
    unary("Neg"),
    unary("Identity"),
    unary("Floor"),
    OpCase("Mish", "Mish", [n("Mish", ["x"])], {"x": [N, 4]}, opsets=(18,)),
    OpCase(
        "HardSwish",
        "HardSwish",
        [n("HardSwish", ["x"])],
        {"x": [N, 4]},
        feeds=lambda rng: {"x": rng.uniform(-5, 5, (3, 4))},
    ),
    float32_fd(OpCase("Gelu", "Gelu", [n("Gelu", ["x"])], {"x": [N, 4]}, opsets=(20,))),
    OpCase("Gelu-tanh", "Gelu", [n("Gelu", ["x"], approximate="tanh")], {"x": [N, 4]}, opsets=(20,)),
    OpCase("PRelu", "PRelu", [n("PRelu", ["x", "slope"])], {"x": [N, 3, 2], "slope": [3, 1]}),
    OpCase(
        "Clip",
        "Clip",
        [n("Clip", ["x", "lo", "hi"])],
        {"x": [N, 4]},
        consts={"lo": np.array(-0.5), "hi": np.array(0.6)},
    ),
    OpCase("Clip-min-only", "Clip", [n("Clip", ["x", "lo"])], {"x": [N, 4]}, consts={"lo": np.array(-0.5)}),
    float32_fd(
        OpCase(
            "Cast",
            "Cast",
            lambda t: [n("Cast", ["x"], ["h"], to=TensorProto.FLOAT), n("Cast", ["h"], to=t)],
            {"x": [N, 3]},
        )
    ),
    OpCase("Min", "Min", [n("Min", ["a", "b", "c"])], {"a": [N, 3], "b": [3], "c": [N, 1]}),
    OpCase("Max", "Max", [n("Max", ["a", "b"])], {"a": [N, 3], "b": [N, 3]}),
    OpCase("Max-tie", "Max", [n("Max", ["a", "a"])], {"a": [N, 3]}),
    OpCase("Sum", "Sum", [n("Sum", ["a", "b", "c"])], {"a": [N, 3], "b": [3], "c": [N, 1]}),
    OpCase("Mean", "Mean", [n("Mean", ["a", "b"])], {"a": [N, 3], "b": [3]}),
    OpCase(
        "Where",
        "Where",
        [n("Where", ["c", "a", "b"])],
        {"a": [N, 3], "b": [3]},
        consts={"c": np.array([[True, False, True]])},
    ),
    OpCase("Mul-self", "Mul", [n("Mul", ["a", "a"])], {"a": [N, 3]}),
    # linear algebra
    OpCase("MatMul-2d", "MatMul", [n("MatMul", ["a", "b"])], {"a": [N, 4], "b": [4, 3]}),
    OpCase("MatMul-batch-bcast", "MatMul", [n("MatMul", ["a", "b"])], {"a": [N, 2, 4], "b": [4, 3]}),
    OpCase("MatMul-bcast-both", "MatMul", [n("MatMul", ["a", "b"])], {"a": [2, 1, 2, 4], "b": [3, 4, 3]}),
    OpCase("MatMul-vec-mat", "MatMul", [n("MatMul", ["a", "b"])], {"a": [4], "b": [N, 4, 3]}),
    OpCase("MatMul-mat-vec", "MatMul", [n("MatMul", ["a", "b"])], {"a": [N, 3, 4], "b": [4]}),
    OpCase("MatMul-dot", "MatMul", [n("MatMul", ["a", "b"])], {"a": [4], "b": [4]}),
    *[
        OpCase(
            f"Gemm-tA{ta}-tB{tb}",
            "Gemm",
            [n("Gemm", ["a", "b", "c"], alpha=0.7, beta=1.3, transA=ta, transB=tb)],
            {"a": [4, 3] if ta else [3, 4], "b": [2, 4] if tb else [4, 2], "c": [2]},
        )
        for ta in (0, 1)
        for tb in (0, 1)
    ],
    OpCase(
        "Gemm-dynamic-batch",
        "Gemm",
        [n("Gemm", ["a", "b", "c"], transB=1)],
        {"a": [N, 4], "b": [2, 4], "c": [N, 1]},
    ),
    OpCase("Gemm-no-bias", "Gemm", [n("Gemm", ["a", "b"])], {"a": [N, 4], "b": [4, 2]}),
    OpCase(
        "Einsum-matmul",
        "Einsum",
        [n("Einsum", ["a", "b"], equation="bij,jk->bik")],
        {"a": [N, 2, 3], "b": [3, 4]},
    ),
    OpCase(
        "Einsum-summed-letter",
        "Einsum",
        [n("Einsum", ["a", "b"], equation="ij,kl->ik")],
        {"a": [2, 3], "b": [4, 2]},
    ),
    OpCase(
        "Einsum-ellipsis",
        "Einsum",
        [n("Einsum", ["a", "b"], equation="...ij,...jk->...ik")],
        {"a": [N, 2, 3], "b": [N, 3, 2]},
    ),  # onnx infers 1 for a broadcast 1 vs N ellipsis
    OpCase(
        "Einsum-implicit", "Einsum", [n("Einsum", ["a", "b"], equation="ij,jk")], {"a": [2, 3], "b": [3, 2]}
    ),
]


def reduce_case(op, axes, keepdims, tag, opsets=(17, 18), positive=False):
    """Reduce with axes as attribute below the opset where they became an input, else as input."""

    def build(opset):
        since = 13 if op == "ReduceSum" else 18
        if axes is None:
            return [n(op, ["x"], keepdims=keepdims)], {}
        if opset >= since:
            return [n(op, ["x", "axes"], keepdims=keepdims)], {"axes": i64(*axes)}
        return [n(op, ["x"], axes=list(axes), keepdims=keepdims)], {}

    return [
        OpCase(
            f"{op}-{tag}-op{opset}",
            op,
            build(opset)[0],
            {"x": [N, 3, 2]},
            consts=build(opset)[1],
            opsets=(opset,),
            positive=("x",) if positive else (),
        )
        for opset in opsets
    ]


for _op in (
    "ReduceSum",
    "ReduceMean",
    "ReduceMax",
    "ReduceMin",
    "ReduceSumSquare",
    "ReduceL2",
    "ReduceLogSumExp",
):
    CASES += reduce_case(_op, [1], 0, "axis1")
    CASES += reduce_case(_op, [0, -1], 1, "keep")
CASES += reduce_case("ReduceMean", None, 0, "all")
CASES += reduce_case("ReduceL1", [2], 1, "axis2")
CASES += reduce_case("ReduceLogSum", [1], 0, "axis1", positive=True)
CASES += reduce_case("ReduceProd", [1], 0, "axis1", positive=True)

CASES += [
    OpCase("CumSum", "CumSum", [n("CumSum", ["x", "axis"])], {"x": [N, 4]}, consts={"axis": np.array(1)}),
    OpCase(
        "CumSum-rev-excl",
        "CumSum",
        [n("CumSum", ["x", "axis"], exclusive=1, reverse=1)],
        {"x": [N, 4]},
        consts={"axis": np.array(-1)},
    ),
    # shapes
    OpCase("Reshape", "Reshape", [n("Reshape", ["x", "s"])], {"x": [N, 6]}, consts={"s": i64(0, 2, 3)}),
    OpCase("Flatten", "Flatten", [n("Flatten", ["x"], axis=2)], {"x": [N, 2, 3]}),
    OpCase("Squeeze", "Squeeze", [n("Squeeze", ["x", "ax"])], {"x": [N, 1, 3]}, consts={"ax": i64(1)}),
    OpCase("Unsqueeze", "Unsqueeze", [n("Unsqueeze", ["x", "ax"])], {"x": [N, 3]}, consts={"ax": i64(0, -1)}),
    OpCase("Transpose", "Transpose", [n("Transpose", ["x"], perm=[2, 0, 1])], {"x": [N, 2, 3]}),
    OpCase("Transpose-default", "Transpose", [n("Transpose", ["x"])], {"x": [N, 2, 3]}),
    OpCase("Expand", "Expand", [n("Expand", ["x", "s"])], {"x": [3, 1]}, consts={"s": i64(2, 3, 4)}),
    OpCase("Tile", "Tile", [n("Tile", ["x", "r"])], {"x": [N, 3]}, consts={"r": i64(2, 3)}),
    OpCase(
        "Concat", "Concat", [n("Concat", ["a", "b", "c"], axis=1)], {"a": [N, 2], "b": [N, 3], "c": [N, 1]}
    ),
    OpCase("Concat-neg-axis", "Concat", [n("Concat", ["a", "b"], axis=-2)], {"a": [2, 3], "b": [N, 3]}),
    OpCase(
        "Split",
        "Split",
        [n("Split", ["x", "s"], ["y", "z"], axis=1)],
        {"x": [N, 5]},
        consts={"s": i64(2, 3)},
        outputs=("y", "z"),
    ),
    OpCase(
        "Split-one-output-used",
        "Split",
        [n("Split", ["x", "s"], ["y", "z"], axis=1)],
        {"x": [N, 5]},
        consts={"s": i64(2, 3)},
        outputs=("z",),
    ),
    OpCase(
        "Slice",
        "Slice",
        [n("Slice", ["x", "st", "en", "ax"])],
        {"x": [N, 5]},
        consts={"st": i64(1), "en": i64(4), "ax": i64(1)},
    ),
    OpCase(
        "Slice-steps-negative",
        "Slice",
        [n("Slice", ["x", "st", "en", "ax", "sp"])],
        {"x": [N, 6, 2]},
        consts={"st": i64(-1, 0), "en": i64(-100, 9), "ax": i64(1, 0), "sp": i64(-2, 2)},
    ),
    OpCase(
        "Gather-axis0-repeats",
        "Gather",
        [n("Gather", ["x", "i"])],
        {"x": [4, 3]},
        consts={"i": np.array([[0, 2], [2, -1]], dtype=np.int64)},
    ),
    OpCase(
        "Gather-one-hot-before-opset16",
        "Gather",
        [n("Gather", ["x", "i"], axis=1)],
        {"x": [N, 4, 2]},
        consts={"i": np.array([[3, 0], [-1, 3]], dtype=np.int64)},
        opsets=(13, 15),
    ),
    OpCase(
        "Gather-axis1",
        "Gather",
        [n("Gather", ["x", "i"], axis=1)],
        {"x": [N, 4, 2]},
        consts={"i": np.array([3, 0, 3], dtype=np.int32)},
    ),
    OpCase(
        "Gather-scalar-index",
        "Gather",
        [n("Gather", ["x", "i"], axis=1)],
        {"x": [N, 4]},
        consts={"i": np.array(2, dtype=np.int64)},
    ),
    OpCase(
        "GatherElements",
        "GatherElements",
        [n("GatherElements", ["x", "i"], axis=1)],
        {"x": [2, 3]},
        consts={"i": np.array([[0, 0, 2], [1, -1, 1]], dtype=np.int64)},
    ),
    OpCase(
        "GatherND",
        "GatherND",
        [n("GatherND", ["x", "i"])],
        {"x": [3, 2]},
        consts={"i": np.array([[0, 1], [2, 0], [0, 1]], dtype=np.int64)},
    ),
    OpCase(
        "ScatterElements",
        "ScatterElements",
        [n("ScatterElements", ["x", "i", "u"], axis=1)],
        {"x": [2, 3], "u": [2, 2]},
        consts={"i": np.array([[0, 2], [1, -3]], dtype=np.int64)},
    ),
    OpCase(
        "ScatterElements-add",
        "ScatterElements",
        [n("ScatterElements", ["x", "i", "u"], axis=0, reduction="add")],
        {"x": [2, 3], "u": [2, 3]},
        consts={"i": np.array([[0, 1, 1], [0, 0, 1]], dtype=np.int64)},  # repeats add up
    ),
    OpCase(
        "ScatterElements-max",
        "ScatterElements",
        [n("ScatterElements", ["x", "i", "u"], axis=0, reduction="max")],
        {"x": [2, 3], "u": [3, 3]},
        consts={"i": np.array([[0, 1, 1], [0, 0, 1], [1, 0, 0]], dtype=np.int64)},
        opsets=(18,),
    ),
    OpCase(
        "ScatterND-min",
        "ScatterND",
        [n("ScatterND", ["x", "i", "u"], reduction="min")],
        {"x": [3, 2], "u": [3]},
        consts={"i": np.array([[0, 1], [0, 1], [2, 0]], dtype=np.int64)},
        opsets=(18,),
    ),
    OpCase(
        "ScatterND",
        "ScatterND",
        [n("ScatterND", ["x", "i", "u"])],
        {"x": [3, 2], "u": [2, 2]},
        consts={"i": np.array([[2], [0]], dtype=np.int64)},
    ),
    OpCase(
        "ScatterND-add",
        "ScatterND",
        [n("ScatterND", ["x", "i", "u"], reduction="add")],
        {"x": [3, 2], "u": [3]},
        consts={"i": np.array([[0, 1], [0, 1], [2, 0]], dtype=np.int64)},
    ),
    OpCase(
        "Pad",
        "Pad",
        [n("Pad", ["x", "p", "v"])],
        {"x": [N, 3]},
        consts={"p": i64(0, 1, 1, 2), "v": np.array(0.5)},
    ),
    OpCase(
        "Pad-axes",
        "Pad",
        [n("Pad", ["x", "p", "", "ax"])],
        {"x": [N, 3, 2]},
        consts={"p": i64(2, 1), "ax": i64(-1)},
        opsets=(18,),
    ),
    # neural-network ops
    OpCase("Softmax", "Softmax", [n("Softmax", ["x"])], {"x": [N, 4]}),
    OpCase("Softmax-axis0", "Softmax", [n("Softmax", ["x"], axis=0)], {"x": [N, 4]}),
    OpCase("LogSoftmax", "LogSoftmax", [n("LogSoftmax", ["x"], axis=1)], {"x": [N, 4, 2]}),
    OpCase(
        "Conv",
        "Conv",
        [n("Conv", ["x", "w", "b"], pads=[1, 0, 1, 1])],
        {"x": [N, 2, 4, 3], "w": [3, 2, 3, 2], "b": [3]},
    ),
    OpCase(
        "Conv-stride-dilation",
        "Conv",
        [n("Conv", ["x", "w"], strides=[2, 2], dilations=[2, 1], pads=[1, 1, 0, 1])],
        {"x": [2, 2, 6, 5], "w": [2, 2, 2, 2]},
    ),
    OpCase(
        "Conv-stride-dynamic",
        "Conv",
        [n("Conv", ["x", "w"], strides=[2, 2])],
        {"x": [N, 2, "H", "W"], "w": [2, 2, 2, 2]},
        feeds=lambda rng: {"x": rng.standard_normal((2, 2, 5, 6))},
    ),
    # onnx.reference's grouped ConvTranspose slices the weight by output channels: ORT computes dX
    OpCase(
        "Conv-group",
        "Conv",
        [n("Conv", ["x", "w", "b"], group=2, pads=[1, 1, 1, 1])],
        {"x": [N, 4, 3, 3], "w": [6, 2, 2, 2], "b": [6]},
        reference_runs_gradient=False,
    ),
    OpCase(
        "Conv-depthwise-same",
        "Conv",
        [n("Conv", ["x", "w"], group=3, auto_pad="SAME_UPPER", strides=[2, 2])],
        {"x": [2, 3, 5, 4], "w": [3, 1, 3, 3]},
    ),
    OpCase(  # stride 1 pads k-1 at any size (PP-OCRv6 detector: 2x2 kernels, dynamic image)
        "Conv-same-dynamic",
        "Conv",
        [n("Conv", ["x", "w", "b"], auto_pad="SAME_UPPER")],
        {"x": [N, 2, "H", "W"], "w": [3, 2, 2, 2], "b": [3]},
        feeds=lambda rng: {"x": rng.standard_normal((2, 2, 4, 5))},
    ),
    OpCase("Conv-1d", "Conv", [n("Conv", ["x", "w"], strides=[2])], {"x": [N, 2, 7], "w": [3, 2, 3]}),
    # 4+ input channels and static sizes: dW as one product per kernel offset (rules/nn.py)
    OpCase(
        "Conv-offsets",
        "Conv",
        [n("Conv", ["x", "w", "b"], pads=[1, 0, 1, 1])],
        {"x": [N, 4, 5, 4], "w": [3, 4, 3, 2], "b": [3]},
    ),
    OpCase(
        "Conv-offsets-stride-dilation",
        "Conv",
        [n("Conv", ["x", "w"], strides=[2, 1], dilations=[2, 1], pads=[1, 1, 0, 1])],
        {"x": [2, 4, 7, 6], "w": [2, 4, 2, 3]},
    ),
    OpCase("Conv-offsets-1d", "Conv", [n("Conv", ["x", "w"], strides=[2])], {"x": [N, 4, 9], "w": [3, 4, 3]}),
    OpCase("Conv-offsets-3d", "Conv", [n("Conv", ["x", "w"])], {"x": [2, 4, 3, 4, 3], "w": [2, 4, 2, 2, 2]}),
    OpCase(
        "ConvTranspose",
        "ConvTranspose",
        [n("ConvTranspose", ["x", "w", "b"], strides=[2, 2], pads=[1, 0, 1, 1], output_padding=[1, 0])],
        {"x": [N, 3, 3, 4], "w": [3, 2, 3, 2], "b": [2]},
    ),
    OpCase(
        "ConvTranspose-dilation",
        "ConvTranspose",
        [n("ConvTranspose", ["x", "w"], dilations=[2, 1], strides=[1, 2])],
        {"x": [2, 4, 3, 3], "w": [4, 3, 2, 2]},
    ),
    OpCase(
        "MaxPool", "MaxPool", [n("MaxPool", ["x"], kernel_shape=[2, 2], strides=[2, 2])], {"x": [N, 2, 4, 4]}
    ),
    OpCase(
        "MaxPool-no-overlap-before-opset16",
        "MaxPool",
        [n("MaxPool", ["x"], kernel_shape=[2, 2], strides=[2, 2])],
        {"x": [N, 2, 4, 4]},
        opsets=(13,),
    ),
    OpCase(
        "MaxPool-tiled-3x3-stride3",
        "MaxPool",
        [n("MaxPool", ["x"], kernel_shape=[3, 3], strides=[3, 3])],
        {"x": [N, 2, 6, 3]},
    ),
    OpCase(
        "MaxPool-tiled-1d", "MaxPool", [n("MaxPool", ["x"], kernel_shape=[2], strides=[2])], {"x": [N, 3, 6]}
    ),
    OpCase(
        "MaxPool-untiled-odd-size",
        "MaxPool",
        [n("MaxPool", ["x"], kernel_shape=[2, 2], strides=[2, 2])],
        {"x": [N, 2, 5, 4]},
    ),
    OpCase(
        "MaxPool-ceil-mode",
        "MaxPool",
        [n("MaxPool", ["x"], kernel_shape=[2, 2], strides=[2, 1], ceil_mode=1)],
        {"x": [N, 2, 5, 4]},
    ),
    OpCase(
        "MaxPool-overlap-pads",
        "MaxPool",
        [n("MaxPool", ["x"], kernel_shape=[3, 3], strides=[1, 2], pads=[1, 1, 1, 1])],
        {"x": [N, 2, 4, 5]},
    ),
    OpCase(
        "AveragePool",
        "AveragePool",
        [n("AveragePool", ["x"], kernel_shape=[2, 2], strides=[2, 1])],
        {"x": [N, 2, 4, 3]},
    ),
    OpCase(
        "AveragePool-pads-exclude",
        "AveragePool",
        [n("AveragePool", ["x"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])],
        {"x": [N, 2, 5, 4]},
    ),
    OpCase(
        "AveragePool-pads-include",
        "AveragePool",
        [n("AveragePool", ["x"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=1)],
        {"x": [N, 2, 4, 4]},
    ),
    OpCase("GlobalAveragePool", "GlobalAveragePool", [n("GlobalAveragePool", ["x"])], {"x": [N, 2, 3, 2]}),
    OpCase("GlobalMaxPool", "GlobalMaxPool", [n("GlobalMaxPool", ["x"])], {"x": [N, 2, 3, 2]}),
    OpCase(
        "BatchNormalization-inference",
        "BatchNormalization",
        [n("BatchNormalization", ["x", "s", "b", "m", "v"])],
        {"x": [N, 3, 2, 2], "s": [3], "b": [3]},
        consts={"m": np.array([0.1, -0.2, 0.3]), "v": np.array([0.5, 1.5, 2.0])},
    ),
    OpCase(
        "BatchNormalization-training",
        "BatchNormalization",
        [n("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"], training_mode=1)],
        {"x": [N, 3, 2, 2], "s": [3], "b": [3]},
        consts={"m": np.array([0.1, -0.2, 0.3]), "v": np.array([0.5, 1.5, 2.0])},
    ),
    OpCase(
        "BatchNormalization-training-2d",
        "BatchNormalization",
        [n("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"], training_mode=1)],
        {"x": [N, 3], "s": [3], "b": [3]},
        consts={"m": np.zeros(3), "v": np.ones(3)},
        batch=4,
    ),
    OpCase(
        "InstanceNormalization",
        "InstanceNormalization",
        [n("InstanceNormalization", ["x", "s", "b"])],
        {"x": [N, 2, 3, 2], "s": [2], "b": [2]},
    ),
    float32_fd(
        OpCase(
            "GroupNormalization-21",
            "GroupNormalization",  # statistics stashed in float32
            [n("GroupNormalization", ["x", "s", "b"], num_groups=2)],
            {"x": [N, 4, 2, 2], "s": [4], "b": [4]},
            opsets=(21,),
        )
    ),
    OpCase(
        "LayerNormalization",
        "LayerNormalization",
        [n("LayerNormalization", ["x", "s", "b"])],
        {"x": [N, 2, 4], "s": [4], "b": [4]},
    ),
    OpCase(
        "LayerNormalization-axis1",
        "LayerNormalization",
        [n("LayerNormalization", ["x", "s"], axis=1, epsilon=1e-3)],
        {"x": [N, 2, 3], "s": [2, 3]},
    ),
    OpCase(
        "Dropout-inference", "Dropout", [n("Dropout", ["x", "r"])], {"x": [N, 4]}, consts={"r": np.array(0.3)}
    ),
    # losses
    OpCase(
        "SoftmaxCrossEntropyLoss-mean",
        "SoftmaxCrossEntropyLoss",
        [n("SoftmaxCrossEntropyLoss", ["x", "t"])],
        {"x": [N, 4]},
        consts={"t": i64(1, 3, 0)},
    ),
    OpCase(
        "SoftmaxCrossEntropyLoss-weights-ignore",
        "SoftmaxCrossEntropyLoss",
        [n("SoftmaxCrossEntropyLoss", ["x", "t", "w"], ignore_index=-1)],
        {"x": [N, 4]},
        consts={"t": i64(1, -1, 3), "w": np.array([0.5, 2.0, 1.0, 1.5])},
    ),
    OpCase(
        "SoftmaxCrossEntropyLoss-none-spatial",
        "SoftmaxCrossEntropyLoss",
        [n("SoftmaxCrossEntropyLoss", ["x", "t"], ["y", "lp"], reduction="none")],
        {"x": [N, 3, 2]},
        consts={"t": np.array([[0, 2], [1, 1], [2, 0]], dtype=np.int64)},
        outputs=("y", "lp"),
    ),
    OpCase(
        "SoftmaxCrossEntropyLoss-sum",
        "SoftmaxCrossEntropyLoss",
        [n("SoftmaxCrossEntropyLoss", ["x", "t"], reduction="sum")],
        {"x": [N, 4]},
        consts={"t": i64(1, 3, 0)},
    ),
    OpCase(
        "NegativeLogLikelihoodLoss",
        "NegativeLogLikelihoodLoss",
        [n("NegativeLogLikelihoodLoss", ["x", "t", "w"], ignore_index=2)],
        {"x": [N, 4]},
        consts={"t": i64(1, 2, 3), "w": np.array([0.5, 2.0, 1.0, 1.5])},
    ),
    OpCase(
        "MSE-primitives",
        "Pow",
        [n("Sub", ["p", "q"], ["d"]), n("Pow", ["d", "two"], ["sq"]), n("ReduceMean", ["sq"], keepdims=0)],
        {"p": [N, 3], "q": [N, 3]},
        consts={"two": np.array(2.0)},
    ),
]


# -- Resize: one case per mode family exporters emit (scales/sizes must stay float32/int64) ----------
def resize(tag, x, mode, coordinates, scales=None, sizes=None, **attrs):
    def nodes(elem):
        made = []
        if scales is not None:
            made.append(
                helper.make_node(
                    "Constant",
                    [],
                    ["scales"],
                    value=helper.make_tensor("scales", TensorProto.FLOAT, [len(scales)], scales),
                )
            )
        if sizes is not None:
            made.append(
                helper.make_node(
                    "Constant",
                    [],
                    ["sizes"],
                    value=helper.make_tensor("sizes", TensorProto.INT64, [len(sizes)], sizes),
                )
            )
        inputs = ["x", "", "scales"] if scales is not None else ["x", "", "", "sizes"]
        return made + [n("Resize", inputs, mode=mode, coordinate_transformation_mode=coordinates, **attrs)]

    return OpCase(f"Resize-{tag}", "Resize", nodes, {"x": x})


def resize_to_runtime_size():
    """sizes computed from Shape(x) at run time (FPN exports): the resized axes are found from the dims."""
    return [
        n("Shape", ["x"], ["lead"], start=0, end=2),
        helper.make_node(
            "Constant", [], ["hw"], value=helper.make_tensor("hw", TensorProto.INT64, [2], [5, 7])
        ),
        n("Concat", ["lead", "hw"], ["sizes"], axis=0),
        n("Resize", ["x", "", "", "sizes"], mode="linear", coordinate_transformation_mode="half_pixel"),
    ]


CASES += [
    resize(
        "nearest-asymmetric-floor",
        [N, 2, 3, 4],
        "nearest",
        "asymmetric",
        scales=[1, 1, 2, 2],
        nearest_mode="floor",
    ),
    resize("nearest-half-pixel-3x", [N, 2, 3, 2], "nearest", "half_pixel", scales=[1, 1, 3, 1.5]),
    resize(
        "nearest-down", [N, 1, 5, 6], "nearest", "asymmetric", scales=[1, 1, 0.5, 0.7], nearest_mode="ceil"
    ),
    resize(
        "nearest-half-pixel-sizes",
        [2, 2, 3, 4],
        "nearest",
        "half_pixel",
        sizes=[2, 2, 5, 9],
        nearest_mode="round_prefer_ceil",
    ),
    resize("linear-pytorch-half-pixel", [N, 2, 3, 4], "linear", "pytorch_half_pixel", scales=[1, 1, 2, 2]),
    resize("linear-half-pixel-down", [N, 2, 5, 6], "linear", "half_pixel", scales=[1, 1, 0.6, 0.5]),
    resize("linear-align-corners-sizes", [2, 2, 3, 4], "linear", "align_corners", sizes=[2, 2, 5, 7]),
    resize("linear-asymmetric-1d", [N, 2, 4], "linear", "asymmetric", scales=[1, 1, 2.5]),
    resize("cubic-half-pixel", [N, 2, 4, 5], "cubic", "half_pixel", scales=[1, 1, 2, 1.5]),
    resize(
        "cubic-exclude-outside-down",
        [N, 1, 6, 7],
        "cubic",
        "asymmetric",
        scales=[1, 1, 0.5, 2],
        cubic_coeff_a=-0.5,
        exclude_outside=1,
    ),
    resize("cubic-align-corners-sizes", [2, 2, 3, 4], "cubic", "align_corners", sizes=[2, 2, 5, 7]),
    OpCase("Resize-linear-runtime-sizes", "Resize", resize_to_runtime_size(), {"x": [N, 2, 3, 4]}),
]


# -- LSTM / GRU: T=3 steps, batch N, 2 features, hidden 3; every output read by the loss ----------
def recurrent(op, tag, direction="forward", bias=True, initial=(), outputs=("y", "yh", "yc"), **attrs):
    gates, d = (4 if op == "LSTM" else 3), (2 if direction == "bidirectional" else 1)
    inputs = {"x": [3, N, 2], "w": [d, gates * 3, 2], "r": [d, gates * 3, 3]}
    if bias:
        inputs["b"] = [d, 2 * gates * 3]
    inputs.update({name: [d, N, 3] for name in initial})
    slots = [
        "x",
        "w",
        "r",
        "b" if bias else "",
        "",
        "h0" if "h0" in initial else "",
        "c0" if "c0" in initial else "",
    ]
    while not slots[-1]:
        slots.pop()
    node = n(op, slots, outputs, hidden_size=3, direction=direction, **attrs)
    # onnx.reference runs no reverse-time Scan: ORT's float32 gradient is checked against the differences
    return OpCase(
        f"{op}-{tag}",
        op,
        [node],
        inputs,
        outputs=tuple(o for o in outputs if o),
        reference_runs_gradient=False,
    )


CASES += [
    recurrent("LSTM", "forward", initial=("h0", "c0")),
    recurrent("LSTM", "reverse-no-bias", direction="reverse", bias=False),
    recurrent("LSTM", "bidirectional-y-only", direction="bidirectional", initial=("h0",), outputs=("y",)),
    recurrent("LSTM", "yh-only", outputs=("", "yh")),
    recurrent("GRU", "forward", initial=("h0",), outputs=("y", "yh")),
    recurrent(
        "GRU", "reverse-linear-before-reset", direction="reverse", outputs=("y", "yh"), linear_before_reset=1
    ),
    recurrent("GRU", "bidirectional", direction="bidirectional", initial=("h0",), outputs=("y", "yh")),
    recurrent(
        "GRU",
        "bidirectional-linear-before-reset",
        direction="bidirectional",
        outputs=("y",),
        linear_before_reset=1,
    ),
]


# -- If: the branches read a and b from the enclosing graph; one branch taken per case ----------------
def if_case(tag, taken):
    def nodes(elem):
        then = helper.make_graph(
            [n("Mul", ["a", "b"], ["t0"]), n("Tanh", ["t0"], ["t"])],
            "then",
            [],
            [helper.make_tensor_value_info("t", elem, None)],
        )
        other = helper.make_graph(
            [n("Sub", ["a", "a"], ["e0"]), n("Add", ["e0", "a"], ["e"])],
            "else",
            [],
            [helper.make_tensor_value_info("e", elem, None)],
        )
        return [n("If", ["cond"], then_branch=then, else_branch=other)]

    return OpCase(f"If-{tag}", "If", nodes, {"a": [N, 3], "b": [3]}, consts={"cond": np.array(taken)})


CASES += [if_case("then", True), if_case("else-reads-one-capture", False)]


def if_reading_constant_nodes_case():
    """The branch reads Constant nodes of the enclosing graph (a scale and a Reshape shape), as
    silero-vad's branches do: their value tensors have no name of their own."""

    def nodes(elem):
        then = helper.make_graph(
            [
                n("Mul", ["a", "b"], ["t0"]),
                n("Mul", ["t0", "scale"], ["t1"]),
                n("Reshape", ["t1", "shape"], ["t2"]),
                n("Tanh", ["t2"], ["t"]),
            ],
            "then",
            [],
            [helper.make_tensor_value_info("t", elem, None)],
        )
        other = helper.make_graph(
            [n("Mul", ["a", "scale"], ["e"])], "else", [], [helper.make_tensor_value_info("e", elem, None)]
        )
        return [
            helper.make_node("Constant", [], ["scale"], value=helper.make_tensor("", elem, [1], [0.5])),
            helper.make_node("Constant", [], ["shape"], value=numpy_helper.from_array(i64(-1, 3), "")),
            n("If", ["cond"], then_branch=then, else_branch=other),
        ]

    return OpCase(
        "If-reads-constant-nodes", "If", nodes, {"a": [N, 3], "b": [3]}, consts={"cond": np.array(True)}
    )


CASES += [if_reading_constant_nodes_case()]
