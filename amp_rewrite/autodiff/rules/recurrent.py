"""LSTM and GRU: backpropagation through time with one reverse-time Scan per direction.

The forward node stays as it is (ORT's fused kernel). Its Y output holds every hidden state, so
the gates of all time steps are recomputed at once from x_t and h_{t-1} (batched MatMuls); only
the LSTM cell state needs a short forward Scan (c_t = f*c_{t-1} + i*g). The backward recurrence
(dh_{t-1} = dz_t @ R + ...) is a Scan over reversed time whose body holds one MatMul; every weight
gradient is then one MatMul over all steps. A reverse direction runs on ReverseSequence'd inputs,
so per-batch sequence_lens reverse as ONNX Runtime does; steps past a sequence's length pass the
state gradient through unchanged. Default activations only; no clip, peepholes or input_forget.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

INT64 = TensorProto.INT64
LSTM_ACTIVATIONS = ["Sigmoid", "Tanh", "Tanh"]
GRU_ACTIVATIONS = ["Sigmoid", "Tanh"]


def _check(ctx, defaults: list[str]) -> None:
    activations = [a.decode() if isinstance(a, bytes) else a for a in (ctx.attr("activations") or [])]
    directions = 2 if ctx.attr("direction", "forward") == "bidirectional" else 1
    if activations and [a.lower() for a in activations] != [a.lower() for a in defaults * directions]:
        raise ctx.error(f"only the default activations {defaults} are supported, not {activations}")
    if ctx.attr("clip") is not None:
        raise ctx.error("clip is not supported")
    if ctx.attr("layout", 0):
        raise ctx.error(
            "layout=1 (batch first) is not supported (ONNX Runtime cannot run it either: export with "
            "layout=0, as torch does)"
        )
    if ctx.attr("input_forget", 0):
        raise ctx.error("input_forget=1 is not supported")
    if ctx.attr("hidden_size") is None:
        raise ctx.error("the hidden_size attribute is missing")


class _Direction:
    """One direction's tensors, in processing order: inputs xs [T,B,I], states ys [T,B,H], h_{t-1} [T,B,H]."""

    def __init__(self, ctx, d: int, reverse: bool, hidden: int, y: str):
        e = self.e = ctx.emit
        self.ctx, self.d, self.reverse, self.hidden = ctx, d, reverse, hidden
        x = ctx.x(0)
        lens = ctx.x(4)
        self.lens = e.cast(lens, INT64) if lens else None
        self.xs = self.in_order(x)
        self.ys = self.in_order(self.pick(y, axis=1))
        self.h0 = self.pick(ctx.x(5)) if ctx.x(5) else self.zeros()
        self.h_prev = self.previous(self.h0, self.ys)
        self.mask = self._mask() if lens else None

    def previous(self, first: str, states: str) -> str:
        """[first, states[0], ..., states[T-2]]: the state each step starts from."""
        e = self.e
        shifted = e.op("Slice", [states, e.ints([0]), e.ints([-1]), e.ints([0])])
        return e.op("Concat", [e.unsqueeze(first, [0]), shifted], axis=0)

    def pick(self, name: str, axis: int = 0) -> str:
        return self.e.op("Gather", [name, self.e.const(np.int64(self.d), INT64)], axis=axis)

    def weight(self, slot: int) -> str:
        return self.pick(self.ctx.x(slot))

    def zeros(self) -> str:
        e = self.e
        shape = e.op("Concat", [e.dim(self.ctx.x(0), 1), e.ints([self.hidden])], axis=0)
        zero = helper.make_tensor("value", self.ctx.dtype(self.ctx.x(0)), [1], [0])
        return e.op("ConstantOfShape", [shape], value=zero)

    def _lengths(self) -> str:
        e, x = self.e, self.ctx.x(0)
        return self.lens if self.lens is not None else e.op("Expand", [e.dim(x, 0), e.dim(x, 1)])

    def in_order(self, name: str) -> str:
        """A [T,B,...] tensor in processing order (each sequence reversed within its length)."""
        if not self.reverse:
            return name
        return self.e.op("ReverseSequence", [name, self._lengths()], batch_axis=1, time_axis=0)

    def _mask(self) -> str:
        """[T,B,1]: 1 where step t is inside sequence b's length."""
        e = self.e
        length = e.op("Reshape", [e.dim(self.ctx.x(0), 0), e.ints([])])
        steps = e.op("Range", [e.const(0, INT64), length, e.const(1, INT64)])
        inside = e.op("Less", [e.unsqueeze(steps, [1]), e.unsqueeze(self.lens, [0])])
        return e.unsqueeze(e.cast(inside, self.ctx.dtype(self.ctx.x(0))), [2])

    def output_grad(self, i: int) -> str | None:
        g = self.ctx.dy(i)
        return None if g is None else self.pick(g, axis=1 if i == 0 else 0)


