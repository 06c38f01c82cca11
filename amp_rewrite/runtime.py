"""ONNX Runtime, asked once: whether its CUDA provider really loads, and the one session factory
(validation, calibration, the fallback search and training all open their sessions here).

onnxruntime-gpu lists CUDA as available even where its libraries fail to load, and then falls
back to CPU after printing a red error; plain onnxruntime lists no CUDA at all. So CUDA counts only
when a session really runs on it: probed once per process on a one-node model, with ORT's spew
silenced, and remembered. An onnxruntime that does not import (or imports as an empty shell) is
one clear line, not an AttributeError.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import io
import logging
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx

from amp_rewrite.errors import RuntimeUnavailableError, ValidationError

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
DEVICES = {"cuda": CUDA, "cpu": CPU}  # where a session runs -> ORT's provider name
TWO_GB = 2**31
_ORT_DEFAULT_SEVERITY = 2
_QUIET = 3  # errors only: ORT's warnings about our own graphs are not the user's business
_FATAL_ONLY = 4

log = logging.getLogger("amp_rewrite")


@functools.cache
def ort():
    """The onnxruntime module; a missing or broken install is one RuntimeUnavailableError line."""
    try:
        import onnxruntime
    except Exception as exc:  # ImportError, or a shared library that fails to load
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RuntimeUnavailableError(
            f"ONNX Runtime does not import ({first}): pip install onnxruntime (or onnxruntime-gpu for CUDA)"
        ) from None
    if not hasattr(onnxruntime, "InferenceSession"):
        raise RuntimeUnavailableError(
            "ONNX Runtime is installed only in part (onnxruntime has no InferenceSession; "
            "two packages fighting over it?): reinstall one of onnxruntime or "
            "onnxruntime-gpu"
        )
    return onnxruntime


def lists_cuda() -> bool:
    """Whether this onnxruntime build names CUDA at all (plain onnxruntime does not)."""
    available = getattr(ort(), "get_available_providers", None)
    return available is not None and CUDA in available()


@functools.cache
def cuda_loads() -> bool:
    """Whether a session really runs on CUDA here: probed once per process on a one-node model."""
    if not lists_cuda():
        return False
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "probe", [x], [y])
    probe = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)], ir_version=8)
    try:
        _, used = _open(probe.SerializeToString(), "cuda", session_options(), 0)
    except Exception:  # a CUDA build that cannot even make a session: no CUDA
        return False
    return used == CUDA


@functools.cache
def say_cpu_fallback_once() -> None:
    log.warning("amp-rewrite: ONNX Runtime's CUDA provider did not load; running on CPU")


@contextlib.contextmanager
def tools_quiet():
    """ONNX Runtime's Python tools (the transformer optimizer, symbolic shape inference) log and
    warn about every pattern they try; what they did is said in our own notes."""
    import warnings

    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def session_options(**settings):
    """SessionOptions with ORT's log quietened; `settings` set as attributes."""
    options = ort().SessionOptions()
    options.log_severity_level = _QUIET
    for name, value in settings.items():
        setattr(options, name, value)
    return options


def _session_source(model, keep_alive: list):
    """Bytes, or for a model over 2 GB a temporary file with external data (kept in `keep_alive`)."""
    if isinstance(model, (bytes, str)):
        return model
    if model.ByteSize() < TWO_GB:
        return model.SerializeToString()
    folder = tempfile.TemporaryDirectory()
    keep_alive.append(folder)
    path = Path(folder.name) / "model.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="model.onnx.data")
    return str(path)


def cuda_options(device_id: int = 0, tf32: bool = False, cuda_graph: bool = False) -> dict:
    """The CUDA provider's options: the device, and `use_tf32`. ORT's CUDA provider computes
    float32 MatMul/Conv in TF32 (a 10-bit mantissa, float16's) unless told otherwise; amp-rewrite
    asks for IEEE float32 unless `tf32` (docs/decisions.md: a node kept float32 for accuracy, or
    the float32 reference a check compares with, must not compute at float16's mantissa)."""
    options = {"device_id": str(device_id), "use_tf32": "1" if tf32 else "0"}
    if cuda_graph:  # the session captures its run as a CUDA graph (training.runner.SessionRunner)
        options["enable_cuda_graph"] = "1"
    return options


