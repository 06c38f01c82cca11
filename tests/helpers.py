"""Small builders and runners shared by the tests.

Models are built at IR version 8 because ONNX Runtime refuses the IR version onnx writes by
default. Every rewrite test runs both models: `run_ort` (what users run) and `run_reference`
(onnx.reference keeps every tensor in its declared type, so it shows float16 overflow that ONNX
Runtime's CPU provider hides by computing in float32).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

IR_VERSION = 8
FLOAT = TensorProto.FLOAT


def tensor(name, shape, elem_type=FLOAT):
    """A graph input/output declaration."""
    return helper.make_tensor_value_info(name, elem_type, shape)


def init(name, array):
    """An initializer from a numpy array."""
    return numpy_helper.from_array(np.asarray(array), name)


def node(op, inputs, outputs, name=None, domain="", **attrs):
    return helper.make_node(op, inputs, outputs, name=name or f"{op}_{outputs[0]}", domain=domain, **attrs)


def make_model(nodes, inputs, outputs, initializers=(), opset=17, ir_version=IR_VERSION, extra_opsets=()):
    graph = helper.make_graph(list(nodes), "g", list(inputs), list(outputs), list(initializers))
    opsets = [helper.make_opsetid("", opset), *[helper.make_opsetid(d, v) for d, v in extra_opsets]]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=ir_version)
    onnx.checker.check_model(model, full_check=True)
    return model


def session(model):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def run_ort(model, feeds):
    return session(model).run(None, feeds)


def run_reference(model, feeds):
    return ReferenceEvaluator(model).run(None, feeds)


def random_feeds(model, seed=0, scale=1.0):
    """Random float32 inputs for every graph input (dims given as strings become 2)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    initializer_names = {i.name for i in model.graph.initializer}
    for value in model.graph.input:
        if value.name in initializer_names:
            continue
        t = value.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else 2 for d in t.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(t.elem_type)
        if np.issubdtype(dtype, np.floating):
            feeds[value.name] = (rng.standard_normal(shape) * scale).astype(dtype)
        elif dtype == np.bool_:
            feeds[value.name] = rng.integers(0, 2, shape).astype(bool)
        else:
            feeds[value.name] = rng.integers(0, 3, shape).astype(dtype)
    return feeds


def assert_close(actual, expected, rtol=1e-2, atol=1e-2):
    for a, e in zip(actual, expected):
        a = np.asarray(a)
        e = np.asarray(e)
        assert a.shape == e.shape, (a.shape, e.shape)
        np.testing.assert_allclose(a.astype(np.float64), e.astype(np.float64), rtol=rtol, atol=atol)
