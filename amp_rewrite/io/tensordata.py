"""The bytes of a tensor, wherever they are: in the proto, or in a checked external-data file.

A model loaded with `lazy_weights` keeps its big weights on disk: each such tensor refers to its
file by an absolute path that loading already checked (`external.resolve`), and only such a
reference is ever opened. Reading
one tensor at a time (range checks, conversion, saving) keeps memory near one copy of the
converted weights instead of the original and the converted side by side.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from amp_rewrite.io import external


def is_external(tensor: onnx.TensorProto) -> bool:
    return tensor.data_location == TensorProto.EXTERNAL


def external_info(tensor: onnx.TensorProto) -> dict:
    return {entry.key: entry.value for entry in tensor.external_data}


def tensor_bytes(tensor: onnx.TensorProto) -> bytes:
    """Raw little-endian bytes of `tensor`'s values."""
    if is_external(tensor):  # only ever a reference the loader checked (external.point_at)
        return external.checked_reference(tensor).read()
    if tensor.HasField("raw_data"):
        return tensor.raw_data
    return numpy_helper.to_array(tensor).tobytes()


def float_values(tensor: onnx.TensorProto) -> np.ndarray:
    """A float32 tensor's values, flat, read straight from its bytes when stored as bytes."""
    if tensor.data_type == TensorProto.FLOAT and (is_external(tensor) or tensor.HasField("raw_data")):
        return np.frombuffer(tensor_bytes(tensor), dtype="<f4")
    return numpy_helper.to_array(tensor).reshape(-1)
