"""The one table of floating-point type facts amp uses (ranges, names, numpy conversion).

Every module that asks "does this value fit fp16/bf16?" or "what is the smallest normal bf16?"
reads it here; ``tests/test_dtypes.py`` checks the numbers against numpy and ml_dtypes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FLOAT_TYPES = ("float16", "bfloat16", "float32", "float64")
LOW_TYPES = ("float16", "bfloat16")  # the types amp converts to
PRECISION_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


@dataclass(frozen=True)
class TypeRange:
    max: float  # largest finite value (the lowest finite value is -max)
    smallest_normal: float
    smallest_subnormal: float


RANGES = {
    "float16": TypeRange(65504.0, 2.0 ** -14, 2.0 ** -24),
    # bf16: fp32's exponent with 7 mantissa bits: (2 - 2^-7) * 2^127
    "bfloat16": TypeRange((2.0 - 2.0 ** -7) * 2.0 ** 127, 2.0 ** -126, 2.0 ** -133),
    "float32": TypeRange(float(np.finfo(np.float32).max), float(np.finfo(np.float32).tiny),
                         float(np.finfo(np.float32).smallest_subnormal)),
    "float64": TypeRange(float(np.finfo(np.float64).max), float(np.finfo(np.float64).tiny),
                         float(np.finfo(np.float64).smallest_subnormal)),
}


def type_range(dtype: str) -> TypeRange:
    """The range facts of a float type name ("float16", "bfloat16", ...)."""
    try:
        return RANGES[dtype]
    except KeyError:
        raise ValueError(f"not a float type amp knows: {dtype}") from None


def lowest(dtype: str) -> float:
    """The most negative finite value of ``dtype`` (what a -inf/finfo.min mask becomes)."""
    return -type_range(dtype).max


def np_to_dtype(array: np.ndarray, dtype: str) -> np.ndarray:
    """``array`` converted to ``dtype``; bf16 through ml_dtypes (numpy has no bf16)."""
    if dtype == "bfloat16":
        import ml_dtypes

        return np.asarray(array).astype(ml_dtypes.bfloat16)
    return np.asarray(array).astype(dtype)


def round_to(array: np.ndarray, dtype: str) -> np.ndarray:
    """``array`` rounded to ``dtype`` and back to fp32 (what storing it in ``dtype`` keeps)."""
    with np.errstate(over="ignore"):  # out-of-range values become inf, as they would
        return np_to_dtype(np.asarray(array, np.float32), dtype).astype(np.float32)
