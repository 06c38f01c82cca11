"""The host update's chains (host_update.py) in one C call each, where the optional extension
`_blocks` (_blocks.c, built by setup.py where a C compiler is) was built.

numpy makes a call, and a pass over a 64K block in L2, per op: AdamW's 13 ops cost 6.9 ms a step on
the MLP where ONNX Runtime training's fused kernel takes 4.0. The C loop runs every op of a chain
over 512 elements, in L1, then the next 512, as a fused kernel does, for whatever chain the apply
graph holds; each op is the same IEEE float32 operation, so the result is numpy's bit for bit
(tests/training/test_host_update.py runs both). Without the extension, numpy's calls run.
"""

from __future__ import annotations

import numpy as np

try:
    import amp_rewrite.training._blocks as _blocks
except ImportError:  # an install built without a C compiler
    _blocks = None

AVAILABLE = _blocks is not None

_OPCODES = {  # _blocks.c's
    None: 0,  # Identity: a copy
    np.add: 1,
    np.subtract: 2,
    np.multiply: 3,
    np.divide: 4,
    np.sqrt: 5,
    np.negative: 6,
    np.absolute: 7,
    np.reciprocal: 8,
}
_ARRAY, _SCALAR, _SCRATCH = 0, 1, 2


class _Refused(Exception):
    pass


def program(ops: list, buffers: dict, holders: dict, env: dict, size: int) -> tuple | None:
    """`run`'s argument for a chain's ops ((function, inputs, output) each): one C call per run
    of ops that shares no tensor but scalars with the rest, so a chain of several weights of one
    shape updates each in turn with its arrays in L1; None where an op has no opcode or an
    operand is not float32 of the chain's size (numpy's calls run the chain then)."""
    if not AVAILABLE:
        return None
    try:
        return tuple(_call(segment, buffers, holders, env, size) for segment in _segments(ops, holders))
    except _Refused:
        return None


def takes(ops: list) -> bool:
    """Whether the C loop has an opcode for every op of a chain ((function, inputs, output) each);
    its operands are checked when it is bound (`program`)."""
    return AVAILABLE and all(f in _OPCODES and 1 <= len(inputs) <= 2 for f, inputs, _ in ops)


def run(calls: tuple) -> None:
    for arguments in calls:
        _blocks.run(*arguments)


def _segments(ops: list, holders: dict) -> list[list]:
    """The ops cut after each op that ends every tensor (but scalars) used so far."""
    last = {name: i for i, (_, inputs, output) in enumerate(ops) for name in (*inputs, output)}
    segments, current, reach = [], [], -1
    for i, op in enumerate(ops):
        current.append(op)
        reach = max([reach] + [last[name] for name in (*op[1], op[2]) if name not in holders])
        if reach == i:
            segments.append(current)
            current = []
    return segments


def _call(ops: list, buffers: dict, holders: dict, env: dict, size: int) -> tuple:
    """_blocks.run's arguments: a slot per array, scalar holder and scratch buffer."""
    slots, operands, kinds, rows = {}, [], [], []

    def slot(name: str) -> int:
        key = ("holder", name) if name in holders else buffers.get(name, ("array", name))
        if key not in slots:
            kind = {"array": _ARRAY, "holder": _SCALAR, "scratch": _SCRATCH}[key[0]]
            operand = None if kind == _SCRATCH else holders[name] if kind == _SCALAR else env.get(key[1])
            if kind != _SCRATCH and not _fits(operand, size if kind == _ARRAY else 1):
                raise _Refused(name)
            slots[key] = len(operands)
            operands.append(operand)
            kinds.append(kind)
        return slots[key]

    for function, inputs, output in ops:
        if function not in _OPCODES or not 1 <= len(inputs) <= 2:
            raise _Refused(output)
        args = [slot(name) for name in inputs] + [-1]
        rows.append((_OPCODES[function], slot(output), args[0], args[1]))
    return np.array(rows, np.int32).tobytes(), tuple(operands), np.array(kinds, np.int32).tobytes(), size


def _fits(operand, size: int) -> bool:
    return (
        isinstance(operand, np.ndarray)
        and operand.dtype == np.float32
        and operand.flags.c_contiguous
        and operand.size == size
    )
