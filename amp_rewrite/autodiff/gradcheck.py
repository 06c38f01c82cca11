"""Central finite differences, the oracle every gradient rule is checked against.

Build the model in float64 and run it with `onnx.reference` (which computes every op in the
declared type), so the difference quotient is accurate to ~1e-8 and a wrong rule stands out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx.reference import ReferenceEvaluator


def numeric_gradients(
    model: onnx.ModelProto,
    loss: str,
    feeds: dict[str, np.ndarray],
    wrt: Sequence[str],
    eps: float = 1e-6,
    max_coords: int = 64,
    seed: int = 0,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """d loss / d feed by central differences: {name: (flat coordinates probed, derivatives there)}.

    Large inputs are probed at `max_coords` random coordinates, which keeps the cost bounded.
    """
    evaluator = ReferenceEvaluator(model)
    rng = np.random.default_rng(seed)
    result = {}
    for name in wrt:
        size = np.size(feeds[name])
        coords = np.arange(size)
        if size > max_coords:
            coords = np.sort(rng.choice(size, max_coords, replace=False))
        derivatives = [
            (
                _loss_shifted(evaluator, loss, feeds, name, flat, eps)
                - _loss_shifted(evaluator, loss, feeds, name, flat, -eps)
            )
            / (2 * eps)
            for flat in coords
        ]
        result[name] = (coords, np.array(derivatives))
    return result


def _loss_shifted(evaluator, loss, feeds, name, flat, delta) -> float:
    """The (summed) loss with one element of feeds[name] moved by delta."""
    probe = np.array(feeds[name], copy=True)
    probe.reshape(-1)[flat] += delta
    return float(np.sum(evaluator.run([loss], {**feeds, name: probe})[0]))


def max_gradient_error(
    numeric: dict[str, tuple[np.ndarray, np.ndarray]], analytic: dict[str, np.ndarray]
) -> float:
    """Largest |analytic - numeric| over the probed coordinates, relative to max(1, |numeric|)."""
    worst = 0.0
    for name, (coords, derivatives) in numeric.items():
        got = np.asarray(analytic[name], dtype=np.float64).reshape(-1)[coords]
        worst = max(
            worst,
            float(np.max(np.abs(got - derivatives) / np.maximum(1.0, np.abs(derivatives)), initial=0.0)),
        )
    return worst
