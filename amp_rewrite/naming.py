"""New node and tensor names that never collide and come out the same on every run."""

from __future__ import annotations

from collections.abc import Iterable


class UniqueNames:
    """Hands out `wanted`, or `wanted_1`, `wanted_2`, ...: the first one nobody holds yet."""

    def __init__(self, taken: Iterable[str] = ()):
        self.taken = set(taken)

    def new(self, wanted: str) -> str:
        name, k = wanted, 0
        while name in self.taken:
            k += 1
            name = f"{wanted}_{k}"
        self.taken.add(name)
        return name
