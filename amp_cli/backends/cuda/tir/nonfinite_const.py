"""Non-finite bf16 (and fp8/fp4) constants that the CUDA source can spell.

Symptom: a bf16 build of a model that compares against ``-inf`` (torch's attention writes
``x != -inf`` to find fully-masked rows; masks fill with ``-inf``) failed on the GPU with
``NVRTC compilation failed: identifier "inff" is undefined``. fp16 builds of the same model
compiled.

Cause (apache-tvm 0.27 ``src/backend/cuda/codegen/codegen_cuda.cc``, ``PrintConst``): fp32,
fp64 and fp16 constants print ``±inf`` / ``nan`` as ``CUDART_INF_F`` / ``CUDART_NAN_F`` (and
include ``math_constants.h``), but bf16, fp8 and fp4 constants are printed with
``std::hexfloat`` straight into ``__float2bfloat16_rn(<value>f)``, which for infinity is
``__float2bfloat16_rn(-inff)``: not C++.

Fix, a PrimFunc pass at the end of amp's device pipeline (after the last simplification, so
nothing folds it back): every non-finite constant of such a type becomes a cast of the fp32
constant, which the codegen prints through the fp32 path (``CUDART_INF_F``). The value is the
same: ±inf and NaN are representable in bf16 (and the fp8/fp4 conversion saturates or maps
them as the type defines, exactly as a runtime conversion would).
"""
from __future__ import annotations

import math

from .... import tvm_compat

PASS_NAME = "amp.NonFiniteConstants"
# float types whose constants TVM 0.27 prints with std::hexfloat (not the fp32 path)
_HEXFLOAT_PRINTED = ("bfloat16", "float8", "float6", "float4")


def _spelled_by_hexfloat(dtype: str) -> bool:
    return dtype.startswith(_HEXFLOAT_PRINTED)


def rewrite_func(func):
    """``func`` with each non-finite bf16/fp8/fp4 constant replaced by ``cast(fp32 constant)``."""
    T = tvm_compat.tirx()
    changed = []

    def on_float(imm, _mutator):
        dtype = str(imm.ty)
        if _spelled_by_hexfloat(dtype) and not math.isfinite(imm.value):
            changed.append(imm)
            # lanes: a constant FloatImm is scalar; vector constants are Broadcast(FloatImm)
            return T.Cast(dtype, T.FloatImm("float32", imm.value))
        return imm

    body = tvm_compat.structural_mutate(func.body, [(T.FloatImm, on_float)])
    return func.with_body(body) if changed else func


def nonfinite_constants_pass():
    """The PrimFunc pass applying :func:`rewrite_func`."""
    return tvm_compat.prim_func_pass(lambda f, _m, _c: rewrite_func(f), PASS_NAME)
