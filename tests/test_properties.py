"""Property tests on random DAGs: the rewrite's invariants hold whatever the graph looks like."""

from collections import Counter

import numpy as np
import onnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import amp_rewrite
from amp_rewrite.analysis.oplists import load_op_lists
from helpers import init, make_model, node, run_ort, tensor

D = 4
UNARY = ["Relu", "Sigmoid", "Tanh", "Softmax", "Exp", "Neg", "Abs", "Identity", "Erf", "Sqrt", "Log"]
BINARY = ["Add", "Mul", "Sub", "Max", "Min"]
DENY = set(load_op_lists("float16").ops("deny"))


@st.composite
def random_models(draw):
    """A DAG over [2, D] float tensors: MatMuls with weights, unary and binary ops, shared constants."""
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    tensors, nodes, inits, used = ["x"], [], [init("c", np.array(0.5, np.float32))], Counter()
    for i in range(draw(st.integers(2, 14))):
        kind = draw(st.sampled_from(["matmul", "unary", "binary", "const", "cast", "layernorm"]))
        a = draw(st.sampled_from(tensors))
        out = f"t{i}"
        if kind == "matmul":
            inits.append(init(f"W{i}", (rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32)))
            nodes.append(node("MatMul", [a, f"W{i}"], [out], f"n{i}"))
        elif kind == "unary":
            op = draw(st.sampled_from(UNARY))
            source = a
            if op in ("Sqrt", "Log"):  # keep the domain positive
                nodes.append(node("Abs", [a], [f"abs{i}"], f"abs{i}"))
                nodes.append(node("Add", [f"abs{i}", "c"], [f"pos{i}"], f"pos{i}"))
                source = f"pos{i}"
            if op == "Exp":
                nodes.append(node("Tanh", [a], [f"tanh{i}"], f"tanh{i}"))
                source = f"tanh{i}"
            nodes.append(node(op, [source], [out], f"n{i}"))
        elif kind == "binary":
            b = draw(st.sampled_from(tensors))
            nodes.append(node(draw(st.sampled_from(BINARY)), [a, b], [out], f"n{i}"))
        elif kind == "const":
            nodes.append(node("Mul", [a, "c"], [out], f"n{i}"))
        elif kind == "cast":
            nodes.append(node("Cast", [a], [out], f"n{i}", to=onnx.TensorProto.FLOAT))
        else:
            inits += [init(f"s{i}", np.ones(D, np.float32)), init(f"b{i}", np.zeros(D, np.float32))]
            nodes.append(node("LayerNormalization", [a, f"s{i}", f"b{i}"], [out], f"n{i}"))
        for x in nodes[-1].input:
            used[x] += 1
        tensors.append(out)
    outputs = [t for t in tensors[1:] if not used[t]] or [tensors[-1]]
    return make_model(nodes, [tensor("x", [2, D])], [tensor(t, [2, D]) for t in outputs], inits)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_models(), st.booleans())
def test_rewrite_invariants(model, keep_io_types):
    result = amp_rewrite.rewrite(model, keep_io_types=keep_io_types)
    out = result.model
    onnx.checker.check_model(out, full_check=True)
    for entry in result.report.nodes:  # deny ops never low precision
        if entry["op_type"] in DENY:
            assert entry["precision"] == "float32", entry
    casts = Counter((n.input[0], n.attribute[0].i) for n in out.graph.node if n.name.startswith("amp/"))
    assert all(count == 1 for count in casts.values()), casts  # one cast per tensor and direction
    again = amp_rewrite.rewrite(out, keep_io_types=keep_io_types)  # idempotent
    assert again.model.SerializeToString() == out.SerializeToString()
    assert amp_rewrite.rewrite(model, keep_io_types=keep_io_types).model.SerializeToString() == \
        out.SerializeToString()  # deterministic
    x = np.random.default_rng(1).standard_normal((2, D)).astype(np.float32)
    expected = run_ort(model, {"x": x})
    feed = x if keep_io_types else x.astype(np.float16)
    for got, want in zip(run_ort(out, {"x": feed}), expected):
        assert got.shape == want.shape
        scale = 1 + np.nanmax(np.abs(want))
        assert np.nanmax(np.abs(got.astype(np.float64) - want)) <= 0.05 * scale