def providers_for(device: str, device_id: int = 0, tf32: bool = False, cuda_graph: bool = False) -> list:
    """ORT's `providers` list for a session on `device` ("cuda": CUDA, then CPU for what it lacks)."""
    return [(CUDA, cuda_options(device_id, tf32, cuda_graph)), CPU] if device == "cuda" else [CPU]


def _open(source, device: str, options, device_id: int, tf32: bool = False, cuda_graph: bool = False):
    """(session, ORT provider used); ORT's load-failure spew silenced while CUDA is tried."""
    runtime = ort()
    cuda = device == "cuda"
    runtime.set_default_logger_severity(_FATAL_ONLY if cuda else _QUIET)
    try:  # ORT prints "EP Error ..." on stdout when a provider's session fails: the error says it
        with contextlib.redirect_stdout(io.StringIO()):
            sess = runtime.InferenceSession(
                source, options, providers=providers_for(device, device_id, tf32, cuda_graph)
            )
    finally:
        runtime.set_default_logger_severity(_ORT_DEFAULT_SEVERITY)
    return sess, (CUDA if CUDA in sess.get_providers() else CPU)


def open_session(
    model,
    device: str,
    *,
    options=None,
    error=ValidationError,
    what: str = "the model",
    device_id: int = 0,
    tf32: bool = False,
    cuda_graph: bool = False,
):
    """(session, ORT provider used). `model`: a ModelProto or its bytes; `device`: "cuda" or "cpu",
    as a `Deployment` resolved it (`Deployment.device`); a model ORT refuses is `error`. `tf32`:
    let CUDA compute float32 MatMul/Conv in TF32 (`cuda_options`); `cuda_graph`: capture runs as a CUDA graph."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r}: a Deployment resolves it to cuda or cpu")
    keep_alive: list = []
    source = _session_source(model, keep_alive)
    try:
        sess, used = _open(source, device, options or session_options(), device_id, tf32, cuda_graph)
    except RuntimeUnavailableError:
        raise
    except Exception as exc:  # ORT raises its own untyped errors for invalid graphs
        first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise error(f"ONNX Runtime refused {what}: {first.strip()}") from None  # an empty message too
    sess._amp_keep_alive = keep_alive  # external data lives as long as the session
    return sess, used


BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_BFLOAT16_TYPE = "tensor(bfloat16)"


def run(session, outputs, feeds: dict) -> list:
    """`session.run(outputs, feeds)`, bfloat16 included: numpy has no bfloat16, so ORT's `run`
    refuses a bfloat16 feed (ml_dtypes') and cannot return a bfloat16 output ("No corresponding
    Numpy type for Tensor Type. bfloat16"). Such a run binds them as OrtValues instead and reads
    bfloat16 outputs back as ml_dtypes.bfloat16 arrays, copied to the host."""
    if not hasattr(session, "io_binding"):  # a SegmentedSession: its pieces run through here
        return session.run(outputs, feeds)
    names = list(outputs) if outputs is not None else [o.name for o in session.get_outputs()]
    if not any(np.asarray(v).dtype == BFLOAT16 for v in feeds.values()) and not _bfloat16_among(
        session, names
    ):
        return session.run(names, feeds)
    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_ortvalue_input(name, _ort_value(np.asarray(value)))
    for name in names:
        binding.bind_output(name, "cpu")
    session.run_with_iobinding(binding)
    return [host_array(v) for v in binding.get_outputs()]


def _bfloat16_among(session, names: list) -> bool:
    wanted = set(names)
    return any(o.type == _BFLOAT16_TYPE for o in session.get_outputs() if o.name in wanted)


def _ort_value(array: np.ndarray):
    if array.dtype == BFLOAT16:
        return ort().OrtValue.ortvalue_from_numpy_with_onnx_type(
            np.ascontiguousarray(array).view(np.uint16), onnx.TensorProto.BFLOAT16
        )
    return ort().OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array))


def host_array(value) -> np.ndarray:
    """An OrtValue on the host as a numpy array; a bfloat16 one as ml_dtypes.bfloat16 (copied:
    ORT's `numpy()` has no bfloat16)."""
    if value.data_type() != _BFLOAT16_TYPE:
        return value.numpy()
    shape = tuple(value.shape())
    count = int(np.prod(shape, dtype=np.int64))
    if not count:
        return np.zeros(shape, BFLOAT16)
    raw = (ctypes.c_uint16 * count).from_address(value.data_ptr())
    return np.frombuffer(raw, np.uint16).copy().view(BFLOAT16).reshape(shape)