def _scan(
    ctx, states: list[str], slices: list[str], body, scan_outputs: int, reverse: bool = True
) -> list[str]:
    """A Scan over time: body(emitter, state names, slice names) -> (new states, per-step outputs)."""
    e = ctx.emit
    elem = ctx.dtype(ctx.x(0))
    b = e.body()
    state_in = [b.fresh(f"{e.scope}/scan_state") for _ in states]
    slice_in = [b.fresh(f"{e.scope}/scan_slice") for _ in slices]
    new_states, outs = body(b, state_in, slice_in)
    outputs = [b.op("Identity", [name]) for name in [*new_states, *outs]]
    # every state and slice is [B, K]; ORT wants the rank of a Scan body's values
    info = lambda names: [helper.make_tensor_value_info(n, elem, [None, None]) for n in names]  # noqa: E731
    graph = helper.make_graph(
        b.nodes, b.fresh(f"{e.scope}/scan_body"), info([*state_in, *slice_in]), info(outputs)
    )
    direction = 1 if reverse else 0
    return e.op(
        "Scan",
        [*states, *slices],
        len(states) + scan_outputs,
        body=graph,
        num_scan_inputs=len(slices),
        scan_input_directions=[direction] * len(slices),
        scan_output_directions=[direction] * scan_outputs,
    )


def _outer_sum(e, g: str, x: str) -> str:
    """sum over t and b of g[t,b,:]^T x[t,b,:]: [width of g, width of x]."""
    flat = lambda t: e.op("Reshape", [t, e.op("Concat", [e.ints([-1]), e.dim(t, 2)], axis=0)])  # noqa: E731
    return e.op("MatMul", [e.op("Transpose", [flat(g)], perm=[1, 0]), flat(x)])


def _stack(e, parts: list[str]) -> str:
    """Per-direction gradients stacked on a new leading axis."""
    return e.op("Concat", [e.unsqueeze(p, [0]) for p in parts], axis=0)


def _directions(ctx):
    direction = ctx.attr("direction", "forward")
    if direction == "bidirectional":
        return [(0, False), (1, True)]
    return [(0, direction == "reverse")]


def _one_minus(e, t: str, elem: int) -> str:
    return e.op("Sub", [e.const(1, elem), t])


def _sigmoid_slope(e, a: str, elem: int) -> str:
    """sigmoid' from its output a: a * (1 - a)."""
    return e.op("Mul", [a, _one_minus(e, a, elem)])


def lstm_grad(ctx):
    """Recompute the gates from Y (batched), c_t with a forward Scan, then one reverse-time Scan whose
    body is dz_t -> dh_{t-1} = dz_t @ R; weight gradients are MatMuls over all steps."""
    _check(ctx, LSTM_ACTIVATIONS)
    peepholes = ctx.constant(ctx.x(7)) if ctx.x(7) else np.zeros(1)
    if peepholes is None or np.any(peepholes):
        raise ctx.error("peepholes (input P) are not supported")
    e, elem, hidden = ctx.emit, ctx.dtype(ctx.x(0)), ctx.attr("hidden_size")
    y = ctx.ensure_output(0, "Y")
    ctx.info.elem[y] = elem
    grads = {slot: [] for slot in (0, 1, 2, 3, 5, 6)}
    for d, reverse in _directions(ctx):
        s = _Direction(ctx, d, reverse, hidden, y)
        w, r = s.weight(1), s.weight(2)
        i, o, f, g = _lstm_gates(ctx, s, w, r, hidden)
        c0 = s.pick(ctx.x(6)) if ctx.x(6) else s.zeros()
        cs = _cell_states(ctx, s, c0, f, e.op("Mul", [i, g]))
        c_prev = s.previous(c0, cs)
        tanh_c = e.op("Tanh", [cs])
        k_i = e.op("Mul", [g, _sigmoid_slope(e, i, elem)])
        k_o = e.op("Mul", [tanh_c, _sigmoid_slope(e, o, elem)])
        k_f = e.op("Mul", [c_prev, _sigmoid_slope(e, f, elem)])
        k_g = e.op("Mul", [i, _one_minus(e, e.op("Mul", [g, g]), elem)])
        k_c = e.op("Mul", [o, _one_minus(e, e.op("Mul", [tanh_c, tanh_c]), elem)])
        dz, dh0, dc0 = _lstm_backward(ctx, s, r, elem, [k_c, f, k_i, k_o, k_f, k_g])
        _collect(ctx, s, grads, dz, w, dz, s.h_prev, dh0, dc0)
    return _finish(ctx, grads, 7)


