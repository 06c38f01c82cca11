"""Where the CUDA provider would run a step's nodes, read from the kernel table without a GPU
(training/step_placement.py), and tools/step_report.py printing it."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from amp_rewrite.training.step_placement import low_without_kernel, place
from helpers import init, load_tool, make_model, node, tensor
from training_models import mlp


def _shape_logic_model():
    """x -> Shape -> Gather -> Reshape's shape (shape arithmetic ORT runs on CPU); NonZero over x
    (a data-dependent shape); EyeLike in float16 (no float16 CUDA kernel); Relu (a CUDA node)."""
    return make_model(
        [
            node("Shape", ["x"], ["shape"]),
            node("Gather", ["shape", "zero"], ["rows"], axis=0),
            node("Concat", ["rows", "minus_one"], ["target"], axis=0),
            node("Reshape", ["x", "target"], ["reshaped"]),
            node("NonZero", ["x"], ["where"]),
            node("Relu", ["reshaped"], ["y"]),
            node("EyeLike", ["h"], ["eye"]),
        ],
        [tensor("x", [2, 3]), tensor("h", [3, 3], TensorProto.FLOAT16)],
        [
            tensor("y", [2, 3]),
            tensor("where", [2, "n"], TensorProto.INT64),
            tensor("eye", [3, 3], TensorProto.FLOAT16),
        ],
        [init("zero", np.array([0], np.int64)), init("minus_one", np.array([-1], np.int64))],
    )


def _names(model, op_type):
    return {n.name or n.output[0] for n in model.graph.node if n.op_type == op_type}


def test_shape_arithmetic_nonzero_and_missing_kernels_are_found():
    model = _shape_logic_model()
    for k, n in enumerate(model.graph.node):
        n.name = f"n{k}_{n.op_type}"
    found = place(model)
    assert found.nodes == 7
    assert set(found.no_kernel) == {"n6_EyeLike"} and "float16" in found.no_kernel["n6_EyeLike"]
    # Gather and Concat compute Reshape's shape from Shape's host output: the CPU provider runs them
    assert set(found.on_cpu) == {"n1_Gather", "n2_Concat", "n6_EyeLike"}
    # NonZero waits for its count; EyeLike on CPU reads a device tensor; the shape logic reads host ones
    assert set(found.host_syncs) == {"n4_NonZero", "n6_EyeLike"}
    assert found.update_nodes == 0
    assert found.summary() == "step-report: 7 nodes, 1 without a CUDA kernel, 2 host syncs, 0 update nodes"
    assert set(low_without_kernel(model)) == {"n6_EyeLike"}


def test_shape_logic_fed_by_a_device_tensor_stays_on_the_device():
    model = _shape_logic_model()
    model.graph.node[0].op_type, model.graph.node[0].input[:] = "Cast", ["x"]  # no longer a host shape
    model.graph.node[0].attribute.add().CopyFrom(helper.make_attribute("to", TensorProto.INT64))
    assert not {n for n in place(model).on_cpu if "Gather" in n or "Concat" in n}


def test_the_cuda_step_of_an_mlp_counts_its_update_nodes(tmp_path):
    """Every update node (an If's branches too, the Casts of gradients into it) is counted once: over
    the weights' elements, on the scalars, or a Reshape. The per-tensor update's If reads its flag on the host; the flat one's
    Where does not, and runs over the weights in fewer kernels."""
    from amp_rewrite.training import AdamW, DynamicLossScale, build_step_graph
    from amp_rewrite.training.step_graph import apply_precision

    found = {}
    for flat in (False, True):
        step = build_step_graph(
            mlp((4, 8, 3)), "cross_entropy", AdamW(1e-3), DynamicLossScale(), flat_update=flat
        )
        step = apply_precision(step, "float16", "cuda")
        placed = found[flat] = place(step.model)
        opt = sum(1 for n in step.model.graph.node if n.name.startswith(("opt/", "scale/")))
        inner = sum(
            len(a.g.node)
            for n in step.model.graph.node
            if n.op_type == "If"
            for a in n.attribute
            if a.HasField("g")
        )
        update = [n for n in step.model.graph.node if n.name.startswith(("opt/", "scale/"))]
        widened = [  # the rewrite's Casts of a float16 gradient read by the update alone
            n
            for n in step.model.graph.node
            if n.op_type == "Cast"
            and n not in update
            and any(n.output[0] in u.input for u in update)
            and all(n.output[0] not in r.input for r in step.model.graph.node if r not in update)
        ]
        # flat, the float16 gradients are concatenated first and cast once, under scale/
        assert bool(widened) != flat and all(n.name.startswith("amp/") for n in widened)
        assert placed.update_nodes + placed.update_scalars + placed.update_aliases == opt + inner + len(
            widened
        )
        assert placed.update_nodes > 0 and placed.update_scalars > 0
        assert placed.no_kernel == {} and low_without_kernel(step.model) == {}
        assert (inner > 0) != flat
    assert any(
        "If" in name for name in found[False].host_syncs
    )  # the If(all_finite) gate reads its flag on the host
    assert found[True].host_syncs == {}
    assert found[True].update_nodes < found[False].update_nodes and found[True].update_aliases > 0


def test_step_report_prints_the_summary_last_and_refuses_a_bad_path(tmp_path, capsys):
    import onnx

    tool = load_tool("step_report")
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp((4, 8, 3)), path)
    assert tool.main([str(path), "--device", "cuda", "--precision", "float16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("nodes: ") and lines[-1].startswith("step-report: ")
    assert ", 0 without a CUDA kernel, " in lines[-1]
    assert tool.main([str(tmp_path / "missing.onnx")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing.onnx" in err


def test_the_bert_export_has_a_kernel_for_every_node_no_host_sync_and_few_update_kernels():
    pytest.importorskip("transformers", reason="the BERT export needs transformers")
    pytest.importorskip("sklearn", reason="its batches come from scikit-learn")
    import exported_training

    model, _, _ = exported_training.export_bert()
    step = load_tool("step_report").build_step(model, "cross_entropy", "float16", "cuda")
    found = place(step.model)
    assert found.no_kernel == {}
    # issue 38's targets: no host sync (no NonZero, no If), the update in at most 20 kernels whatever
    # the number of weights (test_flat_update counts them)
    assert found.host_syncs == {}
    assert not [n for n in step.model.graph.node if n.op_type in ("NonZero", "If")]
    assert len(step.weights) > 30 and found.update_nodes <= 20


def test_a_column_of_scalars_is_on_the_scalars_and_an_expanded_scalar_is_not():
    """The flat update's column of per-row factors reads scalars and writes as many elements: a
    launch on the scalars. An Expand of a scalar to the weights' size writes them all: a pass."""
    one_one = init("one_one", np.array([1, 1], np.int64))
    model = make_model(
        [
            node("Mul", ["lr", "decay"], ["keep"], name="opt/keep"),
            node("Reshape", ["keep", "one_one"], ["keep_1"], name="opt/keep_column"),
            node("Reshape", ["lr", "one_one"], ["lr_1"], name="opt/lr_column"),
            node("Concat", ["keep_1", "lr_1"], ["column"], name="opt/column", axis=0),
            node("Mul", ["rows", "column"], ["scaled"], name="opt/scaled"),
            node("Expand", ["lr", "size"], ["filled"], name="opt/filled"),
        ],
        [tensor("lr", []), tensor("rows", [2, 1000])],
        [tensor("scaled", [2, 1000]), tensor("filled", [1000])],
        [init("decay", np.array(0.5, np.float32)), one_one, init("size", np.array([1000], np.int64))],
    )
    found = place(model)
    assert (found.update_nodes, found.update_scalars, found.update_aliases) == (2, 2, 2)
