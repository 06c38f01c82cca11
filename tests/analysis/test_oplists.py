"""Op lists: user files and arguments move ops between lists; a bad file names the file and the entry."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto

import amp_rewrite
from amp_rewrite.errors import OpListError
from helpers import init, load_tool, make_model, mlp, node, run_ort, tensor, weights

F16 = TensorProto.FLOAT16


def test_user_overrides_move_ops_between_lists(tmp_path):
    model = mlp()
    assert amp_rewrite.rewrite(model, allow=["LogSoftmax"]).report.node("sm")["precision"] == "float16"
    assert amp_rewrite.rewrite(model, op_block_list=["MatMul"]).report.summary["nodes_low"] == 0
    user = tmp_path / "mine.yaml"
    user.write_text("allow:\n  LogSoftmax: I know my logits are small\n")
    assert amp_rewrite.rewrite(model, op_lists=user).report.node("sm")["precision"] == "float16"
    with pytest.raises(OpListError, match="both"):
        amp_rewrite.rewrite(model, allow=["Softmax"], deny=["Softmax"])


@pytest.mark.parametrize(
    "text, message",
    [
        ("allow:\n  Softmax: a\ndeny:\n  Softmax: b\n", "'Softmax' is in both 'allow' and 'deny'"),
        ("alow:\n  Softmax: a\n", "unknown key 'alow'"),
        ("allow: [Softmax\n", "invalid YAML"),
        ("a: &x [1, 2]\nb: *x\n", "aliases are not allowed"),
        ("allow:\n  Softmax: 3\n", "must have a text reason"),
        ("- just a list\n", "must be a mapping"),
        ("target: float8\n", "target 'float8'"),
    ],
)
def test_bad_op_list_files_name_file_and_entry(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(OpListError) as info:
        amp_rewrite.rewrite(mlp(), op_lists=path)
    assert message in str(info.value) and "bad.yaml" in str(info.value)


@pytest.mark.even_if_worse
def test_list_evidence_measures_each_candidate_op_in_float16(tmp_path, capsys):
    """tools/list_evidence.py, whose figures the float16 list's LayerNormalization and Softmax
    reasons quote: per-node and whole-model errors are measured, small, and finite."""
    rng = np.random.default_rng(5)
    model = make_model(
        [
            node("LayerNormalization", ["x", "g", "b"], ["n"], "ln", axis=-1),
            node("MatMul", ["n", "W1"], ["s"], "mm1"),
            node("Softmax", ["s"], ["p"], "sm", axis=-1),
            node("MatMul", ["p", "W2"], ["y"], "mm2"),
        ],
        [tensor("x", ["B", 4, 8])],
        [tensor("y", ["B", 4, 8])],
        [
            init("g", np.ones(8, np.float32)),
            init("b", np.zeros(8, np.float32)),
            init("W1", weights(rng, 8, 8, scale=2.0)),
            init("W2", weights(rng, 8, 8)),
        ],
    )
    path = tmp_path / "block.onnx"
    onnx.save(model, path)
    args = [str(path), "--ops", "LayerNormalization,Softmax", "--dim", "B=2", "--markdown"]
    tool = load_tool("list_evidence", needs=("bench_placement", "bench_rewrite", "exported", "synthetic"))
    assert tool.main(args) == 0
    lines = capsys.readouterr().out.splitlines()[2:]  # after the Markdown head
    rows = {cells[1]: cells for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines)}
    assert set(rows) == {"(all deny)", "LayerNormalization", "Softmax", "all of them"}
    ln, softmax = rows["LayerNormalization"], rows["Softmax"]
    assert ln[2] == softmax[2] == "1"  # one node of each
    assert 0 < float(ln[4]) <= float(ln[3]) < 5e-3 and 0 < float(softmax[3]) < 5e-3  # spec <= all-float16
    assert int(rows["all of them"][5]) < int(rows["(all deny)"][5])  # fewer casts with both in float16
    assert all(float(row[7]) > 0.9999 for row in rows.values())
    # "k/n": output elements outside --validate's tolerance, counted here from the models' runs too
    feeds = tool.feeds_for(model, {"B": 2})
    [want] = run_ort(model, feeds)
    [got] = run_ort(
        amp_rewrite.rewrite(model, placement="cost", infer=["LayerNormalization", "Softmax"]).model, feeds
    )
    outside = int(np.sum(~(np.abs(got.astype(np.float64) - want) <= 1e-3 + 1e-2 * np.abs(want))))
    assert rows["all of them"][8] == f"{outside}/64"
    # and a model whose output differs by 1.0 in exactly 5 of its 64 elements counts 5
    delta = np.zeros((2, 4, 8), np.float32)
    delta.flat[[0, 9, 17, 40, 63]] = 1.0
    shifted = onnx.ModelProto()
    shifted.CopyFrom(model)
    shifted.graph.node[-1].output[0] = "y0"
    shifted.graph.node.append(node("Add", ["y0", "delta"], ["y"], "shift"))
    shifted.graph.initializer.append(init("delta", delta))
    expected = tool.validate.reference_outputs(model, [feeds], tool.Deployment(provider="cpu"))
    assert tool.model_error(shifted, expected, feeds)[2] == "5/64"
