"""The hostile-input corpus: every way a model, a list, a flag or a disk can be wrong.

Each case writes its (small) files into a folder and says how the CLI and the API are called,
which exit code / exception class it must end in, and a piece of the one error line. The corpus
is generated, not committed: `python tests/hostile/make_corpus.py OUTDIR` writes every case into
OUTDIR/<case>/ and prints the table; tests/hostile/test_hostile.py generates each case into tmp_path.

Exit codes (amp_rewrite/errors.py): 2 usage, 3 model, 4 op list, 5 output.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

USAGE, MODEL, OPLIST, OUTPUT = 2, 3, 4, 5
IR = 8


@dataclass
class Built:
    """What a case needs to run: CLI arguments, an API call (or None: CLI only), and patches."""

    cli: list[str]
    api: Callable[[], object] | None
    patch: str | None = None  # 'enospc': writes fail with ENOSPC (in-process only)
    watch: list[Path] = field(default_factory=list)  # folders that must be left exactly as they were


@dataclass
class Case:
    name: str
    code: int
    message: str
    build: Callable[[Path], Built]


# --- model builders (no checker: these models are broken on purpose) -----------------------------


def _vi(name, shape=(2, 4), elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, list(shape))


def _model(nodes, inputs=("x",), outputs=("y",), inits=(), opset=17, ir=IR, opsets=None):
    graph = helper.make_graph(
        list(nodes),
        "g",
        [_vi(i) if isinstance(i, str) else i for i in inputs],
        [_vi(o) if isinstance(o, str) else o for o in outputs],
        list(inits),
    )
    model = helper.make_model(graph, opset_imports=opsets or [helper.make_opsetid("", opset)])
    model.ir_version = ir
    return model


def _n(op, inputs, outputs, name=None, domain="", **attrs):
    return helper.make_node(
        op, list(inputs), list(outputs), name=name or f"{op}_{outputs[0]}", domain=domain, **attrs
    )


def valid_model() -> onnx.ModelProto:
    """MatMul -> Relu -> MatMul: a model that rewrites (so failures are the hostile part's)."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array((rng.standard_normal((4, 32)) / 2).astype(np.float32), "W1")
    w2 = numpy_helper.from_array((rng.standard_normal((32, 4)) / 6).astype(np.float32), "W2")
    return _model(
        [
            _n("MatMul", ["x", "W1"], ["h"], "mm1"),
            _n("Relu", ["h"], ["r"], "relu"),
            _n("MatMul", ["r", "W2"], ["y"], "mm2"),
        ],
        inits=[w1, w2],
    )


def _write_model(folder: Path, model: onnx.ModelProto, name="model.onnx") -> Path:
    path = folder / name
    path.write_bytes(model.SerializeToString())
    return path


def _api_rewrite(path, **kwargs):
    def call():
        import amp_rewrite

        return amp_rewrite.rewrite(str(path), **kwargs)

    return call


def _model_case(make: Callable[[], onnx.ModelProto]):
    def build(folder: Path) -> Built:
        path = _write_model(folder, make())
        return Built([str(path)], _api_rewrite(path))

    return build


def _bytes_case(data: bytes, name="model.onnx"):
    def build(folder: Path) -> Built:
        path = folder / name
        path.write_bytes(data)
        return Built([str(path)], _api_rewrite(path))

    return build


def _with_external(folder: Path, location: str, length_delta=0, write_data=True) -> Path:
    """A model whose W1 lives in external data at `location` (written where it points)."""
    model = valid_model()
    w1 = model.graph.initializer[0]
    raw = w1.raw_data
    w1.ClearField("raw_data")
    w1.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(len(raw) + length_delta))):
        entry = w1.external_data.add()
        entry.key, entry.value = key, value
    target = Path(location) if os.path.isabs(location) else folder / location
    if write_data:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(raw[: len(raw) + min(length_delta, 0)] if length_delta < 0 else raw)
    return _write_model(folder, model)


