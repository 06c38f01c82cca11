"""Resize: the gradient of a linear map is its transpose.

Nearest, linear and cubic Resize interpolate each resized axis separately, so the forward is
Y = X x_d A_d (one [out, in] interpolation matrix per axis) and dX = dY x_d A_d^T. Each A_d is built
at run time from Shape(x) and Shape(y) with ONNX Runtime's own float32 coordinate formulas, so
dynamic image sizes work and ORT's constant folding removes the work when shapes are static. The
coordinates start from a float Range, a deny op of the float16 lists, so the AMP rewrite keeps
the index arithmetic float32 (float16 cannot count pixels past 2048).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64
COORDINATE_MODES = ("half_pixel", "pytorch_half_pixel", "asymmetric", "align_corners")
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


def _check(ctx) -> tuple[str, str, str]:
    mode = ctx.attr("mode", "nearest")
    coordinates = ctx.attr("coordinate_transformation_mode", "half_pixel")
    nearest = ctx.attr("nearest_mode", "round_prefer_floor")
    if mode not in ("nearest", "linear", "cubic"):
        raise ctx.error(f"mode='{mode}' is not supported (nearest, linear and cubic are)")
    if coordinates not in COORDINATE_MODES:
        raise ctx.error(
            f"coordinate_transformation_mode='{coordinates}' is not supported "
            f"({', '.join(COORDINATE_MODES)} are)"
        )
    if ctx.attr("antialias", 0):
        raise ctx.error("antialias=1 is not supported")
    if ctx.attr("keep_aspect_ratio_policy", "stretch") != "stretch":
        raise ctx.error("keep_aspect_ratio_policy other than 'stretch' is not supported")
    return mode, coordinates, nearest


def _resized_axes(ctx, rank: int) -> list[tuple[int, int]]:
    """(position in scales/sizes, axis) of the axes that may be resized: a constant scale of 1, or a
    size equal to the input's (static or the same symbol), is the identity and skipped."""
    axes = [a + rank if a < 0 else a for a in (ctx.attr("axes") or range(rank))]
    scales = _values(ctx, ctx.x(2))
    sizes = _values(ctx, ctx.x(3))
    x_dims, y_dims = ctx.dims(ctx.x(0)) or [None] * rank, ctx.dims(ctx.y()) or [None] * rank
    kept = []
    for k, axis in enumerate(axes):
        if scales is not None and len(scales) and scales[k] == 1.0:
            continue
        same_size = (sizes is not None and sizes[k] == x_dims[axis]) or (
            x_dims[axis] is not None and x_dims[axis] == y_dims[axis]
        )
        if same_size and not _has_scales(ctx):
            continue
        kept.append((k, axis))
    return kept


def _values(ctx, name: str) -> list | None:
    value = ctx.constant(name) if name else None
    return None if value is None else np.asarray(value).reshape(-1).tolist()


def _has_scales(ctx) -> bool:
    """Whether the scales input decides (given and not an empty constant)."""
    scales = ctx.x(2)
    return bool(scales) and (ctx.constant(scales) is None or np.size(ctx.constant(scales)) > 0)


def _scale(ctx, k: int, in_len: str, out_len: str) -> str:
    """The axis' scale as ORT uses it: the scales input, else out/in in float32."""
    e = ctx.emit
    scales = ctx.x(2)
    if _has_scales(ctx):
        value = e.op("Gather", [scales, e.ints([k])])
        return value if ctx.dtype(scales) == FLOAT else e.cast(value, FLOAT)
    return e.op("Div", [e.cast(out_len, FLOAT), e.cast(in_len, FLOAT)])


def _source_coordinates(ctx, coordinates: str, in_len: str, out_len: str, scale: str) -> str:
    """x_original for each output index, ORT's formula per coordinate_transformation_mode (float32)."""
    e = ctx.emit
    f = lambda v: e.const(np.float32(v), FLOAT)  # noqa: E731
    out_f, in_f = e.cast(out_len, FLOAT), e.cast(in_len, FLOAT)
    i = e.op("Range", [f(0), e.op("Reshape", [out_f, e.ints([])]), f(1)])  # float Range: kept float32
    if coordinates == "asymmetric":
        return e.op("Div", [i, scale])
    if coordinates == "align_corners":
        x = e.op("Div", [e.op("Mul", [i, e.op("Sub", [in_f, f(1)])]), e.op("Sub", [out_f, f(1)])])
        return e.op("Where", [e.op("Equal", [out_len, e.ints([1])]), f(0), x])
    x = e.op("Sub", [e.op("Div", [e.op("Add", [i, f(0.5)]), scale]), f(0.5)])
    if coordinates == "pytorch_half_pixel":
        return e.op("Where", [e.op("Greater", [out_len, e.ints([1])]), x, f(0)])
    return x


def _clamped_index(ctx, x: str, in_len: str) -> str:
    """int64 index clamped to [0, in_len - 1]."""
    e = ctx.emit
    index = e.cast(x, INT64)
    return e.op("Max", [e.op("Min", [index, e.op("Sub", [in_len, e.ints([1])])]), e.ints([0])])


def _one_hot(ctx, index: str, in_len: str) -> str:
    """[out, in] float32 rows with a 1 at each index."""
    e = ctx.emit
    columns = e.op("Range", [e.const(0, INT64), e.op("Reshape", [in_len, e.ints([])]), e.const(1, INT64)])
    return e.cast(e.op("Equal", [e.unsqueeze(index, [1]), columns]), FLOAT)


