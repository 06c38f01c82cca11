"""`RewriteOptions`: everything a rewrite is asked to do, built once (frozen) by the CLI or the API
and read by the stages that need it; a new option is one field here and one read in its stage,
never a keyword threaded through every layer.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from types import MappingProxyType

from amp_rewrite.analysis import kernels
from amp_rewrite.analysis.oplists import TARGETS, OpLists, load_op_lists
from amp_rewrite.errors import UsageError
from amp_rewrite.onnx_facts import FLOAT


def _as_tuple(value) -> tuple:
    if value is None:
        return ()
    if isinstance(value, (str, os.PathLike)):
        return (value,)
    return tuple(value)


PLACEMENTS = ("tf", "cost")


@dataclass(frozen=True)
class RewriteOptions:
    """Everything a rewrite is asked to do. Build with `RewriteOptions.of(...)`, which checks the
    values and accepts onnxconverter-common's names (`op_block_list`, `node_block_list`)."""

    target: str = "float16"
    keep_io_types: bool = True
    low_precision_io: tuple = ()  # full-match regexes: main-graph inputs/outputs that take the target type
    op_lists: tuple = ()  # YAML files of user overrides
    allow: tuple = ()  # op types moved into each list
    deny: tuple = ()
    infer: tuple = ()
    clear: tuple = ()
    keep_fp32_nodes: tuple = ()  # node names or full-match regexes pinned float32
    clamp: bool = False  # clamp out-of-range constants instead of keeping their readers float32
    check: bool = True  # onnx.checker on the result
    force_fp32: MappingProxyType = dataclasses.field(default_factory=lambda: MappingProxyType({}))  # node -> reason: deny roots
    calibration: object = None  # a checks.calibrate.CalibrationResult: measured deny roots
    annotate: bool = False  # each node's precision and reason written into the result (Netron shows them)
    provider: str = "cuda"  # where the model runs: groups without a target-type kernel there stay float32
    placement: str = "cost"  # free infer/clear ops: one minimum cut of bytes moved, or "tf" (TF's between-allow rule)
    scale_activations: bool = True  # with calibration: linear regions over the limit run on values x 2^-k
    relax_margin: float = 16.0  # with calibration: range-deny ops measured within LIMIT/margin become infer (0: never)
    dims: MappingProxyType = dataclasses.field(default_factory=lambda: MappingProxyType({}))  # symbolic dim -> size: size estimates only
    pointwise_check: bool = True  # range-deny ops whose pointwise chain agrees on every float16 value become infer
    fold_noop_casts: bool = True  # the model's own Casts that convert nothing in the result are removed
    opset: int | None = None  # convert the model to this default-domain opset first (onnx.version_converter)

    @classmethod
    def of(cls, *, op_block_list=None, node_block_list=None, **fields) -> "RewriteOptions":
        unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise UsageError(f"unknown rewrite option(s): {', '.join(sorted(unknown))}")
        for name in ("op_lists", "allow", "deny", "infer", "clear", "keep_fp32_nodes", "low_precision_io"):
            if name in fields:
                fields[name] = _as_tuple(fields[name])
        fields["deny"] = fields.get("deny", ()) + _as_tuple(op_block_list)
        fields["keep_fp32_nodes"] = fields.get("keep_fp32_nodes", ()) + _as_tuple(node_block_list)
        fields["force_fp32"] = MappingProxyType(dict(fields.get("force_fp32") or {}))
        fields["dims"] = MappingProxyType(dict(fields.get("dims") or {}))
        options = cls(**fields)
        options.check_values()
        return options

    def replace(self, **changes) -> "RewriteOptions":
        return RewriteOptions.of(**{**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, **changes})

    def check_values(self) -> None:
        if self.target not in TARGETS:
            raise UsageError(f"unknown target {self.target!r}: choose one of {', '.join(TARGETS)}")
        kernels.colouring_provider(self.provider)
        if self.relax_margin < 0 or (0 < self.relax_margin < 1):
            raise UsageError(f"relax margin {self.relax_margin:g} must be 0 (off) or at least 1")
        if self.placement not in PLACEMENTS:
            raise UsageError(f"unknown placement {self.placement!r}: choose one of {', '.join(PLACEMENTS)}")
        if self.opset is not None and (isinstance(self.opset, bool) or not isinstance(self.opset, int) or self.opset < 1):
            raise UsageError(f"opset {self.opset!r} must be a whole number of at least 1")
        for name, size in self.dims.items():
            if not isinstance(name, str) or not name or isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise UsageError(f"dim {name!r}={size!r}: a symbolic dim's size must be a whole number of at least 1")
        for option in ("keep_fp32_nodes", "low_precision_io"):
            for pattern in getattr(self, option):
                try:
                    re.compile(pattern)
                except (re.error, TypeError) as exc:
                    raise UsageError(f"{option}: {pattern!r} is not a valid regular expression ({exc})") from None

    def low_io_names(self, graph) -> frozenset:
        """Names of the main graph's float32 inputs and outputs that take the target type: those a
        `low_precision_io` pattern fully matches (a decoder's KV cache), and all of them without
        `keep_io_types`. A pattern that matches no float32 input or output is a UsageError: a typo
        would otherwise leave the model's I/O silently as it was."""
        floats = [v.name for v in (*graph.input, *graph.output) if v.type.tensor_type.elem_type == FLOAT]
        chosen = set() if self.keep_io_types else set(floats)
        for pattern in self.low_precision_io:
            matched = [name for name in floats if re.fullmatch(pattern, name)]
            if not matched:
                shown = ", ".join(floats[:4]) + (", ..." if len(floats) > 4 else "") or "none"
                raise UsageError(f"low_precision_io: {pattern!r} matches no float32 graph input or output "
                                 f"(they are: {shown})")
            chosen.update(matched)
        return frozenset(chosen)

    def lists(self) -> OpLists:
        """The op lists for `target` with the user's files and moves applied."""
        return load_op_lists(self.target, user_files=list(self.op_lists), allow=list(self.allow),
                             deny=list(self.deny), infer=list(self.infer), clear=list(self.clear))

    def kernel_check(self):
        """The provider's kernel check for graph.build (None for provider "any")."""
        return kernels.check_for(self.provider, self.target)

    def relaxed_deny(self) -> dict:
        """Node name -> reason for deny ops calibration measured far inside the range (0 margin: none)."""
        if self.calibration is None or not self.relax_margin:
            return {}
        return {key: reason for key, (reason, _) in self.calibration.relaxed(self.target, self.relax_margin).items()}

    def deny_roots(self, scaling=None) -> dict:
        """Node name -> reason for every node that must start float32 (user pins and calibration).
        `scaling` (transform.scaling.Scaling): its regions' nodes are not forced, its scale Muls are."""
        forced = dict(self.force_fp32)
        if self.calibration is not None:
            exempt = scaling.exempt if scaling is not None else frozenset()
            forced = {**self.calibration.force_fp32(self.target, exempt=exempt), **forced}
        if scaling is not None:
            forced = {**scaling.forced, **forced}
        return forced