def _lstm_gates(ctx, s: _Direction, w: str, r: str, hidden: int) -> list[str]:
    """i, o, f (sigmoid) and g (tanh) of every step at once, from x_t and h_{t-1}."""
    e = ctx.emit
    z = e.op(
        "Add",
        [
            e.op("MatMul", [s.xs, e.op("Transpose", [w], perm=[1, 0])]),
            e.op("MatMul", [s.h_prev, e.op("Transpose", [r], perm=[1, 0])]),
        ],
    )
    if ctx.x(3):
        z = e.op("Add", [z, e.op("Add", e.op("Split", [s.weight(3), e.ints([4 * hidden] * 2)], 2, axis=0))])
    zi, zo, zf, zc = e.op("Split", [z, e.ints([hidden] * 4)], 4, axis=2)
    return [e.op("Sigmoid", [zi]), e.op("Sigmoid", [zo]), e.op("Sigmoid", [zf]), e.op("Tanh", [zc])]


def _cell_states(ctx, s: _Direction, c0: str, f: str, u: str) -> str:
    """c_t for every step (held past a sequence's end), by a forward Scan of c = f*c + u."""
    slices = [f, u] + ([s.mask] if s.mask is not None else [])

    def body(b, states, xs):
        (c,) = states
        c_new = b.op("Add", [b.op("Mul", [xs[0], c]), xs[1]])
        if s.mask is not None:  # c_new inside the sequence, c held past its end
            c_new = b.op("Add", [c, b.op("Mul", [xs[2], b.op("Sub", [c_new, c])])])
        return [c_new], [c_new]

    return _scan(ctx, [c0], slices, body, 1, reverse=False)[1]


def _lstm_backward(ctx, s: _Direction, r: str, elem: int, factors: list[str]):
    """The reverse-time Scan: states (dh, dc), per step dz = [di, do, df, dg] pre-activation gradients."""
    dy, dy_h, dy_c = s.output_grad(0), s.output_grad(1), s.output_grad(2)
    slices = list(factors) + ([s.in_order(dy)] if dy else []) + ([s.mask] if s.mask is not None else [])

    def body(b, states, xs):
        dh, dc = states
        k_c, f, k_i, k_o, k_f, k_g = xs[:6]
        mask = xs[-1] if s.mask is not None else None
        dh_new = b.op("Add", [dh, xs[6]]) if dy else dh
        if mask is not None:  # past a sequence's end the state gradient passes through unchanged
            dh_new, dc = b.op("Mul", [dh_new, mask]), b.op("Mul", [dc, mask])
        dc_new = b.op("Add", [dc, b.op("Mul", [dh_new, k_c])])
        dz = b.op(
            "Concat",
            [
                b.op("Mul", [dc_new, k_i]),
                b.op("Mul", [dh_new, k_o]),
                b.op("Mul", [dc_new, k_f]),
                b.op("Mul", [dc_new, k_g]),
            ],
            axis=1,
        )
        dh_prev, dc_prev = b.op("MatMul", [dz, r]), b.op("Mul", [dc_new, f])
        if mask is not None:
            keep = _one_minus(b, mask, elem)
            dh_prev = b.op("Add", [dh_prev, b.op("Mul", [states[0], keep])])
            dc_prev = b.op("Add", [dc_prev, b.op("Mul", [states[1], keep])])
        return [dh_prev, dc_prev], [dz]

    start = [dy_h or s.zeros(), dy_c or s.zeros()]
    dh0, dc0, dz = _scan(ctx, start, slices, body, 1)
    return dz, dh0, dc0


