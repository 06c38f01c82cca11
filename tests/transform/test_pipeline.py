"""The rewrite on small hand-built models: structure, validity and numerics of every case."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import amp_rewrite
from amp_rewrite.analysis.oplists import load_op_lists
from amp_rewrite.errors import UsageError
from helpers import (
    assert_close,
    check_both,
    init,
    make_model,
    mlp,
    node,
    random_feeds,
    run_ort,
    run_reference,
    tensor,
    weights,
)

F16 = TensorProto.FLOAT16


def nodes_by_name(model):
    return {n.name: n for n in model.graph.node}


def casts(model):
    return [n for n in model.graph.node if n.op_type == "Cast"]


def elem_types(model):
    """Element type of every tensor of the rewritten model, by strict shape inference."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    g = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*g.input, *g.output, *g.value_info)}
    types.update({t.name: t.data_type for t in g.initializer})
    return types


def test_mlp_structure_and_numerics():
    model = mlp()
    result = amp_rewrite.rewrite(model)
    out = result.model
    types = elem_types(out)
    for name in ("h", "h2", "r", "y", "W1", "W2", "b1"):
        assert types[name] == F16, name
    assert types["p"] == TensorProto.FLOAT and out.graph.output[0].name == "p"
    assert sorted((c.input[0], c.attribute[0].i) for c in casts(out)) == [
        ("x", F16),
        ("y", TensorProto.FLOAT),
    ]
    assert result.report.summary["allow_share"] == 1.0
    assert result.report.node("sm")["precision"] == "float32"
    check_both(model, out)


def test_input_model_is_not_modified_and_ir_opset_metadata_kept():
    model = mlp()
    model.metadata_props.add(key="author", value="me")
    before = model.SerializeToString()
    out = amp_rewrite.rewrite(model).model
    assert model.SerializeToString() == before
    assert out.ir_version == model.ir_version
    assert [(o.domain, o.version) for o in out.opset_import] == [
        (o.domain, o.version) for o in model.opset_import
    ]
    assert {p.key: p.value for p in out.metadata_props} == {"author": "me"}
    assert {n.name for n in model.graph.node} <= {n.name for n in out.graph.node}


def cnn():
    rng = np.random.default_rng(0)
    c = 4
    return make_model(
        [
            node("Conv", ["x", "Wc1", "bc1"], ["c1"], "conv1", pads=[1, 1, 1, 1]),
            node("BatchNormalization", ["c1", "s", "b", "m", "v"], ["bn"], "bn1"),
            node("Relu", ["bn"], ["r1"], "relu1"),
            node("MaxPool", ["r1"], ["p1"], "pool1", kernel_shape=[2, 2], strides=[2, 2]),
            node("Conv", ["p1", "Wc2"], ["c2"], "conv2", pads=[1, 1, 1, 1]),
            node("Relu", ["c2"], ["r2"], "relu2"),
            node("GlobalAveragePool", ["r2"], ["g"], "gap"),
            node("Flatten", ["g"], ["f"], "flat"),
            node("Gemm", ["f", "Wf", "bf"], ["logits"], "fc", transB=1),
        ],
        [tensor("x", ["N", 3, 8, 8])],
        [tensor("logits", ["N", 10])],
        [
            init("Wc1", weights(rng, c, 3, 3, 3)),
            init("bc1", weights(rng, c)),
            init("s", np.abs(weights(rng, c)) + 0.5),
            init("b", weights(rng, c)),
            init("m", weights(rng, c)),
            init("v", np.abs(weights(rng, c)) + 0.5),
            init("Wc2", weights(rng, c, c, 3, 3)),
            init("Wf", weights(rng, 10, c)),
            init("bf", weights(rng, 10)),
        ],
    )


def test_cnn_with_batchnorm_all_compute_in_float16():
    model = cnn()
    result = amp_rewrite.rewrite(model)
    types = elem_types(result.model)
    for name in ("c1", "bn", "r1", "p1", "c2", "r2", "g", "f"):
        assert types[name] == F16, name
    assert types["logits"] == TensorProto.FLOAT
    assert result.report.summary["allow_ops_low"] == 3
    assert len(casts(result.model)) == 2  # x in, logits out
    check_both(model, result.model)


