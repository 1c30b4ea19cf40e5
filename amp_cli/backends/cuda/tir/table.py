"""The (dtype, lanes) combinations TVM's CUDA code generator can print, as data.

Source: ``CodeGenCUDA::PrintType`` / ``GetFP8Type`` / ``PrintVecElemLoad`` in
``src/backend/cuda/codegen/codegen_cuda.cc`` (apache/tvm, the 0.27 line), checked against the
installed apache-tvm 0.27.0.post1 by ``tests/test_legalize.py::test_table_matches_codegen``.

Everything not listed here is treated as illegal (conservative). Lane count 1 (scalar) is legal
for every type the generator knows at all.
"""
from __future__ import annotations

# dtype -> lane counts CodeGenCUDA prints. Comments: the CUDA type it prints / why not others.
PRINTABLE_LANES: dict[str, frozenset[int]] = {
    # half / half2 / half4 / uint3 / uint4; odd lanes -> "Check failed: lanes % 2 == 0",
    # > 8 -> "Cannot convert type T.float16x16 to CUDA type".
    "float16": frozenset({1, 2, 4, 6, 8}),
    # nv_bfloat16 / nv_bfloat162 / nv_bfloat164 / uint3 / uint4; same rules as half.
    "bfloat16": frozenset({1, 2, 4, 6, 8}),
    # float, float2..float4, ulonglong3/4 (6 and 8 lanes); 5, 7 and > 8 fail.
    "float32": frozenset({1, 2, 3, 4, 6, 8}),
    "float64": frozenset({1, 2, 3, 4}),
    # __nv_fp8{,x2,x4} for <= 4 lanes (3 throws in GetFP8Type); uint<lanes/4> above, which is
    # only the right size for 8 and 16.
    "float8_e4m3fn": frozenset({1, 2, 4, 8, 16}),
    "float8_e5m2": frozenset({1, 2, 4, 8, 16}),
    "float8_e8m0fnu": frozenset({1, 2, 4, 8, 16}),
    # fp6 / fp4: only <= 4 lanes print at all; keep to the sizes that exist as types.
    "float6_e2m3fn": frozenset({1, 2, 4}),
    "float6_e3m2fn": frozenset({1, 2, 4}),
    "float4_e2m1fn": frozenset({1, 2, 4}),
    # int8: signed char / char2 / char3 / int (x4) / int2 (x8) / int4 (x16); 5-7, 9-15 fail.
    "int8": frozenset({1, 2, 3, 4, 8, 16}),
    "uint8": frozenset({1, 2, 3, 4, 8, 16}),
    # short, short2..4, int3 / int4 (6 / 8 lanes)
    "int16": frozenset({1, 2, 3, 4, 6, 8}),
    "uint16": frozenset({1, 2, 3, 4, 6, 8}),
    # int, int2..int4, longlong3/4 (6 / 8 lanes)
    "int32": frozenset({1, 2, 3, 4, 6, 8}),
    "uint32": frozenset({1, 2, 3, 4, 6, 8}),
    "int64": frozenset({1, 2, 3, 4}),
    "uint64": frozenset({1, 2, 3, 4}),
    # bool vectors print as ushort2..ushort4
    "bool": frozenset({1, 2, 3, 4}),
}

# Printable but not compilable: these lane counts are printed as a container type (uint3 for 6
# halves, ulonglong4 for 8 floats, int3 / longlong4 for 6 / 8 ints ...) whose broadcasts and
# constants come out as `make_<container>(x, x, ...)` with one argument per *lane*; nvcc rejects
# them with "too many arguments in function call". Found when the legalized lane matrix ran on
# the H200 (NVRTC) and reproduced with nvcc 13 here (tests/test_legalize.py::test_nvcc_compiles).
NVCC_REJECTS: dict[str, frozenset[int]] = {
    "float16": frozenset({6}),
    "bfloat16": frozenset({6}),
    "float32": frozenset({6, 8}),
    "int16": frozenset({6, 8}),
    "uint16": frozenset({6, 8}),
    "int32": frozenset({6, 8}),
    "uint32": frozenset({6, 8}),
}

# What the legalizer keeps: printable and compilable.
LEGAL_LANES: dict[str, frozenset[int]] = {
    dtype: lanes - NVCC_REJECTS.get(dtype, frozenset())
    for dtype, lanes in PRINTABLE_LANES.items()}

# Widths the legalizer splits into, widest first. Powers of two only: they are the widths
# whose vector loads/stores can be naturally aligned (a 6-lane half vector is legal to print
# but is a 12-byte type; 7 lanes become 4+2+1, not 6+1).
PIECE_WIDTHS: tuple[int, ...] = (16, 8, 4, 2, 1)

# Largest vector memory access CUDA has (ld/st.v4.b32 = 16 bytes): pieces of a load or store
# are never wider than this.
MAX_ACCESS_BYTES = 16


def _norm(dtype) -> tuple[str, int]:
    """('float16', 3) from 'float16x3', a tvm dtype or PrimType."""
    text = str(getattr(dtype, "dtype", dtype))
    if "x" in text and text.rsplit("x", 1)[1].isdigit():
        base, lanes = text.rsplit("x", 1)
        return base, int(lanes)
    return text, 1


def lane_printable(dtype, lanes: int | None = None) -> bool:
    """Whether stock CUDA codegen prints ``dtype`` with ``lanes`` lanes (without failing)."""
    base, own = _norm(dtype)
    legal = PRINTABLE_LANES.get(base)
    lanes = own if lanes is None else lanes
    return lanes == 1 if legal is None else lanes in legal


def lane_legal(dtype, lanes: int | None = None) -> bool:
    """Whether CUDA codegen prints ``dtype`` with ``lanes`` lanes as code nvcc compiles.

    ``dtype`` is an element type name ("float16") plus ``lanes``, or a vector type name
    ("float16x3") with ``lanes`` omitted.
    """
    base, own = _norm(dtype)
    if lanes is None:
        lanes = own
    legal = LEGAL_LANES.get(base)
    if legal is None:
        return lanes == 1
    return lanes in legal


def element_bytes(dtype) -> int:
    base, _ = _norm(dtype)
    if base == "bool":
        return 1
    digits = "".join(ch for ch in base.split("_")[0] if ch.isdigit())
    bits = int(digits) if digits else 32
    return max(1, bits // 8)
