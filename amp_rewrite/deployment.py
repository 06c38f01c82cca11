"""`Deployment`: where the rewritten model will run, in which low type, at which sizes: one frozen
value, built once by the CLI or the API (it is `RewriteOptions.deployment`) and read by the
colouring (whose kernel table), validation and calibration (which device their sessions use) and
training, in one vocabulary:

    provider  "auto" (default): colour for CUDA's kernels, run on CUDA when it really loads, else CPU
              "cuda": the same, and a check or a Trainer asked for CUDA says when it did not load
              "cpu":  colour for and run on ONNX Runtime's CPU provider (CUDA is never probed)
              "any":  no kernel check; run where "auto" would
    target    "float16" or "bfloat16"
    dims      {symbolic dim: size}: size estimates and synthesised samples

The device is resolved once per process against what ONNX Runtime actually loads (`runtime`).

One word per idea, and where each is read:
    provider  what the user asked for (the CLI's --provider, `rewrite(provider=)`, `Trainer(provider=)`)
    kernels   whose kernel table the colouring respects (`Deployment.kernels`: "cuda", "cpu", None)
    device    where sessions run here (`Deployment.device`: "cuda" or "cpu")
    ORT's provider names ("CUDAExecutionProvider", ...): `runtime`'s session factory, from `device`.
Training's `precision` ("float16", "bfloat16" or "float32") is the rewrite's `target`; "float32"
means no rewrite (training.step_graph.precision_options: `target=precision`, and provider "cuda"
on a CUDA device, else "any": the CPU probe of training.cpu_refusals replaces the kernel table there).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType

import onnx
from onnx import TensorProto

from amp_rewrite import runtime
from amp_rewrite.analysis import kernels
from amp_rewrite.analysis.elemtypes import tensor_types
from amp_rewrite.analysis.oplists import TARGETS
from amp_rewrite.errors import UsageError
from amp_rewrite.onnx_facts import all_graphs, opsets

PROVIDERS = ("auto", "cuda", "cpu", "any")
_KERNELS = {"auto": "cuda", "cuda": "cuda", "cpu": "cpu", "any": None}
_NAMES = {"cuda": "CUDA", "cpu": "CPU"}
# ORT's CPU provider gives a float16 node it has no kernel for casts to float32 around it
# (InsertCastTransformer); a bfloat16 one it refuses (NOT_IMPLEMENTED): the types it runs anyway
_RUNS_WITHOUT_KERNELS = {"cpu": ("float16",), "cuda": ("float16", "bfloat16")}


@dataclass(frozen=True)
class Deployment:
    provider: str = "auto"
    target: str = "float16"
    dims: MappingProxyType = dataclasses.field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self):
        if self.provider not in PROVIDERS:
            raise UsageError(f"unknown provider {self.provider!r}: choose one of {', '.join(PROVIDERS)}")
        if self.target not in TARGETS:
            raise UsageError(f"unknown target {self.target!r}: choose one of {', '.join(TARGETS)}")
        dims = MappingProxyType(dict(self.dims or {}))
        for name, size in dims.items():
            if (
                not isinstance(name, str)
                or not name
                or isinstance(size, bool)
                or not isinstance(size, int)
                or size < 1
            ):
                raise UsageError(
                    f"dim {name!r}={size!r}: a symbolic dim's size must be a whole number of at least 1"
                )
        object.__setattr__(self, "dims", dims)

    @property
    def kernels(self) -> str | None:
        """The provider whose kernel table the colouring respects ("cuda", "cpu"), None for "any"."""
        return _KERNELS[self.provider]

    @property
    def device(self) -> str:
        """Where sessions run here, "cuda" or "cpu": CUDA only when it really loads (probed once per
        process); the notice that it did not is said once, and never to a user who chose cpu."""
        if self.provider == "cpu":
            return "cpu"
        if runtime.cuda_loads():
            return "cuda"
        if self.provider == "cuda" or runtime.lists_cuda():
            runtime.say_cpu_fallback_once()
        return "cpu"

    def check_runnable(self) -> None:
        """A model coloured for one provider's kernels that the device here cannot run at all is a
        UsageError before any work (bfloat16 coloured for CUDA, run on ORT's CPU provider)."""
        device = self.device
        if self.kernels in (device,) or self.target in _RUNS_WITHOUT_KERNELS[device]:
            return
        coloured = (
            f"coloured for {_NAMES[self.kernels]}'s kernels"
            if self.kernels
            else "coloured without a kernel check"
        )
        raise UsageError(
            f"ONNX Runtime's {_NAMES[device]} provider (the one that loads here) cannot run a {self.target} "
            f"model {coloured}: use --provider cpu (provider='cpu'; ops without a CPU {self.target} "
            f"kernel stay float32), or run the checks where CUDA loads"
        )

    def check_runs_here(self, model) -> None:
        """A rewritten `model` the device here refuses when a node runs, though it loads (coloured
        for CUDA's kernels, run on ORT's CPU provider: ScatterElements reduction='add' in float16,
        op_lists/kernel_attributes.yaml) is a UsageError naming the node, before any run."""
        device = self.device
        rules = kernels.attribute_rules(device)
        if self.kernels == device or not rules:
            return
        found = [n for g in all_graphs(model.graph) for n in g.node if f"{_domain(n)}:{n.op_type}" in rules]
        if not found:
            return
        types, _ = tensor_types(model, shape_inference=False)
        check, versions = kernels.KernelCheck(device, self.target), opsets(model)
        for node in found:
            domain = _domain(node)
            opset = versions.get(domain, 0)
            formals = onnx.defs.get_schema(node.op_type, opset, domain).inputs
            for slot, formal in enumerate(formals[: len(node.input)]):
                if _LOW.get(types.get(node.input[slot])) != self.target:
                    continue
                why = check.refuses(domain, node.op_type, opset, node, formal.type_str)
                if why:
                    raise UsageError(
                        f"ONNX Runtime's {_NAMES[device]} provider (the one that loads here) cannot run this "
                        f"{self.target} model coloured for {_NAMES.get(self.kernels, 'no provider')}'s "
                        f"kernels: {node.op_type} {node.name or node.output[0]!r}: {why}; use --provider "
                        f"{device} (provider='{device}'), or run the checks where it was coloured for"
                    )


_LOW = {TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16"}


def _domain(node) -> str:
    return "" if node.domain == "ai.onnx" else node.domain


DEFAULT = Deployment()
