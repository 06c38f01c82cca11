"""Repeated node names (ONNX requires unique ones; OpenVINO's exporter writes 'F0::anon' fifteen
times, and ONNX Runtime loads it): the working copy gets fresh names, the input stays as it was,
and the report or the Trainer says so in one note.
"""

import numpy as np
import onnx

import amp_rewrite
from amp_rewrite.io import load
from amp_rewrite.training import SGD, Trainer
from helpers import check_both, mlp, weights


def _repeated(model: onnx.ModelProto) -> onnx.ModelProto:
    for node in model.graph.node:
        node.name = "F0::anon" if node.name != "sm" else "F0::anon_1"  # a fresh name must skip this one
    return model


def test_a_model_with_repeated_node_names_rewrites_with_a_note_and_the_input_unchanged(tmp_path):
    model = _repeated(mlp())
    before = model.SerializeToString()
    path = tmp_path / "repeated.onnx"
    path.write_bytes(before)
    for source in (model, str(path)):
        result = amp_rewrite.rewrite(source)
        names = [n.name for n in result.model.graph.node]
        assert len(names) == len(set(names)), names
        assert any(
            "renamed 3 nodes whose names repeat ('F0::anon' x4)" in note for note in result.report.notes
        )
        check_both(
            mlp(), result.model
        )  # ONNX Runtime refuses this input itself ("two nodes with same node name")
    assert model.SerializeToString() == before and path.read_bytes() == before


def test_renaming_is_deterministic_and_skips_names_in_use():
    loaded = load(_repeated(mlp()))
    assert [n.name for n in loaded.model.graph.node] == [
        "F0::anon",
        "F0::anon_2",
        "F0::anon_3",
        "F0::anon_4",
        "F0::anon_1",
    ]


def test_the_trainer_trains_a_model_with_repeated_node_names_and_says_so():
    model = _repeated(mlp())
    lines = []
    rng = np.random.default_rng(0)
    trainer = Trainer(
        model, loss="mse", optimizer=SGD(0.1), precision="float32", provider="cpu", verbose=False
    )
    feeds = {"x": weights(rng, 4, 8), "targets": weights(rng, 4, 4)}
    losses = [trainer.step(feeds).loss for _ in range(3)]
    assert losses[-1] < losses[0]
    import amp_rewrite.training.trainer as trainer_module

    original = trainer_module._say
    trainer_module._say = lines.append
    try:
        Trainer(model, loss="mse", optimizer=SGD(0.1), precision="float32", provider="cpu")
    finally:
        trainer_module._say = original
    assert any(line.startswith("amp-rewrite: renamed 3 nodes whose names repeat") for line in lines), lines