def _external_case(location_of: Callable[[Path], str], message_write=True, length_delta=0, symlink=False):
    def build(folder: Path) -> Built:
        model_dir = folder / "models"
        model_dir.mkdir()
        outside = folder / "outside"
        outside.mkdir()
        location = location_of(folder)
        if symlink:  # the data file is a link pointing out of the model's folder
            raw = valid_model().graph.initializer[0].raw_data
            (outside / "secret.bin").write_bytes(raw)
            os.symlink(outside / "secret.bin", model_dir / "weights.bin")
            path = _with_external(model_dir, "weights.bin", write_data=False)
        else:
            path = _with_external(model_dir, location, length_delta=length_delta, write_data=message_write)
        return Built([str(path)], _api_rewrite(path), watch=[model_dir, outside])

    return build


def _yaml_case(text: str | bytes, extra_files: dict[str, str] | None = None):
    def build(folder: Path) -> Built:
        path = _write_model(folder, valid_model())
        lists = folder / "lists.yaml"
        lists.write_bytes(text.encode() if isinstance(text, str) else text)
        for name, content in (extra_files or {}).items():
            (folder / name).write_text(content)
        return Built(
            [str(path), "--op-lists", str(lists), "--dry-run"], _api_rewrite(path, op_lists=[str(lists)])
        )

    return build


def _args_case(args: list[str], api_kwargs: dict | None = None):
    """CLI flags (MODEL stands for the model path); api_kwargs: the same mistake through the API."""

    def build(folder: Path) -> Built:
        path = _write_model(folder, valid_model())
        cli = [str(path) if a == "MODEL" else a for a in args]
        return Built(cli, _api_rewrite(path, **api_kwargs) if api_kwargs is not None else None)

    return build


# --- the cases -----------------------------------------------------------------------------------


