"""Neural-network ops: softmax, convolution, pooling and dropout (normalisation: norm.py).

Where ONNX Runtime's builders call training kernels (ConvGrad, MaxPoolGrad, SoftmaxGrad,
LayerNormalizationGrad...), these rules spell the same math in standard ops: ConvTranspose and a
transposed Conv for convolutions; for max pooling a first-maximum mask where the windows tile the
input, else the MaxPool Indices output plus a scatter.
"""

from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto

from amp_rewrite.autodiff.rules._common import normalize_axis
from amp_rewrite.autodiff.rules.shape import SCATTER_ADD_SINCE, _scatter_flat


def _softmax_axis(ctx, y) -> list[int]:
    """The reduced axis; a negative one needs no rank (ReduceSum takes it as it is), so a model
    whose shapes inference cannot follow (converted from opset 11) still differentiates."""
    axis = ctx.attr("axis", -1)
    return [axis if axis < 0 and ctx.dims(y) is None else normalize_axis(axis, ctx.rank(y))]


def softmax_grad(ctx):
    """y * (dY - sum(dY*y, axis))."""
    e, y = ctx.emit, ctx.y()
    axis = _softmax_axis(ctx, y)
    inner = e.reduce_sum(e.op("Mul", [ctx.dy(), y]), axis)
    return [e.op("Mul", [y, e.op("Sub", [ctx.dy(), inner])])]


def log_softmax_grad(ctx):
    """dY - exp(y) * sum(dY, axis)."""
    e, y = ctx.emit, ctx.y()
    axis = _softmax_axis(ctx, y)
    return [e.op("Sub", [ctx.dy(), e.op("Mul", [e.op("Exp", [y]), e.reduce_sum(ctx.dy(), axis)])])]


