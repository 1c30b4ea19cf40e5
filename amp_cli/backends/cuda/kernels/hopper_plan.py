"""How the Hopper GEMMs (``hopper_gemm``) tile a GEMM: the CTA tile's width and stage count
for a static M (``plan``), the plans over a range of symbolic M (``plan_variants``,
``symbolic_plans``), and the tile's name in the build report (``tile_name``)."""
from __future__ import annotations

from dataclasses import dataclass

from .... import tvm_compat
from ....config import CudaConfig
from ....hardware import sm_count
from .analysis import SYMBOLIC_M_GUESS, size_at_optimum
from .hopper_match import GemmMatch

BM, BK = 128, 64        # rows per CTA (two m64 warpgroups), K per stage (128 bytes of fp16)
BNS = (192, 128, 64)     # 256 wide: same speed as 128 on N=4096, but its epilogue spills registers
# two CTAs an SM (``cuda.hopper_two_per_sm``): 288 threads each must stay under 113 registers
# (ptxas, sm_90a: 108 at BN = 128, 140 at BN = 192) and half the shared memory
TWO_PER_SM_BNS = (128, 64)
MIN_K = CudaConfig.hopper_min_k  # the default shortest K (``cuda.hopper_min_k``)
MAX_K = 8192            # the consumer's K loop is unrolled (see gemm_kernel): 128 steps at most
SMEM_BUDGET = 200 * 1024
MAX_STAGES = 6
HOPPER_SMS = sm_count(90)  # H100/H200


@dataclass(frozen=True)
class Plan:
    bn: int
    stages: int

    def smem_bytes(self, in_bytes: int = 2) -> int:
        return self.stages * (BM + self.bn) * BK * in_bytes


def plan(m: int, n: int, k: int, sms: int = HOPPER_SMS, min_k: int = MIN_K,
         per_sm: int = 1):
    """The tile width and stage count for an M x N x K GEMM, or a string saying why not.
    ``min_k``: the shortest K taken (``cuda.hopper_min_k``; at least one 64-deep step).
    ``per_sm``: CTAs an SM is planned for (2: ``cuda.hopper_two_per_sm``, tiles at most 128
    wide and half the stages, so one CTA's epilogue runs under the other's main loop).

    BN: the widest of 192/128/64 dividing N whose grid still fills 90% of the SMs (else the
    one with the most CTAs); stages: as many as fit ``SMEM_BUDGET``, at most ``MAX_STAGES``.

    >>> plan(1024, 4096, 1024), plan(1024, 3072, 1024), plan(1024, 1024, 4096)
    (Plan(bn=128, stages=6), Plan(bn=192, stages=5), Plan(bn=64, stages=6))
    >>> plan(1024, 1000, 1024)
    'N=1000 is not a multiple of 64'
    >>> plan(12000, 3072, 768), plan(12000, 3072, 768, per_sm=2)
    (Plan(bn=192, stages=5), Plan(bn=128, stages=3))
    """
    if n % 64:
        return f"N={n} is not a multiple of 64"
    lo = max(BK, min_k)
    if k % BK or not lo <= k <= MAX_K:
        return f"K={k} is not a multiple of {BK} in {lo}..{MAX_K}"
    if m < BM:
        return f"M={m} is below {BM}"
    rows = -(-m // BM)
    fits = [bn for bn in (TWO_PER_SM_BNS if per_sm == 2 else BNS) if n % bn == 0]
    full = [bn for bn in fits if rows * (n // bn) >= 0.9 * sms]
    bn = full[0] if full else fits[-1]
    stages = min(MAX_STAGES, SMEM_BUDGET // per_sm // Plan(bn, 1).smem_bytes())
    return Plan(bn, stages)


# kernels per symbolic-row GEMM at most: each is a whole wgmma kernel to compile (BERT's
# dynamic build went 21 -> 29 s with three, 2x its static build)
MAX_VARIANTS = 2


def plan_variants(lo: int, hi: int, n: int, k: int, sms: int = HOPPER_SMS,
                  min_k: int = MIN_K, most: int = MAX_VARIANTS, per_sm: int = 1):
    """The plans :func:`plan` makes for a GEMM whose M is symbolic in ``lo..hi``: [(first M,
    plan), ...] ascending, one entry per run of M with the same plan (an M below one 128-row
    tile is planned as one tile), or a string saying why not. The plan depends on M only
    through its count of 128-row blocks and widens as they grow, so the row blocks are walked
    until the plan at ``hi`` is reached. Of more than ``most`` runs the first ``most - 1`` and
    the last are kept, each dropped run taken by the narrower plan before it (more CTAs, not
    fewer).

    >>> [(m, p.bn) for m, p in plan_variants(1, 4096, 3072, 1024, most=3)]
    [(1, 64), (513, 128), (897, 192)]
    >>> [(m, p.bn) for m, p in plan_variants(1, 4096, 3072, 1024)]
    [(1, 64), (897, 192)]
    >>> plan_variants(128, 4096, 1000, 1024)
    'N=1000 is not a multiple of 64'
    """
    lo, hi = max(lo, 1), max(hi, lo, 1)
    last = plan(max(hi, BM), n, k, sms, min_k, per_sm)
    if isinstance(last, str):
        return last
    variants = []
    rows = -(-lo // BM)
    while True:
        start = lo if not variants else (rows - 1) * BM + 1
        p = plan(rows * BM, n, k, sms, min_k, per_sm)
        if not variants or variants[-1][1] != p:
            variants.append((start, p))
        if p == last or rows * BM >= hi:
            return variants if len(variants) <= most else variants[:most - 1] + variants[-1:]
        rows += 1


def symbolic_plans(match: GemmMatch, sms: int, min_k: int, dims: dict | None,
                    ranges: dict | None, per_sm: int = 1):
    """[(first M, plan), ...] for a symbolic M: where ``ranges`` ({dim: (lo, hi)}) bound it,
    the plans of :func:`plan_variants` from its least value up to the optimum's (``dims``;
    the range's greatest without one), the optimum's plan serving every M above it; else one
    plan at the optimum. Below the optimum a wide tile starves the GPU (batch 1 of BERT-large:
    16 CTAs on 132 SMs), above it the optimum's tile still fills it: the narrower variants pay
    for their compile time (each is a whole wgmma kernel: BERT-large's dynamic build took 29 s
    with the variants above the optimum too, 21 s with none, its static build 14 s), the wider
    ones measured 7 % at batch 32 (H200, 2026-12-07)."""
    if ranges:
        lo = tvm_compat.size_upper_bound(match.m, {d: r[0] for d, r in ranges.items()})
        hi = tvm_compat.size_upper_bound(match.m, {d: r[1] for d, r in ranges.items()})
        opt = tvm_compat.size_upper_bound(match.m, dims or {})
        if isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi:
            top = min(hi, max(lo, opt)) if isinstance(opt, int) else hi
            return plan_variants(lo, top, match.n, match.k, sms, min_k, per_sm=per_sm)
    p = plan(max(size_at_optimum(match.m, dims, SYMBOLIC_M_GUESS), BM), match.n, match.k,
             sms, min_k, per_sm)
    return p if isinstance(p, str) else [(1, p)]


def tile_name(p: Plan, persistent: bool = False) -> str:
    """The tile as the build report names it: rows x width x K-step, stages, ``p`` when the
    kernel is persistent."""
    return f"{BM}x{p.bn}x{BK}s{p.stages}" + ("p" if persistent else "")
