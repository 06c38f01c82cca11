"""The step runner: one ONNX Runtime session, the training state in ONNX Runtime's memory.

Every state tensor (master weights, optimizer slots, step count, loss-scale state) is one OrtValue
on the session's device, bound with IOBinding as the step's input *and* as the output holding its
next value, so the step updates it in place: one copy of the state, no host copies, nothing but the
batch in and the loss and skip flag out per step. That is safe because every node that reads a
state tensor runs before the node that writes it (`check_in_place`, checked once per graph); the
writers are the flat update's Reshapes (flat_update.py), elementwise ops or the update's `If`,
whose branches are checked alike. `read`/`write` copy a tensor out or in on demand
(checkpoints, export, the skip diagnostic).

On CPU the Trainer runs the step split in two instead (`split_runner.SplitRunner`: a gradient
session, then the update on the host); the data-parallel runner (`distributed.MpiRunner`) puts its
Allreduce between the two. All have the surface of `SessionRunner`.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from amp_rewrite import ir
from amp_rewrite.autodiff.emitter import Emitter
from amp_rewrite.autodiff.graphinfo import node_inputs
from amp_rewrite.deployment import Deployment
from amp_rewrite.errors import TrainingError, UsageError
from amp_rewrite.onnx_facts import default_opset, names_in, reads
from amp_rewrite.runtime import CUDA, open_session, session_options
from amp_rewrite.training.feeds import ort_message
from amp_rewrite.training.step_graph import LR_INPUT, SKIPPED_OUTPUT, StepGraph


def deployment_for(provider: str) -> Deployment:
    """The Trainer's `provider` as a Deployment (deployment.py's vocabulary); a bad one is a TrainingError."""
    try:
        return Deployment(provider=provider)
    except UsageError as error:
        raise TrainingError(f"provider: {error}") from None


def open_step_session(
    model: onnx.ModelProto,
    provider: str,
    precision: str,
    device_id: int = 0,
    threads: int = 0,
    tf32: bool = False,
):
    """(session, OrtValue device: 'cuda' or 'cpu'); provider='cuda' that does not load is an error.
    `threads`: CPU intra-op threads (0: ONNX Runtime's default). ONNX Runtime's memory pattern is
    off: it plans one block for every intermediate of the step, which on a BERT 4Lx256H at batch 16
    raised the peak above the floor from 2010 to 3280 MB at no measured gain in speed. On CPU the
    graph is optimised to the extended level, without the NCHWc layout pass: its reorders around
    every forward and backward Conv cost more than they gained (the small CNN's step at 1 thread,
    alternating in one process: 55.8 vs 63.2 and 58.9 vs 62.0 ms CPU; the MLP equal). `tf32`: CUDA
    computes the step's float32 MatMul/Conv in TF32 (runtime.cuda_options; off: IEEE float32)."""
    device = deployment_for(provider).device
    settings = {}
    if device == "cpu":
        model = log_sum_exp_by_log_softmax(model)
        settings["graph_optimization_level"] = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    try:
        options = session_options(intra_op_num_threads=threads, enable_mem_pattern=False, **settings)
        session, used = open_session(
            model.SerializeToString(),
            device,
            options=options,
            device_id=device_id,
            tf32=tf32,
            error=TrainingError,
            what="the step graph",
        )
        if provider == "cuda" and used != CUDA:
            raise TrainingError("provider='cuda' was asked for but ONNX Runtime's CUDA provider did not load")
        return session, "cuda" if used == CUDA else "cpu"
    except TrainingError as error:
        text = ort_message(str(error))
        if precision != "bfloat16":
            raise TrainingError(text) from None
        raise TrainingError(
            f"{text} (ONNX Runtime's CPU provider lacks most bfloat16 kernels: "
            "use the CUDA provider or float16)"
        ) from None


def log_sum_exp_by_log_softmax(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with each ReduceLogSumExp over the last axis (the cross-entropy's) computed as
    x[..., :1] - LogSoftmax(x)[..., :1]; the model itself when it has none. ONNX Runtime's CPU
    kernel for ReduceLogSumExp is scalar: on [2048, 30522] (a BERT's LM head at batch 16) it takes
    430-570 ms at one thread where LogSoftmax, vectorised, takes 72-76 ms, and is further from
    float64 (8e-5 vs 1e-5). The output keeps its name, so the backward still reads x and it; its
    Exp(x - lse) (the gradient's softmax) becomes Softmax(x), one vectorised pass instead of two."""
    graph = model.graph
    constants = {t.name: t for t in graph.initializer}
    found = [n for n, node in enumerate(graph.node) if _log_sum_exp_axis(constants, node) == -1]
    if not found:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = list(out.graph.node)
    e = Emitter([], out.graph.initializer, default_opset(out), names_in(out.graph), scope="lse")
    outputs = {o.name for o in graph.output}
    replaced = _softmax_for_exp_of_difference(nodes, [nodes[n] for n in found], outputs)
    for n in found:
        node, e.nodes = nodes[n], []
        e.scope = f"{node.name or 'lse'}/by_log_softmax"
        x, first = node.input[0], (e.ints([0]), e.ints([1]), e.ints([-1]))
        log_softmax = e.op("LogSoftmax", [x], axis=-1)
        keepdims = next((a.i for a in node.attribute if a.name == "keepdims"), 1)
        pair = [e.op("Slice", [x, *first]), e.op("Slice", [log_softmax, *first])]
        if keepdims:
            e.op("Sub", pair, [node.output[0]])
        else:
            e.op("Squeeze", [e.op("Sub", pair), e.ints([-1])], [node.output[0]])
        replaced[n] = e.nodes
    kept = [new for n, node in enumerate(nodes) for new in replaced.get(n, [node])]
    copies = [onnx.NodeProto() for _ in kept]
    for copy, node in zip(copies, kept):
        copy.CopyFrom(node)
    del out.graph.node[:]
    out.graph.node.extend(copies)
    return out


def _softmax_for_exp_of_difference(nodes: list, log_sum_exps: list, outputs: set) -> dict[int, list]:
    """{node index: its replacement}: Exp(Sub(x, lse)) read from a kept-dims log-sum-exp of x over
    the last axis becomes one Softmax(x) writing the Exp's output (the Sub, read only there, goes)."""
    readers = ir.readers(node_inputs(node) for node in nodes)
    replaced: dict[int, list] = {}
    for lse in log_sum_exps:
        if not next((a.i for a in lse.attribute if a.name == "keepdims"), 1):
            continue
        for s in readers.get(lse.output[0], ()):
            sub = nodes[s]
            after = readers.get(sub.output[0], [])
            if sub.op_type != "Sub" or list(sub.input) != [lse.input[0], lse.output[0]] or len(after) != 1:
                continue
            exp = nodes[after[0]]
            if exp.op_type == "Exp" and sub.output[0] not in outputs:
                softmax = helper.make_node(
                    "Softmax", [lse.input[0]], list(exp.output), name=exp.name, axis=-1
                )
                replaced[s], replaced[after[0]] = [], [softmax]
    return replaced


def _log_sum_exp_axis(constants: dict, node: onnx.NodeProto) -> int | None:
    """The one axis a ReduceLogSumExp node reduces, when it is written as a constant (else None)."""
    if node.op_type != "ReduceLogSumExp" or node.domain not in ("", "ai.onnx"):
        return None
    axes = next((list(a.ints) for a in node.attribute if a.name == "axes"), None)
    if axes is None and len(node.input) > 1 and node.input[1] in constants:
        axes = numpy_helper.to_array(constants[node.input[1]]).reshape(-1).tolist()
    return axes[0] if axes is not None and len(axes) == 1 else None


def feed_dtypes(model: onnx.ModelProto) -> dict[str, np.dtype]:
    """Graph input -> the numpy dtype a feed is converted to."""
    return {i.name: helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type) for i in model.graph.input}


class DeviceState:
    """One OrtValue per state tensor, plus the learning rate. On CUDA ONNX Runtime owns the memory;
    on CPU each OrtValue wraps a numpy array (`arrays`, the learning rate under LR_INPUT), the same
    memory, so the host update (host_update.py) updates the one copy in place too."""

    def __init__(self, initial: dict[str, np.ndarray], lr: float, device: str, device_id: int = 0):
        self.device, self.device_id = device, device_id if device == "cuda" else 0
        self.arrays: dict[str, np.ndarray] = {}
        self.values = {name: self._new(name, array) for name, array in initial.items()}
        self.lr = self._new(LR_INPUT, np.array(lr, np.float32))

    def _new(self, name: str, array: np.ndarray) -> ort.OrtValue:
        if self.device == "cpu":
            self.arrays[name] = np.array(array, order="C", copy=True)
            return ort.OrtValue.ortvalue_from_numpy(self.arrays[name])
        value = ort.OrtValue.ortvalue_from_shape_and_type(
            list(array.shape), array.dtype, self.device, self.device_id
        )
        value.update_inplace(np.ascontiguousarray(array))
        return value

    def read(self, name: str) -> np.ndarray:
        return np.array(self.values[name].numpy(), copy=True)

    def specs(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {
            name: (tuple(v.shape()), np.dtype(helper.tensor_dtype_to_np_dtype(v.element_type())))
            for name, v in self.values.items()
        }

    def write(self, state: dict[str, np.ndarray]) -> None:
        for name, value in state.items():
            self.values[name].update_inplace(np.ascontiguousarray(value))

    def bind(self, binding: ort.IOBinding, inputs, next_state: dict[str, str] | None = None) -> None:
        """Bind the state among `inputs` (and the learning rate); each state output onto its input."""
        for name in inputs:
            if name in self.values:
                binding.bind_ortvalue_input(name, self.values[name])
            elif name == LR_INPUT:
                binding.bind_ortvalue_input(name, self.lr)
        for name, out in (next_state or {}).items():
            binding.bind_ortvalue_output(out, self.values[name])


class SingleProcess:
    """What a runner of one process says to the Trainer's data-parallel hooks: rank 0 is everyone,
    nothing to share."""

    primary = True

    def on_primary(self, action) -> None:
        action()

    def share_state(self) -> None:
        pass

    def check_batch_count(self, count: int) -> None:
        pass


class SessionRunner(SingleProcess):
    """The one-graph step in one session (see the module doc)."""

    def __init__(
        self,
        step: StepGraph,
        initial: dict[str, np.ndarray],
        lr: float,
        provider: str,
        precision: str,
        threads: int = 0,
        tf32: bool = False,
    ):
        check_in_place(step.model, step.next_state)
        self.session, self.device = open_step_session(
            step.model, provider, precision, threads=threads, tf32=tf32
        )
        self.feed_types = feed_dtypes(step.model)
        self.batch_inputs = step.batch_inputs
        self.state = DeviceState(initial, lr, self.device)
        self._loss, self._skipped = np.zeros((), np.float32), np.zeros((), np.bool_)
        self.binding = self.session.io_binding()
        self.state.bind(self.binding, feed_dtypes(step.model), step.next_state)
        self.binding.bind_ortvalue_output(step.loss_output, ort.OrtValue.ortvalue_from_numpy(self._loss))
        self.binding.bind_ortvalue_output(SKIPPED_OUTPUT, ort.OrtValue.ortvalue_from_numpy(self._skipped))

    def run(self, batch: dict[str, np.ndarray]) -> tuple[float, bool]:
        """One step on a batch (converted feeds); returns (loss, skipped)."""
        for name, array in batch.items():
            self.binding.bind_cpu_input(name, array)
        self.session.run_with_iobinding(self.binding)
        return float(self._loss), bool(self._skipped)


def check_in_place(model: onnx.ModelProto, next_state: dict[str, str]) -> None:
    """Every (live) reader of a state input must run before the node writing its next value (an
    ancestor of it), or updating in place would feed it the new value. Our own bug if not, so a
    RuntimeError. Readers before the finite flag (forward, backward) are ancestors of every gated
    writer: the walk from each writer stops there, so it visits only that tensor's update chain.
    A writer with branches (the update's `If`) is checked the same way inside each branch."""
    _check_graph(model.graph, next_state)


def _check_graph(graph: onnx.GraphProto, next_state: dict[str, str]) -> None:
    producers = ir.producer_nodes(graph.node)
    readers: dict[str, list] = {}
    live = _ancestors(
        producers, [o.name for o in graph.output], stop=set()
    )  # a dead reader reads nothing used
    for node in live.values():
        for name in set(reads(node)):
            if name in next_state:
                readers.setdefault(name, []).append(node)
    before_flag = _ancestors(producers, [SKIPPED_OUTPUT], stop=set())
    for state, out in next_state.items():
        if _identity_of(producers, out) == state:  # written back unchanged (a fixed loss scale)
            continue
        writer_chain = _ancestors(producers, [out], stop=before_flag)
        gated = any(
            id(producers.get(name)) in before_flag for node in writer_chain.values() for name in node.input
        )
        for reader in readers.get(state, ()):
            if id(reader) in writer_chain or (gated and id(reader) in before_flag):
                continue
            raise RuntimeError(
                f"step graph node {reader.name!r} reads state {state!r} but does not run before its update"
            )
    writers = {id(producers[out]): producers[out] for out in next_state.values() if out in producers}
    for writer in writers.values():
        for attribute in writer.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                branch = attribute.g
                outputs = dict(zip(writer.output, (o.name for o in branch.output)))
                _check_graph(branch, {s: outputs[o] for s, o in next_state.items() if o in outputs})


def _identity_of(producers: dict, name: str) -> str:
    """What `name` is a chain of Identity nodes of (itself if none)."""
    while name in producers and producers[name].op_type == "Identity":
        name = producers[name].input[0]
    return name


def _ancestors(producers: dict, targets: list[str], stop: set) -> dict[int, onnx.NodeProto]:
    """id(node) -> node for the nodes `targets` depend on, not entering the node ids in `stop`."""
    seen: dict[int, onnx.NodeProto] = {}
    pending = list(targets)
    while pending:
        node = producers.get(pending.pop())
        if node is None or id(node) in seen or id(node) in stop:
            continue
        seen[id(node)] = node
        pending.extend(reads(node))
    return seen
