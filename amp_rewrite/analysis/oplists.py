"""Load, validate and merge the allow / deny / infer / clear op lists.

The lists are data (`op_lists/*.yaml`); this module only reads them. A list file maps each of the
four list names to `{op: reason}` (or a plain list of ops), may `extends:` another file whose
entries it overrides (a regular file in its own folder: io.external's rules), and names its
`target`. Files are read bounded in size and nesting depth. User overrides (a YAML file of the same shape, CLI
flags, API arguments) move an op into the list they name; naming one op in two lists of the same
source is an error. Ops are keyed `OpType` for the default ONNX domain and `domain:OpType` else.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache, lru_cache
from pathlib import Path

import yaml

from amp_rewrite.errors import OpListError
from amp_rewrite.io.external import contained_file, read_bounded

LISTS = ("allow", "deny", "infer", "clear")
FILE_KEYS = {"target", "extends", *LISTS}
TARGETS = ("float16", "bfloat16")
DEFAULT_DOMAINS = ("", "ai.onnx")
# Installed wheels carry the lists inside the package; a source checkout keeps them at the top.
# Installed, the lists ship as amp_rewrite/op_lists; in a checkout they are op_lists/ at the top.
OP_LIST_DIRS = (Path(__file__).parents[1] / "op_lists", Path(__file__).parents[2] / "op_lists")


def op_key(domain: str, op_type: str) -> str:
    """The list key of an op: `Gemm`, or `com.microsoft:Attention`."""
    return op_type if domain in DEFAULT_DOMAINS else f"{domain}:{op_type}"


@dataclass(frozen=True)
class Entry:
    """One op's place: which list, why, and where that was decided."""

    list: str
    reason: str
    source: str


@dataclass(frozen=True)
class OpLists:
    """The merged lists for one target: op key -> Entry."""

    target: str
    entries: Mapping[str, Entry] = field(default_factory=dict)
    named: tuple = ()  # (op key, where) for each op the user named: checked against the model's ops

    def classify(self, domain: str, op_type: str) -> Entry | None:
        return self.entries.get(op_key(domain, op_type))

    def ops(self, list_name: str) -> list[str]:
        return sorted(op for op, e in self.entries.items() if e.list == list_name)


MAX_YAML_BYTES = 2**20  # an op list is a few KB; a bigger file is not one
MAX_YAML_DEPTH = 32  # an op list nests three deep; deeper nesting is refused before it recurses


