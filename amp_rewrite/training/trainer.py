"""The loss-scaled training wrapper: step graph -> engine -> (optional) MPI reduction.

The step graph is built once (step_graph.py, engine.step_graph_for); the engine that runs it is
picked in one place from one resolved Deployment (engine.py: one session on CUDA, a gradient
session then the host update on CPU, the Allreduce between them over MPI) and owns the session(s)
and the one copy of the training state, updated in place by each step. The Trainer converts feeds,
keeps the skip policy (retry, the skip warning) and reads the state out only when asked (`state`,
`save`, `export`).
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import onnx
from onnx import numpy_helper

from amp_rewrite.api import rewrite
from amp_rewrite.autodiff import build_gradient_graph
from amp_rewrite.errors import TrainingError
from amp_rewrite.io import atomic_write
from amp_rewrite.progress import Progress
from amp_rewrite.training import arguments, engine, parameters, range_guard, skips, sparsity
from amp_rewrite.training import feeds as feed_checks
from amp_rewrite.training import precision as precision_line
from amp_rewrite.training.checkpoint import checkpoint_meta, read_checkpoint, write_checkpoint
from amp_rewrite.training.loss_scale import (
    SCALE_STATE,
    DynamicLossScale,
    initial_scale_state,
    resolve_loss_scale,
)
from amp_rewrite.training.optimizers import DEFAULT_OPTIMIZER, Optimizer
from amp_rewrite.training.prepare import prepare
from amp_rewrite.training.step_graph import LR_INPUT, STEP_STATE, StepGraph, build_step_graph


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One step: the unscaled loss, the loss scale after the step, whether the update was skipped,
    and how many times the batch was recomputed (retry mode)."""

    loss: float
    loss_scale: float
    skipped: bool
    retries: int = 0


