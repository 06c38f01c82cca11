"""Write a Trainer checkpoint, and read one back verifying all of it before any state is touched.

A checkpoint is an .npz (`Trainer.save`): `meta` (JSON: format, optimizer, loss scale, lr),
`names` (the state tensors' names) and `state_I` per name, written atomically (`write_checkpoint`).
`read_checkpoint` reads it bounded (io.npz: zip integrity, CRCs, no pickles), then checks the
metadata keys and values and every tensor's name, dtype and shape against what the trainer
expects, and returns a plain value; the Trainer changes its state only from that value, so a bad
file leaves it as it was.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping

import numpy as np

from amp_rewrite.errors import TrainingError
from amp_rewrite.io import atomic_write
from amp_rewrite.io.npz import read_npz

CHECKPOINT_FORMAT = "amp-rewrite-trainer/1"
META_KEYS = ("format", "optimizer", "loss_scale", "lr")
MATCHING = ("format", "optimizer", "loss_scale")  # must equal the trainer's own


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint: its metadata and {state name: array}."""

    meta: dict
    state: dict


def checkpoint_meta(optimizer, loss_scale_policy, lr: float) -> dict:
    """The metadata a checkpoint carries (and `read_checkpoint` expects) for this optimizer, loss
    scale and learning rate."""
    policy = dataclasses.asdict(loss_scale_policy) | {"kind": type(loss_scale_policy).__name__}
    meta = {
        "format": CHECKPOINT_FORMAT,
        "optimizer": optimizer.config(),
        "loss_scale": policy,
        "lr": lr,
    }
    return json.loads(json.dumps(meta))  # the form it has after a round trip (tuples -> lists)


def write_checkpoint(path, state: Mapping[str, np.ndarray], meta: Mapping) -> None:
    """`state` and `meta` to the .npz at `path`, atomically (no pickle)."""
    arrays = {f"state_{i}": value for i, value in enumerate(state.values())}
    arrays["names"] = np.array(list(state), dtype=np.str_)
    arrays["meta"] = np.array(json.dumps(meta), dtype=np.str_)
    atomic_write(path, lambda f: np.savez(f, **arrays))


def read_checkpoint(path, expected_meta: Mapping, expected_state: Mapping[str, np.ndarray]) -> Checkpoint:
    """The checkpoint at `path`, verified whole against the trainer's metadata (`expected_meta`)
    and state (`expected_state`: name -> array of the right dtype and shape); one TrainingError
    line for whatever does not match."""
    where = f"checkpoint {os.fspath(path)!r}"
    arrays = read_npz(path, what=f"cannot read {where}", error=TrainingError)
    meta = _meta(arrays, where)
    for key in MATCHING:
        if meta[key] != expected_meta[key]:
            raise TrainingError(
                f"{where}: {key} {meta[key]!r} does not match this trainer's {expected_meta[key]!r}"
            )
    names = _names(arrays, where)
    extra = sorted(set(arrays) - {"meta", "names"} - {f"state_{i}" for i in range(len(names))})
    if extra:
        raise TrainingError(f"{where}: unexpected array {extra[0]!r}")
    if set(names) != set(expected_state):
        differs = sorted(set(names) ^ set(expected_state))
        raise TrainingError(
            f"{where}: state does not match this trainer's step graph (differs in {differs[0]!r})"
        )
    state = {}
    for i, name in enumerate(names):
        key = f"state_{i}"
        if key not in arrays:
            raise TrainingError(f"{where}: state tensor {name!r} ({key}) is missing")
        value, reference = arrays[key], expected_state[name]
        if value.shape != reference.shape or value.dtype != reference.dtype:
            raise TrainingError(
                f"{where}: state {name!r} is {value.dtype}{list(value.shape)}, "
                f"expected {reference.dtype}{list(reference.shape)}"
            )
        state[name] = value
    return Checkpoint(meta, state)


def _meta(arrays: Mapping, where: str) -> dict:
    raw = arrays.get("meta")
    if raw is None or raw.shape != () or raw.dtype.kind != "U":
        raise TrainingError(f"{where}: no metadata (a 'meta' text array)")
    try:
        meta = json.loads(str(raw))
    except ValueError:
        raise TrainingError(f"{where}: metadata is not JSON") from None
    if not isinstance(meta, dict):
        raise TrainingError(f"{where}: metadata is not a JSON object")
    missing = [key for key in META_KEYS if key not in meta]
    if missing:
        raise TrainingError(f"{where}: metadata lacks {', '.join(missing)}")
    lr = meta["lr"]
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
        raise TrainingError(f"{where}: metadata lr {lr!r} is not a finite number of at least 0")
    return meta


def _names(arrays: Mapping, where: str) -> list[str]:
    raw = arrays.get("names")
    if raw is None or raw.ndim != 1 or raw.dtype.kind != "U":
        raise TrainingError(f"{where}: no state names (a 'names' text array)")
    names = [str(n) for n in raw]
    if len(set(names)) != len(names):
        raise TrainingError(f"{where}: a state name appears twice")
    return names
