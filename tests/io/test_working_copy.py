"""The working copy: big weights borrowed (read, never changed), restored byte for byte, and an
in-memory rewrite equal to the rewrite from a file.
"""

import numpy as np
import onnx
from onnx import TensorProto

import amp_rewrite
from helpers import big_weights_model, check_both

F16 = TensorProto.FLOAT16


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