class _SafeLoader(yaml.SafeLoader):
    """A safe loader that refuses aliases (a 'billion laughs' cannot blow up memory) and nesting
    deeper than MAX_YAML_DEPTH (100k brackets cannot exhaust the stack)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.YAMLError(f"aliases are not allowed (line {event.start_mark.line + 1})")
        self.depth = getattr(self, "depth", 0) + 1
        try:
            if self.depth > MAX_YAML_DEPTH:
                event = self.peek_event()
                raise yaml.YAMLError(
                    f"nested deeper than {MAX_YAML_DEPTH} levels (line {event.start_mark.line + 1})"
                )
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def _read_yaml(path: Path) -> dict:
    """A YAML mapping from a regular file of at most MAX_YAML_BYTES; every failure one OpListError line."""
    try:
        os.stat(path)
    except (OSError, ValueError) as exc:
        raise OpListError(f"{path}: cannot read op list ({getattr(exc, 'strerror', None) or exc})") from None
    data = read_bounded(path, MAX_YAML_BYTES, what="op list", error=OpListError)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise OpListError(f"{path}: op list is not UTF-8 text") from None
    try:
        data = yaml.load(text, Loader=_SafeLoader)
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).split())
        raise OpListError(f"{path}: invalid YAML: {detail[:300]}") from None
    except RecursionError:  # a structure the depth limit does not see (kept as a backstop)
        raise OpListError(f"{path}: invalid YAML: nested too deeply") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise OpListError(f"{path}: an op list must be a mapping of list names to ops")
    return data


def _entries_of(section, where: str) -> dict[str, str]:
    """Normalise one list section (mapping op -> reason, or a list of ops) to op -> reason."""
    if section is None:
        return {}
    if isinstance(section, list):
        for op in section:
            if not isinstance(op, str):
                raise OpListError(f"{where}: entry {op!r} is not an op type name")
        section = {op: None for op in section}
    if not isinstance(section, dict):
        raise OpListError(f"{where}: expected a mapping of op -> reason or a list of ops")
    out = {}
    for op, reason in section.items():
        if not isinstance(op, str) or not op or any(c.isspace() for c in op):
            raise OpListError(f"{where}: entry {op!r} is not an op type name")
        if reason is not None and not isinstance(reason, str):
            raise OpListError(f"{where}: entry {op!r} must have a text reason")
        out[op] = reason or "user list"
    return out


def _check_one_list_each(sections: Mapping[str, Mapping[str, str]], source: str) -> None:
    seen: dict[str, str] = {}
    for list_name in LISTS:
        for op in sections.get(list_name, {}):
            if op in seen:
                raise OpListError(f"{source}: op {op!r} is in both '{seen[op]}' and '{list_name}'")
            seen[op] = list_name


def _parse_file(path: Path, chain: tuple[Path, ...] = ()) -> tuple[str | None, dict[str, Entry]]:
    """Entries of one file with its `extends` chain applied (later files override earlier)."""
    try:
        path = path.resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # a NUL byte, a loop of links, a name too long
        raise OpListError(f"{path}: cannot read op list ({getattr(exc, 'strerror', None) or exc})") from None
    if path in chain:
        raise OpListError(f"{path}: 'extends' loops back to itself")
    data = _read_yaml(path)
    unknown = sorted(set(map(str, data)) - FILE_KEYS)
    if unknown:
        raise OpListError(f"{path}: unknown key {unknown[0]!r} (allowed: {', '.join(sorted(FILE_KEYS))})")
    target = data.get("target")
    if target is not None and target not in TARGETS:
        raise OpListError(f"{path}: target {target!r} is not one of {', '.join(TARGETS)}")
    entries: dict[str, Entry] = {}
    if data.get("extends"):
        if not isinstance(data["extends"], str):
            raise OpListError(f"{path}: 'extends' must name one file")
        base = contained_file(
            path.parent,
            data["extends"],
            what=f"{path}: 'extends'",
            error=OpListError,
            inside="the op list's folder",
        )
        base_target, entries = _parse_file(base, chain + (path,))
        target = target or base_target
    sections = {name: _entries_of(data.get(name), f"{path}: {name}") for name in LISTS}
    _check_one_list_each(sections, str(path))
    for list_name, ops in sections.items():
        for op, reason in ops.items():
            entries[op] = Entry(list_name, reason, path.name)
    return target, entries


def shipped_path(file_name: str) -> Path:
    """A data file shipped with the op lists (`op_lists/` in a checkout, amp_rewrite/op_lists installed)."""
    for folder in OP_LIST_DIRS:
        if (folder / file_name).is_file():
            return folder / file_name
    raise OpListError(f"op_lists/{file_name} is missing from the installation")


@cache
def shipped_table(file_name: str) -> dict:
    """A shipped YAML or JSON table of op facts (kernels, scaling, parameter slots), read once."""
    path = shipped_path(file_name)
    return json.loads(path.read_text()) if path.suffix == ".json" else _read_yaml(path)


def default_list_path(target: str) -> Path:
    if target not in TARGETS:
        raise OpListError(f"unknown target {target!r}: choose one of {', '.join(TARGETS)}")
    return shipped_path(f"{target}.yaml")


@lru_cache(maxsize=8)
def _cached_default(path: Path, stamp: tuple) -> tuple[str | None, dict[str, Entry]]:
    return _parse_file(path)


def _default_entries(target: str) -> tuple[str | None, dict[str, Entry]]:
    """The shipped lists, parsed once per process (and again if the file changes)."""
    path = default_list_path(target)
    stamps = []
    for file in sorted(path.parent.glob("*.yaml")):  # `extends` may name a sibling
        stat = file.stat()
        stamps.append((file.name, stat.st_mtime_ns, stat.st_size))
    return _cached_default(path, tuple(stamps))


def load_op_lists(
    target: str = "float16",
    *,
    user_files: Iterable[str | Path] = (),
    allow: Iterable[str] = (),
    deny: Iterable[str] = (),
    infer: Iterable[str] = (),
    clear: Iterable[str] = (),
) -> OpLists:
    """The default lists for `target`, then each user file, then the explicit op arguments."""
    list_target, entries = _default_entries(target)
    entries = dict(entries)
    named = []
    for user_file in user_files:
        file_target, user_entries = _parse_file(Path(user_file))
        if file_target is not None and file_target != target:
            raise OpListError(f"{user_file}: written for target {file_target!r}, not {target!r}")
        entries.update(user_entries)
        named += [(op, f"{user_file}: {entry.list}") for op, entry in user_entries.items()]
    explicit = {"allow": allow, "deny": deny, "infer": infer, "clear": clear}
    sections = {name: _entries_of(list(ops), f"--{name}") for name, ops in explicit.items()}
    _check_one_list_each(sections, "op arguments")
    for list_name, ops in sections.items():
        for op in ops:
            entries[op] = Entry(list_name, f"moved to {list_name} by the user", "arguments")
            named.append((op, f"--{list_name}"))
    return OpLists(list_target or target, dict(entries), tuple(named))


@lru_cache(maxsize=1)
def known_op_keys() -> frozenset:
    """Op keys of every ONNX schema (all domains onnx registers), every op in the shipped kernel
    tables (ONNX Runtime's contrib ops) and every op the shipped lists name."""
    import onnx.defs

    keys = {op_key(s.domain, s.name) for s in onnx.defs.get_all_schemas_with_history()}
    for provider in ("cpu", "cuda"):
        for key in shipped_table(f"kernels_{provider}.json")["kernels"]:
            domain, _, op = key.rpartition(":")
            keys.add(op_key(domain, op))
    for target in TARGETS:
        keys.update(_default_entries(target)[1])
    return frozenset(keys)


def check_named_ops(lists: OpLists, model) -> None:
    """An op type the user named that no ONNX schema, kernel table or node of `model` knows is a
    typo that would change nothing: one line naming the closest known ops. Op list files say so
    as an OpListError, command-line arguments as a UsageError."""
    if not lists.named:
        return
    from amp_rewrite.onnx_facts import all_graphs

    present = {op_key(n.domain, n.op_type) for g in all_graphs(model.graph) for n in g.node}
    present |= {op_key(f.domain, f.name) for f in model.functions}
    known = known_op_keys() | present
    for op, where in lists.named:
        if op in known:
            continue
        import difflib

        folded = {k.lower(): k for k in known}
        close = ([folded[op.lower()]] if op.lower() in folded else []) or difflib.get_close_matches(
            op, sorted(known), n=3
        )
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        text = f"{where}: unknown op type {op!r} (no ONNX schema, kernel or node of the model has it){hint}"
        if where.startswith("--"):
            from amp_rewrite.errors import UsageError

            raise UsageError(text)
        raise OpListError(text)
