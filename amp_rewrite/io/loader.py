"""Load a model safely: a path or a ModelProto in, a `LoadedModel` out, every failure one line.

The model stays an `onnx.ModelProto` (see ARCHITECTURE.md for why not onnx-ir). Loading checks
what a hostile or broken file could do: not protobuf, no graph, external data that escapes the
model's folder or is missing; `input_checks.validate` then checks the model itself.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from onnx import TensorProto

from amp_rewrite.errors import ModelError
from amp_rewrite.io import external
from amp_rewrite.io.input_checks import check_after_failure, validate
from amp_rewrite.io.output import interrupt_hook
from amp_rewrite.onnx_facts import all_graphs, walk


@dataclass
class LoadedModel:
    model: onnx.ModelProto
    path: Path | None  # None when the model came in memory
    had_external_data: bool
    data_files: tuple = ()  # the resolved external-data files it was read from (the output plan's reads)
    owned: bool = False  # True when nobody else holds `model` (read from a file): no copy needed
    lazy: bool = False  # big external weights stay on disk (tensordata reads them one at a time)
    data_bytes: int = 0  # bytes of tensor data, counted while validating
    float_bytes: int | None = None  # bytes of float weights, counted while validating
    nested: bool = True  # some node holds a subgraph (False: validation saw none)
    checked: bool = True  # False: loaded with checker=False, onnx.checker has not seen it yet
    notes: tuple = ()  # what loading changed in the working model (never in the input)
    memo: dict = field(
        default_factory=dict, repr=False, compare=False
    )  # what every rewrite of it computes alike

    def validate_in_full(self) -> None:
        """After a stage failed: run the checks `load(checker=False)` left out and those only worth
        running then (input_checks.check_after_failure); a ModelError if the input is at fault."""
        if self.owned:  # rewritten in place by now: read the input again
            model = load(self.path, lazy_weights=self.lazy).model
        else:
            model = self.model
            if not self.checked:
                validate(
                    model,
                    self.path if self.path is not None else "model",
                    skeleton=self.lazy,
                    in_memory=self.path is None,
                )
        check_after_failure(model, self.path if self.path is not None else "model")
        self.checked = True


def _fail(path, message: str):
    raise ModelError(f"{path}: {message}")


MAX_MODEL_BYTES = 2**31  # protobuf cannot parse more: larger weights must be external data
LAZY_MIN_BYTES = 2**20  # with lazy_weights, external tensors from this size stay on disk


def _load_external_data(
    model: onnx.ModelProto, path: Path, lazy: bool = False, outputs=None, walked=None, sparse=None
) -> tuple[tuple[Path, ...], bool]:
    """Check every external reference anywhere in the model (external.resolve), then read each
    (or, with `lazy`, point at it): (the data files read, whether any tensor was left on disk).
    Every reference is checked, and the data files against `outputs` (an OutputPlan), before
    any byte is read."""
    tensors = [t for t in external.model_tensors(model, walked, sparse) if external.is_external(t)]
    if not tensors:
        return (), False
    refs = [external.resolve(tensor, path.parent, path) for tensor in tensors]
    files = tuple(dict.fromkeys(ref.path for ref in refs))
    if outputs is not None:
        outputs.check_reads(files, label="a data file of the input model")
    # only the graphs' initializers may stay on disk: what `save` streams and tensordata's readers see
    graphs = walked[0] if walked is not None else all_graphs(model.graph)
    movable = {id(t) for g in graphs for t in g.initializer if external.is_external(t)} if lazy else set()
    left = False
    for tensor, ref in zip(tensors, refs):
        if id(tensor) in movable and ref.length >= LAZY_MIN_BYTES:
            external.point_at(tensor, ref)  # read when needed (tensordata), one at a time
            left = True
            continue
        tensor.raw_data = ref.read()
        tensor.data_location = TensorProto.DEFAULT
        del tensor.external_data[:]
    return files, left


def load(source, *, lazy_weights: bool = False, checker: bool = True, outputs=None) -> LoadedModel:
    """A path or a ModelProto -> LoadedModel; every failure is one ModelError line.

    `lazy_weights` leaves big external-data tensors on disk until they are read or saved: for
    a caller that will only rewrite and `save`, so memory stays near the converted size.
    `checker=False` leaves onnx.checker out of validation, for a caller that runs it on what it
    makes and calls `validate_in_full` when anything fails (see `pipeline.rewrite`).
    `outputs` (an `output.OutputPlan`): its writes are checked against the model's data files
    before any of them is read."""
    if isinstance(source, LoadedModel):
        return source
    if isinstance(source, onnx.ModelProto):
        if not source.HasField("graph"):
            raise ModelError("model has no graph")
        sparse: list = []
        walked = walk(source.graph, sparse)  # one walk, shared as for a file (0.15 s each at 100k nodes)
        if any(external.is_external(t) for t in external.model_tensors(source, walked, sparse)):
            raise ModelError("model refers to external data but came in memory: pass its path instead")
        notes = ()
        if _repeated_node_names(walked[0]):  # rare: renamed on a copy, the caller's stays
            source = _copied(source)
            walked = walk(source.graph)
            notes = (unique_node_names(walked[0]),)
        found = validate(source, "model", in_memory=True, checker=checker, walked=walked, names_unique=True)
        return LoadedModel(
            source,
            None,
            False,
            data_bytes=found.data_bytes,
            float_bytes=found.float_bytes,
            nested=found.nested,
            checked=checker,
            notes=notes,
        )
    if not isinstance(source, (str, os.PathLike)):
        raise ModelError(f"expected a path or an onnx.ModelProto, got {type(source).__name__}")
    path = Path(source)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        _fail(path, "no such file")
    except (OSError, ValueError) as exc:  # a NUL byte, a name too long, a loop of links
        _fail(path, f"cannot read ({getattr(exc, 'strerror', None) or exc})")
    if not stat.S_ISREG(mode):
        _fail(path, "not a file")
    data = external.read_bounded(path, MAX_MODEL_BYTES, what="model file")
    interrupt_hook("load")
    if not data:
        _fail(path, "empty file, not an ONNX model")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception as exc:
        if "MaxDepth" in str(exc):  # upb's limit: 100 nested messages, 31 levels of subgraphs
            _fail(
                path,
                "messages nested deeper than protobuf's limit of 100 (about 31 levels of nested "
                "subgraphs); ONNX Runtime cannot load it either",
            )
        _fail(path, "not an ONNX model (protobuf parse failed: truncated or not a model file)")
    del data
    if not model.HasField("graph") or not model.opset_import:
        _fail(path, "not an ONNX model (no graph or no opset imports)")
    sparse: list = []
    walked = walk(model.graph, sparse)  # one walk, shared by the external-data check and validation
    data_files, lazy = _load_external_data(model, path, lazy_weights, outputs, walked, sparse)
    notes = (unique_node_names(walked[0]),) if _repeated_node_names(walked[0]) else ()
    found = validate(model, path, skeleton=lazy, checker=checker, walked=walked, names_unique=True)
    return LoadedModel(
        model,
        path,
        bool(data_files),
        data_files,
        owned=True,
        lazy=lazy,
        data_bytes=found.data_bytes,
        float_bytes=found.float_bytes,
        nested=found.nested,
        checked=checker,
        notes=notes,
    )


def _repeated_node_names(graphs) -> bool:
    for graph in graphs:
        names = [node.name for node in graph.node if node.name]
        if len(names) != len(set(names)):
            return True
    return False


def unique_node_names(graphs) -> str:
    """Give each node whose name an earlier node of its graph holds a fresh one, `name_1`,
    `name_2`, ... in graph order (deterministic), unused anywhere in the model; returns the note.
    ONNX requires unique node names; some exporters repeat one (OpenVINO's 'F0::anon'), and
    ONNX Runtime loads them anyway, so this is a fix of the working copy, not a refusal."""
    taken = {node.name for graph in graphs for node in graph.node}
    renamed = {}
    for graph in graphs:
        seen = set()
        for node in graph.node:
            if not node.name:
                continue
            if node.name in seen:
                k = 1
                while f"{node.name}_{k}" in taken:
                    k += 1
                renamed.setdefault(node.name, []).append(f"{node.name}_{k}")
                node.name = f"{node.name}_{k}"
                taken.add(node.name)
            seen.add(node.name)
    count = sum(len(v) for v in renamed.values())
    shown = ", ".join(f"{old!r} x{len(new) + 1}" for old, new in list(renamed.items())[:3])
    return (
        f"renamed {count} nodes whose names repeat ({shown}{' ...' if len(renamed) > 3 else ''}): ONNX requires "
        f"unique node names; the later ones became name_1, name_2, ... (the input is unchanged)"
    )


def _copied(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy
