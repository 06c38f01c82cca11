"""Folding the model's own Casts that convert nothing, once the types are settled.

A Cast of the source model (never one the materialiser inserts: it makes none of these) is removed
and its readers read the value it was given when, in the rewritten model,
- its `to` is its input's element type already (a no-op: exporters write `Cast(to=FLOAT)` on
  float32 tensors, and colouring makes more, e.g. a Cast to float16 of a tensor now float16), or
- it takes back to its original type a value another of the model's Casts widened exactly
  (float16 -> float32 -> float16, bfloat16 -> float32 -> bfloat16: every value comes back bit for
  bit). torch's eager attention exports `softmax(...).to(float32)` twice on float32 tensors; with
  Softmax in float16 the first becomes float16 -> float32 and the second, retargeted, float32 ->
  float16: a round trip. The widening Cast goes too when nothing else reads it. The widening
  Cast may be one the materialiser inserted: with keep_io_types=False a float16 graph input
  read by the model's `Cast(to=FLOAT)` gets a float32 Cast of its own before it, and the model's
  Cast, retargeted to float16, takes it back.

Readers in subgraphs (outer-scope reads) are rewired like any other. Kept: a Cast whose output
is a graph output, the main graph's or a body's (output names stay; but a main output renamed at
its producer for keep_io_types=False is written by an inserted Cast, which then reads the
replacement), one whose removal would give a tensor two inserted Casts to one type in one graph,
and one with a reader in a subgraph that would see another tensor under the replacement's name
(a shadowing name, which onnx.checker refuses anyway). Only float Casts are looked at (those with a type group in the
colouring graph: int64 -> int64 is not ours to tidy), and a model the rewrite leaves unchanged
(no allow op) keeps its Casts. Linear: one visit of each of the model's Casts and of their
readers, the inserted Casts indexed once by what they read.
"""

from __future__ import annotations

import onnx

from amp_rewrite.onnx_facts import DEFAULT_DOMAINS, FLOAT
from amp_rewrite.transform.state import Materialisation

F16, BF16, F64 = onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE
# (from, to) where every value of `from` is exactly a value of `to`: converting back gives it again
EXACT_WIDENING = frozenset({(F16, FLOAT), (BF16, FLOAT), (F16, F64), (BF16, F64), (FLOAT, F64)})


_NAMES = {FLOAT: "float32", F16: "float16", BF16: "bfloat16", F64: "float64"}


def _type_name(elem: int) -> str:
    return _NAMES.get(elem) or onnx.TensorProto.DataType.Name(elem).lower()


