"""A float32 run of a small graph's nodes in numpy, for the range run (`range_run.py`).

Opening an ONNX Runtime session costs about 70 us per node before the first run (0.94 s of a 9k-node
stack's 2 s rewrite) while the run itself takes 25 ms: for a range check that runs once, the
session is the cost. Here each node is one or two numpy calls on the synthesised sample (about
10 us each), so the same cone runs in a tenth of the time. Only the ops below run here, with the
attributes they are read with; a cone with anything else (another op, a domain, a subgraph, an
attribute form not handled) returns None and the range run opens ONNX Runtime's session as before.
The values are the run's to within float32 rounding: evidence compares them with a limit (512).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

_ERF_P, _ERF_A = 0.3275911, (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def _erf(x):
    """erf within 1.5e-7 (Abramowitz and Stegun 7.1.26): numpy has none, and a range needs no more."""
    t = 1.0 / (1.0 + _ERF_P * np.abs(x))
    poly = t * (_ERF_A[0] + t * (_ERF_A[1] + t * (_ERF_A[2] + t * (_ERF_A[3] + t * _ERF_A[4]))))
    return (np.sign(x) * (1.0 - poly * np.exp(-x * x))).astype(x.dtype)


def _divide(a, b):
    if np.issubdtype(a.dtype, np.integer):  # ONNX Div on integers truncates toward zero
        return (np.abs(a) // np.abs(b) * np.sign(a) * np.sign(b)).astype(a.dtype)
    return np.divide(a, b)


_ELEMENTWISE = {
    "Add": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "Div": _divide,
    "Pow": lambda a, b: np.power(a, b.astype(a.dtype)),
    "Sqrt": np.sqrt,
    "Exp": np.exp,
    "Log": np.log,
    "Tanh": np.tanh,
    "Erf": _erf,
    "Neg": np.negative,
    "Abs": np.abs,
    "Reciprocal": np.reciprocal,
    "Relu": lambda x: np.maximum(x, x.dtype.type(0)),
    "Sigmoid": lambda x: (1 / (1 + np.exp(-x))).astype(x.dtype),
    "Identity": lambda x: x,
    "MatMul": np.matmul,
    "Where": np.where,
    "Equal": np.equal,
    "Less": np.less,
    "Greater": np.greater,
    "Not": np.logical_not,
}


def _attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _reshape(data, shape, allowzero=0):
    shape = [int(d) for d in shape]
    if not allowzero:
        shape = [data.shape[i] if d == 0 else d for i, d in enumerate(shape)]
    return data.reshape(shape)


def _softmax(x, axis, opset):
    if opset < 13:  # the input is flattened to 2-D at `axis` (ONNX before opset 13)
        flat = x.reshape(int(np.prod(x.shape[:axis])), -1)
        return _softmax(flat, 1, 13).reshape(x.shape)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _layer_norm(x, scale, bias=None, axis=-1, epsilon=1e-5):
    axes = tuple(range(axis % x.ndim, x.ndim))
    centred = x - x.mean(axis=axes, keepdims=True)
    y = centred / np.sqrt((centred * centred).mean(axis=axes, keepdims=True) + np.float32(epsilon)) * scale
    return y + bias if bias is not None else y


def _gemm(a, b, c=None, alpha=1.0, beta=1.0, transA=0, transB=0):
    y = np.float32(alpha) * ((a.T if transA else a) @ (b.T if transB else b))
    return y + np.float32(beta) * c if c is not None else y


def _axes(node, inputs, opset, since):
    """Reduce/Squeeze/Unsqueeze axes: an input from opset `since`, an attribute before; None for
    all (absent or empty: a reduction's every axis)."""
    if opset >= since:
        value = inputs[1] if len(inputs) > 1 else None
    else:
        value = _attrs(node).get("axes")
    return tuple(int(a) for a in value) or None if value is not None else None  # empty: every axis


def _run_node(node, inputs: list, opset: int):
    """The node's outputs, or raise KeyError for what is not handled here."""
    op, a = node.op_type, _attrs(node)
    if op in _ELEMENTWISE and not a:
        return [_ELEMENTWISE[op](*inputs)]
    if op == "Constant" and "value" in a:
        return [numpy_helper.to_array(a["value"])]
    if op == "Reshape":
        return [_reshape(inputs[0], inputs[1], a.get("allowzero", 0))]
    if op == "Transpose":
        return [np.transpose(inputs[0], a.get("perm"))]
    if op == "Softmax":
        return [_softmax(inputs[0], a.get("axis", -1 if opset >= 13 else 1) % inputs[0].ndim, opset)]
    if op == "LayerNormalization" and len(node.output) == 1 and a.get("stash_type", 1) == 1:
        return [_layer_norm(*inputs, axis=a.get("axis", -1), epsilon=a.get("epsilon", 1e-5))]
    if op == "Gemm":
        return [_gemm(*inputs, **a)]
    if op == "Cast" and set(a) == {"to"}:
        return [inputs[0].astype(helper.tensor_dtype_to_np_dtype(a["to"]))]
    if op in ("ReduceMean", "ReduceSum") and not a.get("noop_with_empty_axes", 0):
        axes = _axes(node, inputs, opset, 13 if op == "ReduceSum" else 18)
        reduce = np.mean if op == "ReduceMean" else np.sum
        return [reduce(inputs[0], axis=axes, keepdims=bool(a.get("keepdims", 1))).astype(inputs[0].dtype)]
    if op == "Unsqueeze":
        return [np.expand_dims(inputs[0], _axes(node, inputs, opset, 13))]
    if op == "Squeeze":
        return [np.squeeze(inputs[0], _axes(node, inputs, opset, 13))]
    if op == "Concat":
        return [np.concatenate(inputs, axis=a["axis"])]
    if op == "Shape" and not a:
        return [np.array(inputs[0].shape, np.int64)]
    if op == "Gather" and inputs[1].dtype.kind == "i":
        return [np.take(inputs[0], inputs[1], axis=a.get("axis", 0))]
    raise KeyError(op)


def opset_of(model: onnx.ModelProto) -> int | None:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)


def run_nodes(nodes, initializers, opset: int | None, feeds: dict, wanted: list) -> list | None:
    """The arrays of `wanted` after running `nodes` in order (default domain, no subgraphs) on
    `initializers` and `feeds`, or None when they hold anything this does not run (the caller
    opens ONNX Runtime instead). A cone of a bigger graph runs without being copied into a model."""
    if opset is None:
        return None
    env = {t.name: _array(t) for t in initializers}
    env.update(feeds)
    try:
        with np.errstate(all="ignore"):  # inf and NaN are values here, as in ONNX Runtime
            for node in nodes:
                if node.domain not in ("", "ai.onnx"):
                    return None
                inputs = [env[x] if x else None for x in node.input]
                for name, value in zip(node.output, _run_node(node, inputs, opset)):
                    env[name] = np.asarray(value)
    except (KeyError, TypeError, ValueError, IndexError):  # an op or a form not handled here
        return None
    return [env[x] for x in wanted]


def _array(tensor: onnx.TensorProto) -> np.ndarray:
    """A weight's values: float32 bytes read in place (numpy_helper's general path costs 12 us a
    tensor, most of a 9k-node stack's 5,000 small weights)."""
    if tensor.data_type == onnx.TensorProto.FLOAT and tensor.HasField("raw_data"):
        return np.frombuffer(tensor.raw_data, dtype="<f4").reshape(tuple(tensor.dims))
    return numpy_helper.to_array(tensor)
