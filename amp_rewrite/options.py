"""`RewriteOptions`: everything a rewrite is asked to do, built once (frozen) by the CLI or the API
and read by the stages that need it; a new option is one field here (its default written only
here), one read in its stage and, for a flag, one `add_argument` line in cli_parser.py (dest = the
field). Where the model runs (provider, target, dims) is one value, `deployment` (deployment.py).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
from dataclasses import dataclass
from types import MappingProxyType

from amp_rewrite.analysis import kernels
from amp_rewrite.analysis.oplists import OpLists, load_op_lists
from amp_rewrite.deployment import Deployment
from amp_rewrite.errors import UsageError
from amp_rewrite.onnx_facts import FLOAT


def _as_tuple(value) -> tuple:
    if value is None:
        return ()
    if isinstance(value, (str, os.PathLike)):
        return (value,)
    return tuple(value)


PLACEMENTS = ("tf", "cost")
TUPLE_FIELDS = ("op_lists", "allow", "deny", "infer", "clear", "keep_fp32_nodes", "low_precision_io")
DEPLOYMENT_FIELDS = tuple(f.name for f in dataclasses.fields(Deployment))  # provider, target, dims
ALIASES = ("op_block_list", "node_block_list")  # onnxconverter-common's names


@dataclass(frozen=True)
class RewriteOptions:
    """Everything a rewrite is asked to do, checked however it is built (`__post_init__`).
    `RewriteOptions.of(...)` also refuses unknown names and accepts onnxconverter-common's names (`op_block_list`, `node_block_list`) and the
    deployment's fields (`provider`, `target`, `dims`) as options of their own."""

    deployment: Deployment = Deployment()  # where the model runs: provider, target, dims
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
    force_fp32: MappingProxyType = dataclasses.field(
        default_factory=lambda: MappingProxyType({})
    )  # node -> reason: deny roots
    colour_as: MappingProxyType = dataclasses.field(
        default_factory=lambda: MappingProxyType({})
    )  # node -> node whose colour it takes
    calibration: object = None  # a checks.calibrate.CalibrationResult: measured deny roots
    annotate: bool = False  # each node's precision and reason written into the result (Netron shows them)
    placement: str = (
        "cost"  # free infer/clear ops: one minimum cut of bytes moved, or "tf" (TF's between-allow rule)
    )
    scale_activations: bool = True  # with calibration: linear regions over the limit run on values x 2^-k
    relax_margin: float = (
        16.0  # with calibration: range-deny ops measured within LIMIT/margin become infer (0: never)
    )
    pointwise_check: bool = (
        True  # range-deny ops whose pointwise chain agrees on every float16 value become infer
    )
    fold_noop_casts: bool = True  # the model's own Casts that convert nothing in the result are removed
    never_worse: bool = True  # cost placement: a model its estimate says moves more bytes low stays float32
    opset: int | None = None  # convert the model to this default-domain opset first (onnx.version_converter)
    fuse: str | None = None  # ORT's transformer optimizer first: "auto" or its model type (transform/fuse.py)

    def __post_init__(self):
        """Every way in (the constructor, `of`, `replace`, dataclasses.replace) is normalised and
        checked here: sequences become tuples, mappings read-only, and a bad value one UsageError."""
        for name in TUPLE_FIELDS:
            object.__setattr__(self, name, _as_tuple(getattr(self, name)))
        for name in ("force_fp32", "colour_as"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name) or {})))
        self.check_values()

    @property
    def target(self) -> str:
        return self.deployment.target

    @property
    def provider(self) -> str:
        return self.deployment.provider

    @property
    def dims(self) -> MappingProxyType:
        return self.deployment.dims

    @classmethod
    def of(cls, *, op_block_list=None, node_block_list=None, **fields) -> RewriteOptions:
        check_names(fields)
        placed = {name: fields.pop(name) for name in DEPLOYMENT_FIELDS if name in fields}
        placed = {name: value for name, value in placed.items() if value is not None}  # None: not given
        if placed:
            base = fields.get("deployment") or Deployment()
            fields["deployment"] = dataclasses.replace(base, **placed)
        fields["deny"] = _as_tuple(fields.get("deny")) + _as_tuple(op_block_list)
        fields["keep_fp32_nodes"] = _as_tuple(fields.get("keep_fp32_nodes")) + _as_tuple(node_block_list)
        return cls(**fields)  # normalised and checked in __post_init__

    def replace(self, **changes) -> RewriteOptions:
        return RewriteOptions.of(
            **{**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, **changes}
        )

    def check_values(self) -> None:
        """Provider, target and dims are checked by `Deployment`; the rest here (from __post_init__)."""
        if not isinstance(self.deployment, Deployment):
            raise UsageError(f"deployment {self.deployment!r}: expected a Deployment")
        if self.relax_margin < 0 or (0 < self.relax_margin < 1):
            raise UsageError(f"relax margin {self.relax_margin:g} must be 0 (off) or at least 1")
        if self.placement not in PLACEMENTS:
            raise UsageError(f"unknown placement {self.placement!r}: choose one of {', '.join(PLACEMENTS)}")
        if self.opset is not None and (
            isinstance(self.opset, bool) or not isinstance(self.opset, int) or self.opset < 1
        ):
            raise UsageError(f"opset {self.opset!r} must be a whole number of at least 1")
        if self.fuse is not None and not isinstance(self.fuse, str):
            raise UsageError(f"fuse {self.fuse!r}: expected 'auto' or a model type such as 'bert'")
        for option in ("keep_fp32_nodes", "low_precision_io"):
            for pattern in getattr(self, option):
                try:
                    re.compile(pattern)
                except (re.error, TypeError) as exc:
                    raise UsageError(
                        f"{option}: {pattern!r} is not a valid regular expression ({exc})"
                    ) from None

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
                raise UsageError(
                    f"low_precision_io: {pattern!r} matches no float32 graph input or output "
                    f"(they are: {shown})"
                )
            chosen.update(matched)
        return frozenset(chosen)

    def lists(self) -> OpLists:
        """The op lists for `target` with the user's files and moves applied."""
        return load_op_lists(
            self.target,
            user_files=list(self.op_lists),
            allow=list(self.allow),
            deny=list(self.deny),
            infer=list(self.infer),
            clear=list(self.clear),
        )

    def kernel_check(self):
        """The deployment's kernel check for graph.build (None for provider "any")."""
        return kernels.check_for(self.deployment.kernels, self.target)

    def relaxed_deny(self) -> dict:
        """Node name -> reason for deny ops calibration measured far inside the range (0 margin: none)."""
        if self.calibration is None or not self.relax_margin:
            return {}
        return {
            key: reason
            for key, (reason, _) in self.calibration.relaxed(self.target, self.relax_margin).items()
        }

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


def option_names() -> tuple:
    """Every keyword `RewriteOptions.of` and `rewrite()` take."""
    return (*(f.name for f in dataclasses.fields(RewriteOptions)), *DEPLOYMENT_FIELDS, *ALIASES)


def check_names(fields) -> None:
    """An unknown option is a UsageError, with "did you mean" where a known one is close."""
    known = option_names()
    for name in sorted(set(fields) - set(known)):
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f" (known: {', '.join(known)})"
        raise UsageError(f"unknown rewrite option {name!r}{hint}")


def _accept_deployment_fields(generated_init):
    """`RewriteOptions(target=..., provider=..., dims=...)` keeps working as before the three moved
    into `deployment`: given, they replace those fields of the (given or default) Deployment."""

    @functools.wraps(generated_init)
    def __init__(self, *args, **fields):
        placed = {name: fields.pop(name) for name in DEPLOYMENT_FIELDS if name in fields}
        if placed:
            base = fields.get("deployment") or Deployment()
            fields["deployment"] = dataclasses.replace(base, **placed)
        generated_init(self, *args, **fields)

    return __init__


RewriteOptions.__init__ = _accept_deployment_fields(RewriteOptions.__init__)
