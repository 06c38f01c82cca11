"""A large model runs as a chain of ONNX Runtime sessions: same numbers as one session."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from amp_rewrite.checks import pieces
from amp_rewrite.deployment import Deployment
from amp_rewrite.runtime import open_session
from helpers import FLOAT, init, load_tool, make_model, node, random_feeds, tensor


def _residual_with_if():
    """x -> 12 residual blocks; an If in the middle reads outer-scope tensors from earlier blocks."""
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(12):
        inits.append(init(f"w{i}", rng.standard_normal((4, 4)).astype(np.float32) * 0.5))
        nodes += [
            node("MatMul", [x, f"w{i}"], [f"m{i}"], name=f"mm{i}"),
            node("Tanh", [f"m{i}"], [f"t{i}"], name=f"tanh{i}"),
            node("Add", [x, f"t{i}"], [f"r{i}"], name=f"add{i}"),
        ]
        x = f"r{i}"
        if i == 5:
            then = helper.make_graph(
                [node("Mul", ["r0", "r5"], ["then_out"])],
                "then",
                [],
                [helper.make_tensor_value_info("then_out", FLOAT, None)],
            )
            other = helper.make_graph(
                [node("Sub", ["r5", "r1"], ["else_out"])],
                "else",
                [],
                [helper.make_tensor_value_info("else_out", FLOAT, None)],
            )
            nodes += [
                node("ReduceSum", ["r5"], ["s5"], name="sum", keepdims=0),
                node("Greater", ["s5", "zero"], ["c5"], name="gt"),
                node("If", ["c5"], ["if5"], name="if", then_branch=then, else_branch=other),
            ]
            inits.append(init("zero", np.zeros((), np.float32)))
            x = "if5"
    return make_model(
        nodes, [tensor("x", [2, 4])], [tensor(x, [2, 4]), tensor("r3", [2, 4]), tensor("x", [2, 4])], inits
    )  # the input is an output too, as calibration exposes it


def test_segmented_session_matches_one_session():
    model = _residual_with_if()
    feeds = random_feeds(model)
    whole, _ = open_session(model, "cpu")
    chain, used = pieces.open_checked(model, "cpu", size=4)
    assert isinstance(chain, pieces.SegmentedSession) and len(chain.pieces) > 5
    assert [o.name for o in chain.get_outputs()] == [o.name for o in whole.get_outputs()]
    for a, b in zip(chain.run(None, feeds), whole.run(None, feeds)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert chain.run(["r3"], feeds)[0].shape == (2, 4)
    # tensors exposed to the caller (calibration's, without a copy of the model): as one session has them
    exposed, _ = pieces.open_checked(model, "cpu", size=4, expose=["m3", "t7", "x", "w0", "nosuch"])
    names = [o.name for o in exposed.get_outputs()]
    assert names[1:] == ["r3", "x", "m3", "t7"] and len(exposed.pieces) > 5
    assert {o.type for o in exposed.get_outputs()} == {"tensor(float)"}
    whole_exposed, _ = open_session(pieces.with_outputs(model, ["m3", "t7"]), "cpu")
    for a, b in zip(exposed.run(names, feeds), whole_exposed.run(names, feeds)):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_small_or_unordered_model_runs_whole():
    model = _residual_with_if()
    assert pieces.plan(model, size=len(model.graph.node)) is None
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(reversed(nodes))
    assert pieces.plan(model, size=4) is None
    session, _ = pieces.open_checked(model, "cpu", size=4)
    assert not isinstance(session, pieces.SegmentedSession)


def test_synthetic_stack_validates_in_pieces():
    """A 1k-node stack's rewrite validates in pieces, with ORT's numbers for one session."""
    import amp_rewrite
    from amp_rewrite.checks import validate

    model = load_tool("synthetic").transformer_stack(1000)
    rewritten = amp_rewrite.rewrite(model).model
    samples = validate.synthesise(model, dims={"batch": 1, "seq": 4})
    result = validate.validate(
        model, rewritten, samples, deployment=Deployment(provider="cpu"), reference=False
    )
    whole, _ = open_session(rewritten, "cpu")
    [expected] = whole.run(None, validate.as_declared(rewritten, samples)[0])
    chain, _ = pieces.open_checked(rewritten, "cpu")
    [got] = chain.run(None, validate.as_declared(rewritten, samples)[0])
    np.testing.assert_allclose(got.astype(np.float64), expected.astype(np.float64), rtol=1e-2, atol=1e-2)
    assert result.runs["ort:CPUExecutionProvider"][0]["cosine"] > 0.999
    assert TensorProto.FLOAT16 in {i.data_type for i in rewritten.graph.initializer}
    # the float32 original: the chain computes what one session does (ORT fuses a little there)
    feeds = samples[0]
    original, _ = pieces.open_checked(model, "cpu")
    [want] = open_session(model, "cpu")[0].run(None, feeds)
    np.testing.assert_allclose(original.run(None, feeds)[0], want, rtol=1e-4, atol=1e-5)


def test_a_cache_reuses_the_sessions_of_unchanged_pieces_only():
    """The fallback's candidates differ in a few nodes: a piece whose bytes the last call opened
    keeps its session, a changed piece gets a new one, and the numbers are a fresh chain's."""
    model = _residual_with_if()
    feeds = random_feeds(model)
    cache: dict = {}
    first, _ = pieces.open_checked(model, "cpu", size=4, cache=cache)
    assert len(cache) == len(first.pieces)
    changed = model.__class__()
    changed.CopyFrom(model)
    last = next(n for n in reversed(changed.graph.node) if n.op_type == "Tanh")
    last.op_type = "Sigmoid"  # a node of a late piece: the pieces before it are the same bytes
    second, _ = pieces.open_checked(changed, "cpu", size=4, cache=cache)
    kept = [a.session is b.session for a, b in zip(first.pieces, second.pieces)]
    assert kept[0] and not all(kept) and len(cache) == len(second.pieces)
    fresh, _ = pieces.open_checked(changed, "cpu", size=4)
    for a, b in zip(second.run(None, feeds), fresh.run(None, feeds)):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(second.run(None, feeds)[0], first.run(None, feeds)[0])
