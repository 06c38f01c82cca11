"""The step's sessions and state: one ONNX Runtime session per graph, the training state in
ONNX Runtime's memory, and the one-session engine (`SessionRunner`, engine.py picks it for CUDA).

Every state tensor (master weights, optimizer slots, step count, loss-scale state) is one OrtValue
on the session's device, bound with IOBinding as the step's input *and* as the output holding its
next value, so the step updates it in place: one copy of the state, no host copies, nothing but the
batch in and the loss and skip flag out per step. That is safe because every node that reads a
state tensor runs before the node that writes it (`check_in_place`, checked once per graph); the
writers are the flat update's Reshapes (flat_update.py), elementwise ops or the update's `If`,
whose branches are checked alike. `read`/`write` copy a tensor out or in on demand
(checkpoints, export, the skip diagnostic).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from amp_rewrite import ir
from amp_rewrite.errors import TrainingError
from amp_rewrite.onnx_facts import reads
from amp_rewrite.runtime import CUDA, open_session, session_options
from amp_rewrite.training.feeds import ort_message
from amp_rewrite.training.step_graph import LR_INPUT, SKIPPED_OUTPUT, StepGraph


def open_step_session(
    model: onnx.ModelProto,
    device: str,
    precision: str,
    device_id: int = 0,
    threads: int = 0,
    tf32: bool = False,
    cuda_graph: bool = False,
):
    """An ONNX Runtime session of a step graph on `device` ("cuda" or "cpu", as the engine's plan
    resolved it once); CUDA that does not load after all is an error, not a silent CPU run.
    `threads`: CPU intra-op threads (0: ONNX Runtime's default). ONNX Runtime's memory pattern is
    off: it plans one block for every intermediate of the step, which on a BERT 4Lx256H at batch 16
    raised the peak above the floor from 2010 to 3280 MB at no measured gain in speed. On CPU the
    graph is optimised to the extended level, without the NCHWc layout pass: its reorders around
    every forward and backward Conv cost more than they gained (the small CNN's step at 1 thread,
    alternating in one process: 55.8 vs 63.2 and 58.9 vs 62.0 ms CPU; the MLP equal). `tf32`: CUDA
    computes the step's float32 MatMul/Conv in TF32 (runtime.cuda_options; off: IEEE float32).
    `cuda_graph`: ONNX Runtime captures the step as a CUDA graph and replays it (runner.SessionRunner)."""
    settings = {}
    if device == "cpu":
        settings["graph_optimization_level"] = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    try:
        options = session_options(intra_op_num_threads=threads, enable_mem_pattern=False, **settings)
        session, used = open_session(
            model.SerializeToString(),
            device,
            options=options,
            device_id=device_id,
            tf32=tf32,
            cuda_graph=cuda_graph,
            error=TrainingError,
            what="the step graph",
        )
        if device == "cuda" and used != CUDA:
            raise TrainingError("ONNX Runtime's CUDA provider did not load for the step graph")
        return session, "cuda" if used == CUDA else "cpu"
    except TrainingError as error:
        text = ort_message(str(error))
        if precision != "bfloat16":
            raise TrainingError(text) from None
        raise TrainingError(
            f"{text} (ONNX Runtime's CPU provider lacks most bfloat16 kernels: "
            "use the CUDA provider or float16)"
        ) from None


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


@dataclasses.dataclass
class _Bound:
    """A session of the step bound to the state: its binding, the loss and skip flag it writes,
    and (a captured graph's) the device buffers the batch is copied into."""

    session: object
    binding: ort.IOBinding
    outputs: dict
    feeds: dict


class SessionRunner(SingleProcess):
    """The one-graph step in one session (see the module doc). With `cuda_graph` (CUDA, every node
    on the device: engine.cuda_graph_refusal), the session is opened at the first batch with the
    batch inputs declared at its shapes, so ONNX Runtime folds the step's shape arithmetic away,
    and captures the step as a CUDA graph to replay: the batch is copied into device buffers bound
    once (a graph replays the addresses it captured); a batch of other shapes runs in a plain
    session over the same state, said once. ONNX Runtime's first run of a graph session runs the
    step three times (two runs to allocate, one to capture: its
    min_num_runs_before_cuda_graph_capture_ is 2, and Run recurses until captured), and the step
    updates its state in place: so the state is saved before that run and written back after it,
    and the batch then steps once, replayed. A capture ONNX Runtime refuses is said, and the plain
    session runs. `description`: what runs, for the engine's line."""

    def __init__(
        self,
        step: StepGraph,
        initial: dict[str, np.ndarray],
        lr: float,
        device: str,
        precision: str,
        threads: int = 0,
        tf32: bool = False,
        cuda_graph: bool = False,
        say=lambda line: None,
    ):
        check_in_place(step.model, step.next_state)
        self._step, self._say, self._precision = step, say, precision
        self._options = {"threads": threads, "tf32": tf32}
        self.device, self.cuda_graph = device, cuda_graph
        self.feed_types = feed_dtypes(step.model)
        self.state = DeviceState(initial, lr, device)
        self._plain = None if cuda_graph else self._open(None)
        self._graph: _Bound | None = None  # captured at the first batch
        how = "forward, backward and the update in one session on " + device.upper()
        self.description = how + ("; captured as a CUDA graph at the first batch" if cuda_graph else "")

    def _open(self, shapes: dict | None) -> _Bound:
        """The plain session (`shapes` None), or one at the batch's `shapes` that captures a graph."""
        model = self._step.model if shapes is None else with_batch_shapes(self._step.model, shapes)
        session, _ = open_step_session(
            model, self.device, self._precision, cuda_graph=shapes is not None, **self._options
        )
        binding = session.io_binding()
        self.state.bind(binding, self.feed_types, self._step.next_state)
        where = (self.device, self.state.device_id)
        outputs, feeds = {}, {}
        for name, dtype in ((self._step.loss_output, np.float32), (SKIPPED_OUTPUT, np.bool_)):
            if shapes is None:
                outputs[name] = ort.OrtValue.ortvalue_from_numpy(np.zeros((), dtype))
            else:  # a graph cannot capture a copy to the host
                outputs[name] = ort.OrtValue.ortvalue_from_shape_and_type([], dtype, *where)
            binding.bind_ortvalue_output(name, outputs[name])
        for name, (shape, dtype) in (shapes or {}).items():
            feeds[name] = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, *where)
            binding.bind_ortvalue_input(name, feeds[name])
        return _Bound(session, binding, outputs, feeds)

    def run(self, batch: dict[str, np.ndarray]) -> tuple[float, bool]:
        """One step on a batch (converted feeds); returns (loss, skipped)."""
        if self.cuda_graph and self._graph is None:
            self._graph = self._capture(batch)
        graph = self._graph
        if graph is not None and all(tuple(graph.feeds[n].shape()) == a.shape for n, a in batch.items()):
            for name, array in batch.items():
                graph.feeds[name].update_inplace(np.ascontiguousarray(array))
            graph.session.run_with_iobinding(graph.binding)
            return self._result(graph.outputs)
        if self._plain is None:
            if graph is not None:
                shapes = {n: list(v.shape()) for n, v in graph.feeds.items()}
                self._say(
                    f"amp-rewrite: a batch of other shapes than the CUDA graph's {shapes}: run without it"
                )
            self._plain = self._open(None)
        for name, array in batch.items():
            self._plain.binding.bind_cpu_input(name, array)
        self._plain.session.run_with_iobinding(self._plain.binding)
        return self._result(self._plain.outputs)

    def _capture(self, batch: dict[str, np.ndarray]) -> _Bound | None:
        """The graph session at the batch's shapes, captured on it, with the state written back
        afterwards (see the class doc); None, said, where ONNX Runtime refuses."""
        saved = {name: self.state.read(name) for name in self.state.values}
        try:
            graph = self._open({name: (array.shape, array.dtype) for name, array in batch.items()})
            for name, array in batch.items():
                graph.feeds[name].update_inplace(np.ascontiguousarray(array))
            graph.session.run_with_iobinding(graph.binding)
        except Exception as error:  # ONNX Runtime's own errors: a capture it cannot make
            first = next(iter(str(error).splitlines()), type(error).__name__)
            self._say(f"amp-rewrite: no CUDA graph: ONNX Runtime could not capture the step ({first})")
            self.cuda_graph, graph = False, None
        self.state.write(saved)
        return graph

    @staticmethod
    def _result(outputs: dict) -> tuple[float, bool]:
        loss, skipped = (value.numpy() for value in outputs.values())
        return float(loss), bool(skipped)


def with_batch_shapes(model: onnx.ModelProto, shapes: dict) -> onnx.ModelProto:
    """`model` with the inputs in `shapes` ({name: (shape, dtype)}) declared at those sizes: every
    shape in the step is then static, and ONNX Runtime folds its shape arithmetic into constants."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for value in out.graph.input:
        if value.name in shapes:
            dims = value.type.tensor_type.shape.dim
            del dims[:]
            for size in shapes[value.name][0]:
                dims.add().dim_value = int(size)
    return out


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
