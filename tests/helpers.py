"""Small builders and runners shared by the tests.

Models are built at IR version 8 because ONNX Runtime refuses the IR version onnx writes by
default. Every rewrite test runs both models: `run_ort` (what users run) and `run_reference`
(onnx.reference keeps every tensor in its declared type, so it shows float16 overflow that ONNX
Runtime's CPU provider hides by computing in float32).

Random values come from a generator made in the test (or builder) that uses them
(`np.random.default_rng(seed)`), never from one shared by a module: under `pytest -n 2` the
tests a worker runs, and their order, change from run to run.

`tools/` and `examples/` are folders of scripts, not packages, and never on sys.path: a test that
needs one loads it from its file with `load_tool("synthetic")` / `load_script("examples/x.py")`.
Tools never import from tests/.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from amp_rewrite.checks.validate import synthesise

IR_VERSION = 8
FLOAT = TensorProto.FLOAT
ROOT = Path(__file__).resolve().parent.parent  # the checkout: tools/ and examples/ live there


def load_script(path: str, needs=()):
    """The script at `path` (relative to the checkout) as a module, loaded once per process from
    its file and registered under its file's stem. `needs`: the paths of the sibling scripts it
    imports (`import synthetic`), loaded first so that import finds them; run as a script, Python
    puts the script's own folder on sys.path, so tools import siblings plainly."""
    for sibling in needs:
        load_script(sibling)
    file = ROOT / path
    name = file.stem
    loaded = sys.modules.get(name)
    if loaded is not None:
        if Path(getattr(loaded, "__file__", None) or "").resolve() == file:
            return loaded
        raise RuntimeError(f"{path}: a module named {name!r} is imported already, from {loaded.__file__}")
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickle look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def run_script(path: str, *args: str, timeout: int = 60) -> subprocess.CompletedProcess:
    """`python <path> <args>` from the checkout's root, output captured. The script imports the
    installed amp_rewrite, as the tests do (CI installs the wheel)."""
    return subprocess.run(
        [sys.executable, str(ROOT / path), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def load_tool(name: str, needs=()):
    """tools/<name>.py as a module; `needs`: the names of the sibling tools it imports (see load_script)."""
    return load_script(f"tools/{name}.py", [f"tools/{n}.py" for n in needs])


def tensor(name, shape, elem_type=FLOAT):
    """A graph input/output declaration."""
    return helper.make_tensor_value_info(name, elem_type, shape)


def init(name, array):
    """An initializer from a numpy array."""
    return numpy_helper.from_array(np.asarray(array), name)


def node(op, inputs, outputs, name=None, domain="", **attrs):
    return helper.make_node(op, inputs, outputs, name=name or f"{op}_{outputs[0]}", domain=domain, **attrs)


def make_model(nodes, inputs, outputs, initializers=(), opset=17, ir_version=IR_VERSION, extra_opsets=()):
    graph = helper.make_graph(list(nodes), "g", list(inputs), list(outputs), list(initializers))
    opsets = [helper.make_opsetid("", opset), *[helper.make_opsetid(d, v) for d, v in extra_opsets]]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=ir_version)
    onnx.checker.check_model(model, full_check=True)
    return model


def weights(rng, *shape, scale=0.3):
    """float32 weights of `shape` from the caller's generator."""
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def mlp(seed=0):
    """MatMul -> Add -> Relu -> MatMul -> LogSoftmax over [N, 8]: allow, infer, clear, allow, deny."""
    rng = np.random.default_rng(seed)
    return make_model(
        [
            node("MatMul", ["x", "W1"], ["h"], "mm1"),
            node("Add", ["h", "b1"], ["h2"], "add1"),
            node("Relu", ["h2"], ["r"], "relu"),
            node("MatMul", ["r", "W2"], ["y"], "mm2"),
            node("LogSoftmax", ["y"], ["p"], "sm", axis=-1),
        ],
        [tensor("x", ["N", 8])],
        [tensor("p", ["N", 4])],
        [init("W1", weights(rng, 8, 16)), init("b1", weights(rng, 16)), init("W2", weights(rng, 16, 4))],
    )


def session(model):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    # ONNX Runtime 1.31's MatMulScaleFusion drops a Mul's output that another node still reads
    # (x*c read by a MatMul and by a Mul: "Node input 't4' is not ... output of a previous node");
    # hypothesis found such a graph, so the models under test load without that fusion
    return ort.InferenceSession(
        model.SerializeToString(),
        options,
        providers=["CPUExecutionProvider"],
        disabled_optimizers=["MatMulScaleFusion"],
    )


def run_ort(model, feeds):
    return session(model).run(None, feeds)


def run_reference(model, feeds):
    return ReferenceEvaluator(model).run(None, feeds)


def random_feeds(model, seed=0, scale=1.0):
    """Random float32 inputs for every graph input (dims given as strings become 2)."""
    return synthesise(model, seed=seed, scale=scale, default_dim=2)[0]


def assert_close(actual, expected, rtol=1e-2, atol=1e-2):
    for a, e in zip(actual, expected):
        a = np.asarray(a)
        e = np.asarray(e)
        assert a.shape == e.shape, (a.shape, e.shape)
        np.testing.assert_allclose(a.astype(np.float64), e.astype(np.float64), rtol=rtol, atol=atol)


def check_both(original, rewritten, feeds=None, rtol=2e-2, atol=2e-2):
    """Checker (full), then ORT and the reference evaluator against the float32 original: the
    check every rewrite test makes of its result."""
    onnx.checker.check_model(rewritten, full_check=True)
    feeds = feeds or random_feeds(original)
    expected = run_ort(original, feeds)
    assert_close(run_ort(rewritten, feeds), expected, rtol, atol)
    assert_close(run_reference(rewritten, feeds), expected, rtol, atol)
    return expected


def big_weights_model():
    """Weights above the skeleton limit (1024 values), so an in-memory rewrite borrows them: one
    converted in place (with a doc string and metadata), one read in both precisions, one only
    in float32, and a big int64 tensor that is never converted."""
    rng = np.random.default_rng(0)
    w_shared = init("W_shared", weights(rng, 64, 64))
    w_doc = init("W_doc", weights(rng, 64, 64))
    w_doc.doc_string = "kept through the conversion"
    w_doc.metadata_props.add(key="origin", value="test")
    return make_model(
        [
            node("MatMul", ["x", "W_doc"], ["h"], "mm1"),
            node("MatMul", ["h", "W_shared"], ["y"], "mm2"),
            node("ReduceSum", ["W_shared"], ["s"], "sum_shared", keepdims=0),
            node("ReduceMean", ["W_f32"], ["m"], "mean_f32", keepdims=0),
            node("Gather", ["W_shared", "idx"], ["g"], "gather", axis=0),
            node("ReduceSum", ["g"], ["gs"], "sum_gathered", keepdims=0),
        ],
        [tensor("x", ["N", 64])],
        [tensor("y", ["N", 64]), tensor("s", []), tensor("m", []), tensor("gs", [])],
        [
            w_doc,
            w_shared,
            init("W_f32", weights(rng, 48, 48)),
            init("idx", np.arange(2000, dtype=np.int64) % 64),
        ],
    )


def deny_chain_model():
    """m1 -> ln/ReduceMean -> r1 (Reshape) -> a (Add with m1's output) -> m2."""
    rng = np.random.default_rng(0)
    inits = [
        init("W1", rng.standard_normal((16, 32)).astype(np.float32) * 0.3),
        init("W2", rng.standard_normal((32, 8)).astype(np.float32) * 0.3),
        init("shape", np.array([4, 1], np.int64)),
    ]
    nodes = [
        node("MatMul", ["x", "W1"], ["h"], name="m1"),
        node("ReduceMean", ["h"], ["mu"], name="ln/ReduceMean", axes=[1], keepdims=1),
        node("Reshape", ["mu", "shape"], ["mu2"], name="r1"),
        node("Add", ["h", "mu2"], ["s"], name="a"),
        node("MatMul", ["s", "W2"], ["y"], name="m2"),
    ]
    return make_model(nodes, [tensor("x", [4, 16])], [tensor("y", [4, 8])], inits)


def loaded_provider() -> str:
    """The provider a "cuda"/"auto" deployment really runs on here (CUDA where it loads, else CPU):
    expectations that depend on the device follow it, so the suite holds on CPU and on a GPU."""
    from amp_rewrite import runtime

    return runtime.CUDA if runtime.cuda_loads() else runtime.CPU


def on_cuda() -> bool:
    """Whether CUDA loads: float32 matrix products then run TF32 (ORT's CUDA default, ~1e-3 relative)
    and float16 ops compute in float16, not float32 as on CPU."""
    from amp_rewrite import runtime

    return loaded_provider() == runtime.CUDA


# float32 matmul-heavy figures on CUDA: TF32 (10-bit mantissa products) is on by default there
TF32_RTOL = 1e-3


def run_loaded(model, feeds):
    """`model` run on the provider the checks (validate, fallback) use here: a test judging a
    rewrite as they do must see the numbers they see (float16 computed in float16 on CUDA)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    providers = [loaded_provider(), "CPUExecutionProvider"]
    return ort.InferenceSession(model.SerializeToString(), options, providers=providers).run(None, feeds)
