"""bfloat16 read back from ONNX Runtime: numpy has no bfloat16, so ORT's `run` refuses a bfloat16
feed and cannot return a bfloat16 output ("No corresponding Numpy type for Tensor Type. bfloat16",
which made `--validate --target bfloat16` an internal error, exit 70). runtime.run binds them as
OrtValues and reads them back as ml_dtypes.bfloat16, on CPU as on CUDA."""

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto

from amp_rewrite import runtime
from amp_rewrite.checks import validate
from amp_rewrite.checks.pieces import open_checked
from amp_rewrite.cli import main
from amp_rewrite.deployment import Deployment
from helpers import make_model, mlp, node, tensor

BF16 = np.dtype(ml_dtypes.bfloat16)


def bfloat16_io():
    """x (bfloat16) -> float32 -> Tanh -> Mul -> bfloat16 y, and a float32 z beside it."""
    return make_model(
        [
            node("Cast", ["x"], ["x32"], "in", to=TensorProto.FLOAT),
            node("Tanh", ["x32"], ["t"], "tanh"),
            node("Cast", ["t"], ["t16"], "low", to=TensorProto.BFLOAT16),
            node("Cast", ["t16"], ["t32"], "high", to=TensorProto.FLOAT),
            node("Mul", ["t32", "t32"], ["z"], "square"),
            node("Cast", ["z"], ["y"], "out", to=TensorProto.BFLOAT16),
        ],
        [tensor("x", ["N", 5], TensorProto.BFLOAT16)],
        [tensor("y", ["N", 5], TensorProto.BFLOAT16), tensor("z", ["N", 5])],
    )


def test_bfloat16_feeds_and_outputs_round_trip_whole_and_in_pieces():
    model = bfloat16_io()
    x = np.linspace(-2, 2, 15, dtype=np.float32).reshape(3, 5).astype(BF16)
    expected = np.tanh(x.astype(np.float32)).astype(BF16).astype(np.float32) ** 2
    for size in (100, 2):  # one session, and pieces of two nodes with bfloat16 crossing the cuts
        session, _ = open_checked(model, "cpu", size=size)
        y, z = runtime.run(session, None, {"x": x})
        assert y.dtype == BF16 and y.shape == (3, 5) and z.dtype == np.float32
        np.testing.assert_array_equal(y, expected.astype(BF16))
        np.testing.assert_array_equal(z, expected)
    session, _ = open_checked(model, "cpu")
    [empty] = runtime.run(session, ["y"], {"x": np.zeros((0, 5), BF16)})
    assert empty.dtype == BF16 and empty.shape == (0, 5)


def test_validate_compares_bfloat16_outputs():
    model = bfloat16_io()
    samples = validate.as_declared(model, validate.synthesise(model, dims={"N": 4}, count=2))
    result = validate.validate(model, model, samples, deployment=Deployment(provider="cpu"))
    assert result.passed, result.to_text()
    y = next(s for s in result.runs["ort:CPUExecutionProvider"] if s["name"] == "y")
    assert y["max_abs"] == 0.0 and y["top1"] == 1.0  # judged as numbers, not as opaque bytes
    other = validate.compare([np.ones((2, 3), BF16)], [np.full((2, 3), 2, BF16)], rtol=1e-2, atol=1e-3)
    assert not other["passed"] and other["max_abs"] == 1.0


def test_cli_checks_a_rewrite_with_bfloat16_inputs_and_outputs(tmp_path, capsys):
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp(), path)
    common = [str(path), "--provider", "cpu", "--no-keep-io-types", "--dim", "N=4", "--dry-run", "--quiet"]
    for target in ("bfloat16", "float16"):
        assert main(common + ["--target", target, "--validate"]) == 0, capsys.readouterr().err
        assert main(common + ["--target", target, "--tolerance"]) == 0, capsys.readouterr().err