# -- convolution ----------------------------------------------------------------------------------
def _geometry(ctx, x, kernel):
    """strides, dilations and explicit pads (begins then ends), auto_pad resolved."""
    spatial = len(kernel)
    strides = list(ctx.attr("strides") or [1] * spatial)
    dilations = list(ctx.attr("dilations") or [1] * spatial)
    auto_pad = ctx.attr("auto_pad", "NOTSET")
    if auto_pad in ("NOTSET", ""):
        return strides, dilations, list(ctx.attr("pads") or [0] * 2 * spatial)
    if auto_pad == "VALID":
        return strides, dilations, [0] * 2 * spatial
    sizes = (ctx.dims(x) or [None] * (spatial + 2))[2:]
    if not all(isinstance(size, int) or s == 1 for size, s in zip(sizes, strides)):
        raise ctx.error(f"auto_pad={auto_pad} with strides > 1 needs static spatial sizes")
    begins, ends = [], []
    for size, s, d, k in zip(sizes, strides, dilations, kernel):
        # stride 1 pads (k-1)*d whatever the size: a dynamic image size needs no static one
        total = (k - 1) * d if s == 1 else max((math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size, 0)
        small, large = total // 2, total - total // 2
        begins.append(small if auto_pad == "SAME_UPPER" else large)
        ends.append(large if auto_pad == "SAME_UPPER" else small)
    return strides, dilations, begins + ends


def _conv_input_grad(ctx, dy, w, x, kernel, strides, dilations, pads, group):
    """dX of a convolution: ConvTranspose of dY, sized exactly like x.

    With static spatial sizes the output padding is computed; otherwise the largest output is
    produced and sliced to Shape(x), which keeps a dynamic image size working.
    """
    e = ctx.emit
    spatial = len(kernel)
    sizes = (ctx.dims(x) or [None] * (spatial + 2))[2:]
    out_sizes = (ctx.dims(dy) or [None] * (spatial + 2))[2:]
    attrs = dict(strides=strides, dilations=dilations, pads=pads, group=group, kernel_shape=kernel)
    if all(isinstance(s, int) for s in [*sizes, *out_sizes]):
        extra = [
            size + pads[i] + pads[i + spatial] - d * (k - 1) - 1 - s * (out - 1)
            for i, (size, out, s, d, k) in enumerate(zip(sizes, out_sizes, strides, dilations, kernel))
        ]
        return e.op("ConvTranspose", [dy, w], output_padding=extra, **attrs)
    grown = e.op("ConvTranspose", [dy, w], output_padding=[s - 1 for s in strides], **attrs)
    axes = list(range(2, spatial + 2))
    return e.op("Slice", [grown, e.ints([0] * spatial), e.shape(x, 2), e.ints(axes)])


# dW as one product per kernel offset needs this many input channels (ONNX Runtime CPU, 1 thread,
# dW of a 3x3 conv, batch 32 at 28x28 to 32 channels: 0.81x the transposed Conv's time at 4
# channels, 0.53x at 8, 0.45x at 64; at 1 channel the products are matrix-vector ones, 2x slower)
OFFSET_PRODUCTS_MIN_CHANNELS = 4
OFFSET_PRODUCTS_MAX_OFFSETS = 25  # a 5x5 kernel; each offset is a slice of x and a product


def _conv_weight_grad(ctx, dy, x, kernel, strides, dilations, pads, group, w_dims):
    """dW of a convolution: a product per kernel offset where that is faster (_by_offsets), else
    x correlated with dY, batch and channel axes swapped (per group)."""
    out_sizes = (ctx.dims(dy) or [None] * (len(kernel) + 2))[2:]
    if (
        group == 1
        and ctx.opset >= 13  # Pad and Slice read their sizes from inputs
        and w_dims[1] >= OFFSET_PRODUCTS_MIN_CHANNELS
        and math.prod(kernel) <= OFFSET_PRODUCTS_MAX_OFFSETS
        and all(isinstance(size, int) for size in out_sizes)
    ):
        return _conv_weight_grad_by_offsets(ctx, dy, x, kernel, strides, dilations, pads, w_dims, out_sizes)
    e = ctx.emit
    spatial = len(kernel)
    swap = [1, 0, *range(2, spatial + 2)]
    if group == 1:
        xt = e.op("Transpose", [x], perm=swap)
    else:  # channels grouped as [C/g, g*N]: Conv's group split then pairs each group with its dY
        per_group = w_dims[1]
        split = e.op("Concat", [e.shape(x, 0, 1), e.ints([group, per_group]), e.shape(x, 2)], axis=0)
        grouped = e.op("Transpose", [e.op("Reshape", [x, split])], perm=[2, 1, 0, *range(3, spatial + 3)])
        xt = e.op("Reshape", [grouped, e.op("Concat", [e.ints([per_group, -1]), e.shape(x, 2)], axis=0)])
    dyt = e.op("Transpose", [dy], perm=swap)
    corr = e.op("Conv", [xt, dyt], strides=dilations, dilations=strides, pads=pads, group=group)
    dw = e.op("Transpose", [corr], perm=swap)
    axes = list(range(2, spatial + 2))
    return e.op("Slice", [dw, e.ints([0] * spatial), e.ints(kernel), e.ints(axes)])


def _conv_weight_grad_by_offsets(ctx, dy, x, kernel, strides, dilations, pads, w_dims, out_sizes):
    """dW[:, :, o] = dY' x_o'^T for each kernel offset o: dY as [Co, N*out] and the window of x
    that offset reads as [Ci, N*out], one Gemm each; what ONNX Runtime's ConvGrad does with
    im2col, without the [Ci*K, N*out] matrix. Its transposed-Conv form ran MLAS Gemms of as many
    columns as the kernel has offsets (9): 2x slower on the small CNN's second conv."""
    e = ctx.emit
    spatial = len(kernel)
    swap = [1, 0, *range(2, spatial + 2)]
    if any(pads):
        x = e.op("Pad", [x, e.ints([0, 0, *pads[:spatial], 0, 0, *pads[spatial:]])])
    xt = e.op("Transpose", [x], perm=swap)  # [Ci, N, ...]
    dy2 = e.op("Reshape", [e.op("Transpose", [dy], perm=swap), e.ints([w_dims[0], -1])])  # [Co, N*out]
    columns, axes = e.ints([w_dims[1], -1]), e.ints(list(range(2, spatial + 2)))
    parts = []
    for offset in np.ndindex(*kernel):
        begins = [o * d for o, d in zip(offset, dilations)]
        ends = [b + (n - 1) * s + 1 for b, n, s in zip(begins, out_sizes, strides)]
        window = e.op("Slice", [xt, e.ints(begins), e.ints(ends), axes, e.ints(strides)])
        product = e.op("Gemm", [dy2, e.op("Reshape", [window, columns])], transB=1)  # [Co, Ci]
        parts.append(e.unsqueeze(product, [2]))
    stacked = e.op("Concat", parts, axis=2)  # [Co, Ci, K]
    return e.op("Reshape", [stacked, e.ints(w_dims)])


def _weight_and_kernel(ctx, w):
    """A convolution's weight dims and kernel size, both needed static by its gradients."""
    w_dims = ctx.dims(w)
    if w_dims is None:
        raise ctx.error("the weight's shape must be known")
    kernel = list(ctx.attr("kernel_shape") or w_dims[2:])
    if not all(isinstance(k, int) for k in kernel):
        raise ctx.error("the kernel size must be static")
    return w_dims, kernel


def conv_grad(ctx):
    """dX by ConvTranspose, dW by a transposed Conv of x with dY, dB by summing dY."""
    x, w, dy = ctx.x(0), ctx.x(1), ctx.dy()
    w_dims, kernel = _weight_and_kernel(ctx, w)
    strides, dilations, pads = _geometry(ctx, x, kernel)
    group = ctx.attr("group", 1)
    grads = [None, None, None]
    if ctx.needs(0):
        grads[0] = _conv_input_grad(ctx, dy, w, x, kernel, strides, dilations, pads, group)
    if ctx.needs(1):
        grads[1] = _conv_weight_grad(ctx, dy, x, kernel, strides, dilations, pads, group, w_dims)
    if ctx.needs(2):
        grads[2] = ctx.emit.reduce_sum(dy, [0, *range(2, len(kernel) + 2)], keepdims=False)
    return grads


def conv_transpose_grad(ctx):
    """ConvTranspose(x, W) is the adjoint of Conv(., W) with the same geometry, so dX = Conv(dY, W)
    and dW is Conv's weight gradient with the roles of x and dY exchanged; dB sums dY. Explicit
    pads only (auto_pad and output_shape place the output by rules this does not replay)."""
    x, w, dy = ctx.x(0), ctx.x(1), ctx.dy()
    w_dims, kernel = _weight_and_kernel(ctx, w)
    if ctx.attr("auto_pad", "NOTSET") not in ("NOTSET", "") or ctx.attr("output_shape"):
        raise ctx.error("only explicit pads are supported (not auto_pad or output_shape)")
    spatial = len(kernel)
    strides = list(ctx.attr("strides") or [1] * spatial)
    dilations = list(ctx.attr("dilations") or [1] * spatial)
    pads = list(ctx.attr("pads") or [0] * 2 * spatial)
    group = ctx.attr("group", 1)
    grads = [None, None, None]
    if ctx.needs(0):
        grads[0] = ctx.emit.op(
            "Conv", [dy, w], strides=strides, dilations=dilations, pads=pads, group=group, kernel_shape=kernel
        )
    if ctx.needs(1):
        grads[1] = _conv_weight_grad(ctx, x, dy, kernel, strides, dilations, pads, group, w_dims)
    if ctx.needs(2):
        grads[2] = ctx.emit.reduce_sum(dy, [0, *range(2, spatial + 2)], keepdims=False)
    return grads


# -- pooling --------------------------------------------------------------------------------------
def _no_ceil_mode(ctx):
    if ctx.attr("ceil_mode", 0):
        raise ctx.error("ceil_mode=1 is not supported")


RESIZE_SCALES_SINCE = 13  # Resize's roi input optional: Resize(x, "", scales)


def _tiled_windows(ctx, x, kernel):
    """True when the windows tile x exactly: stride == kernel, no dilation or padding, and static
    spatial sizes that the kernel divides."""
    sizes = (ctx.dims(x) or [None])[2:]
    return (
        ctx.opset >= RESIZE_SCALES_SINCE
        and list(ctx.attr("strides") or []) == list(kernel)
        and not any(d != 1 for d in ctx.attr("dilations") or [])
        and not any(ctx.attr("pads") or [])
        and ctx.attr("auto_pad", "NOTSET") in ("NOTSET", "", "VALID")
        and len(sizes) == len(kernel)
        and all(isinstance(s, int) and s % k == 0 for s, k in zip(sizes, kernel))
    )


def _tiled_max_pool_grad(ctx, x, kernel):
    """dY to the first maximum of each window in scan order, as MaxPool's Indices and torch pick it,
    without Indices or a scatter (both slow on ONNX Runtime CPU): upsample Y (Resize nearest,
    asymmetric: a plain copy), mark x == Y, rank the marks by window position (first = highest),
    keep the best mark of each window (MaxPool of the ranks, upsampled, Equal), times upsampled dY."""
    e, elem = ctx.emit, ctx.dtype(x)
    scales = e.const([1.0, 1.0, *map(float, kernel)], TensorProto.FLOAT)
    up = lambda t: e.op(  # noqa: E731 - a one-expression helper
        "Resize",
        [t, "", scales],
        mode="nearest",
        coordinate_transformation_mode="asymmetric",  # noqa: E731
        nearest_mode="floor",
    )
    window = np.arange(np.prod(kernel), 0, -1).reshape(kernel)  # first position ranks highest
    tiles = [s // k for s, k in zip(ctx.dims(x)[2:], kernel)]
    rank = e.const(np.tile(window, tiles)[None, None], elem)
    marks = e.op("Mul", [e.cast(e.op("Equal", [x, up(ctx.y())]), elem), rank])
    best = e.op("MaxPool", [marks], kernel_shape=list(kernel), strides=list(kernel))
    first = e.cast(e.op("Equal", [marks, up(best)]), elem)
    return e.op("Mul", [first, up(ctx.dy())])


def max_pool_grad(ctx):
    """Windows that tile the input: a mask of each window's first maximum (_tiled_max_pool_grad).
    Others: scatter dY to the argmax positions given by MaxPool's own Indices output, which also
    covers ceil_mode's partial last windows (a CRNN's captcha reader pools that way)."""
    if ctx.attr("storage_order", 0):
        raise ctx.error("storage_order=1 is not supported")
    kernel, strides = ctx.attr("kernel_shape"), ctx.attr("strides") or [1] * len(ctx.attr("kernel_shape"))
    if _tiled_windows(ctx, ctx.x(0), kernel):
        return [_tiled_max_pool_grad(ctx, ctx.x(0), kernel)]
    overlapping = any(s < k for s, k in zip(strides, kernel))
    if overlapping and ctx.opset < SCATTER_ADD_SINCE:
        raise ctx.error(f"overlapping windows need scatter-add (opset {SCATTER_ADD_SINCE}+)")
    indices = ctx.ensure_output(1, "indices")
    ctx.info.elem[indices] = TensorProto.INT64
    return [_scatter_flat(ctx, ctx.x(0), indices, ctx.dy(), reduction="add" if overlapping else None)]


def average_pool_grad(ctx):
    """Spread dY/count evenly over each window: a depthwise ConvTranspose with a ones kernel."""
    _no_ceil_mode(ctx)
    e, x, dy = ctx.emit, ctx.x(0), ctx.dy()
    dims = ctx.dims(x)
    if dims is None or not isinstance(dims[1], int):
        raise ctx.error("the channel count must be static")
    kernel = list(ctx.attr("kernel_shape"))
    strides, dilations, pads = _geometry(ctx, x, kernel)
    channels, elem = dims[1], ctx.dtype(x)
    ones = e.const(np.ones([channels, 1, *kernel]), elem)
    if ctx.attr("count_include_pad", 0) or not any(pads):
        g = e.op("Div", [dy, e.const(float(np.prod(kernel)), elem)])
    else:  # each window's divisor is how many real (unpadded) elements it covers
        counts = e.op(
            "Conv",
            [e.ones_of_shape(e.shape(x), elem), ones],
            strides=strides,
            dilations=dilations,
            pads=pads,
            group=channels,
        )
        g = e.op("Div", [dy, counts])
    return [_conv_input_grad(ctx, g, ones, x, kernel, strides, dilations, pads, channels)]


def global_average_pool_grad(ctx):
    """dY / (H*W...) broadcast over the spatial axes."""
    e, x = ctx.emit, ctx.x(0)
    count = e.cast(e.op("Div", [e.op("Size", [x]), e.op("Size", [ctx.y()])]), ctx.dtype(x))
    return [e.op("Expand", [e.op("Div", [ctx.dy(), count]), e.shape(x)])]


def global_max_pool_grad(ctx):
    """dY to the spatial maxima, split evenly between ties."""
    e, x = ctx.emit, ctx.x(0)
    hit = e.cast(e.op("Equal", [x, ctx.y()]), ctx.dtype(x))
    count = e.reduce_sum(hit, list(range(2, ctx.rank(x))), keepdims=True)
    return [e.op("Mul", [ctx.dy(), e.op("Div", [hit, count])])]


def dropout_grad(ctx):
    """dY * mask / (1 - ratio) in training mode (the node's mask output is added when missing), else dY."""
    training = ctx.x(2)
    if not training:
        return [ctx.dy()]
    value = ctx.constant(training)
    if value is not None and not bool(np.asarray(value)):
        return [ctx.dy()]
    e, x = ctx.emit, ctx.x(0)
    elem = ctx.dtype(x)
    mask = ctx.ensure_output(1, "mask")
    ctx.info.elem[mask] = TensorProto.BOOL
    ratio = ctx.x(1) or e.const(0.5, elem)
    if ctx.dtype(ratio) != elem:
        ratio = e.cast(ratio, elem)
    keep_scale = e.op("Reciprocal", [e.op("Sub", [e.const(1, elem), ratio])])
    factor = e.op("Mul", [e.cast(mask, elem), keep_scale])
    if value is None:  # training mode decided at run time
        factor = e.op("Where", [training, factor, e.const(1, elem)])
    return [e.op("Mul", [ctx.dy(), factor])]