def _collect(ctx, s: _Direction, grads, dgx, w, dgh, h_in, dh0, dc0=None, dgh_bias=None):
    """One direction's gradients: dX (back in input order), dW, dR, dB, d initial_h/c. dgx: gate
    gradients on the input side; dgh: on the recurrent side, read with h_in (lists: row blocks)."""
    e = ctx.emit
    if ctx.needs(0):
        grads[0].append(s.in_order(e.op("MatMul", [dgx, w])))
    if ctx.needs(1):
        grads[1].append(_outer_sum(e, dgx, s.xs))
    if ctx.needs(2):
        grads[2].append(
            _outer_sum(e, dgh, h_in)
            if isinstance(dgh, str)
            else e.op("Concat", [_outer_sum(e, g, h) for g, h in zip(dgh, h_in)], axis=0)
        )
    if ctx.needs(3):
        sums = [e.reduce_sum(t, [0, 1], keepdims=False) for t in (dgx, dgh_bias or dgh)]
        grads[3].append(e.op("Concat", sums, axis=0))
    if ctx.needs(5):
        grads[5].append(dh0)
    if ctx.needs(6) and dc0 is not None:
        grads[6].append(dc0)


def _finish(ctx, grads, count):
    """dX sums the directions' contributions; per-direction tensors stack on their leading axis."""
    e = ctx.emit
    result = [_stack(e, grads[slot]) if grads.get(slot) else None for slot in range(count)]
    if grads[0]:
        result[0] = grads[0][0] if len(grads[0]) == 1 else e.op("Add", grads[0])
    return result


def gru_grad(ctx):
    """Recompute z, r and the candidate from Y (batched), then one reverse-time Scan carrying dh_t;
    linear_before_reset 0 and 1. Weight gradients are MatMuls over all steps."""
    _check(ctx, GRU_ACTIVATIONS)
    e, elem, hidden = ctx.emit, ctx.dtype(ctx.x(0)), ctx.attr("hidden_size")
    y = ctx.ensure_output(0, "Y")
    ctx.info.elem[y] = elem
    grads = {slot: [] for slot in (0, 1, 2, 3, 5)}
    for d, reverse in _directions(ctx):
        s = _Direction(ctx, d, reverse, hidden, y)
        w, r = s.weight(1), s.weight(2)
        z, rg, cand, hh, reset_h, r_split = _gru_gates(ctx, s, w, r, hidden)
        k_z = e.op("Mul", [e.op("Sub", [s.h_prev, cand]), _sigmoid_slope(e, z, elem)])
        k_h = e.op("Mul", [_one_minus(e, z, elem), _one_minus(e, e.op("Mul", [cand, cand]), elem)])
        if ctx.attr("linear_before_reset", 0):  # the candidate reads r * (h @ R_h^T + Rb_h)
            k_r = e.op("Mul", [e.op("Mul", [k_h, hh]), _sigmoid_slope(e, rg, elem)])
            k_all = e.op("Concat", [k_z, k_r, e.op("Mul", [k_h, rg])], axis=2)
            dh0, (dh_new,) = _gru_backward(ctx, s, r, elem, [z, k_all])
            dz, dr, dhh = (e.op("Mul", [dh_new, k]) for k in (k_z, k_r, k_h))
            dgh = e.op("Concat", [dz, dr, e.op("Mul", [dhh, rg])], axis=2)
            _collect(ctx, s, grads, e.op("Concat", [dz, dr, dhh], axis=2), w, dgh, s.h_prev, dh0)
        else:  # the candidate reads (r * h) @ R_h^T
            k_r = e.op("Mul", [s.h_prev, _sigmoid_slope(e, rg, elem)])
            dh0, (dh_new, q) = _gru_backward(ctx, s, r, elem, [z, k_z, k_h, k_r, rg], r_split)
            dz, dhh, dr = e.op("Mul", [dh_new, k_z]), e.op("Mul", [dh_new, k_h]), e.op("Mul", [q, k_r])
            dgx = e.op("Concat", [dz, dr, dhh], axis=2)
            dgh = [e.op("Concat", [dz, dr], axis=2), dhh]
            _collect(ctx, s, grads, dgx, w, dgh, [s.h_prev, reset_h], dh0, dgh_bias=dgx)
    return _finish(ctx, grads, 6)


