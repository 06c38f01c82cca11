"""Where a CUDA training step's nodes would run, read without a GPU (amp_rewrite.training.step_placement).

    python tools/step_report.py MODEL.onnx --device cuda --precision float16
    python tools/step_report.py MODEL.onnx --loss mse --list 20

Builds the step graph the Trainer would build for the device (forward, loss, backward, finite
check, update, the precision rewrite with the CUDA kernel table) and prints its node count, the
nodes without a CUDA kernel, the nodes ONNX Runtime would place on the CPU, the host syncs and the
update/finite-check nodes (those running over the weights' elements; the scalar ones and the
Reshapes apart) and the most memory the update's own tensors hold at once; the last line is the summary
`step-report: N nodes, K without a CUDA kernel, S host syncs, U update nodes`.
"""

from __future__ import annotations

import argparse
import sys

from amp_rewrite.errors import AmpRewriteError


def build_step(model, loss: str = "cross_entropy", precision: str = "float16", device: str = "cuda"):
    """The step graph a default `Trainer(model, loss, precision=...)` builds for `device`, with no
    session: forward, loss, backward, finite check, AdamW update, the precision rewrite."""
    import onnx

    from amp_rewrite.training import arguments, parameters
    from amp_rewrite.training.loss_scale import resolve_loss_scale
    from amp_rewrite.training.optimizers import AdamW
    from amp_rewrite.training.prepare import prepare
    from amp_rewrite.training.step_graph import apply_precision, build_step_graph

    prepared, found = prepare(arguments.load_model(model, lambda line: None), lambda line: None)
    floats = [t.name for t in prepared.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    scale = resolve_loss_scale(1.0 if precision == "float32" else "dynamic")
    trainable = parameters.select(found, floats)
    step = build_step_graph(prepared, loss, AdamW(1e-3), scale, trainable, flat_update=device == "cuda")
    return apply_precision(step, precision, device)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--device", choices=("cuda",), default="cuda")
    parser.add_argument("--precision", choices=("float32", "float16", "bfloat16"), default="float16")
    parser.add_argument("--loss", default="cross_entropy")
    parser.add_argument("--list", type=int, default=10, help="nodes listed per finding (default 10)")
    args = parser.parse_args(argv)
    from amp_rewrite.training.step_placement import place, update_memory

    try:
        step = build_step(args.model, args.loss, args.precision, args.device)
        placement = place(step.model)
    except AmpRewriteError as error:
        print(f"step-report: {error}", file=sys.stderr)
        return 2
    print(f"nodes: {placement.nodes}")
    for title, found in (
        ("without a CUDA kernel", placement.no_kernel),
        ("placed on CPU by ONNX Runtime", placement.on_cpu),
        ("host syncs", placement.host_syncs),
    ):
        print(f"{title}: {len(found)}")
        for name, reason in list(found.items())[: args.list]:
            print(f"  {name}: {reason}")
    print(
        f"update/finite-check nodes: {placement.update_nodes} over the weights' elements "
        f"({placement.update_scalars} more on the scalars, {placement.update_aliases} Reshapes: no kernel)"
    )
    peak, weights = update_memory(step.model, step.weights)
    print(
        f"update memory: at most {peak / 2**20:.1f} MiB live in the update's own tensors over the weights, "
        f"{peak / weights:.1f}x the float32 weights' {weights / 2**20:.1f} MiB"
    )
    print(placement.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
