"""The plan: the colour of every vertex of the colouring graph and why, as the colouring passes
decide it (analysis/paint.py, analysis/placement.py) and the materialiser, the report and the
picture read it. Data only: it imports nothing of the package, so every stage can reach it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import NamedTuple

LOW, FP32 = "low", "float32"


class Step(Enum):
    """The pass (or fixed fact) that decided a vertex's colour; the report and the HTML picture
    match on these, never on the wording."""

    ALLOW_LIST = "allow list"
    DENY_LIST = "deny list"
    MEASURED = "measured deny root"  # calibration or a user's force_fp32: `detail` says why
    DOWNSTREAM_OF_DENY = "downstream of deny"
    BETWEEN_ALLOW = "between allow ops"
    INFER_AFTER_ALLOW = "infer fed by allow (bfloat16)"
    CLEAR_NEXT_TO_LOW = "clear next to low precision"
    ALL_CONSUMERS_LOW = "all consumers low precision"
    BLOCKED = "blocked"  # may never be low precision (no list, schema, user pin, range): `detail`
    NOT_PAINTED = "not painted"  # no pass reached it: `detail` says which rule left it float32
    TIED = "tied"  # shares one colour with the ops a sequence joins it to (ties.py): `detail` says which
    COST_PLACEMENT = "cost placement"  # free infer/clear op coloured by the minimum cut: `detail` says which
    COLOURED_AS = "coloured as the node it must match"  # RewriteOptions.colour_as (transform/colour_as.py)
    # not a colour: a node entry's step when the model's own Cast was removed as converting nothing
    # (transform/noop_casts.py); its groups keep the reasons of their colours
    REMOVED_NO_OP = "removed: no-op Cast"


class Reason(NamedTuple):
    """Why a vertex got its colour: the step, the neighbour it came through (if any), and for
    steps that carry one, the particular reason. A NamedTuple: one is made for every vertex."""

    step: Step
    via: int | None = None
    detail: str | None = None

    @property
    def text(self) -> str:
        """The reason in words: the detail where the step has one, else the step's name."""
        return self.detail or self.step.value


@dataclass(frozen=True)
class Plan:
    """The frozen result: colour and reason of every vertex."""

    colour: MappingProxyType  # vertex -> LOW | FP32
    reason: MappingProxyType  # vertex -> Reason

    def is_low(self, v: int) -> bool:
        return self.colour.get(v) == LOW