def _matrix(ctx, mode, coordinates, nearest, k, axis) -> str:
    """The [out, in] interpolation matrix of one axis, in the input's element type."""
    e, x = ctx.emit, ctx.x(0)
    in_len, out_len = e.dim(x, axis), e.dim(ctx.y(), axis)
    source = _source_coordinates(ctx, coordinates, in_len, out_len, _scale(ctx, k, in_len, out_len))
    f = lambda v: e.const(np.float32(v), FLOAT)  # noqa: E731
    if mode == "nearest":
        rounded = {
            "round_prefer_floor": lambda: e.op("Ceil", [e.op("Sub", [source, f(0.5)])]),
            "round_prefer_ceil": lambda: e.op("Floor", [e.op("Add", [source, f(0.5)])]),
            "floor": lambda: e.op("Floor", [source]),
            "ceil": lambda: e.op("Ceil", [source]),
        }[nearest]()
        matrix = _one_hot(ctx, _clamped_index(ctx, rounded, in_len), in_len)
    elif mode == "cubic":
        matrix = _cubic(ctx, source, in_len)
    else:  # linear: the source clamped to [0, in - 1], weights 1-w and w on its two neighbours
        last = e.cast(e.op("Sub", [in_len, e.ints([1])]), FLOAT)
        clamped = e.op("Max", [e.op("Min", [source, last]), f(0)])
        low = e.op("Floor", [clamped])
        weight = e.unsqueeze(e.op("Sub", [clamped, low]), [1])
        i0 = _clamped_index(ctx, low, in_len)
        i1 = e.op("Min", [e.op("Add", [i0, e.ints([1])]), e.op("Sub", [in_len, e.ints([1])])])
        matrix = e.op(
            "Add",
            [
                e.op("Mul", [_one_hot(ctx, i0, in_len), e.op("Sub", [f(1), weight])]),
                e.op("Mul", [_one_hot(ctx, i1, in_len), weight]),
            ],
        )
    return matrix if ctx.dtype(x) == FLOAT else e.cast(matrix, ctx.dtype(x))


def _cubic(ctx, source: str, in_len: str) -> str:
    """Keys' cubic convolution as ORT computes it: taps floor(x) - 1 .. floor(x) + 2 at distances
    1 + r, r, 1 - r, 2 - r (r = x - floor(x)), indices clamped to the edge; with exclude_outside,
    taps outside [0, in) weigh 0 and the rest are renormalised."""
    e = ctx.emit
    f = lambda v: e.const(np.float32(v), FLOAT)  # noqa: E731
    a = float(ctx.attr("cubic_coeff_a", -0.75))
    low = e.op("Floor", [source])
    r = e.op("Sub", [source, low])
    near = lambda d: e.op(  # noqa: E731 - Keys' kernel, |d| <= 1
        "Add",
        [
            e.op(
                "Mul",
                [
                    e.op("Sub", [e.op("Mul", [f(a + 2), d]), f(a + 3)]),
                    e.op("Mul", [d, d]),
                ],
            ),
            f(1),
        ],
    )  # |d| <= 1
    far = lambda d: e.op(  # noqa: E731 - Keys' kernel, 1 < |d| < 2
        "Sub",
        [
            e.op(
                "Mul",
                [
                    e.op(
                        "Add",
                        [
                            e.op(
                                "Mul",
                                [
                                    e.op(
                                        "Sub",
                                        [
                                            e.op("Mul", [f(a), d]),  # noqa: E731
                                            f(5 * a),
                                        ],
                                    ),
                                    d,
                                ],
                            ),
                            f(8 * a),
                        ],
                    ),
                    d,
                ],
            ),
            f(4 * a),
        ],
    )  # 1 < |d| < 2
    weights = [
        far(e.op("Add", [r, f(1)])),
        near(r),
        near(e.op("Sub", [f(1), r])),
        far(e.op("Sub", [f(2), r])),
    ]
    base = e.cast(low, INT64)
    taps = [e.op("Add", [base, e.ints([offset])]) for offset in (-1, 0, 1, 2)]
    if ctx.attr("exclude_outside", 0):
        inside = [
            e.cast(e.op("And", [e.op("GreaterOrEqual", [t, e.ints([0])]), e.op("Less", [t, in_len])]), FLOAT)
            for t in taps
        ]
        weights = [e.op("Mul", [w, m]) for w, m in zip(weights, inside)]
        total = e.op("Sum", weights)
        weights = [e.op("Div", [w, total]) for w in weights]
    last = e.op("Sub", [in_len, e.ints([1])])
    rows = [
        e.op(
            "Mul",
            [_one_hot(ctx, e.op("Max", [e.op("Min", [t, last]), e.ints([0])]), in_len), e.unsqueeze(w, [1])],
        )
        for t, w in zip(taps, weights)
    ]
    return e.op("Sum", rows)


def _apply_transpose(ctx, g: str, matrix: str, axis: int, rank: int) -> str:
    """g x_axis A^T: the axis of length out becomes length in."""
    e = ctx.emit
    if axis == rank - 1:
        return e.op("MatMul", [g, matrix])
    if axis == rank - 2:
        return e.op("MatMul", [e.op("Transpose", [matrix], perm=[1, 0]), g])
    perm = [a for a in range(rank) if a != axis] + [axis]
    back = [0] * rank
    for i, p in enumerate(perm):
        back[p] = i
    moved = e.op("MatMul", [e.op("Transpose", [g], perm=perm), matrix])
    return e.op("Transpose", [moved], perm=back)


def resize_grad(ctx):
    """dX = dY times each resized axis' interpolation matrix transposed (nearest, linear, cubic; the matrices are
    built at run time with ORT's float32 coordinate formulas, so dynamic sizes work)."""
    mode, coordinates, nearest = _check(ctx)
    rank = ctx.rank(ctx.x(0))
    g = ctx.dy()
    for k, axis in _resized_axes(ctx, rank):
        g = _apply_transpose(ctx, g, _matrix(ctx, mode, coordinates, nearest, k, axis), axis, rank)
    return [g]
