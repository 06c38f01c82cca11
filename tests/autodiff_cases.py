"""One small forward graph per gradient rule, shared by the rule tests and the coverage tool.

Each case names the op it covers, its differentiable inputs (shapes; a string is a dynamic dim,
fed as `OpCase.batch`) and any constant inputs. The harness appends loss = sum(out * R) with a
fixed random R, so every output element gets a different upstream gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from onnx import TensorProto, helper

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


def float32_fd(case: OpCase) -> OpCase:
    """Finite differences in float32: a larger step and tolerance (smooth ops only)."""
    case.fd_elem, case.eps, case.rtol = TensorProto.FLOAT, 1e-2, 2e-3
    return case


def n(op, inputs, outputs=("y",), **attrs):
    return helper.make_node(op, list(inputs), list(outputs), name=f"{op}_{outputs[0]}", **attrs)


def i64(*values):
    return np.array(values, dtype=np.int64)


def unary(op, shape=(N, 4), positive=False, **attrs):
    return OpCase(f"{op}", op, [n(op, ["x"], **attrs)], {"x": list(shape)}, positive=("x",) if positive else ())


def binary(op, a_shape, b_shape, tag, positive=()):
    return OpCase(f"{op}-{tag}", op, [n(op, ["a", "b"])], {"a": list(a_shape), "b": list(b_shape)}, positive=positive)


BROADCASTS = {"same": ([N, 3], [N, 3]), "row": ([N, 3], [3]), "col": ([N, 3], [N, 1]), "scalar": ([2, 3], [])}

CASES: list[OpCase] = []
for _tag, (_a, _b) in BROADCASTS.items():
    CASES += [binary("Add", _a, _b, _tag), binary("Sub", _b, _a, _tag), binary("Mul", _a, _b, _tag)]
    CASES += [binary("Div", _a, _b, _tag, positive=("b",))]
CASES += [
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
    OpCase("HardSwish", "HardSwish", [n("HardSwish", ["x"])], {"x": [N, 4]},
           feeds=lambda rng: {"x": rng.uniform(-5, 5, (3, 4))}),
    float32_fd(OpCase("Gelu", "Gelu", [n("Gelu", ["x"])], {"x": [N, 4]}, opsets=(20,))),
    OpCase("Gelu-tanh", "Gelu", [n("Gelu", ["x"], approximate="tanh")], {"x": [N, 4]}, opsets=(20,)),
    OpCase("PRelu", "PRelu", [n("PRelu", ["x", "slope"])], {"x": [N, 3, 2], "slope": [3, 1]}),
    OpCase("Clip", "Clip", [n("Clip", ["x", "lo", "hi"])], {"x": [N, 4]},
           consts={"lo": np.array(-0.5), "hi": np.array(0.6)}),
    OpCase("Clip-min-only", "Clip", [n("Clip", ["x", "lo"])], {"x": [N, 4]}, consts={"lo": np.array(-0.5)}),
    float32_fd(OpCase("Cast", "Cast", lambda t: [n("Cast", ["x"], ["h"], to=TensorProto.FLOAT), n("Cast", ["h"], to=t)],
           {"x": [N, 3]})),
    OpCase("Min", "Min", [n("Min", ["a", "b", "c"])], {"a": [N, 3], "b": [3], "c": [N, 1]}),
    OpCase("Max", "Max", [n("Max", ["a", "b"])], {"a": [N, 3], "b": [N, 3]}),
    OpCase("Max-tie", "Max", [n("Max", ["a", "a"])], {"a": [N, 3]}),
    OpCase("Sum", "Sum", [n("Sum", ["a", "b", "c"])], {"a": [N, 3], "b": [3], "c": [N, 1]}),
    OpCase("Mean", "Mean", [n("Mean", ["a", "b"])], {"a": [N, 3], "b": [3]}),
    OpCase("Where", "Where", [n("Where", ["c", "a", "b"])], {"a": [N, 3], "b": [3]},
           consts={"c": np.array([[True, False, True]])}),
    OpCase("Mul-self", "Mul", [n("Mul", ["a", "a"])], {"a": [N, 3]}),
    # linear algebra
    OpCase("MatMul-2d", "MatMul", [n("MatMul", ["a", "b"])], {"a": [N, 4], "b": [4, 3]}),
    OpCase("MatMul-batch-bcast", "MatMul", [n("MatMul", ["a", "b"])], {"a": [N, 2, 4], "b": [4, 3]}),
    OpCase("MatMul-bcast-both", "MatMul", [n("MatMul", ["a", "b"])], {"a": [2, 1, 2, 4], "b": [3, 4, 3]}),
    OpCase("MatMul-vec-mat", "MatMul", [n("MatMul", ["a", "b"])], {"a": [4], "b": [N, 4, 3]}),
    OpCase("MatMul-mat-vec", "MatMul", [n("MatMul", ["a", "b"])], {"a": [N, 3, 4], "b": [4]}),
    OpCase("MatMul-dot", "MatMul", [n("MatMul", ["a", "b"])], {"a": [4], "b": [4]}),
    *[
        OpCase(f"Gemm-tA{ta}-tB{tb}", "Gemm",
               [n("Gemm", ["a", "b", "c"], alpha=0.7, beta=1.3, transA=ta, transB=tb)],
               {"a": [4, 3] if ta else [3, 4], "b": [2, 4] if tb else [4, 2], "c": [2]})
        for ta in (0, 1) for tb in (0, 1)
    ],
    OpCase("Gemm-dynamic-batch", "Gemm", [n("Gemm", ["a", "b", "c"], transB=1)], {"a": [N, 4], "b": [2, 4], "c": [N, 1]}),
    OpCase("Gemm-no-bias", "Gemm", [n("Gemm", ["a", "b"])], {"a": [N, 4], "b": [4, 2]}),
    OpCase("Einsum-matmul", "Einsum", [n("Einsum", ["a", "b"], equation="bij,jk->bik")], {"a": [N, 2, 3], "b": [3, 4]}),
    OpCase("Einsum-summed-letter", "Einsum", [n("Einsum", ["a", "b"], equation="ij,kl->ik")], {"a": [2, 3], "b": [4, 2]}),
    OpCase("Einsum-ellipsis", "Einsum", [n("Einsum", ["a", "b"], equation="...ij,...jk->...ik")],
           {"a": [N, 2, 3], "b": [N, 3, 2]}),  # onnx infers 1 for a broadcast 1 vs N ellipsis
    OpCase("Einsum-implicit", "Einsum", [n("Einsum", ["a", "b"], equation="ij,jk")], {"a": [2, 3], "b": [3, 2]}),
]
