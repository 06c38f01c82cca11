"""Type groups read from the operator schemas (analysis.schemas), op by op.

The slots of a node that share a type parameter must share one element type, so they are one
group; a fixed-type parameter (Resize's scales) is a group that admits nothing else; an output
whose parameter no input shares (LayerNormalization's U, Cast's T2) is output-only.
"""

from __future__ import annotations

import pytest

from amp_rewrite.analysis.schemas import TypeGroup, signature, type_groups

F16, BF16, F32 = "tensor(float16)", "tensor(bfloat16)", "tensor(float)"


def groups(op, opset, n_inputs, n_outputs, domain=""):
    sig = signature(domain, op, opset)
    return sig, {g.type_param: g for g in type_groups(sig, n_inputs, n_outputs)}


def test_add_ties_both_inputs_and_its_output():
    sig, found = groups("Add", 17, 2, 1)
    assert list(found.values()) == [TypeGroup("T", (0, 1), (0,))]
    assert sig.admits("T", F16) and sig.admits("T", BF16)


def test_the_schema_in_force_at_the_opset_decides_the_types():
    """Add-7 has no bfloat16; Add-13 does. signature() picks the version in force at the opset."""
    old, _ = groups("Add", 12, 2, 1)
    new, _ = groups("Add", 17, 2, 1)
    assert (old.since_version, new.since_version) == (7, 14)
    assert old.admits("T", F16) and not old.admits("T", BF16) and new.admits("T", BF16)


def test_resize_scales_is_a_fixed_float_group_of_its_own():
    sig, found = groups("Resize", 13, 4, 1)
    assert found["T1"] == TypeGroup("T1", (0,), (0,))  # X and Y
    scales = found["tensor(float)@in:scales"]
    assert (scales.inputs, scales.outputs) == ((2,), ())
    assert sig.admits(scales.type_param, F32) and not sig.admits(scales.type_param, F16)
    assert not sig.admits("tensor(int64)@in:sizes", F16)


def test_layer_normalization_mean_and_inv_std_dev_are_a_separate_output_group():
    sig, found = groups("LayerNormalization", 17, 3, 3)
    assert found["T"] == TypeGroup("T", (0, 1, 2), (0,))
    assert found["U"] == TypeGroup("U", (), (1, 2)) and found["U"].output_only
    assert sig.admits("T", F16) and not sig.admits("U", F16)  # statistics may be float32 or bfloat16 only


def test_where_condition_is_a_bool_group_apart_from_the_values():
    sig, found = groups("Where", 16, 3, 1)
    assert found["B"] == TypeGroup("B", (0,), ())
    assert found["T"] == TypeGroup("T", (1, 2), (0,))
    assert sig.allowed["B"] == frozenset({"tensor(bool)"})


def test_cast_output_is_typed_by_its_attribute():
    _, found = groups("Cast", 13, 1, 1)
    assert not found["T1"].output_only and found["T2"].output_only


@pytest.mark.parametrize("n_inputs", [1, 2, 5])
def test_a_variadic_input_repeats_its_type_parameter(n_inputs):
    _, found = groups("Concat", 13, n_inputs, 1)
    assert found["T"] == TypeGroup("T", tuple(range(n_inputs)), (0,))


def test_ops_outside_onnx_come_from_onnx_runtime_and_unknown_ops_have_none():
    sig, found = groups("FusedMatMul", 1, 2, 1, domain="com.microsoft")
    assert found["T"] == TypeGroup("T", (0, 1), (0,)) and sig.admits("T", F16)
    assert signature("", "NoSuchOp", 17) is None
