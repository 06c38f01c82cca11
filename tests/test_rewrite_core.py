"""The rewrite on small hand-built models: structure, validity and numerics of every case."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import amp_rewrite
from amp_rewrite.errors import OpListError, UsageError
from helpers import (assert_close, init, make_model, node, random_feeds, run_ort, run_reference, tensor)

F16 = TensorProto.FLOAT16
rng = np.random.default_rng(0)


def weights(*shape, scale=0.3):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


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


def check_both(original, rewritten, feeds=None, rtol=2e-2, atol=2e-2):
    """Checker (full), then ORT and the reference evaluator against the float32 original."""
    onnx.checker.check_model(rewritten, full_check=True)
    feeds = feeds or random_feeds(original)
    expected = run_ort(original, feeds)
    assert_close(run_ort(rewritten, feeds), expected, rtol, atol)
    assert_close(run_reference(rewritten, feeds), expected, rtol, atol)
    return expected


def mlp():
    return make_model(
        [node("MatMul", ["x", "W1"], ["h"], "mm1"), node("Add", ["h", "b1"], ["h2"], "add1"),
         node("Relu", ["h2"], ["r"], "relu"), node("MatMul", ["r", "W2"], ["y"], "mm2"),
         node("Softmax", ["y"], ["p"], "sm", axis=-1)],
        [tensor("x", ["N", 8])], [tensor("p", ["N", 4])],
        [init("W1", weights(8, 16)), init("b1", weights(16)), init("W2", weights(16, 4))])


def test_mlp_structure_and_numerics():
    model = mlp()
    result = amp_rewrite.rewrite(model)
    out = result.model
    types = elem_types(out)
    for name in ("h", "h2", "r", "y", "W1", "W2", "b1"):
        assert types[name] == F16, name
    assert types["p"] == TensorProto.FLOAT and out.graph.output[0].name == "p"
    assert sorted((c.input[0], c.attribute[0].i) for c in casts(out)) == [("x", F16), ("y", TensorProto.FLOAT)]
    assert result.report.summary["allow_share"] == 1.0
    assert result.report.node("sm")["precision"] == "float32"
    check_both(model, out)


def big_weights_model():
    """Weights above the skeleton limit (1024 values), so an in-memory rewrite borrows them: one
    converted in place (with a doc string and metadata), one read in both precisions, one only
    in float32, and a big int64 tensor that is never converted."""
    w_shared = init("W_shared", weights(64, 64))
    w_doc = init("W_doc", weights(64, 64))
    w_doc.doc_string = "kept through the conversion"
    w_doc.metadata_props.add(key="origin", value="test")
    return make_model(
        [node("MatMul", ["x", "W_doc"], ["h"], "mm1"), node("MatMul", ["h", "W_shared"], ["y"], "mm2"),
         node("ReduceSum", ["W_shared"], ["s"], "sum_shared", keepdims=0),
         node("ReduceMean", ["W_f32"], ["m"], "mean_f32", keepdims=0),
         node("Gather", ["W_shared", "idx"], ["g"], "gather", axis=0),
         node("ReduceSum", ["g"], ["gs"], "sum_gathered", keepdims=0)],
        [tensor("x", ["N", 64])],
        [tensor("y", ["N", 64]), tensor("s", []), tensor("m", []), tensor("gs", [])],
        [w_doc, w_shared, init("W_f32", weights(48, 48)),
         init("idx", np.arange(2000, dtype=np.int64) % 64)])


def test_working_copy_restored_whole_is_the_model_byte_for_byte():
    from amp_rewrite import io as model_io

    model = big_weights_model()
    work, borrowed = model_io.working_copy(model)
    assert set(borrowed) == {"W_shared", "W_doc", "W_f32", "idx"}
    assert all(not t.raw_data for t in work.graph.initializer if t.name in borrowed)
    model_io.restore_borrowed(work.graph, borrowed, replaced=set())
    assert work.SerializeToString() == model.SerializeToString()


def test_in_memory_rewrite_borrows_big_weights_and_matches_the_rewrite_from_a_file(tmp_path):
    model = big_weights_model()
    before = model.SerializeToString()
    path = tmp_path / "big.onnx"
    path.write_bytes(before)
    in_memory = amp_rewrite.rewrite(model).model
    assert model.SerializeToString() == before  # borrowed, never changed
    from_file = amp_rewrite.rewrite(str(path)).model  # read here: rewritten in place, nothing borrowed
    assert in_memory.SerializeToString() == from_file.SerializeToString()
    tensors = {t.name: t for t in in_memory.graph.initializer}
    assert tensors["W_doc"].data_type == F16 and tensors["W_doc"].doc_string == "kept through the conversion"
    assert {p.key: p.value for p in tensors["W_doc"].metadata_props} == {"origin": "test"}
    assert tensors["W_f32"].data_type == TensorProto.FLOAT and tensors["W_f32"].raw_data
    assert (tensors["W_shared"].data_type, tensors["W_shared_fp16"].data_type) == (TensorProto.FLOAT, F16)
    assert onnx.numpy_helper.to_array(tensors["idx"]).tolist() == (np.arange(2000) % 64).tolist()
    check_both(model, in_memory)


def test_onnxruntime_float16_cast_matches_numpy_bit_for_bit():
    from amp_rewrite.transform import weights

    rng = np.random.default_rng(0)
    patterns = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    near_range = np.arange(0x33000000, 0x47800000, 9973, dtype=np.uint32)  # subnormals .. past 65504
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x477FE000, 0x477FEFFF,
                        0x477FF000, 0x387FC000, 0x33000001], dtype=np.uint32)  # ties, overflow, tiny
    values = np.concatenate([patterns, near_range, near_range | 0x80000000, special]).view(np.float32)
    assert values.size >= weights.ORT_CAST_MIN_VALUES and weights._ort_float16_cast() is not None
    with np.errstate(over="ignore"):
        ours, reference = weights.cast_values(values, F16), values.astype(np.float16)
    nan = np.isnan(reference)
    assert ours.dtype == np.float16 and (np.isnan(ours) == nan).all()
    assert (ours.view(np.uint16)[~nan] == reference.view(np.uint16)[~nan]).all()


def test_rewrite_is_the_same_with_numpy_doing_the_casts(monkeypatch):
    from amp_rewrite.transform import weights

    model = big_weights_model()
    fast = amp_rewrite.rewrite(model).model.SerializeToString()
    monkeypatch.setattr(weights, "_ort_float16_cast", lambda: None)
    assert amp_rewrite.rewrite(model).model.SerializeToString() == fast


def test_input_model_is_not_modified_and_ir_opset_metadata_kept():
    model = mlp()
    model.metadata_props.add(key="author", value="me")
    before = model.SerializeToString()
    out = amp_rewrite.rewrite(model).model
    assert model.SerializeToString() == before
    assert out.ir_version == model.ir_version
    assert [(o.domain, o.version) for o in out.opset_import] == [(o.domain, o.version) for o in model.opset_import]
    assert {p.key: p.value for p in out.metadata_props} == {"author": "me"}
    assert {n.name for n in model.graph.node} <= {n.name for n in out.graph.node}


def cnn():
    c = 4
    return make_model(
        [node("Conv", ["x", "Wc1", "bc1"], ["c1"], "conv1", pads=[1, 1, 1, 1]),
         node("BatchNormalization", ["c1", "s", "b", "m", "v"], ["bn"], "bn1"),
         node("Relu", ["bn"], ["r1"], "relu1"),
         node("MaxPool", ["r1"], ["p1"], "pool1", kernel_shape=[2, 2], strides=[2, 2]),
         node("Conv", ["p1", "Wc2"], ["c2"], "conv2", pads=[1, 1, 1, 1]),
         node("Relu", ["c2"], ["r2"], "relu2"),
         node("GlobalAveragePool", ["r2"], ["g"], "gap"),
         node("Flatten", ["g"], ["f"], "flat"),
         node("Gemm", ["f", "Wf", "bf"], ["logits"], "fc", transB=1)],
        [tensor("x", ["N", 3, 8, 8])], [tensor("logits", ["N", 10])],
        [init("Wc1", weights(c, 3, 3, 3)), init("bc1", weights(c)), init("s", np.abs(weights(c)) + 0.5),
         init("b", weights(c)), init("m", weights(c)), init("v", np.abs(weights(c)) + 0.5),
         init("Wc2", weights(c, c, 3, 3)), init("Wf", weights(10, c)), init("bf", weights(10))])


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
    d, h = 16, 2
    nodes = [
        node("LayerNormalization", ["x", "ln_s", "ln_b"], ["ln"], "ln", axis=-1),
        node("MatMul", ["ln", "Wq"], ["q"], "q"), node("MatMul", ["ln", "Wk"], ["k"], "k"),
        node("MatMul", ["ln", "Wv"], ["v"], "v"),
        node("Reshape", ["q", "heads"], ["qh"], "q_heads"), node("Transpose", ["qh"], ["qt"], "q_t", perm=[0, 2, 1, 3]),
        node("Reshape", ["k", "heads"], ["kh"], "k_heads"), node("Transpose", ["kh"], ["kt"], "k_t", perm=[0, 2, 3, 1]),
        node("Reshape", ["v", "heads"], ["vh"], "v_heads"), node("Transpose", ["vh"], ["vt"], "v_t", perm=[0, 2, 1, 3]),
        node("MatMul", ["qt", "kt"], ["scores"], "qk"), node("Mul", ["scores", "scale"], ["scaled"], "scale"),
        node("Add", ["scaled", "mask"], ["masked"], "mask_add"),
        node("Softmax", ["masked"], ["probs"], "softmax", axis=-1),
        node("MatMul", ["probs", "vt"], ["ctx"], "pv"), node("Transpose", ["ctx"], ["ctx_t"], "ctx_t", perm=[0, 2, 1, 3]),
        node("Reshape", ["ctx_t", "merge"], ["ctx_m"], "merge"), node("MatMul", ["ctx_m", "Wo"], ["o"], "out_proj"),
        node("Add", ["o", "x"], ["y"], "residual"),
    ]
    mask = np.where(np.tril(np.ones((4, 4))) > 0, 0.0, -1e4).astype(np.float32)
    inits = [init("ln_s", np.ones(d, np.float32)), init("ln_b", np.zeros(d, np.float32)),
             init("Wq", weights(d, d)), init("Wk", weights(d, d)), init("Wv", weights(d, d)), init("Wo", weights(d, d)),
             init("heads", np.array([0, 0, h, d // h], np.int64)), init("merge", np.array([0, 0, d], np.int64)),
             init("scale", np.array(1 / np.sqrt(d // h), np.float32)), init("mask", mask)]
    return make_model(nodes, [tensor("x", ["B", 4, d])], [tensor("y", ["B", 4, d])], inits)


def test_attention_block_keeps_layernorm_and_softmax_float32():
    model = attention_block()
    result = amp_rewrite.rewrite(model)
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
    model = make_model(
        [node("MatMul", ["x", "W"], ["h"], "mm"), node("Add", ["h", "c"], ["h2"], "add_low"),
         node("MatMul", ["h2", "W"], ["a"], "mm2"),
         node("Pow", ["x2", "c"], ["p"], "pow_deny"), node("ReduceSum", ["p"], ["s"], "sum", keepdims=0)],
        [tensor("x", [2, 4]), tensor("x2", [2, 4])], [tensor("a", [2, 4]), tensor("s", [])],
        [init("W", weights(4, 4)), init("c", np.array(2.0, np.float32))])
    result = amp_rewrite.rewrite(model)
    out = result.model
    inits = {t.name: t.data_type for t in out.graph.initializer}
    assert inits["c"] == TensorProto.FLOAT and inits["c_fp16"] == F16
    assert nodes_by_name(out)["add_low"].input[1] == "c_fp16"
    assert nodes_by_name(out)["pow_deny"].input[1] == "c"
    assert result.report.summary["constants_duplicated"] == 1
    check_both(model, out)


def test_existing_casts_are_retargeted_not_chained():
    model = make_model(
        [node("Cast", ["ids"], ["idf"], "cast_in", to=TensorProto.FLOAT),
         node("MatMul", ["idf", "W"], ["h"], "mm"),
         node("Cast", ["half"], ["half32"], "cast_half", to=TensorProto.FLOAT),
         node("MatMul", ["half32", "W2"], ["h2"], "mm_half"),
         node("Softmax", ["half32"], ["sm"], "sm")],
        [tensor("ids", [2, 4], TensorProto.INT64), tensor("half", [2, 4], F16)],
        [tensor("h", [2, 4]), tensor("h2", [2, 4]), tensor("sm", [2, 4])],
        [init("W", weights(4, 4)), init("W2", weights(4, 4))])
    out = amp_rewrite.rewrite(model).model
    by_name = nodes_by_name(out)
    assert by_name["cast_in"].attribute[0].i == F16  # all consumers low: retargeted
    assert by_name["mm_half"].input[0] == "half"  # reads the float16 source, no Cast(Cast(...))
    for cast in casts(out):
        producer = next((n for n in out.graph.node if cast.input[0] in n.output), None)
        assert producer is None or producer.op_type != "Cast", "cast chain"
    feeds = {"ids": np.array([[0, 1, 2, 3], [3, 2, 1, 0]], np.int64),
             "half": rng.standard_normal((2, 4)).astype(np.float16)}
    check_both(model, out, feeds)


def test_tensor_feeding_many_consumers_gets_one_cast_per_type():
    consumers = [node("Softmax", ["h"], [f"s{i}"], f"sm{i}", axis=i % 2) for i in range(5)]
    consumers += [node("MatMul", ["h", "W"], [f"m{i}"], f"mm{i}") for i in range(1, 4)]
    model = make_model([node("MatMul", ["x", "W"], ["h"], "mm0"), *consumers],
                       [tensor("x", [4, 4])],
                       [tensor(f"s{i}", [4, 4]) for i in range(5)] + [tensor(f"m{i}", [4, 4]) for i in range(1, 4)],
                       [init("W", weights(4, 4))])
    out = amp_rewrite.rewrite(model).model
    sources = [(c.input[0], c.attribute[0].i) for c in casts(out)]
    assert len(sources) == len(set(sources))
    assert sources.count(("h", TensorProto.FLOAT)) == 1
    check_both(model, out)


def test_low_precision_output_keeps_name_and_float32_type():
    model = make_model([node("MatMul", ["x", "W"], ["y"], "mm"), node("Relu", ["y"], ["z"], "relu"),
                        node("MatMul", ["z", "W"], ["w"], "mm2")],
                       [tensor("x", [2, 4])], [tensor("y", [2, 4]), tensor("w", [2, 4])], [init("W", weights(4, 4))])
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


def test_out_of_range_constant_keeps_consumer_float32_unless_clamped():
    model = make_model([node("MatMul", ["x", "W"], ["h"], "mm"), node("Add", ["h", "big"], ["a"], "add_big"),
                        node("Relu", ["a"], ["r"], "relu"), node("MatMul", ["r", "W"], ["y"], "mm2")],
                       [tensor("x", [2, 4])], [tensor("y", [2, 4])],
                       [init("W", weights(4, 4)), init("big", np.array([0, -1e9, 0, 0], np.float32))])
    result = amp_rewrite.rewrite(model)
    entry = result.report.node("add_big")
    assert entry["precision"] == "float32"
    assert "outside the float16 range" in entry["groups"]["T"]["reason"]
    assert {t.name: t.data_type for t in result.model.graph.initializer}["big"] == TensorProto.FLOAT
    check_both(model, result.model, rtol=2e-2, atol=1e9 * 1e-3)
    clamped = amp_rewrite.rewrite(model, clamp=True)
    assert clamped.report.node("add_big")["precision"] == "float16"
    assert clamped.report.summary["values_clamped"] == 1


def test_range_check_by_chunks_names_exactly_the_tensors_out_of_range():
    from amp_rewrite.analysis import graph
    from amp_rewrite.transform import weights

    rng = np.random.default_rng(1)
    tensors = [init(f"w{i}", rng.standard_normal(1000).astype(np.float32)) for i in range(700)]  # ~3 chunks
    for i, value in ((3, 7e4), (400, -1e9), (699, np.inf)):  # inf is representable: not out of range
        array = onnx.numpy_helper.to_array(tensors[i]).copy()
        array[17] = value
        tensors[i].CopyFrom(onnx.numpy_helper.from_array(array, f"w{i}"))
    g = helper.make_graph([], "g", [], [], tensors)
    scopes = [graph.Scope(g, None, None)]
    scan = weights.scan(scopes, {}, "float16", convert_to=F16)
    assert scan.out_of_range == {(0, "w3"): 7e4, (0, "w400"): 1e9}
    values = {t.name: onnx.numpy_helper.to_array(t).reshape(-1) for t in tensors}
    assert set(scan.converted) == {(0, name) for name in values} - {(0, "w3"), (0, "w400")}
    for (_, name), (converted, clamped) in scan.converted.items():  # converted a chunk at a time
        assert clamped == 0 and converted == values[name].astype(np.float16).tobytes(), name
    clamped = weights.scan(scopes, {}, "float16", clamp=True, convert_to=F16)
    assert not clamped.out_of_range and len(clamped.converted) == 700
    assert [(name, n) for (_, name), (_, n) in clamped.converted.items() if n] == [("w3", 1), ("w400", 1)]
    assert np.frombuffer(clamped.converted[(0, "w400")][0], np.float16)[17] == np.float16(-65504)


def test_weights_over_many_chunks_convert_once_and_run_the_same():
    """4 MB of weights (several scan chunks), one bias out of range in a late chunk: its reader
    stays float32, every other weight is converted once, and both models agree in ONNX Runtime."""
    from amp_rewrite.transform import weights

    rng = np.random.default_rng(3)
    nodes, inits, h = [], [], "x"
    for i in range(64):
        bias = (rng.standard_normal(128) * 0.1).astype(np.float32)
        if i == 50:
            bias[7] = 1e5
        inits += [init(f"W{i}", (rng.standard_normal((128, 128)) / 16).astype(np.float32)), init(f"b{i}", bias)]
        nodes += [node("MatMul", [h, f"W{i}"], [f"m{i}"], f"mm{i}"), node("Add", [f"m{i}", f"b{i}"], [f"a{i}"], f"add{i}"),
                  node("Tanh", [f"a{i}"], [f"h{i}"], f"tanh{i}")]
        h = f"h{i}"
    model = make_model(nodes, [tensor("x", [2, 128])], [tensor(h, [2, 128])], inits)
    assert 64 * 128 * 128 * 4 > 3 * weights.CHUNK_BYTES
    result = amp_rewrite.rewrite(model)
    assert result.report.node("add50")["precision"] == "float32"
    assert result.report.node("add49")["precision"] == "float16" and result.report.node("mm50")["precision"] == "float16"
    converted = {t.name for t in result.model.graph.initializer if t.data_type == F16}
    # b63: the last Add leads to no allow op, so it stays float32 (infer ops go low only between allow ops)
    assert converted == {f"W{i}" for i in range(64)} | ({f"b{i}" for i in range(64)} - {"b50", "b63"})
    assert result.report.summary["constants_converted"] == 126 and result.report.summary["constants_duplicated"] == 0
    check_both(model, result.model, rtol=5e-2, atol=5e-2)


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


def test_user_overrides_move_ops_between_lists(tmp_path):
    model = mlp()
    assert amp_rewrite.rewrite(model, allow=["Softmax"]).report.node("sm")["precision"] == "float16"
    assert amp_rewrite.rewrite(model, op_block_list=["MatMul"]).report.summary["nodes_low"] == 0
    user = tmp_path / "mine.yaml"
    user.write_text("allow:\n  Softmax: I know my logits are small\n")
    assert amp_rewrite.rewrite(model, op_lists=user).report.node("sm")["precision"] == "float16"
    with pytest.raises(OpListError, match="both"):
        amp_rewrite.rewrite(model, allow=["Softmax"], deny=["Softmax"])


@pytest.mark.parametrize("text, message", [
    ("allow:\n  Softmax: a\ndeny:\n  Softmax: b\n", "'Softmax' is in both 'allow' and 'deny'"),
    ("alow:\n  Softmax: a\n", "unknown key 'alow'"),
    ("allow: [Softmax\n", "invalid YAML"),
    ("a: &x [1, 2]\nb: *x\n", "aliases are not allowed"),
    ("allow:\n  Softmax: 3\n", "must have a text reason"),
    ("- just a list\n", "must be a mapping"),
    ("target: float8\n", "target 'float8'"),
])
def test_bad_op_list_files_name_file_and_entry(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(OpListError) as info:
        amp_rewrite.rewrite(mlp(), op_lists=path)
    assert message in str(info.value) and "bad.yaml" in str(info.value)


def test_resize_scales_stay_float32_by_schema():
    model = make_model(
        [node("Conv", ["x", "W"], ["c"], "conv", pads=[1, 1, 1, 1]),
         node("Resize", ["c", "", "scales"], ["r"], "resize", mode="nearest"),
         node("Conv", ["r", "W"], ["y"], "conv2", pads=[1, 1, 1, 1])],
        [tensor("x", [1, 2, 4, 4])], [tensor("y", [1, 2, 8, 8])],
        [init("W", weights(2, 2, 3, 3)), init("scales", np.array([1, 1, 2, 2], np.float32))], opset=19)
    result = amp_rewrite.rewrite(model)
    assert result.report.node("resize")["precision"] == "mixed"  # data float16, scales float32
    assert {t.name: t.data_type for t in result.model.graph.initializer}["scales"] == TensorProto.FLOAT
    check_both(model, result.model)


def test_if_subgraph_casts_land_inside_branches():
    then_graph = helper.make_graph(
        [node("MatMul", ["h", "W"], ["t1"], "then_mm"), node("Softmax", ["t1"], ["t_out"], "then_sm")],
        "then", [], [tensor("t_out", [2, 4])])
    else_graph = helper.make_graph([node("Relu", ["h"], ["e_out"], "else_relu")], "else", [], [tensor("e_out", [2, 4])])
    model = make_model(
        [node("MatMul", ["x", "W"], ["h"], "mm"),
         node("If", ["cond"], ["y"], "if", then_branch=then_graph, else_branch=else_graph)],
        [tensor("x", [2, 4]), tensor("cond", [], TensorProto.BOOL)], [tensor("y", [2, 4])], [init("W", weights(4, 4))])
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
    result = amp_rewrite.rewrite(model, target="bfloat16")
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


def test_unknown_domain_stays_float32_with_a_note():
    model = make_model([node("MatMul", ["x", "W"], ["h"], "mm"),
                        node("Mystery", ["h"], ["y"], "custom", domain="com.example")],
                       [tensor("x", [2, 4])], [tensor("y", [2, 4])], [init("W", weights(4, 4))],
                       extra_opsets=[("com.example", 1)])
    result = amp_rewrite.rewrite(model, check=False)
    assert any("com.example" in note and "float32" in note for note in result.report.notes)
    assert result.report.node("mm")["precision"] == "float16"
    assert result.model.graph.node[-1].input[0] != "h"  # the custom op reads a float32 cast


def test_cast_of_an_integer_cast_reads_the_integer_directly():
    """A Cast(int -> float) read by both colours stays; the float16 readers get Cast(int -> float16)."""
    model = make_model(
        [node("Cast", ["ids"], ["idf"], "cast_in", to=TensorProto.FLOAT),
         node("MatMul", ["idf", "W"], ["h"], "mm"),
         node("Softmax", ["idf"], ["sm"], "sm")],
        [tensor("ids", [2, 4], TensorProto.INT64)], [tensor("h", [2, 4]), tensor("sm", [2, 4])],
        [init("W", weights(4, 4))])
    out = amp_rewrite.rewrite(model).model
    by_name = nodes_by_name(out)
    assert by_name["cast_in"].attribute[0].i == TensorProto.FLOAT  # a float32 reader remains
    produced_by_cast = {c.output[0] for c in casts(out)}
    assert all(c.input[0] not in produced_by_cast for c in casts(out)), "cast chain"
    assert by_name["mm"].input[0] != "idf"
    check_both(model, out, {"ids": np.array([[0, 1, 2, 3], [3, 2, 1, 0]], np.int64)})
