"""ONNX shape arithmetic that TVM's importer turns into data-dependent shapes, converted by amp so
that a model with dynamic dims keeps them symbolic (docs/dynamic-shapes.md).

``Range(0, Gather(Shape(x), 1), 1)`` (``torch.arange(seq_len)`` as transformers exports it for
position ids and masks): TVM 0.27's converter reads the limit, a ``PrimValue`` of the symbolic
dim, as a runtime tensor and gives the result a fresh shape variable defined by the tensor's
value. Memory planned for the largest shape cannot size a buffer by such a variable (the build
fails: "PrimExpr ... range_len_0 ... has not been computed"). Here a Range whose inputs are
constants or symbolic dims becomes ``arange(start, limit, delta)`` over those dims; any other
Range goes to TVM's converter.
"""
from __future__ import annotations

from .. import tvm_compat


def _scalar(expr):
    """An int constant or a symbolic dim (a PrimValue of one) as an int / PrimExpr; None for
    anything else (a runtime tensor)."""
    value = tvm_compat.constant_value(expr)
    if value is not None:
        return int(value.item()) if value.size == 1 and value.dtype.kind in "iu" else None
    return tvm_compat.prim_value_expr(expr)


def convert_range(bb, inputs, attrs, opset):
    start, limit, delta = (_scalar(x) for x in inputs)
    dtype = tvm_compat.scalar_dtype(inputs[0])
    if None in (start, limit, delta) or not isinstance(delta, int) or delta == 0 or \
            dtype is None or not dtype.startswith("int"):
        return tvm_compat.onnx_default_converter("Range", opset)(bb, inputs, attrs, None)
    return tvm_compat.relax().op.arange(start, limit, delta, dtype)


CONVERTERS = {"Range": convert_range}