class _Folder:
    def __init__(self, m: Materialisation):
        self.m, self.cg = m, m.cg
        self.candidates = {}  # (scope, node) -> the Cast node, for the model's own Casts
        for vertex in m.cg.vertices:
            if vertex.op_type == "Cast":
                key = (vertex.scope, vertex.node)
                if key not in self.candidates:
                    node = m.cg.node(*key)
                    if node.domain in DEFAULT_DOMAINS and len(node.input) == 1 and node.input[0]:
                        self.candidates[key] = node
        self.inserted_elem = {}  # inserted Cast's output -> its element type
        self.inserted_index = {}  # inserted Cast's output -> its index in result.casts
        self.inserted_readers = {}  # tensor -> the inserted Casts reading it (NodeProtos)
        if self.candidates:
            for i, (_, _, _, elem, out) in enumerate(m.result.casts):
                self.inserted_elem[out] = elem
                self.inserted_index[out] = i
            for nodes in (*m.after.values(), *m.top.values()):
                for node in nodes:
                    if node.output[0] in self.inserted_elem:
                        self.inserted_readers.setdefault(node.input[0], []).append(node)
        self.removed = m.removed
        self.done = set()  # Casts settled
        self.dead_inserted = set()  # outputs of inserted Casts nothing reads any more
        self.rewired = set()  # names that readers of folded Casts were pointed at

    # --- what the rewritten model holds ---

    def elem(self, scope: int, name: str) -> int | None:
        """Element type of `name`, as read from graph `scope`, in the rewritten model."""
        m, cg = self.m, self.cg
        elem = self.inserted_elem.get(name)
        if elem is not None:
            return elem
        found = cg.resolve(scope, name)
        if found is None:  # a name the materialiser made for a float32 tensor: renamed, or a constant's copy
            s = scope
            while s is not None:
                if (s, name) in m.low_names:
                    return m.low
                s = cg.scopes[s].parent
            return FLOAT
        elem = cg.types.get(name)
        if elem == FLOAT and (found.scope, name) in m.low_names:
            return m.low
        return elem

    def producer(self, scope: int, name: str):
        """(scope, node) of the model's own Cast that makes `name`, or None."""
        found = self.cg.resolve(scope, name)
        if found is None or found.definition.kind != "node":
            return None
        key = (found.scope, found.definition.node)
        return key if key in self.candidates else None

    def is_removed(self, scope: int, node: int) -> bool:
        gone = self.removed.get(scope)
        return gone is not None and node in gone

    def readers(self, scope: int, name: str, current: str | None = None):
        """(use, node) of each live node reading `name` (defined in `scope`) under its `current`
        name (a main-graph output renamed at its producer: the graph output reads an inserted Cast
        of it, not counted here); None when a graph output reads it under that name."""
        cg, found = self.cg, []
        current = current or name
        for use in cg.uses.get((scope, name), ()):
            if use.node < 0:
                if current == name:
                    return None
                continue
            if self.is_removed(use.scope, use.node):
                continue
            node = cg.node(use.scope, use.node)
            if node.input[use.slot] == current:  # else it reads an inserted Cast of it
                found.append((use, node))
        return found

    def visible(self, scope: int, reader_scope: int, name: str) -> bool:
        """`name` read in `reader_scope` (`scope` or a graph inside it) is the tensor `scope` sees."""
        if reader_scope == scope:
            return True
        return self.cg.resolve(reader_scope, name) == self.cg.resolve(scope, name)

    # --- folding ---

    def settle(self, key) -> None:
        """Fold `key` if it converts nothing, after the Casts that feed it (chains of Casts)."""
        chain = []
        while key is not None and key not in self.done:
            self.done.add(key)
            chain.append(key)
            key = self.producer(key[0], self.candidates[key].input[0])
        for key in reversed(chain):
            self.fold(key)

    def fold(self, key) -> None:
        s, n = key
        node = self.candidates[key]
        source, out = node.input[0], self.cg.scopes[s].io[n][1][0]  # the output's name as read
        # a main-graph output renamed at this Cast (another type): an inserted Cast writes the output
        # from the new name, and reads the replacement instead; the output keeps its name
        current = self.m.renamed.get((s, out), out)
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        elem = self.elem(s, source)
        widened = inserted = None
        if elem is None or to is None:
            return
        if elem == to:
            replacement = source
            reason = f"converts nothing: its input '{source}' is {_type_name(elem)} already"
        else:
            if (to, elem) not in EXACT_WIDENING:
                return
            if source in self.inserted_elem:  # an inserted Cast widened it: the replacement is what it read
                inserted = source
                _, first, replacement, _, _ = self.m.result.casts[self.inserted_index[source]]
                if self.elem(s, replacement) != to:
                    return
                first = f"the inserted Cast '{first}'"
            else:
                widened = self.producer(s, source)
                if widened is None:
                    return
                replacement = self.candidates[widened].input[0]
                if (
                    self.is_removed(*widened)
                    or self.elem(widened[0], replacement) != to
                    or not self.visible(widened[0], s, replacement)
                ):
                    return
                first = f"Cast '{self.candidates[widened].name}'"
            reason = (
                f"converts nothing: with {first} it takes '{replacement}' from "
                f"{_type_name(to)} to {_type_name(elem)} and back, exactly"
            )
        if not self.rewire(s, out, current, replacement):
            return
        self.remove(s, n, node, replacement, reason)
        if widened is not None:
            self.drop_if_dead(widened, node.name, to)
        if inserted is not None:
            self.drop_inserted_if_dead(s, replacement, inserted)

    def rewire(self, s: int, out: str, current: str, replacement: str) -> bool:
        """Every reader of `out` (named `current` now) reads `replacement` instead; False (nothing
        changed) if one cannot."""
        readers = self.readers(s, out, current)
        if readers is None:
            return False
        inserted = self.inserted_readers.get(current, ())
        if not all(self.visible(s, use.scope, replacement) for use, _ in readers):
            return False
        casts = self.m.result.casts
        made = set()  # (graph, type) of the inserted Casts of `replacement`
        for c in self.inserted_readers.get(replacement, ()):
            scope, _, _, elem, _ = casts[self.inserted_index[c.output[0]]]
            made.add((scope, elem))
        for c in inserted:
            scope, _, _, elem, _ = casts[self.inserted_index[c.output[0]]]
            if not self.visible(s, scope, replacement):
                return False
            if (scope, elem) in made and (scope, c.output[0]) not in self.m.main_outputs:
                return False  # `replacement` has that Cast already: two would be one too many (one
                # writing a main-graph output is a node of its own whatever it reads)
        for use, reader in readers:
            reader.input[use.slot] = replacement
        if readers:
            self.rewired.add(replacement)
        for cast in inserted:
            cast.input[0] = replacement
            i = self.inserted_index[cast.output[0]]
            scope, name, _, elem, output = casts[i]
            casts[i] = (scope, name, replacement, elem, output)
        if inserted:
            self.inserted_readers.setdefault(replacement, []).extend(inserted)
            del self.inserted_readers[current]
            if replacement in self.inserted_elem:
                self.unwind(s, out, replacement, inserted)
        return True

    def unwind(self, s: int, out: str, widened: str, moved: list) -> None:
        """Inserted Casts just moved onto `widened`, an inserted Cast's exact widening of a tensor,
        that take it back to that tensor's type: their readers (readers of `out`) read the tensor."""
        casts = self.m.result.casts
        _, _, source, wide, _ = casts[self.inserted_index[widened]]
        narrow = self.elem(s, source)
        if (narrow, wide) not in EXACT_WIDENING:
            return
        for cast in moved:
            scope, _, _, elem, output = casts[self.inserted_index[cast.output[0]]]
            if elem != narrow or (scope, output) in self.m.main_outputs:
                continue
            readers = self.readers(s, out, output)
            if readers is None or not all(self.visible(s, use.scope, source) for use, _ in readers):
                continue
            for use, reader in readers:
                reader.input[use.slot] = source
            self.dead_inserted.add(output)
            self.inserted_readers[widened].remove(cast)
        self.drop_inserted_if_dead(s, source, widened)

    def drop_if_dead(self, key, back: str, to: int) -> None:
        """The widening Cast of a folded round trip goes too when nothing reads it any more."""
        s, n = key
        if self.is_removed(s, n):
            return
        node = self.candidates[key]
        out = self.cg.scopes[s].io[n][1][0]
        if (s, out) in self.m.renamed or self.inserted_readers.get(out):
            return
        readers = self.readers(s, out)
        if readers is None or readers:
            return
        self.remove(
            s,
            n,
            node,
            None,
            f"its only reader, Cast '{back}', took the value back to {_type_name(to)}: "
            f"nothing reads it any more",
        )

    def drop_inserted_if_dead(self, s: int, tensor: str, cast_output: str) -> None:
        """An inserted Cast of `tensor` whose only reader was a folded Cast goes too."""
        found = self.cg.resolve(s, tensor)
        if found is None or self.inserted_readers.get(cast_output) or cast_output in self.rewired:
            return  # (readers of a folded Cast that now read the inserted one are no uses of `tensor`)
        readers = self.readers(found.scope, tensor, cast_output)
        if readers is not None and not readers:
            self.dead_inserted.add(cast_output)

    def remove(self, s: int, n: int, node, replacement, reason: str) -> None:
        self.removed.setdefault(s, set()).add(n)
        self.m.result.removed_casts.append((s, n, node.name, node.output[0], replacement, reason))

    def run(self) -> None:
        for key in self.candidates:
            self.settle(key)


def fold_noop_casts(m: Materialisation) -> None:
    """Mark the model's Casts that convert nothing as removed (`m.removed`, skipped by splice.py)
    and point their readers at what they read; drop their value_info entries."""
    if not m.low_vertices and not m.low_io:  # nothing is rewritten (no allow op): the model stays as it is
        return
    folder = _Folder(m)
    folder.run()
    if folder.dead_inserted:
        _drop_inserted(m, folder.dead_inserted)
    gone_by_scope: dict = {}
    for s, _, _, out, _, _ in m.result.removed_casts:
        gone_by_scope.setdefault(s, set()).add(out)
    for s, gone in gone_by_scope.items():
        value_info = m.cg.scopes[s].graph.value_info
        for i in reversed([i for i, v in enumerate(value_info) if v.name in gone]):
            del value_info[i]


def _drop_inserted(m: Materialisation, dead: set) -> None:
    """Take the inserted Casts writing `dead` out of what splice.py emits and the result's list."""
    m.result.casts[:] = [c for c in m.result.casts if c[4] not in dead]
    for nodes in (*m.after.values(), *m.top.values()):
        nodes[:] = [node for node in nodes if node.output[0] not in dead]
