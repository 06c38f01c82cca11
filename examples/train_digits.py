"""Train a small MLP on scikit-learn's digits (ships offline) in float32 and in float16 mixed
precision with amp-rewrite's Trainer, and print both test-accuracy curves.

    pip install scikit-learn        # or, in a checkout: pip install -e '.[examples]'
    python examples/train_digits.py --epochs 15

Both runs start from the same weights and see the same batches, so the curves differ only by
precision. Accuracy is measured on the float32 master weights (the exported inference model).

ONNX Runtime's CPU provider computes most float16 ops in float32, so on CPU the two ONNX Runtime
curves can coincide. `--reference` adds a third run: the same float16 step graph executed by
onnx.reference, which keeps float16 tensors in float16 as a GPU does (slower, still seconds).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from amp_rewrite.training import Adam, Trainer

IR_VERSION = 8  # ONNX Runtime refuses the newest IR versions onnx writes by default


def digits_split(seed: int = 0):
    """(x_train, y_train, x_test, y_test): 8x8 images scaled to [0, 1], a stratified 80/20 split."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        sys.exit("this example needs scikit-learn: pip install scikit-learn")
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    return x_train, y_train, x_test, y_test


def mlp_model(sizes=(64, 128, 10), seed: int = 0) -> onnx.ModelProto:
    """Gemm + Relu layers with torch.nn.Linear's default initialisation, logits as the output."""
    rng = np.random.default_rng(seed)
    nodes, weights = [], []
    current = "x"
    for i, (fan_in, fan_out) in enumerate(zip(sizes, sizes[1:])):
        bound = 1 / np.sqrt(fan_in)
        weights.append(
            numpy_helper.from_array(
                rng.uniform(-bound, bound, (fan_in, fan_out)).astype(np.float32), f"fc{i}.weight"
            )
        )
        weights.append(
            numpy_helper.from_array(rng.uniform(-bound, bound, fan_out).astype(np.float32), f"fc{i}.bias")
        )
        last = i == len(sizes) - 2
        linear = "logits" if last else f"fc{i}"
        nodes.append(
            helper.make_node("Gemm", [current, f"fc{i}.weight", f"fc{i}.bias"], [linear], name=f"fc{i}")
        )
        if not last:
            nodes.append(helper.make_node("Relu", [linear], [f"relu{i}"], name=f"relu{i}"))
            current = f"relu{i}"
    graph = helper.make_graph(
        nodes,
        "digits_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", sizes[0]])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", sizes[-1]])],
        weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)


def epoch_batches(x, y, batch_size: int, seed: int):
    """A function epoch -> shuffled batches, identical for every run with the same seed."""

    def batches(epoch: int):
        order = np.random.default_rng([seed, epoch]).permutation(len(x))
        return [
            {"x": x[order[i : i + batch_size]], "labels": y[order[i : i + batch_size]]}
            for i in range(0, len(x), batch_size)
        ]

    return batches


def accuracy(model: onnx.ModelProto, x, y) -> float:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"x": x})
    return float((logits.argmax(axis=1) == y).mean())


def train(
    precision: str,
    epochs: int,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    provider: str = "auto",
    progress: bool | None = False,
) -> list[float]:
    """Test accuracy after each epoch of training the digits MLP at `precision`."""
    x_train, y_train, x_test, y_test = digits_split(seed)
    trainer = Trainer(
        mlp_model(seed=seed), loss="cross_entropy", optimizer=Adam(lr), precision=precision, provider=provider
    )
    batches = epoch_batches(x_train, y_train, batch_size, seed)
    curve = []
    for epoch in range(epochs):
        trainer.fit(lambda _, epoch=epoch: batches(epoch), epochs=1, progress=progress)
        curve.append(accuracy(trainer.inference_model(), x_test, y_test))
    return curve


def train_on_reference(
    precision: str, epochs: int, batch_size: int = 64, lr: float = 3e-3, seed: int = 0
) -> list[float]:
    """As `train`, but every step graph run is onnx.reference's: true low-precision arithmetic."""
    x_train, y_train, x_test, y_test = digits_split(seed)
    trainer = Trainer(
        mlp_model(seed=seed), loss="cross_entropy", optimizer=Adam(lr), precision=precision, provider="cpu"
    )
    step = trainer.step_graph
    evaluator = ReferenceEvaluator(step.model)
    output_names = [o.name for o in step.model.graph.output]
    state, batches, curve = trainer.state(), epoch_batches(x_train, y_train, batch_size, seed), []
    for epoch in range(epochs):
        for feeds in batches(epoch):
            outputs = dict(
                zip(output_names, evaluator.run(None, {**state, **feeds, "opt/lr": np.float32(lr)}))
            )
            state = {name: outputs[next_name] for name, next_name in step.next_state.items()}
        trainer.load_state(state)
        curve.append(accuracy(trainer.inference_model(), x_test, y_test))
    return curve


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--precision",
        default="float16",
        choices=["float16", "bfloat16"],
        help="the mixed-precision run's low-precision type (bfloat16 needs CUDA on ONNX Runtime)",
    )
    parser.add_argument("--provider", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument(
        "--reference",
        action="store_true",
        help="also train the low-precision step graph on onnx.reference (true float16 arithmetic)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    run = (args.epochs, args.batch_size, args.lr)
    curves = {
        "float32": train("float32", *run, provider=args.provider, progress=False if args.quiet else None),
        f"{args.precision} AMP": train(
            args.precision, *run, provider=args.provider, progress=False if args.quiet else None
        ),
    }
    if args.reference:
        curves[f"{args.precision} AMP (onnx.reference)"] = train_on_reference(args.precision, *run)
    print("test accuracy after each epoch")
    print("epoch  " + "  ".join(f"{name:>14}" for name in curves))
    for epoch, row in enumerate(zip(*curves.values()), start=1):
        print(f"{epoch:>5}  " + "  ".join(f"{100 * a:>13.2f}%" for a in row))
    baseline = 100 * curves["float32"][-1]
    for name, curve in curves.items():
        print(f"final {name}: {100 * curve[-1]:.2f}% ({100 * curve[-1] - baseline:+.2f} points vs float32)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
