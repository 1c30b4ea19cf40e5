"""Which elements of a materialized tensor a chain of layout ops reads: a strided view.

A kernel that takes its operand through strides can read ``permute_dims``, ``reshape``,
``strided_slice``, ``expand_dims`` / ``squeeze`` and constant-index ``take`` chains in place
instead of running them as copy kernels. Exporters write such
chains around every attention: the head split ``reshape -> permute``, K^T as ``permute`` or (the
dynamo exporter) ``reshape -> permute -> reshape``, Q/K/V as slices of a combined projection
(torch's ``nn.MultiheadAttention``: ``unflatten -> unsqueeze -> transpose -> squeeze`` and
``proj[0]``, ``proj[1]``, ``proj[2]``, exported as constant-index ``Gather``s).
A multiply by a positive scalar constant on the way (``q * sqrt(scale)``) changes no address;
its factor is returned for the kernel to apply.

``views(expr, lookup)`` lists, deepest source first, each tensor the chain can be read from
with the view (shape, element strides, offset) that reads ``expr`` from it; the last entry is
``expr`` itself (contiguous). Along the chain each dim is kept in mixed radix, a list of
(size, stride) digits, so a reshape may merge dims whose strides do not combine as long as a
later reshape splits them again (the dynamo exporter's K^T merges B and H, transposes and
splits them back); at the end every dim must be one stride, else that source is not a view
and the search starts higher up the chain.

Sizes, strides and offsets may be symbolic (PrimExprs over a dynamic model's shape variables:
``batch``, ``sequence``): sizes are compared and divided only where TVM's arithmetic analyzer
proves the relation for every value of the variables, so a symbolic chain is a view exactly
when it is one at every shape; a digit is split only at constant sizes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .... import tvm_compat
from .base import op_name, shape_of

SCALES = ("relax.multiply", "relax.divide")


@dataclass(frozen=True)
class View:
    """``expr`` read as ``source[offset + sum(i_k * strides[k])]`` over ``shape``, times
    ``factor``."""
    source: object
    shape: tuple
    strides: tuple
    offset: int = 0
    factor: float = 1.0


def _is(a, b) -> bool:
    return tvm_compat.prove_equal(a, b)


def _all_are(xs, ys) -> bool:
    return len(xs) == len(ys) and all(_is(x, y) for x, y in zip(xs, ys))


def contiguous_strides(shape) -> tuple:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step = step * n
    return tuple(reversed(out))


def bound(expr, lookup):
    """The call ``expr`` is (or is bound to), else None."""
    relax = tvm_compat.relax()
    if isinstance(expr, relax.Var):
        expr = lookup(expr)
    return expr if isinstance(expr, relax.Call) else None


def scalar(expr) -> float | None:
    """The value of a one-element constant, else None."""
    if not isinstance(expr, tvm_compat.tvm().ir.expr.Constant):
        return None
    value = expr.value.numpy()
    return float(value.reshape(-1)[0]) if value.size == 1 else None


def positive_scale(call) -> tuple | None:
    """(tensor operand, factor) when ``call`` multiplies or divides a tensor by a positive scalar
    constant, else None."""
    if op_name(call) not in SCALES:
        return None
    a, b = call.args
    c, x = scalar(b), a
    if c is None and op_name(call) == "relax.multiply":
        c, x = scalar(a), b
    if c is None or not c > 0 or not math.isfinite(c):
        return None
    return x, (1.0 / c if op_name(call) == "relax.divide" else c)


def _ints(tup) -> list | None:
    try:
        return [int(getattr(f, "value", f)) for f in tup.fields]
    except (AttributeError, TypeError):
        return None


def _collapse(digits) -> list:
    """Mixed-radix digits (outer first) with neighbours that form one stride merged."""
    out = []
    for n, st in digits:
        if _is(n, 1):
            continue
        if out and _is(out[-1][1], n * st):
            out[-1] = (out[-1][0] * n, st)
        else:
            out.append((n, st))
    return out


def _regroup(dims, new_shape):
    """The digits of ``dims`` (a list of digit lists) regrouped into ``new_shape``, splitting a
    digit where a new dim ends inside it (constant sizes only); None when sizes do not
    divide."""
    flat = [d for dim in dims for d in dim if not _is(d[0], 1)]
    out = []
    for m in (tvm_compat.size_value(x) for x in new_shape):
        group, size = [], 1
        while not _is(size, m):
            if not flat:
                return None
            n, st = flat.pop(0)
            if tvm_compat.prove_divisible(m, size * n):  # the digit ends inside this dim
                group.append((n, st))
                size = size * n
            elif (all(isinstance(x, int) for x in (m, size, n)) and m % size == 0
                  and n % (m // size) == 0):  # split: the outer part ends here
                outer = m // size
                group.append((outer, st * (n // outer)))
                flat.insert(0, (n // outer, st))
                size = m
            else:
                return None
        out.append(group)
    return out if not flat else None


def _strides(dims) -> tuple | None:
    out = []
    for dim in dims:
        digits = _collapse(dim)
        if len(digits) > 1:
            return None
        out.append(digits[0][1] if digits else 0)
    return tuple(out)


def _reshape(shape, strides, new_shape):
    """Strides of ``new_shape`` over the elements ``shape``/``strides`` address, in order, or
    None when that is not one strided view (``torch.Tensor.view``'s rule)."""
    dims = _regroup([[(n, s)] for n, s in zip(shape, strides)], new_shape)
    return None if dims is None else _strides(dims)


def _slice(dims, offset, axis: int, begin: int, extent: int):
    """(dims, offset) of ``extent`` elements from ``begin`` (negative: from the end) along
    ``axis``, or None when that axis is not one stride."""
    digits = _collapse(dims[axis])
    if len(digits) > 1:
        return None
    size, stride = digits[0] if digits else (1, 0)
    dims = [list(d) for d in dims]
    dims[axis] = [(extent, stride)]
    return dims, offset + (begin + size if begin < 0 else begin) * stride


def _step(dims, offset, factor, call):
    """(dims, offset, factor) carried through the layout op ``call``, or None."""
    name = op_name(call)
    if name == "relax.permute_dims":
        axes = call.attrs.axes
        axes = list(range(len(dims)))[::-1] if axes is None else [int(a) for a in axes]
        return [dims[a] for a in axes], offset, factor
    if name == "relax.reshape":
        shape = shape_of(call)
        new = None if shape is None else _regroup(dims, shape)
        return None if new is None else (new, offset, factor)
    if name == "relax.strided_slice":
        axes, begin, end = (_ints(x) for x in call.args[1:4])
        steps = _ints(call.args[4]) if len(call.args) > 4 else [1] * len(axes or [])
        shape = shape_of(call)
        if None in (axes, begin, end, steps, shape) or any(s != 1 for s in steps):
            return None
        for a, b in zip(axes, begin):
            sliced = _slice(dims, offset, a % len(dims), b, shape[a % len(dims)])
            if sliced is None:
                return None
            dims, offset = sliced
        return dims, offset, factor
    if name == "relax.expand_dims":  # new size-1 dims: no digits
        rank = len(dims) + len(call.attrs.axis)
        new_axes = {int(a) % rank for a in call.attrs.axis}
        rest = iter(dims)
        return [[] if i in new_axes else next(rest) for i in range(rank)], offset, factor
    if name == "relax.squeeze":
        shape = shape_of(call.args[0])
        if shape is None:
            return None
        axes = call.attrs.axis
        drop = ({i for i, n in enumerate(shape) if _is(n, 1)} if axes is None
                else {int(a) % len(dims) for a in axes})
        if not all(_is(shape[i], 1) for i in drop):
            return None
        return [d for i, d in enumerate(dims) if i not in drop], offset, factor
    if name == "relax.take":  # x[..., i, ...] at a constant index: a slice of one
        index, shape = _take_index(call), shape_of(call.args[0])
        if index is None or shape is None or not isinstance(shape[index[0]], int):
            return None
        axis, i, keep = index
        if not 0 <= i < shape[axis]:  # (relax's take reads a negative index out of bounds)
            return None
        sliced = _slice(dims, offset, axis, i, 1)
        if sliced is None:
            return None
        dims, offset = sliced
        return (dims if keep else dims[:axis] + dims[axis + 1:]), offset, factor
    scaled = positive_scale(call)
    if scaled is not None and _all_are(shape_of(call) or [],
                                       [math.prod(n for n, _ in d) for d in dims]):
        return dims, offset, factor * scaled[1]
    return None


def _take_index(call) -> tuple | None:
    """(axis, index, keeps the axis) of ``take(x, c, axis)`` with a one-element integer
    constant ``c`` (a 0-d index drops the axis, a [1] index keeps it), else None."""
    if op_name(call) != "relax.take" or call.attrs.axis is None:
        return None
    c = call.args[1]
    if not isinstance(c, tvm_compat.tvm().ir.expr.Constant):
        return None
    value = c.value.numpy()
    if value.size != 1 or value.ndim > 1 or value.dtype.kind not in "iu":
        return None
    rank = len(shape_of(call.args[0]) or ())
    if rank == 0:
        return None
    return int(call.attrs.axis) % rank, int(value.reshape(-1)[0]), value.ndim == 1


LAYOUT_OPS = ("relax.permute_dims", "relax.reshape", "relax.strided_slice",
              "relax.expand_dims", "relax.squeeze")


def _is_layout_op(call) -> bool:
    return (op_name(call) in LAYOUT_OPS or _take_index(call) is not None
            or positive_scale(call) is not None)


@dataclass(frozen=True)
class _Piece:
    """``split(source, ...)[i]``: the slice [begin, end) of ``source`` along ``axis``."""
    source: object
    axis: int
    begin: int
    end: int


def _split_piece(expr, lookup) -> _Piece | None:
    """``expr`` as a slice when it is (bound to) an item of a static-shape ``split``."""
    relax = tvm_compat.relax()
    item = lookup(expr) if isinstance(expr, relax.Var) else expr
    if not isinstance(item, tvm_compat.tvm().ir.expr.TupleGetItem):
        return None
    split = bound(item.tuple_value, lookup)
    shape = shape_of(split.args[0]) if split is not None and \
        op_name(split) == "relax.split" else None
    if shape is None:
        return None
    axis = int(split.attrs.axis) % len(shape)
    sections = split.attrs.indices_or_sections
    n = shape[axis]
    if not isinstance(n, int):
        return None
    if hasattr(sections, "value"):  # equal sections
        k = int(sections.value)
        bounds = [n * i // k for i in range(k + 1)] if n % k == 0 else None
    else:
        bounds = [0, *(min(int(i), n) for i in sections), n]
    if bounds is None or not 0 <= int(item.index) < len(bounds) - 1:
        return None
    i = int(item.index)
    return _Piece(split.args[0], axis, bounds[i], bounds[i + 1])


def views(expr, lookup, max_depth: int = 16) -> list[View]:
    """Each way to read ``expr`` in place, deepest source first (module docstring)."""
    chain = [expr]          # chain[i + 1] is the tensor operand of the layout op chain[i]
    while len(chain) <= max_depth:
        piece = _split_piece(chain[-1], lookup)
        if piece is not None:  # a split item: a slice of the split's input
            chain[-1] = (chain[-1], piece)
            chain.append(piece.source)
            continue
        call = bound(chain[-1], lookup)
        if call is None or not _is_layout_op(call):
            break
        scaled = positive_scale(call)
        chain.append(scaled[0] if scaled is not None else call.args[0])
    out = []
    for depth in range(len(chain) - 1, -1, -1):
        src = chain[depth][0] if isinstance(chain[depth], tuple) else chain[depth]
        shape = shape_of(src)
        if shape is None:
            continue
        state = ([[(n, st)] for n, st in zip(shape, contiguous_strides(shape))], 0, 1.0)
        for i in range(depth - 1, -1, -1):
            if isinstance(chain[i], tuple):  # (item, _Piece): a split item
                piece = chain[i][1]
                sliced = _slice(state[0], state[1], piece.axis, piece.begin,
                                piece.end - piece.begin)
                state = None if sliced is None else (*sliced, state[2])
            else:
                state = _step(*state, bound(chain[i], lookup))
            if state is None:
                break
        strides = None if state is None else _strides(state[0])
        if strides is not None:
            out.append(View(src, tuple(shape_of(expr)), strides, state[1], state[2]))
    return out
