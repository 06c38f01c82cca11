"""The public API under random hostile input: every exception is an AmpRewriteError (issue 24).

Hypothesis mutates a small valid model (fields set to hostile values, nodes renamed, removed and
duplicated, tensors retyped, external data pointed anywhere, bytes flipped and cut), random
options, op-list YAML text, .npz bytes and checkpoints, and the CLI's argument vector. Whatever
it draws, `rewrite`, `io.load`, `load_op_lists`, `load_samples`, `read_checkpoint` raise nothing
but AmpRewriteError subclasses, with one-line messages, and the CLI never exits 70.

AMP_REWRITE_HYPOTHESIS_EXAMPLES=N runs N examples per property (the suite's default is small;
the figures in the issue's closing note come from a larger run).
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import onnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import amp_rewrite
from amp_rewrite.analysis.oplists import load_op_lists
from amp_rewrite.checks.validate import load_samples
from amp_rewrite.cli import main
from amp_rewrite.errors import AmpRewriteError
from amp_rewrite.io import load
from amp_rewrite.training.checkpoint import read_checkpoint
from helpers import load_script

make_corpus = load_script("tests/hostile/make_corpus.py")

EXAMPLES = int(os.environ.get("AMP_REWRITE_HYPOTHESIS_EXAMPLES", "40"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not os.environ.get("AMP_REWRITE_HYPOTHESIS_EXAMPLES"),
    suppress_health_check=list(HealthCheck),
)

NAMES = ["x", "y", "h", "r", "W1", "W2", "", "ghost", "x\0", "é", "a" * 300, "../../etc/passwd"]
OPS = [
    "Relu",
    "MatMul",
    "Add",
    "If",
    "Loop",
    "Cast",
    "Constant",
    "Softmax",
    "Exp",
    "Frob",
    "",
    "Scan",
    "Identity",
]
DOMAINS = ["", "ai.onnx", "com.microsoft", "local", "ai.onnx.ml", "\0", "x" * 200]
LOCATIONS = [
    "w.bin",
    "../outside.bin",
    "/etc/passwd",
    "/dev/zero",
    "",
    "w\0.bin",
    "x" * 5000,
    "loop",
    "fifo",
    "sub/../w.bin",
    ".",
]
ELEM_TYPES = list(range(-1, 26))


def _mutate(draw, model: onnx.ModelProto) -> None:
    """One hostile change to `model` (drawn)."""
    graph = model.graph
    kind = draw(
        st.sampled_from(
            [
                "ir",
                "opset",
                "op",
                "rename",
                "drop_node",
                "dup_node",
                "dims",
                "elem",
                "raw",
                "external",
                "attribute",
                "output_type",
                "function",
                "value_info",
                "sparse",
                "subgraph",
            ]
        )
    )
    if kind == "ir":
        model.ir_version = draw(st.integers(-5, 20))
    elif kind == "opset":
        opset = model.opset_import.add() if draw(st.booleans()) else model.opset_import[0]
        opset.domain, opset.version = draw(st.sampled_from(DOMAINS)), draw(st.integers(-2, 40))
    elif kind == "op" and graph.node:
        node = graph.node[draw(st.integers(0, len(graph.node) - 1))]
        node.op_type, node.domain = draw(st.sampled_from(OPS)), draw(st.sampled_from(DOMAINS[:4]))
    elif kind == "rename" and graph.node:
        node = graph.node[draw(st.integers(0, len(graph.node) - 1))]
        names = node.input if draw(st.booleans()) or not node.output else node.output
        if names:
            names[draw(st.integers(0, len(names) - 1))] = draw(st.sampled_from(NAMES))
        else:
            names.append(draw(st.sampled_from(NAMES)))
    elif kind == "drop_node" and graph.node:
        del graph.node[draw(st.integers(0, len(graph.node) - 1))]
    elif kind == "dup_node" and graph.node:
        graph.node.append(graph.node[draw(st.integers(0, len(graph.node) - 1))])
    elif kind == "dims" and graph.initializer:
        tensor = graph.initializer[draw(st.integers(0, len(graph.initializer) - 1))]
        del tensor.dims[:]
        tensor.dims.extend(draw(st.lists(st.integers(-3, 2**40), max_size=4)))
    elif kind == "elem" and graph.initializer:
        graph.initializer[draw(st.integers(0, len(graph.initializer) - 1))].data_type = draw(
            st.sampled_from(ELEM_TYPES)
        )
    elif kind == "raw" and graph.initializer:
        tensor = graph.initializer[draw(st.integers(0, len(graph.initializer) - 1))]
        tensor.raw_data = tensor.raw_data[: draw(st.integers(0, len(tensor.raw_data)))] + draw(
            st.binary(max_size=16)
        )
    elif kind == "external" and graph.initializer:
        tensor = graph.initializer[draw(st.integers(0, len(graph.initializer) - 1))]
        tensor.ClearField("raw_data")
        tensor.data_location = TensorProto.EXTERNAL
        for key in draw(
            st.lists(st.sampled_from(["location", "offset", "length", "checksum", "junk"]), max_size=4)
        ):
            entry = tensor.external_data.add()
            entry.key = key
            entry.value = draw(
                st.sampled_from(LOCATIONS)
                if key == "location"
                else st.sampled_from(["0", "-1", "512", "4096", "x", "", "99999999999999999999999"])
            )
    elif kind == "attribute" and graph.node:
        node = graph.node[draw(st.integers(0, len(graph.node) - 1))]
        value = draw(
            st.one_of(
                st.integers(-(2**63), 2**63 - 1),
                st.floats(),
                st.text(max_size=8),
                st.lists(st.integers(-5, 5), min_size=1, max_size=3),
            )
        )
        node.attribute.append(
            helper.make_attribute(draw(st.sampled_from(["axis", "to", "perm", "bogus", "value"])), value)
        )
    elif kind == "output_type":
        graph.output[0].type.tensor_type.elem_type = draw(st.sampled_from(ELEM_TYPES))
    elif kind == "function":
        body = [
            helper.make_node(draw(st.sampled_from(OPS)), ["a", draw(st.sampled_from(["b", "a", ""]))], ["c"])
        ]
        model.functions.append(
            helper.make_function("local", "F", ["a", "b"], ["c"], body, [helper.make_opsetid("", 17)])
        )
        graph.node.append(
            helper.make_node(
                "F",
                draw(st.lists(st.sampled_from(NAMES[:4]), max_size=3)),
                ["fy"],
                domain=draw(st.sampled_from(["local", "other"])),
                name="call",
            )
        )
        if draw(st.booleans()):
            model.opset_import.add(domain="local", version=1)
    elif kind == "value_info":
        graph.value_info.append(
            helper.make_tensor_value_info(
                draw(st.sampled_from(NAMES)), draw(st.sampled_from(ELEM_TYPES[2:])), None
            )
        )
    elif kind == "sparse":
        values = numpy_helper.from_array(np.ones(2, np.float32), "S")
        indices = numpy_helper.from_array(
            np.array(draw(st.lists(st.integers(-3, 300), min_size=2, max_size=2)), np.int64), "S_i"
        )
        graph.sparse_initializer.append(
            helper.make_sparse_tensor(values, indices, draw(st.lists(st.integers(-1, 40), max_size=3)))
        )
    elif kind == "subgraph" and graph.node:
        branch = helper.make_graph(
            [helper.make_node(draw(st.sampled_from(OPS)), [draw(st.sampled_from(NAMES[:5]))], ["b"])],
            "b",
            [],
            [helper.make_tensor_value_info("b", 1, None)],
        )
        graph.node[0].attribute.append(
            helper.make_attribute(draw(st.sampled_from(["then_branch", "body", "g"])), branch)
        )


@st.composite
def hostile_models(draw) -> bytes:
    model = make_corpus.valid_model()
    for _ in range(draw(st.integers(1, 3))):
        _mutate(draw, model)
    data = bytearray(model.SerializeToString())
    for _ in range(draw(st.integers(0, 2))):  # flip bytes: protobuf may still parse
        if data:
            data[draw(st.integers(0, len(data) - 1))] ^= draw(st.integers(1, 255))
    if draw(st.booleans()) and draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data)


@contextlib.contextmanager
def _folder():
    """A fresh folder with the files hostile locations name: a data file, a loop, a FIFO, a secret outside."""
    with tempfile.TemporaryDirectory() as root:
        root = Path(root)
        (root / "outside.bin").write_bytes(b"SECRET" * 200)
        folder = root / "m"
        folder.mkdir()
        (folder / "w.bin").write_bytes(np.ones(128, np.float32).tobytes())
        os.symlink("loop", folder / "loop")
        os.mkfifo(folder / "fifo")
        yield folder


@contextlib.contextmanager
def _chdir(folder: Path):
    """contextlib.chdir, which Python 3.10 lacks."""
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


def _only_ours(call):
    try:
        call()
    except AmpRewriteError as exc:
        assert "\n" not in str(exc), str(exc)


@SETTINGS
@given(data=hostile_models())
def test_rewrite_and_load_raise_only_amp_rewrite_errors(data):
    with _folder() as folder:
        path = folder / "model.onnx"
        path.write_bytes(data)
        _only_ours(lambda: amp_rewrite.rewrite(str(path)))
        _only_ours(lambda: load(path, lazy_weights=True))
        model = onnx.ModelProto()
        try:
            model.ParseFromString(data)
        except Exception:
            return
        _only_ours(lambda: amp_rewrite.rewrite(model, target="bfloat16"))


OPTION_VALUES = {
    "target": st.sampled_from(["float16", "bfloat16", "float8", "", "FLOAT16"]),
    "keep_fp32_nodes": st.lists(st.sampled_from(["mm1", "(", "[a-", ".*", "relu", "\\"]), max_size=2),
    "allow": st.lists(st.sampled_from(["Relu", "MatMul", "", " ", "a b", "com.x:Op"]), max_size=2),
    "deny": st.lists(st.sampled_from(["Relu", "MatMul", "Softmax"]), max_size=2),
    "dims": st.dictionaries(
        st.sampled_from(["batch", "", "n"]),
        st.one_of(st.integers(-2, 5), st.just(True), st.floats(allow_nan=True)),
    ),
    "relax_margin": st.floats(allow_nan=True, allow_infinity=True),
    "placement": st.sampled_from(["tf", "cost", "best", ""]),
    "provider": st.sampled_from(["cuda", "cpu", "any", "tpu", ""]),
    "op_block_list": st.one_of(st.none(), st.sampled_from(["Relu", ["MatMul"]])),
    "op_lists": st.lists(
        st.sampled_from(["/nonexistent.yaml", "/dev/zero", "/etc/passwd", "", "."]), max_size=1
    ),
}


@SETTINGS
@given(options=st.fixed_dictionaries({}, optional=OPTION_VALUES))
def test_rewrite_options_raise_only_amp_rewrite_errors(options):
    _only_ours(lambda: amp_rewrite.rewrite(make_corpus.valid_model(), **options))


YAML_PIECES = [
    "allow:",
    "deny:",
    "infer:",
    "clear:",
    "target:",
    "extends:",
    " - Relu",
    " MatMul: why",
    "[",
    "]",
    "{",
    "}",
    "&a",
    "*a",
    "!!python/object:os.system",
    "\n",
    "  ",
    "- ",
    "float16",
    "bfloat16",
    "../outside.bin",
    "/dev/zero",
    "fifo",
    "\xff",
    "\0",
    ": ",
    "'",
    '"',
    "#",
    "? ",
    "|",
    ">",
]


@SETTINGS
@given(text=st.lists(st.sampled_from(YAML_PIECES), max_size=30).map("".join), raw=st.binary(max_size=20))
def test_op_list_files_raise_only_op_list_errors(text, raw):
    with _folder() as folder:
        path = folder / "lists.yaml"
        path.write_bytes(text.encode("utf-8", "surrogatepass") + (raw if raw.startswith(b"#") else b""))
        _only_ours(lambda: load_op_lists("float16", user_files=[path]))


def _good_npz() -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **{"0/x": np.ones((2, 4), np.float32), "1/x": np.zeros((2, 4), np.float32)})
    return buffer.getvalue()


@SETTINGS
@given(
    cuts=st.lists(st.tuples(st.integers(0, 2000), st.integers(0, 255)), max_size=4),
    cut=st.integers(0, 2000),
    compress=st.booleans(),
)
def test_sample_files_raise_only_usage_errors(cuts, cut, compress):
    data = bytearray(_good_npz())
    if compress:
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
            archive.writestr("x.npy", bytes(data[-200:]))
        data = bytearray(buffer.getvalue())
    for at, value in cuts:
        data[at % len(data)] = value
    with _folder() as folder:
        path = folder / "s.npz"
        path.write_bytes(bytes(data[: max(cut, len(data) // 2)]))
        _only_ours(lambda: load_samples(path, make_corpus.valid_model()))


EXPECTED_META = {
    "format": "amp-rewrite-trainer/1",
    "optimizer": {"kind": "SGD", "lr": 0.1},
    "loss_scale": {"kind": "none"},
    "lr": 0.1,
}
EXPECTED_STATE = {"W": np.zeros((4, 2), np.float32), "step": np.zeros((), np.int64)}


def _checkpoint_bytes(meta: str, names: list, shapes: list) -> bytes:
    buffer = io.BytesIO()
    arrays = {f"state_{i}": np.zeros(s, np.float32) for i, s in enumerate(shapes)}
    np.savez(buffer, meta=np.array(meta, dtype=np.str_), names=np.array(names, dtype=np.str_), **arrays)
    return buffer.getvalue()


@SETTINGS
@given(
    meta=st.one_of(
        st.text(max_size=40),
        st.sampled_from(
            [
                '{"format": "amp-rewrite-trainer/1"}',
                "[]",
                "1",
                "null",
                '{"lr": "x", "format": 1, "optimizer": 2, "loss_scale": 3}',
            ]
        ),
    ),
    names=st.lists(st.sampled_from(["W", "step", "", "W"]), max_size=3),
    shapes=st.lists(st.lists(st.integers(0, 3), max_size=2), max_size=3),
    flips=st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 255)), max_size=2),
)
def test_checkpoints_raise_only_training_errors(meta, names, shapes, flips):
    data = bytearray(_checkpoint_bytes(meta, names, shapes))
    for at, value in flips:
        data[at % len(data)] = value
    with _folder() as folder:
        path = folder / "c.npz"
        path.write_bytes(bytes(data))
        _only_ours(lambda: read_checkpoint(path, EXPECTED_META, EXPECTED_STATE))


FLAGS = [
    "--target",
    "--force",
    "--dry-run",
    "--report",
    "--html",
    "--allow",
    "--deny",
    "--op-lists",
    "--keep-fp32-node",
    "--clamp",
    "--provider",
    "--placement",
    "--dim",
    "--external-data",
    "--validate",
    "--calibrate",
    "--tolerance",
    "--inputs",
    "--samples",
    "--rtol",
    "--atol",
    "--safety",
    "--max-runs",
    "--explain",
    "--keep-failed",
    "-o",
    "--relax-margin",
    "--reference",
    "--quiet",
]
VALUES = [
    "0",
    "-1",
    "nan",
    "inf",
    "1e-400",
    "float16",
    "cpu",
    "batch=0",
    "x=",
    "relu",
    "(",
    "{out}",
    "{model}",
    "{data}",
    "{fifo}",
    "{folder}",
    "a\nb",
    "1",
]


@SETTINGS
@given(argv=st.lists(st.one_of(st.sampled_from(FLAGS), st.sampled_from(VALUES)), max_size=6))
def test_the_cli_never_exits_70(argv):
    with _folder() as folder:
        model = folder / "model.onnx"
        model.write_bytes(make_corpus.valid_model().SerializeToString())
        names = {
            "out": str(folder / "out.onnx"),
            "model": str(model),
            "data": str(folder / "w.bin"),
            "fifo": str(folder / "fifo"),
            "folder": str(folder),
        }
        args = [str(model), *(a.format(**names) for a in argv), "--provider", "cpu", "--reference", "never"]
        err = io.StringIO()
        with _chdir(folder), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(args)  # relative outputs ("-o cpu") land in the temporary folder
        assert code != 70, (args, err.getvalue())
        lines = [line for line in err.getvalue().splitlines() if line.startswith("amp-rewrite: error")]
        assert code == 0 or len(lines) == 1, (args, err.getvalue())