class Trainer:
    """Mixed-precision training of an ONNX model on ONNX Runtime with loss scaling.

    `loss`: "cross_entropy" (first output = logits, feed `labels`; `losses.CrossEntropy(ignore_index,
    label_smoothing)` for torch's options), "mse" (feed `targets`), or the name of a scalar model
    output. `optimizer`: default AdamW(lr=1e-4, warmup_steps=10) (torch's AdamW at a fine-tuning rate, warmed up). `loss_scale`: "dynamic", a number, or a DynamicLossScale /
    FixedLossScale; "auto" (the default) is dynamic in float16/bfloat16 and none (a fixed 1) in
    float32. `on_nonfinite`: "skip" the update, or "retry" the batch at half the scale until
    finite or the scale is 1. `trainable` / `frozen`: names or full-match regexes over the float
    constants (default: the model's parameters, `training.parameters`). `gradient_builder`: a
    function with `amp_rewrite.autodiff.build_gradient_graph`'s signature (the default).
    `verbose`: say what is trained (one line on stderr). `threads`: CPU intra-op threads (0: ONNX
    Runtime's default). `tf32`: on CUDA, the step's float32 MatMul/Conv run in TF32 (ONNX Runtime's
    default, faster, float16's 10-bit mantissa); off (default), IEEE float32, as torch's matmuls.
    `cuda_graph`: on CUDA, capture the step once and replay it (engine.py says when it cannot).
    `distributed="mpi"`: data-parallel over MPI ranks; its options (`loss_reduction`, `bucket_mb`,
    `device_id`, `comm`) are described at `amp_rewrite.training.distributed.MpiReduction`.
    `recompute`: segments whose activations the backward recomputes instead of keeping: node-name
    regexes, "auto" or a byte budget (`amp_rewrite.autodiff.recompute`); `checkpointed` then lists
    the forward tensors kept for it. `keep_sparsity`: weights mostly of exact zeros keep them
    (training/sparsity.py; `kept_sparse` names them); False trains them dense.
    """

    def __init__(
        self,
        model,
        loss="cross_entropy",
        optimizer: Optimizer = DEFAULT_OPTIMIZER,
        loss_scale="auto",
        precision: str = "float16",
        provider: str = "auto",
        on_nonfinite: str = "skip",
        trainable: list[str] | None = None,
        gradient_builder=None,
        distributed: str | None = None,
        frozen: list[str] | None = None,
        verbose: bool = True,
        recompute=None,
        threads: int = 0,
        tf32: bool = False,
        cuda_graph: bool = False,
        keep_sparsity: bool = True,
        **distributed_options,
    ):
        self.precision = arguments.check_choice("precision", precision, arguments.PRECISIONS)
        arguments.check_distributed(distributed, distributed_options)
        arguments.check_threads(threads)
        arguments.check_flag("tf32", tf32)
        arguments.check_flag("cuda_graph", cuda_graph)
        arguments.check_flag("keep_sparsity", keep_sparsity)
        plan = engine.plan(arguments.deployment(provider, precision), distributed, cuda_graph)
        say = _say if verbose else (lambda line: None)
        self._model, found = prepare(arguments.load_model(model, say), say)
        self.optimizer = arguments.check_optimizer(optimizer)
        if loss_scale == "auto":
            loss_scale = 1.0 if precision == "float32" else "dynamic"
        self.loss_scale_policy = resolve_loss_scale(loss_scale)
        self.on_nonfinite = arguments.check_choice("on_nonfinite", on_nonfinite, arguments.NONFINITE_POLICIES)
        if on_nonfinite == "retry" and not isinstance(self.loss_scale_policy, DynamicLossScale):
            raise TrainingError(
                "on_nonfinite='retry' needs a dynamic loss scale (a fixed scale never changes)"
            )
        floats = [t.name for t in self._model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
        patterns = (arguments.literal_patterns(trainable, floats), arguments.literal_patterns(frozen, floats))
        names = parameters.select(found, floats, *patterns)
        nonzero = sparsity.sparse_weights(self._model, names) if keep_sparsity else {}
        self.kept_sparse = {w: float(1 - mask.mean()) for w, mask in nonzero.items()}
        built = (
            self._model,
            loss,
            self.optimizer,
            self.loss_scale_policy,
            names,
            sparsity.keeping_zeros(gradient_builder or build_gradient_graph, nonzero),
            recompute,
        )
        step = build_step_graph(*built, plan.flat)
        self.recompute_plan = _recompute_plan(step.model)
        self._float_step = step.model  # what `report` draws
        self.step_graph: StepGraph = engine.step_graph_for(step, self.precision, plan.device)
        self._feed_check = feed_checks.FeedCheck.of(
            self.step_graph.model, self.step_graph.batch_inputs, loss, self._model
        )
        sizes = {w: step.initial_state[w].size for w in step.weights}
        initial = step.initial_state
        # The engine holds the one copy of the state from here on.
        self.step_graph = dataclasses.replace(self.step_graph, initial_state={})
        _drop_weight_data(self._model, set(step.weights))
        del step
        options = {"threads": threads, "tf32": tf32, **distributed_options}
        self.engine: engine.StepEngine = engine.open_engine(
            plan, self.step_graph, initial, self.optimizer.lr, self.precision, loss, say=say, **options
        )
        self._guard = None
        if self.precision != "float32" and distributed is None:
            float_step = dataclasses.replace(self.step_graph, model=self._float_step)

            def rebuild(kept: dict) -> None:  # the step again, `kept` float32, around the same state
                state, lr = self.state() | initial_scale_state(self.loss_scale_policy), self.lr
                self.step_graph = engine.step_graph_for(float_step, self.precision, plan.device, kept)
                self.engine = engine.open_engine(
                    plan, self.step_graph, state, lr, self.precision, loss, say=say, **options
                )

            self._guard = range_guard.RangeGuard(rebuild, self.precision, say)
        del initial
        self.device = self.engine.device
        precision_line.announce(self.step_graph.model, self.precision, self.device, say)
        self._specs = self.engine.state.specs()
        self._watch = skips.Watch(getattr(self.loss_scale_policy, "min_scale", None))
        self._backs_off = isinstance(self.loss_scale_policy, DynamicLossScale)
        self._found_scale = False  # no finite step yet: skip mode retries at the backed-off scale
        summary = parameters.summary(list(self.step_graph.weights), sizes, len(floats) - len(sizes))
        say(f"amp-rewrite: {summary}{sparsity.summary(self.kept_sparse)}")

    # --- stepping -------------------------------------------------------------------------------

    def step(self, feeds: dict) -> StepResult:
        """One optimizer step on a batch. Retry mode recomputes a non-finite batch at the backed-off
        scale until finite or at the floor (TF's LossScaleGradientTape); so does skip mode until a
        first step is finite (2^16 is a guess: magika v3.3 needs less), then a skip is a skip."""
        if self.on_nonfinite == "skip" and (self._found_scale or not self._backs_off):
            return self._run(feeds, retries=0)
        scale_used = self.loss_scale  # an extra host read, only in retry mode
        result = self._run(feeds, retries=0)
        while result.skipped and scale_used > self.loss_scale_policy.min_scale:
            scale_used = result.loss_scale
            result = self._run(feeds, retries=result.retries + 1)
        self._found_scale = self._found_scale or not result.skipped
        if result.skipped and not self._found_scale and self._guard_range(feeds):
            return self.step(feeds)  # the rebuilt step, from the initial scale again
        return result

    def _guard_range(self, feeds: dict) -> bool:
        """No scale stepped this batch: range_guard keeps float32 what was not finite, rebuilds."""
        if self._guard is None:
            return False
        probe = self.state() | {LR_INPUT: np.array(self.lr, np.float32), **self._feed_check.check(feeds)}
        return self._guard.attempt(self.step_graph.model, probe, self.device)

    def fit(self, batches, epochs: int = 1, progress: bool | None = None) -> list[float]:
        """Train for `epochs` over `batches` (a list, or a callable epoch -> iterable of feed dicts);
        returns the mean loss of each epoch over its non-skipped steps. The progress line (loss,
        scale, skipped steps) shows on a terminal by default (rank 0 only); `progress=True/False`
        forces it."""
        if epochs > 1 and not callable(batches) and iter(batches) is batches:
            raise TrainingError(
                "batches is a one-shot iterator: pass a list or a callable for several epochs"
            )
        if not callable(batches) and hasattr(batches, "__len__"):
            self.engine.check_batch_count(len(batches))
        if not self.engine.primary:
            progress = False
        epoch_losses = []
        for epoch in range(epochs):
            epoch_batches = batches(epoch) if callable(batches) else batches
            losses, skipped = [], 0
            with Progress(_length(epoch_batches), f"epoch {epoch + 1}/{epochs}", progress) as bar:
                for feeds in epoch_batches:
                    result = self.step(feeds)
                    skipped += result.skipped
                    if not result.skipped:
                        losses.append(result.loss)
                    last = f"{losses[-1]:.4f}" if losses else "nan"
                    bar.step(note=f"loss {last} scale {result.loss_scale:g} skipped {skipped}")
            epoch_losses.append(float(np.mean(losses)) if losses else float("nan"))
        return epoch_losses

    def _run(self, feeds: dict, retries: int) -> StepResult:
        batch = self._feed_check.check(feeds)
        try:
            loss, skipped = self.engine.run(batch)
        except TrainingError:
            raise
        except Exception as error:  # ONNX Runtime's errors never reach the user raw
            raise feed_checks.run_failure(error, self.precision) from None
        result = StepResult(loss, self.loss_scale, skipped, retries)
        if self._watch.due(result.skipped, result.loss_scale):
            feeds = self.state() | {LR_INPUT: np.array(self.lr, np.float32), **batch}
            self._watch.warn(self.step_graph, feeds, self.device)
        return result

    @property
    def kept_for_range(self) -> dict[str, str]:
        """{node: why}: what the range guard kept float32 (training/range_guard.py)."""
        return dict(self._guard.kept) if self._guard is not None else {}

    @property
    def trainable(self) -> list[str]:
        """The names of the tensors this trainer trains."""
        return list(self.step_graph.weights)

    # --- state ----------------------------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        return float(self.engine.state.read(SCALE_STATE))

    @property
    def checkpointed(self) -> tuple[str, ...]:
        """Forward tensors kept for recomputation (empty without `recompute`)."""
        return self.recompute_plan.checkpointed if self.recompute_plan else ()

    @property
    def step_count(self) -> int:
        """Applied (non-skipped) optimizer steps so far."""
        return int(self.engine.state.read(STEP_STATE))

    @property
    def lr(self) -> float:
        return float(self.engine.state.lr.numpy())

    @lr.setter
    def lr(self, value: float) -> None:
        """Change the learning rate between steps (schedules); the step graph stays the same."""
        self.engine.state.lr.update_inplace(np.array(value, np.float32))

    def state(self) -> dict[str, np.ndarray]:
        """A host copy of every state tensor: weights, optimizer slots, step, loss-scale state."""
        return {name: self.engine.state.read(name) for name in self.step_graph.next_state}

    def weights(self) -> dict[str, np.ndarray]:
        """A host copy of the float32 master weights."""
        return {name: self.engine.state.read(name) for name in self.step_graph.weights}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Replace every state tensor (shapes and dtypes must match the step graph)."""
        if set(state) != set(self._specs):
            missing = sorted(set(self._specs) ^ set(state))
            raise TrainingError(f"state does not match this trainer's step graph (differs in {missing[0]!r})")
        arrays = {}
        for name, (shape, dtype) in self._specs.items():
            value = np.asarray(state[name])
            if value.shape != shape or value.dtype != dtype:
                raise TrainingError(
                    f"state {name!r} is {value.dtype}{list(value.shape)}, expected {dtype}{list(shape)}"
                )
            arrays[name] = value
        self.engine.state.write(arrays)

    # --- checkpoint and export ------------------------------------------------------------------

    def save(self, path) -> None:
        """Checkpoint weights, optimizer state and loss-scale state to an .npz (atomic, no pickle);
        data-parallel: rank 0 writes, every rank returns once it is written."""
        self.engine.on_primary(lambda: self._save(path))

    def _save(self, path) -> None:
        write_checkpoint(path, self.state(), self._checkpoint_meta())

    def load(self, path) -> None:
        """Restore a checkpoint written by `save` for the same model, optimizer and loss scale. The
        whole file is verified first (training/checkpoint.py), so a bad one changes nothing; then it
        is written into the runner's state. Data-parallel: rank 0 reads and verifies it, then every
        rank gets its state."""
        self.engine.on_primary(lambda: self._load(path))
        self.engine.share_state()

    def _load(self, path) -> None:
        shapes = {
            name: np.broadcast_to(np.zeros((), dtype), shape) for name, (shape, dtype) in self._specs.items()
        }
        checkpoint = read_checkpoint(
            path, self._checkpoint_meta(), shapes
        )  # stand-ins: shape and dtype, no data
        self.load_state(checkpoint.state)
        self.lr = checkpoint.meta["lr"]

    def inference_model(self, precision: str = "float32") -> onnx.ModelProto:
        """The original model with the trained weights; rewritten to `precision` unless float32."""
        arguments.check_choice("precision", precision, arguments.PRECISIONS)
        model = onnx.ModelProto()
        model.CopyFrom(self._model)
        trained = set(self.step_graph.weights)
        for i, tensor in enumerate(model.graph.initializer):
            if tensor.name in trained:
                model.graph.initializer[i].CopyFrom(
                    numpy_helper.from_array(self.engine.state.read(tensor.name), tensor.name)
                )
        if precision == "float32":
            return model
        return rewrite(model, target=precision, keep_io_types=True).model

    def export(self, path, precision: str = "float32") -> None:
        """Write the trained inference model (float32, or rewritten to `precision`), atomically;
        data-parallel: rank 0 writes, every rank returns once it is written."""

        def write():
            data = self.inference_model(precision).SerializeToString()
            atomic_write(path, lambda f: f.write(data))

        self.engine.on_primary(write)

    def report(self, html=None):
        """The mixed-precision rewrite's report of the step graph (the one the step was built
        with, no rewrite again); with `html` (a path) also the HTML picture, forward, backward,
        loss-scale and optimizer regions drawn apart."""
        from amp_rewrite.training.step_picture import step_report

        return step_report(
            self._float_step, self.step_graph.report, self.precision, html, title="training step"
        )

    # --- internals ------------------------------------------------------------------------------

    def _checkpoint_meta(self) -> dict:
        return checkpoint_meta(self.optimizer, self.loss_scale_policy, self.lr)


def _drop_weight_data(model: onnx.ModelProto, names: set[str]) -> None:
    """Empty the trained initializers of the kept original model: the runner holds their values,
    and `inference_model` writes them back."""
    for tensor in model.graph.initializer:
        if tensor.name in names:
            for field in ("raw_data", "float_data", "external_data"):
                tensor.ClearField(field)
            tensor.data_location = onnx.TensorProto.DEFAULT


def _say(line: str) -> None:
    print(line, file=sys.stderr)


def _recompute_plan(model: onnx.ModelProto):
    from amp_rewrite.autodiff.recompute import plan_of

    return plan_of(model)


def _length(batches) -> int | None:
    try:
        return len(batches)
    except TypeError:
        return None