def _truncated():
    data = valid_model().SerializeToString()
    return data[: len(data) // 2]


def _no_graph():
    model = onnx.ModelProto(ir_version=IR)
    model.opset_import.add(domain="", version=17)
    model.producer_name = "hostile"
    return model


def _no_opset():
    model = valid_model()
    del model.opset_import[:]
    return model


def _with(mutate):
    def make():
        model = valid_model()
        mutate(model)
        return model

    return make


def _set_ir(model, version):
    model.ir_version = version


def _set_opset(model, version):
    model.opset_import[0].version = version


def _no_type(model):
    model.graph.input[0].ClearField("type")


def _no_elem_type(model):
    model.graph.input[0].type.tensor_type.elem_type = 0


def _short_raw(model):
    w = model.graph.initializer[0]
    w.raw_data = w.raw_data[:-8]


def _short_typed(model):
    w = model.graph.initializer[1]
    values = numpy_helper.to_array(w).ravel()[:-3]
    w.ClearField("raw_data")
    w.float_data.extend(values.tolist())


def _negative_dim(model):
    w = model.graph.initializer[0]
    w.dims[0] = -4


def _huge_claim(model):
    w = model.graph.initializer[0]
    w.ClearField("raw_data")
    del w.dims[:]
    w.dims.extend([2**20, 2**20])


def _dup_init(model):
    model.graph.initializer.append(model.graph.initializer[0])


def _dup_input(model):
    model.graph.input.append(model.graph.input[0])


def _output_undefined(model):
    model.graph.output[0].name = "nowhere"


def _bad_attr(model):
    model.graph.node[1].attribute.append(helper.make_attribute("bogus", 3))


def _missing_input(model):
    del model.graph.node[0].input[1:]


def _empty_op(model):
    model.graph.node[1].op_type = ""


def _unknown_op(model):
    model.graph.node[1].op_type = "Frobnicate"


def _dup_opset(model):
    model.opset_import.add(domain="ai.onnx", version=17)


def _wrong_elem(model):
    model.graph.initializer[0].data_type = 999


CASES: list[Case] = [
    # files that are not models
    Case("empty_file", MODEL, "empty file", _bytes_case(b"")),
    Case("random_bytes", MODEL, "not an ONNX model", _bytes_case(np.random.default_rng(7).bytes(4096))),
    Case("truncated_model", MODEL, "not an ONNX model", _bytes_case(_truncated())),
    Case("text_file", MODEL, "not an ONNX model", _bytes_case(b"ir_version: 8\nthis is not a model\n")),
    Case(
        "tensor_proto_not_model",
        MODEL,
        "not an ONNX model",
        _bytes_case(numpy_helper.from_array(np.ones((3, 3), np.float32), "t").SerializeToString()),
    ),
    Case(
        "graph_proto_not_model",
        MODEL,
        "not an ONNX model",
        _bytes_case(valid_model().graph.SerializeToString()),
    ),
    Case("model_without_graph", MODEL, "no graph", _model_case(_no_graph)),
    Case("model_without_opsets", MODEL, "no opset", _model_case(_no_opset)),
    Case(
        "missing_file",
        MODEL,
        "no such file",
        lambda d: Built([str(d / "absent.onnx")], _api_rewrite(d / "absent.onnx")),
    ),
    Case("directory_as_model", MODEL, "not a file", lambda d: Built([str(d)], _api_rewrite(d))),
    # graphs that are not valid
    Case(
        "cycle",
        MODEL,
        "cycle",
        _model_case(
            lambda: _model(
                [
                    _n("Relu", ["b"], ["a"], "r1"),
                    _n("Relu", ["a"], ["b"], "r2"),
                    _n("Add", ["x", "b"], ["y"], "add"),
                ]
            )
        ),
    ),
    Case(
        "undefined_input",
        MODEL,
        "which nothing defines",
        _model_case(lambda: _model([_n("Add", ["x", "ghost"], ["y"], "add")])),
    ),
    Case(
        "undefined_in_subgraph",
        MODEL,
        "which nothing defines",
        _model_case(
            lambda: _model(
                [
                    _n(
                        "Constant",
                        [],
                        ["c"],
                        "c",
                        value=helper.make_tensor("v", TensorProto.BOOL, [], [True]),
                    ),
                    _n(
                        "If",
                        ["c"],
                        ["y"],
                        "if",
                        then_branch=helper.make_graph(
                            [_n("Relu", ["phantom"], ["t"], "tr")], "then", [], [_vi("t")]
                        ),
                        else_branch=helper.make_graph(
                            [_n("Relu", ["x"], ["e"], "er")], "else", [], [_vi("e")]
                        ),
                    ),
                ]
            )
        ),
    ),
    Case(
        "duplicate_tensor_name",
        MODEL,
        "defined twice",
        _model_case(lambda: _model([_n("Relu", ["x"], ["y"], "a"), _n("Sigmoid", ["x"], ["y"], "b")])),
    ),
    Case("duplicate_initializer", MODEL, "defined twice", _model_case(_with(_dup_init))),
    Case("duplicate_graph_input", MODEL, "defined twice", _model_case(_with(_dup_input))),
    Case(
        "graph_without_outputs",
        MODEL,
        "no outputs",
        _model_case(_with(lambda m: m.graph.ClearField("output"))),
    ),
    Case("output_not_produced", MODEL, "not produced", _model_case(_with(_output_undefined))),
    Case(
        "undeclared_op_domain",
        MODEL,
        "No opset import for domain",
        _model_case(lambda: _model([_n("Frob", ["x"], ["y"], "frob", domain="com.hostile")])),
    ),
    Case("unknown_op_default_domain", MODEL, "Frobnicate", _model_case(_with(_unknown_op))),
    Case("empty_op_type", MODEL, "invalid ONNX model", _model_case(_with(_empty_op))),
    Case("unknown_attribute", MODEL, "bogus", _model_case(_with(_bad_attr))),
    Case("missing_required_input", MODEL, "invalid ONNX model", _model_case(_with(_missing_input))),
    Case("duplicate_opset_import", MODEL, "imported twice", _model_case(_with(_dup_opset))),
    # versions
    Case("ir_version_too_new", MODEL, "IR version 14 is newer", _model_case(_with(lambda m: _set_ir(m, 14)))),
    Case(
        "ir_version_far_future", MODEL, "IR version 99 is newer", _model_case(_with(lambda m: _set_ir(m, 99)))
    ),
    Case("ir_version_missing", MODEL, "no IR version", _model_case(_with(lambda m: _set_ir(m, 0)))),
    Case(
        "opset_too_new_for_ort",
        MODEL,
        "newer than ONNX Runtime",
        _model_case(_with(lambda m: _set_opset(m, 27))),
    ),
    Case(
        "opset_far_future", MODEL, "newer than ONNX Runtime", _model_case(_with(lambda m: _set_opset(m, 99)))
    ),
    # types and tensors
    Case("input_without_type", MODEL, "type", _model_case(_with(_no_type))),
    Case("input_without_elem_type", MODEL, "no element type", _model_case(_with(_no_elem_type))),
    Case("initializer_raw_data_short", MODEL, "needs 512", _model_case(_with(_short_raw))),
    Case("initializer_typed_data_short", MODEL, "needs 128", _model_case(_with(_short_typed))),
    Case("initializer_negative_dim", MODEL, "negative dimension", _model_case(_with(_negative_dim))),
    Case("initializer_huge_shape_no_data", MODEL, "needs", _model_case(_with(_huge_claim))),
    Case("initializer_unknown_dtype", MODEL, "unknown element type", _model_case(_with(_wrong_elem))),
    # external data
    Case(
        "external_data_missing",
        MODEL,
        "is missing",
        _external_case(lambda d: "weights.bin", message_write=False),
    ),
    Case(
        "external_data_dotdot",
        MODEL,
        "escapes the model's folder",
        _external_case(lambda d: "../outside/w.bin"),
    ),
    Case(
        "external_data_absolute",
        MODEL,
        "must be a relative path",
        _external_case(lambda d: str(d / "outside" / "w.bin")),
    ),
    Case(
        "external_data_symlink_out",
        MODEL,
        "escapes the model's folder",
        _external_case(lambda d: "weights.bin", symlink=True),
    ),
    Case(
        "external_data_short", MODEL, "needs 512", _external_case(lambda d: "weights.bin", length_delta=-100)
    ),
    # op lists
    Case(
        "yaml_alias_bomb",
        OPLIST,
        "aliases are not allowed",
        _yaml_case(
            "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
            "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nallow: [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
        ),
    ),
    Case("yaml_unknown_key", OPLIST, "unknown key 'alow'", _yaml_case("alow:\n  MatMul: typo\n")),
    Case("yaml_op_in_two_lists", OPLIST, "in both", _yaml_case("allow: [Softmax]\ndeny: [Softmax]\n")),
    Case("yaml_syntax_error", OPLIST, "invalid YAML", _yaml_case("allow: [MatMul\ndeny: {\n")),
    Case("yaml_not_mapping", OPLIST, "must be a mapping", _yaml_case("- MatMul\n- Relu\n")),
    Case(
        "yaml_python_tag",
        OPLIST,
        "invalid YAML",
        _yaml_case("allow: !!python/object/apply:os.system ['true']\n"),
    ),
    Case("yaml_binary", OPLIST, "not UTF-8", _yaml_case(b"\xff\xfe\x00allow")),
    Case("yaml_bad_entry", OPLIST, "not an op type name", _yaml_case("allow:\n  - [MatMul]\n")),
    Case("yaml_extends_loop", OPLIST, "loops back", _yaml_case("extends: lists.yaml\nallow: [MatMul]\n")),
    Case(
        "yaml_wrong_target", OPLIST, "written for target", _yaml_case("target: bfloat16\nallow: [MatMul]\n")
    ),
    Case(
        "yaml_missing_file",
        OPLIST,
        "cannot read op list",
        _args_case(
            ["MODEL", "--op-lists", "/nonexistent/lists.yaml"], {"op_lists": ["/nonexistent/lists.yaml"]}
        ),
    ),
    Case(
        "flag_op_in_two_lists",
        OPLIST,
        "in both",
        _args_case(
            ["MODEL", "--allow", "Softmax", "--deny", "Softmax"], {"allow": ["Softmax"], "deny": ["Softmax"]}
        ),
    ),
    # bad CLI values
    Case("bad_target", USAGE, "'float8'", _args_case(["MODEL", "--target", "float8"], {"target": "float8"})),
    Case(
        "bad_regex",
        USAGE,
        "regular expression",
        _args_case(["MODEL", "--keep-fp32-node", "(unclosed"], {"keep_fp32_nodes": ["(unclosed"]}),
    ),
    Case("unknown_flag", USAGE, "unrecognized arguments", _args_case(["MODEL", "--make-it-fast"])),
    Case("missing_model_argument", USAGE, "required", lambda d: Built([], None)),
    Case("flag_missing_value", USAGE, "expected one argument", _args_case(["MODEL", "-o"])),
    # outputs
    Case("output_is_input", OUTPUT, "is the input", _args_case(["MODEL", "-o", "MODEL", "--force"])),
    Case("output_exists", OUTPUT, "already exists", lambda d: _existing_output(d)),
    Case(
        "output_folder_missing",
        OUTPUT,
        "does not exist",
        lambda d: _args_case(["MODEL", "-o", str(d / "no" / "such" / "out.onnx")])(d),
    ),
    Case("output_is_directory", OUTPUT, "is a directory", lambda d: _output_dir(d)),
    Case(
        "output_folder_unwritable",
        OUTPUT,
        "not writable" if os.geteuid() != 0 else "cannot write",
        lambda d: _unwritable(d),
    ),
    Case("report_is_input", OUTPUT, "is the input", _args_case(["MODEL", "--dry-run", "--report", "MODEL"])),
    Case("disk_full", OUTPUT, "No space left", lambda d: _disk_full(d, external=False)),
    Case("disk_full_external_data", OUTPUT, "No space left", lambda d: _disk_full(d, external=True)),
]


def _existing_output(folder: Path) -> Built:
    path = _write_model(folder, valid_model())
    (folder / "out.onnx").write_bytes(b"previous output")
    return Built([str(path), "-o", str(folder / "out.onnx")], None)


def _output_dir(folder: Path) -> Built:
    path = _write_model(folder, valid_model())
    (folder / "out.onnx").mkdir()
    return Built([str(path), "-o", str(folder / "out.onnx"), "--force"], None)


def _unwritable(folder: Path) -> Built:
    path = _write_model(folder, valid_model())
    if os.geteuid() == 0:  # root writes anywhere a mode allows nothing; /proc refuses even root
        return Built([str(path), "-o", "/proc/amp-rewrite-out.onnx"], None)
    locked = folder / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    return Built([str(path), "-o", str(locked / "out.onnx")], None, watch=[folder, locked])


def _disk_full(folder: Path, external: bool) -> Built:
    path = _write_model(folder, valid_model())

    def api():
        import amp_rewrite
        from amp_rewrite import io as model_io

        result = amp_rewrite.rewrite(str(path))
        model_io.save(result.model, folder / "api_out.onnx", external_data=external)

    cli = [str(path), "-o", str(folder / "out.onnx")] + (["--external-data"] if external else [])
    return Built(cli, api, patch="enospc")


def enospc_write(*args, **kwargs):
    """Stand-in for os.fsync on a full disk."""
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: make_corpus.py OUTDIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    for case in CASES:
        folder = out / case.name
        folder.mkdir(parents=True, exist_ok=True)
        built = case.build(folder)
        print(f"{case.code}  {case.name:32s} {' '.join(built.cli)}")
    print(f"{len(CASES)} cases")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