def attention_block():
    rng = np.random.default_rng(0)
    d, h = 16, 2
    nodes = [
        node("LayerNormalization", ["x", "ln_s", "ln_b"], ["ln"], "ln", axis=-1),
        node("MatMul", ["ln", "Wq"], ["q"], "q"),
        node("MatMul", ["ln", "Wk"], ["k"], "k"),
        node("MatMul", ["ln", "Wv"], ["v"], "v"),
        node("Reshape", ["q", "heads"], ["qh"], "q_heads"),
        node("Transpose", ["qh"], ["qt"], "q_t", perm=[0, 2, 1, 3]),
        node("Reshape", ["k", "heads"], ["kh"], "k_heads"),
        node("Transpose", ["kh"], ["kt"], "k_t", perm=[0, 2, 3, 1]),
        node("Reshape", ["v", "heads"], ["vh"], "v_heads"),
        node("Transpose", ["vh"], ["vt"], "v_t", perm=[0, 2, 1, 3]),
        node("MatMul", ["qt", "kt"], ["scores"], "qk"),
        node("Mul", ["scores", "scale"], ["scaled"], "scale"),
        node("Add", ["scaled", "mask"], ["masked"], "mask_add"),
        node("Softmax", ["masked"], ["probs"], "softmax", axis=-1),
        node("MatMul", ["probs", "vt"], ["ctx"], "pv"),
        node("Transpose", ["ctx"], ["ctx_t"], "ctx_t", perm=[0, 2, 1, 3]),
        node("Reshape", ["ctx_t", "merge"], ["ctx_m"], "merge"),
        node("MatMul", ["ctx_m", "Wo"], ["o"], "out_proj"),
        node("Add", ["o", "x"], ["y"], "residual"),
    ]
    mask = np.where(np.tril(np.ones((4, 4))) > 0, 0.0, -1e4).astype(np.float32)
    inits = [
        init("ln_s", np.ones(d, np.float32)),
        init("ln_b", np.zeros(d, np.float32)),
        init("Wq", weights(rng, d, d)),
        init("Wk", weights(rng, d, d)),
        init("Wv", weights(rng, d, d)),
        init("Wo", weights(rng, d, d)),
        init("heads", np.array([0, 0, h, d // h], np.int64)),
        init("merge", np.array([0, 0, d], np.int64)),
        init("scale", np.array(1 / np.sqrt(d // h), np.float32)),
        init("mask", mask),
    ]
    return make_model(nodes, [tensor("x", ["B", 4, d])], [tensor("y", ["B", 4, d])], inits)


def test_attention_block_runs_in_float16_between_one_cast_in_and_one_out():
    """LayerNormalization (statistics in float32 by the spec) and Softmax are infer ops: the cut
    puts the whole block in float16, with a cast after the input and one before the output."""
    model = attention_block()
    result = amp_rewrite.rewrite(model)
    assert {n["precision"] for n in result.report.nodes} == {"float16"}
    assert "stash_type" in load_op_lists("float16").classify("", "LayerNormalization").reason
    assert sorted((c.input[0], c.attribute[0].i) for c in casts(result.model)) == [
        ("x", F16),
        ("y_fp16", TensorProto.FLOAT),
    ]
    check_both(model, result.model)


def test_attention_block_with_layernorm_and_softmax_denied_under_tf_placement():
    model = attention_block()
    result = amp_rewrite.rewrite(model, deny=["LayerNormalization", "Softmax"], placement="tf")
    report = result.report
    for name in ("q", "k", "v", "qk", "pv", "out_proj", "q_heads", "q_t"):
        assert report.node(name)["precision"] == "float16", name
    # Infer ops after an allow op that lead to a deny op or an output are not between two allow
    # ops: they stay float32 (TF's rule), so the residual stream stays float32.
    for name in ("ln", "scale", "mask_add", "softmax", "residual"):
        assert report.node(name)["precision"] == "float32", name
    types = elem_types(result.model)
    assert types["ln"] == TensorProto.FLOAT and types["probs"] == TensorProto.FLOAT
    # One cast per boundary tensor: ln -> fp16 (shared by q, k, v), scores -> fp32, probs -> fp16,
    # o -> fp32 for the residual.
    assert len(casts(result.model)) == 4
    check_both(model, result.model)


def test_shared_constant_read_by_both_colours_stays_valid():
    rng = np.random.default_rng(0)
    model = make_model(
        [
            node("MatMul", ["x", "W"], ["h"], "mm"),
            node("Add", ["h", "c"], ["h2"], "add_low"),
            node("MatMul", ["h2", "W"], ["a"], "mm2"),
            node("Pow", ["x2", "c"], ["p"], "pow_deny"),
            node("ReduceSum", ["p"], ["s"], "sum", keepdims=0),
        ],
        [tensor("x", [2, 4]), tensor("x2", [2, 4])],
        [tensor("a", [2, 4]), tensor("s", [])],
        [init("W", weights(rng, 4, 4)), init("c", np.array(2.0, np.float32))],
    )
    result = amp_rewrite.rewrite(model)
    out = result.model
    inits = {t.name: t.data_type for t in out.graph.initializer}
    assert inits["c"] == TensorProto.FLOAT and inits["c_fp16"] == F16
    assert nodes_by_name(out)["add_low"].input[1] == "c_fp16"
    assert nodes_by_name(out)["pow_deny"].input[1] == "c"
    assert result.report.summary["constants_duplicated"] == 1
    check_both(model, out)


def test_existing_casts_are_retargeted_not_chained():
    rng = np.random.default_rng(0)
    model = make_model(
        [
            node("Cast", ["ids"], ["idf"], "cast_in", to=TensorProto.FLOAT),
            node("MatMul", ["idf", "W"], ["h"], "mm"),
            node("Cast", ["half"], ["half32"], "cast_half", to=TensorProto.FLOAT),
            node("MatMul", ["half32", "W2"], ["h2"], "mm_half"),
            node("Softmax", ["half32"], ["sm"], "sm"),
        ],
        [tensor("ids", [2, 4], TensorProto.INT64), tensor("half", [2, 4], F16)],
        [tensor("h", [2, 4]), tensor("h2", [2, 4]), tensor("sm", [2, 4])],
        [init("W", weights(rng, 4, 4)), init("W2", weights(rng, 4, 4))],
    )
    out = amp_rewrite.rewrite(model).model
    by_name = nodes_by_name(out)
    assert by_name["cast_in"].attribute[0].i == F16  # all consumers low: retargeted
    assert by_name["mm_half"].input[0] == "half"  # reads the float16 source, no Cast(Cast(...))
    for cast in casts(out):
        producer = next((n for n in out.graph.node if cast.input[0] in n.output), None)
        assert producer is None or producer.op_type != "Cast", "cast chain"
    feeds = {
        "ids": np.array([[0, 1, 2, 3], [3, 2, 1, 0]], np.int64),
        "half": rng.standard_normal((2, 4)).astype(np.float16),
    }
    check_both(model, out, feeds)


@pytest.mark.even_if_worse
def test_tensor_feeding_many_consumers_gets_one_cast_per_type():
    rng = np.random.default_rng(0)
    consumers = [node("Softmax", ["h"], [f"s{i}"], f"sm{i}", axis=i % 2) for i in range(5)]
    consumers += [node("MatMul", ["h", "W"], [f"m{i}"], f"mm{i}") for i in range(1, 4)]
    model = make_model(
        [node("MatMul", ["x", "W"], ["h"], "mm0"), *consumers],
        [tensor("x", [4, 4])],
        [tensor(f"s{i}", [4, 4]) for i in range(5)] + [tensor(f"m{i}", [4, 4]) for i in range(1, 4)],
        [init("W", weights(rng, 4, 4))],
    )
    out = amp_rewrite.rewrite(model).model
    sources = [(c.input[0], c.attribute[0].i) for c in casts(out)]
    assert len(sources) == len(set(sources))
    assert sources.count(("h", TensorProto.FLOAT)) == 1
    check_both(model, out)


def test_low_precision_output_keeps_name_and_float32_type():
    rng = np.random.default_rng(0)
    model = make_model(
        [
            node("MatMul", ["x", "W"], ["y"], "mm"),
            node("Relu", ["y"], ["z"], "relu"),
            node("MatMul", ["z", "W"], ["w"], "mm2"),
        ],
        [tensor("x", [2, 4])],
        [tensor("y", [2, 4]), tensor("w", [2, 4])],
        [init("W", weights(rng, 4, 4))],
    )
    out = amp_rewrite.rewrite(model).model
    assert [o.name for o in out.graph.output] == ["y", "w"]
    assert all(o.type.tensor_type.elem_type == TensorProto.FLOAT for o in out.graph.output)
    assert elem_types(out)["y"] == TensorProto.FLOAT
    assert nodes_by_name(out)["relu"].input[0] == "y_fp16"  # low consumers read the renamed tensor
    check_both(model, out)


def test_no_keep_io_types_makes_io_float16():
    model = mlp()
    out = amp_rewrite.rewrite(model, keep_io_types=False).model
    assert out.graph.input[0].type.tensor_type.elem_type == F16
    assert out.graph.output[0].type.tensor_type.elem_type == F16
    onnx.checker.check_model(out, full_check=True)
    feeds = random_feeds(model)
    expected = run_ort(model, feeds)
    half = {k: v.astype(np.float16) for k, v in feeds.items()}
    assert_close(run_ort(out, half), expected)


def test_keep_fp32_node_by_name_and_regex():
    model = cnn()
    by_name = amp_rewrite.rewrite(model, keep_fp32_nodes=["conv2"]).report
    assert by_name.node("conv2")["precision"] == "float32" and by_name.node("conv1")["precision"] == "float16"
    by_regex = amp_rewrite.rewrite(model, keep_fp32_nodes=[r"conv\d"]).report
    assert by_regex.node("conv1")["precision"] == "float32" and by_regex.node("fc")["precision"] == "float16"
    aliased = amp_rewrite.rewrite(model, node_block_list=["fc"]).report
    assert aliased.node("fc")["precision"] == "float32"
    with pytest.raises(UsageError, match="regular expression"):
        amp_rewrite.rewrite(model, keep_fp32_nodes=["conv("])


def test_resize_scales_stay_float32_by_schema():
    rng = np.random.default_rng(0)
    model = make_model(
        [
            node("Conv", ["x", "W"], ["c"], "conv", pads=[1, 1, 1, 1]),
            node("Resize", ["c", "", "scales"], ["r"], "resize", mode="nearest"),
            node("Conv", ["r", "W"], ["y"], "conv2", pads=[1, 1, 1, 1]),
        ],
        [tensor("x", [1, 2, 4, 4])],
        [tensor("y", [1, 2, 8, 8])],
        [init("W", weights(rng, 2, 2, 3, 3)), init("scales", np.array([1, 1, 2, 2], np.float32))],
        opset=19,
    )
    result = amp_rewrite.rewrite(model)
    assert result.report.node("resize")["precision"] == "mixed"  # data float16, scales float32
    assert {t.name: t.data_type for t in result.model.graph.initializer}["scales"] == TensorProto.FLOAT
    check_both(model, result.model)


def test_if_subgraph_casts_land_inside_branches():
    rng = np.random.default_rng(0)
    then_graph = helper.make_graph(
        [node("MatMul", ["h", "W"], ["t1"], "then_mm"), node("Softmax", ["t1"], ["t_out"], "then_sm")],
        "then",
        [],
        [tensor("t_out", [2, 4])],
    )
    else_graph = helper.make_graph(
        [node("Relu", ["h"], ["e_out"], "else_relu")], "else", [], [tensor("e_out", [2, 4])]
    )
    model = make_model(
        [
            node("MatMul", ["x", "W"], ["h"], "mm"),
            node("If", ["cond"], ["y"], "if", then_branch=then_graph, else_branch=else_graph),
        ],
        [tensor("x", [2, 4]), tensor("cond", [], TensorProto.BOOL)],
        [tensor("y", [2, 4])],
        [init("W", weights(rng, 4, 4))],
    )
    out = amp_rewrite.rewrite(model).model
    top_level_casts = {c.output[0] for c in casts(out)}
    if_node = nodes_by_name(out)["if"]
    then_casts = [n for n in if_node.attribute[0].g.node if n.op_type == "Cast"]
    assert then_casts and all(c.output[0] not in top_level_casts for c in then_casts)
    for flag in (True, False):
        feeds = {"x": rng.standard_normal((2, 4)).astype(np.float32), "cond": np.array(flag)}
        check_both(model, out, feeds)


def test_bfloat16_target_is_valid_and_accurate_in_reference():
    model = mlp()
    result = amp_rewrite.rewrite(model, target="bfloat16", provider="any")  # CUDA has no bfloat16 LogSoftmax
    out = result.model
    onnx.checker.check_model(out, full_check=True)
    assert result.report.node("sm")["precision"] == "bfloat16"  # infer in the bfloat16 lists
    assert elem_types(out)["h"] == TensorProto.BFLOAT16
    feeds = random_feeds(model)
    assert_close(run_reference(out, feeds), run_ort(model, feeds), rtol=5e-2, atol=5e-2)


def test_deterministic_and_idempotent():
    model = attention_block()
    first = amp_rewrite.rewrite(model).model.SerializeToString()
    second = amp_rewrite.rewrite(model).model.SerializeToString()
    assert first == second
    once = onnx.load_from_string(first)
    twice = amp_rewrite.rewrite(once)
    assert twice.model.SerializeToString() == first
    assert not twice.changed


def test_unsorted_input_comes_out_sorted():
    original = mlp()
    model = onnx.ModelProto()
    model.CopyFrom(original)
    nodes = list(model.graph.node)[::-1]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    out = amp_rewrite.rewrite(model).model
    onnx.checker.check_model(out, full_check=True)
    feeds = random_feeds(model)
    assert_close(run_ort(out, feeds), run_ort(original, feeds))
    assert_close(run_reference(out, feeds), run_ort(original, feeds))


@pytest.mark.even_if_worse
def test_unknown_domain_stays_float32_with_a_note():
    rng = np.random.default_rng(0)
    model = make_model(
        [
            node("MatMul", ["x", "W"], ["h"], "mm"),
            node("Mystery", ["h"], ["y"], "custom", domain="com.example"),
        ],
        [tensor("x", [2, 4])],
        [tensor("y", [2, 4])],
        [init("W", weights(rng, 4, 4))],
        extra_opsets=[("com.example", 1)],
    )
    result = amp_rewrite.rewrite(model, check=False)
    assert any("com.example" in note and "float32" in note for note in result.report.notes)
    assert result.report.node("mm")["precision"] == "float16"
    assert result.model.graph.node[-1].input[0] != "h"  # the custom op reads a float32 cast


@pytest.mark.even_if_worse
def test_cast_of_an_integer_cast_reads_the_integer_directly():
    """A Cast(int -> float) read by both colours stays; the float16 readers get Cast(int -> float16)."""
    rng = np.random.default_rng(0)
    model = make_model(
        [
            node("Cast", ["ids"], ["idf"], "cast_in", to=TensorProto.FLOAT),
            node("MatMul", ["idf", "W"], ["h"], "mm"),
            node("Softmax", ["idf"], ["sm"], "sm"),
        ],
        [tensor("ids", [2, 4], TensorProto.INT64)],
        [tensor("h", [2, 4]), tensor("sm", [2, 4])],
        [init("W", weights(rng, 4, 4))],
    )
    out = amp_rewrite.rewrite(model).model
    by_name = nodes_by_name(out)
    assert by_name["cast_in"].attribute[0].i == TensorProto.FLOAT  # a float32 reader remains
    produced_by_cast = {c.output[0] for c in casts(out)}
    assert all(c.input[0] not in produced_by_cast for c in casts(out)), "cast chain"
    assert by_name["mm"].input[0] != "idf"
    check_both(model, out, {"ids": np.array([[0, 1, 2, 3], [3, 2, 1, 0]], np.int64)})


def _symbolic_mlp():
    """x [batch, seq, 16] -> MatMul(w [16, 16]) -> Relu -> y: every activation is batch*seq*16."""
    rng = np.random.default_rng(3)
    return make_model(
        [node("MatMul", ["x", "w"], ["h"], name="mm"), node("Relu", ["h"], ["y"], name="relu")],
        [tensor("x", ["batch", "seq", 16])],
        [tensor("y", ["batch", "seq", 16])],
        [init("w", rng.standard_normal((16, 16)).astype(np.float32) / 4)],
    )


def test_dims_size_the_estimated_bytes_and_leave_the_model_alone():
    """Bytes moved in float32, by hand: MatMul reads x and w and writes h, Relu reads h and writes y,
    4 bytes each; a symbolic dim counts 1 without --dim, its size with it."""
    model = _symbolic_mlp()
    plain = amp_rewrite.rewrite(model, placement="tf")  # TF's rule reads no sizes: same decisions
    sized = amp_rewrite.rewrite(model, placement="tf", dims={"batch": 8, "seq": 4})

    def by_hand(batch, seq):
        activation, weight = batch * seq * 16, 16 * 16
        return 4 * ((activation + weight + activation) + (activation + activation))

    assert plain.report.summary["bytes_moved_float32"] == by_hand(1, 1)
    assert sized.report.summary["bytes_moved_float32"] == by_hand(8, 4)
    assert sized.report.summary["dims"] == {"batch": 8, "seq": 4} and plain.report.summary["dims"] == {}
    assert "(tf placement, batch=8, seq=4)" in sized.report.to_text()
    assert sized.report.summary["flops_total"] == 2 * 8 * 4 * 16 * 16  # FLOPs are known with sizes
    # sizes change no TF decision: the model is the same bytes, its declarations symbolic still
    assert sized.model.SerializeToString() == plain.model.SerializeToString()
    assert sized.model.graph.input == model.graph.input and sized.model.graph.output == model.graph.output


def test_dims_move_the_cut_and_both_results_run():
    """Add(h [4, 64], z [k, 1, 64]) writes y [k, 4, 64]. In float16 it pays a cast of z and one of
    its k-times-wider output; in float32 one cast of h after the MatMul. Counting k as 1 the cut
    keeps the Add low; at k=8 the cast after the MatMul is cheaper."""
    rng = np.random.default_rng(5)
    model = make_model(
        [node("MatMul", ["x", "w"], ["h"], name="mm"), node("Add", ["h", "z"], ["y"], name="widen")],
        [tensor("x", [4, 64]), tensor("z", ["k", 1, 64])],
        [tensor("y", ["k", 4, 64])],
        [init("w", rng.standard_normal((64, 64)).astype(np.float32) / 8)],
    )
    plain = amp_rewrite.rewrite(model, placement="cost")
    sized = amp_rewrite.rewrite(model, placement="cost", dims={"k": 8})
    assert plain.report.node("widen")["precision"] == "float16"
    assert sized.report.node("widen")["precision"] == "float32"
    assert [n.input[0] for n in sized.model.graph.node if n.op_type == "Cast"] == ["x", "h"]
    feeds = {
        "x": rng.standard_normal((4, 64)).astype(np.float32),
        "z": rng.standard_normal((8, 1, 64)).astype(np.float32),
    }
    expected = run_ort(model, feeds)
    for result in (plain, sized):
        assert (
            result.model.graph.input == model.graph.input and result.model.graph.output == model.graph.output
        )
        assert_close(run_ort(result.model, feeds)[0], expected[0], rtol=2e-2, atol=2e-2)


def test_dims_above_the_shape_inference_limit_are_a_note(monkeypatch):
    from amp_rewrite.analysis import elemtypes

    monkeypatch.setattr(elemtypes, "SHAPE_INFERENCE_NODE_LIMIT", 1)
    result = amp_rewrite.rewrite(_symbolic_mlp(), dims={"batch": 8})
    assert result.report.summary["dims"] == {}
    assert any("dims batch=8 not used" in n for n in result.report.notes)


def test_a_dim_the_inputs_lack_is_a_usage_error():
    with pytest.raises(UsageError, match="'bacth': not a symbolic dim .* are batch, seq"):
        amp_rewrite.rewrite(_symbolic_mlp(), dims={"bacth": 8})


def test_an_unread_output_of_a_float16_node_is_declared_float16():
    """A GRU's Y_h that nothing reads (a TorchScript export declares it in value_info) has the GRU's
    type: declared float32 beside a float16 GRU, ONNX Runtime refuses to load the model."""
    rng = np.random.default_rng(0)
    hidden, size = 4, 3
    nodes = [
        node("GRU", ["x", "W", "R"], ["Y", "Y_h"], name="gru", hidden_size=hidden),
        node("Relu", ["Y"], ["out"]),
    ]
    inits = [init("W", weights(rng, 1, 3 * hidden, size)), init("R", weights(rng, 1, 3 * hidden, hidden))]
    model = make_model(nodes, [tensor("x", [5, 2, size])], [tensor("out", [5, 1, 2, hidden])], inits)
    model.graph.value_info.append(tensor("Y_h", [1, 2, hidden]))
    out = amp_rewrite.rewrite(model).model
    assert nodes_by_name(out)["gru"].input[0] != "x"  # the GRU runs in float16
    assert {v.name: v.type.tensor_type.elem_type for v in out.graph.value_info}["Y_h"] == F16
    check_both(model, out)
