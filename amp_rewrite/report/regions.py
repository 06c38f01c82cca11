"""Regions of a big graph for the picture: a tree whose leaves are compute nodes.

Exporters name nodes after their module path (`/encoder/layer.3/attention/MatMul`); when most
names have one, the tree is that path hierarchy. Otherwise, and wherever one region holds too many
items, consecutive items (in topological order) are cut into runs, preferably where the graph
narrows to one producer between them. Every level holds at most MAX_ITEMS items. Linear in the
graph size times the tree depth.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

FLAT_MAX = 300  # up to this many compute nodes the picture draws every node
MAX_ITEMS = 60  # items (nodes or regions) in one region, at most
MIN_REGION = 3  # a name prefix with fewer nodes is not a region of its own
NAMED_SHARE = 0.6  # share of nodes with a path-like name for the names to define regions


@dataclass
class Group:
    label: str  # full path or "first … last"
    short: str  # what the box shows
    parent: int  # -1 for the root
    items: list = field(default_factory=list)  # node k >= 0, group g as ~g (negative)
    first: int = 0  # smallest topological position of a member
    flat: bool = False  # small enough to draw every node: never cut into runs


def ref(gid: int) -> int:
    return ~gid


class _Trie:
    __slots__ = ("children", "nodes", "size")

    def __init__(self):
        self.children: dict = {}
        self.nodes: list = []
        self.size = 0


def _name_trie(names: list[str], nodes) -> _Trie | None:
    root = _Trie()
    named = 0
    at: dict = {"": root}  # prefix -> its trie node: most nodes share their prefix with a neighbour
    for k in nodes:
        prefix = names[k].strip("/").rpartition("/")[0]
        t = at.get(prefix)
        if t is None:
            t = root
            for p in prefix.split("/"):
                if not p:
                    continue
                child = t.children.get(p)
                if child is None:
                    child = t.children[p] = _Trie()
                t = child
            at[prefix] = t
        named += bool(prefix)
        t.nodes.append(k)
    _sizes(root)
    if named < NAMED_SHARE * max(1, len(nodes)):
        return None
    while not root.nodes and len(root.children) == 1:  # a prefix every name shares: not a level
        root = next(iter(root.children.values()))
    return root if len(root.children) >= 2 or (root.children and root.nodes) else None


def _sizes(t: _Trie) -> int:
    t.size = len(t.nodes) + sum(_sizes(c) for c in t.children.values())
    return t.size


def _subtree_nodes(t: _Trie, out: list) -> list:
    stack = [t]
    while stack:
        x = stack.pop()
        out.extend(x.nodes)
        stack.extend(x.children.values())
    return out


def _from_trie(t: _Trie, label: str, short: str, parent: int, groups: list) -> int:
    gid = len(groups)
    groups.append(Group(label, short, parent))
    items = groups[gid].items
    for name, child in t.children.items():
        path = name
        while not child.nodes and len(child.children) == 1:
            sub, child = next(iter(child.children.items()))
            path += "/" + sub
        if child.size < MIN_REGION:
            _subtree_nodes(child, items)
        else:
            items.append(ref(_from_trie(child, f"{label}/{path}", path, gid, groups)))
    items.extend(t.nodes)
    return gid


def _finish(groups: list, gid: int) -> int:
    """Sets `first` of every group under `gid` and sorts items by it; returns `first`."""
    g = groups[gid]
    firsts = {}
    for item in g.items:
        firsts[item] = item if item >= 0 else _finish(groups, ~item)
    g.items.sort(key=firsts.__getitem__)
    g.first = firsts[g.items[0]] if g.items else 0
    return g.first


def _members(groups: list, item: int, out: list) -> list:
    stack = [item]
    while stack:
        x = stack.pop()
        if x >= 0:
            out.append(x)
        else:
            stack.extend(groups[~x].items)
    return out


def _item_label(groups: list, names: list, ops: list, item: int) -> str:
    if item < 0:
        return groups[~item].short
    return names[item] or ops[item]


def _split(groups: list, gid: int, succ: list, names: list, ops: list) -> None:
    """Cuts a group of more than MAX_ITEMS items into runs (regions of their own), recursively."""
    items = groups[gid].items
    if len(items) > MAX_ITEMS and not groups[gid].flat:
        levels = math.ceil(math.log(len(items)) / math.log(MAX_ITEMS))
        target = math.ceil(len(items) / math.ceil(len(items) ** (1 / levels)))
        chunks = _runs(groups, items, target, succ)
        new_items = []
        for chunk in chunks:
            if len(chunk) == 1:
                new_items.append(chunk[0])
                continue
            a, b = _item_label(groups, names, ops, chunk[0]), _item_label(groups, names, ops, chunk[-1])
            child = len(groups)
            label = f"{a} … {b}"
            groups.append(
                Group(f"{groups[gid].label}: {label}" if groups[gid].label else label, label, gid, chunk)
            )
            for item in chunk:
                if item < 0:
                    groups[~item].parent = child
            new_items.append(ref(child))
        groups[gid].items = new_items
    for item in list(groups[gid].items):
        if item < 0:
            _split(groups, ~item, succ, names, ops)


def _runs(groups: list, items: list, target: int, succ: list) -> list[list[int]]:
    """Consecutive runs of about `target` items, ended where one item alone feeds the rest."""
    where = {}
    for i, item in enumerate(items):
        for node in _members(groups, item, []):
            where[node] = i
    reach = list(range(len(items)))  # the furthest later item each item feeds
    for node, i in where.items():
        for s in succ[node]:
            j = where.get(s)
            if j is not None and j > reach[i]:
                reach[i] = j
    change = [0] * (len(items) + 1)
    for i, j in enumerate(reach):
        if j > i:
            change[i + 1] += 1
            change[j + 1] -= 1
    chunks, current, open_ = [], [], 0
    for i, item in enumerate(items):
        open_ += change[i]
        if current and (len(current) >= 2 * target or (len(current) >= target and open_ <= 1)):
            chunks.append(current)
            current = []
        current.append(item)
    if current:
        chunks.append(current)
    return chunks


# A model may declare its parts, as [[name prefix, label], ...] in its metadata under this key (a
# training step graph declares forward, loss, backward, loss scale, optimizer); each part is a
# region of its own, the first prefix a node's name starts with decides (a "" prefix takes the rest).
REGIONS_KEY = "amp_rewrite.regions"
OTHER = "other"  # the part of nodes no declared prefix matches


def declared(model) -> tuple[tuple[str, str], ...]:
    """The (prefix, label) parts the model declares in its metadata; () when none."""
    for prop in model.metadata_props:
        if prop.key == REGIONS_KEY:
            return tuple((str(prefix), str(label)) for prefix, label in json.loads(prop.value))
    return ()


def declare(model, parts) -> None:
    """Write the (prefix, label) parts into the model's metadata (replacing any declared before)."""
    kept = [p for p in model.metadata_props if p.key != REGIONS_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    entry = model.metadata_props.add()
    entry.key, entry.value = REGIONS_KEY, json.dumps([list(p) for p in parts])


def part_of(name: str, parts) -> str:
    return next((label for prefix, label in parts if name.startswith(prefix)), OTHER)


def _region(groups: list, nodes: list, names: list, label: str, parent: int) -> int:
    """A region of `nodes`: every node when few, else their name tree (or one list, cut later)."""
    trie = _name_trie(names, nodes) if len(nodes) > FLAT_MAX else None
    if trie is None:
        groups.append(Group(label, label, parent, list(nodes), flat=len(nodes) <= FLAT_MAX))
        return len(groups) - 1
    return _from_trie(trie, label, label, parent, groups)


def build(names: list[str], ops: list[str], succ: list, parts=()) -> list[Group]:
    """The region tree of compute nodes 0..n-1 (topological order); groups[0] is the root. With
    `parts` (a model's declared (prefix, label) parts) the root holds one region per part."""
    groups: list = []
    if parts:
        groups.append(Group("", "", -1))
        members: dict = {}
        for k, name in enumerate(names):
            members.setdefault(part_of(name, parts), []).append(k)
        for label, nodes in members.items():
            groups[0].items.append(ref(_region(groups, nodes, names, label, 0)))
    else:
        _region(groups, range(len(names)), names, "", -1)
    _finish(groups, 0)
    _split(groups, 0, succ, names, ops)
    _finish(groups, 0)
    return groups
