"""The bytes of a tensor, wherever they are: in the proto, or in a checked external-data file.

A model loaded with `lazy_weights` keeps its big weights on disk: each such tensor refers to its
file by an absolute path that loading already checked (`external.resolve`), and only such a
reference is ever opened. A weight converted by the rewrite stays there too: it keeps its
reference to the float32 bytes, takes the target type and a *pending conversion*
(`defer_conversion`), and `chunks` converts it piece by piece while `save` streams it into the
output's data file. So no weight is ever held whole, converted or not, and memory does not grow
with the model (tools/big_model.py measures it).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from amp_rewrite.io import external
from amp_rewrite.onnx_facts import np_dtype

CHUNK_BYTES = 16 * 2**20  # what `chunks` reads at once: big enough for full disk speed, small beside 1 GB
ORT_CAST_MIN_VALUES = 4096  # below this, numpy's astype beats the cost of a session call
PENDING = (
    "amp_rewrite.convert"  # external_data key of a pending conversion (never saved: `save` writes bytes)
)
MODES = ("cast", "saturate", "clip")
_LARGEST = {TensorProto.FLOAT16: float(np.finfo(np.float16).max)}  # bfloat16 holds float32's range


def is_external(tensor: onnx.TensorProto) -> bool:
    return tensor.data_location == TensorProto.EXTERNAL


def external_info(tensor: onnx.TensorProto) -> dict:
    return {entry.key: entry.value for entry in tensor.external_data}


def tensor_bytes(tensor: onnx.TensorProto) -> bytes:
    """Raw little-endian bytes of `tensor`'s values (a pending conversion done)."""
    if is_external(tensor):  # only ever a reference the loader checked (external.point_at)
        mode = pending_conversion(tensor)
        data = external.checked_reference(tensor).read()
        return data if mode is None else convert(data, tensor.data_type, mode).tobytes()
    if tensor.HasField("raw_data"):
        return tensor.raw_data
    return numpy_helper.to_array(tensor).tobytes()


def float_values(tensor: onnx.TensorProto) -> np.ndarray:
    """A float32 tensor's values, flat, read straight from its bytes when stored as bytes."""
    if tensor.data_type == TensorProto.FLOAT and (is_external(tensor) or tensor.HasField("raw_data")):
        return np.frombuffer(tensor_bytes(tensor), dtype="<f4")
    return numpy_helper.to_array(tensor).reshape(-1)


def chunks(tensor: onnx.TensorProto, size: int = CHUNK_BYTES) -> Iterator:
    """`tensor_bytes` in pieces of about `size` bytes read from disk (converted, when pending),
    so that a weight on disk is never held whole; one piece for a tensor in the proto. Pieces are
    bytes-like (`len` counts bytes), each valid until the next is asked for."""
    if not is_external(tensor):
        yield tensor_bytes(tensor)
        return
    mode = pending_conversion(tensor)
    for data in external.checked_reference(tensor).parts(size - size % 4):
        yield data if mode is None else convert(data, tensor.data_type, mode)


def pending_conversion(tensor: onnx.TensorProto) -> str | None:
    """The conversion mode a weight on disk waits for (its bytes there are float32), or None."""
    for entry in tensor.external_data:
        if entry.key == PENDING:
            return entry.value
    return None


def defer_conversion(source: onnx.TensorProto, target: onnx.TensorProto, elem: int, mode: str) -> None:
    """Make `target` (`source` itself, or a new initializer) the float32 weight on disk that
    `source` refers to, as `elem`: converted when read or saved (`mode`: "cast"; "saturate":
    finite values beyond `elem`'s range become its largest, as for a mask sentinel; "clip": every
    value clipped to that range, as clamp does); "keep" refers to the same bytes unconverted."""
    entries = [(e.key, e.value) for e in source.external_data if e.key != PENDING]
    if target is not source:
        target.dims[:] = source.dims
        target.data_location = TensorProto.EXTERNAL
    del target.external_data[:]
    for key, value in entries + ([] if mode == "keep" else [(PENDING, mode)]):
        entry = target.external_data.add()
        entry.key, entry.value = key, value
    target.data_type = elem


def convert(data, elem: int, mode: str) -> np.ndarray:
    """float32 bytes as `elem` bytes (a flat uint8 array: no copy to `bytes` on the way to a file),
    as `defer_conversion` describes `mode`."""
    array = np.frombuffer(data, "<f4")
    largest = _LARGEST.get(elem)
    if largest is not None and mode == "clip":
        array = np.clip(array, -largest, largest)
    elif largest is not None and mode == "saturate":
        beyond = np.isfinite(array) & (np.abs(array) > largest)
        if beyond.any():
            array = np.where(beyond, np.copysign(np.float32(largest), array), array)
    with np.errstate(over="ignore"):
        return cast_values(array, elem).view(np.uint8)


@functools.cache
def _ort_float16_cast():
    """float32 array -> float16 array by a one-node ONNX Runtime session, or None if none can be made.

    Its Cast kernel converts with the CPU's F16C instructions, faster than numpy's astype
    (docs/benchmarks.md) and
    bit for bit the same (round to nearest even; only NaN payloads may differ), which matters with
    hundreds of megabytes of weights. bfloat16 stays with numpy: ONNX Runtime's Python API cannot
    hand a bfloat16 array back."""
    try:
        import onnxruntime as ort

        graph = helper.make_graph(
            [helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT16)],
            "cast",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [None])],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7)
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1  # chunks are small: threads cost more than they give
        options.log_severity_level = 3
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 - any failure: numpy does the same job
        return None
    return lambda array: session.run(None, {"x": array})[0]


def cast_values(array: np.ndarray, elem: int) -> np.ndarray:
    """Flat float32 `array` as `elem`, rounding to nearest even."""
    if elem == TensorProto.FLOAT16 and array.size >= ORT_CAST_MIN_VALUES:
        cast = _ort_float16_cast()
        if cast is not None:
            return cast(array)
    return array.astype(np_dtype(elem))
