"""Op lists: user files and arguments move ops between lists; a bad file names the file and the entry."""

import pytest
from onnx import TensorProto

import amp_rewrite
from amp_rewrite.errors import OpListError
from helpers import mlp

F16 = TensorProto.FLOAT16


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