def _gru_gates(ctx, s: _Direction, w: str, r: str, hidden: int):
    """z, r, the candidate, its recurrent term hh, r*h_{t-1} and (R_zr, R_h), for all steps at once."""
    e = ctx.emit
    r_zr, r_h = e.op("Split", [r, e.ints([2 * hidden, hidden])], 2, axis=0)
    gx = e.op("MatMul", [s.xs, e.op("Transpose", [w], perm=[1, 0])])
    gh = e.op("MatMul", [s.h_prev, e.op("Transpose", [r_zr], perm=[1, 0])])
    if ctx.x(3):
        wb, rb = e.op("Split", [s.weight(3), e.ints([3 * hidden] * 2)], 2, axis=0)
        rb_zr, rb_h = e.op("Split", [rb, e.ints([2 * hidden, hidden])], 2, axis=0)
        gx, gh = e.op("Add", [gx, wb]), e.op("Add", [gh, rb_zr])
    xz, xr, xh = e.op("Split", [gx, e.ints([hidden] * 3)], 3, axis=2)
    hz, hr = e.op("Split", [gh, e.ints([hidden] * 2)], 2, axis=2)
    z, rg = e.op("Sigmoid", [e.op("Add", [xz, hz])]), e.op("Sigmoid", [e.op("Add", [xr, hr])])
    before_reset = ctx.attr("linear_before_reset", 0)
    reset_h = e.op("Mul", [rg, s.h_prev])
    hh = e.op("MatMul", [s.h_prev if before_reset else reset_h, e.op("Transpose", [r_h], perm=[1, 0])])
    if ctx.x(3):
        hh = e.op("Add", [hh, rb_h])
    cand = e.op("Tanh", [e.op("Add", [xh, e.op("Mul", [rg, hh]) if before_reset else hh])])
    return z, rg, cand, hh, reset_h, (r_zr, r_h)


def _gru_backward(ctx, s: _Direction, r: str, elem: int, factors: list[str], split_r=None):
    """Reverse-time Scan carrying dh. linear_before_reset=1: dh_{t-1} = dh*z + (dh*K) @ R;
    0: the candidate's matrix reads r*h, so dh_{t-1} adds q*r + ... with q = (dh*k_h) @ R_h."""
    dy, dy_h = s.output_grad(0), s.output_grad(1)
    n = len(factors)
    slices = list(factors) + ([s.in_order(dy)] if dy else []) + ([s.mask] if s.mask is not None else [])

    def body(b, states, xs):
        (dh,) = states
        mask = xs[-1] if s.mask is not None else None
        dh_new = b.op("Add", [dh, xs[n]]) if dy else dh
        if mask is not None:
            dh_new = b.op("Mul", [dh_new, mask])
        z = xs[0]
        if split_r is None:  # factors: z, [k_z, k_r, k_h*r] (3H)
            tiled = b.op("Concat", [dh_new] * 3, axis=1)
            dh_prev = b.op(
                "Add", [b.op("Mul", [dh_new, z]), b.op("MatMul", [b.op("Mul", [tiled, xs[1]]), r])]
            )
            outs = [dh_new]
        else:  # factors: z, k_z, k_h, k_r, r
            r_zr, r_h = split_r
            k_z, k_h, k_r, rg = xs[1:5]
            q = b.op("MatMul", [b.op("Mul", [dh_new, k_h]), r_h])
            dzr = b.op("Concat", [b.op("Mul", [dh_new, k_z]), b.op("Mul", [q, k_r])], axis=1)
            dh_prev = b.op(
                "Add",
                [b.op("Add", [b.op("Mul", [dh_new, z]), b.op("MatMul", [dzr, r_zr])]), b.op("Mul", [q, rg])],
            )
            outs = [dh_new, q]
        if mask is not None:
            dh_prev = b.op("Add", [dh_prev, b.op("Mul", [dh, _one_minus(b, mask, elem)])])
        return [dh_prev], outs

    dh0, *outs = _scan(ctx, [dy_h or s.zeros()], slices, body, 1 if split_r is None else 2)
    return dh0, outs
