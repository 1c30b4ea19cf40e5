"""Which tile amp's tensor-core GEMM (``tc_gemm``) runs a GEMM with: the candidate tiles, the
default choice per shape (:func:`choose_config`), the tiles over a symbolic size's range
(:func:`tile_variants`), the deeper K step and the split-K factor. Pure arithmetic on sizes:
no TVM objects."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ....hardware import sm_count, smem_limit

FRAG = 16  # wmma m16n16k16
WARP = 32
# fp32 staging tile row padding (floats). Unpadded rows of BN floats put a warp's accumulator
# stores 4-way on the same banks; 8 floats make them conflict-free (H200 sweep 2026-12-03:
# 1-4% faster on every BERT-large GEMM, docs/gpu-performance.md).
ACC_PAD = 8

@dataclass(frozen=True)
class TileConfig:
    warps_m: int = 2    # warps along M
    warps_n: int = 4    # warps along N
    frags_m: int = 4    # 16x16 fragments per warp along M
    frags_n: int = 2    # ... along N
    k_frags: int = 2    # 16-wide K fragments per pipeline step (BK = 16 * k_frags)
    stages: int = 3     # shared-memory pipeline depth (cp.async); 1 = no pipelining

    @property
    def bm(self) -> int:
        return FRAG * self.warps_m * self.frags_m

    @property
    def bn(self) -> int:
        return FRAG * self.warps_n * self.frags_n

    @property
    def bk(self) -> int:
        return FRAG * self.k_frags

    @property
    def warps(self) -> int:
        return self.warps_m * self.warps_n

    def shared_bytes(self, in_bytes: int = 2, acc_bytes: int = 4) -> int:
        """Upper bound of dynamic shared memory (A/B stages + the accumulator staging tile; TVM
        reuses the stages' memory for the tile, so the real need is usually the larger one)."""
        ab = self.stages * (self.bm + self.bn) * (self.bk + 8) * in_bytes
        acc = self.bm * (self.bn + ACC_PAD) * acc_bytes
        return ab + acc

    def name(self) -> str:
        return (f"{self.bm}x{self.bn}x{self.bk}_w{self.warps_m}x{self.warps_n}"
                f"_s{self.stages}")


# Candidates the default heuristic picks from, largest CTA tile first. 128x128 tiles with 8 warps
# of 64x32 (2x4) measured slowest on every H200 shape of the sweep (docs/gpu-performance.md), so
# the 128x128 tile uses 4 warps of 64x64 and a 4-deep pipeline (its best depth in the sweep).
CANDIDATES = (
    TileConfig(2, 2, 4, 4, 2, 4),   # 128x128x32, 4 warps of 64x64
    TileConfig(2, 2, 4, 2, 2, 3),   # 128x64x32, 4 warps of 64x32
    TileConfig(2, 2, 2, 4, 2, 3),   # 64x128x32, 4 warps of 32x64
    TileConfig(2, 2, 2, 2, 4, 3),   # 64x64x64, 4 warps of 32x32
)
# With ``cuda.narrow_gemm`` (on by default since its H100 A/B of 2026-12-07), GEMMs with N <= 32 (convs
# with 16 or 32 output channels over a large image: a detector's first stages) take a tile as
# narrow as N instead of padding N to 64/128: the same 128 rows per
# CTA (4 warps of 32 rows), 1 or 2 fragments across. Such GEMMs are memory-bound; the wide
# tiles spent 2-8x the tensor-core work and shared memory on padding, and before these tiles
# N = 16 fell to dlight's SIMT rule (yolo_head at 640 px: 0.155 ms for a 3x3 conv 16 -> 16 over
# 8 x 160 x 160 pixels, ~35x its memory time, on the H100 of 2026-12-07).
NARROW = (
    TileConfig(4, 1, 2, 1, 2, 3),   # 128x16x32
    TileConfig(4, 1, 2, 2, 2, 3),   # 128x32x32
)
# A tile is big enough to use when its grid fills this share of the SMs (one near-full wave).
FULL_WAVE = 0.9
# With ``cuda.padding_aware_tiles``: a tile whose grid covers more than this many times the
# output the least-padded candidate covers is not chosen (its CTAs multiply that much padding).
# A batched GEMM of ResNet-50's last stage over a symbolic batch (each image 7 x 7 = 49 rows)
# took 128-row tiles, 38 % of their rows the image's, where 64-row tiles use 77 %; an N = 64
# conv took 128-wide tiles, half their columns padding.
PAD_SLACK = 1.25


def fitting(sm: int, in_bytes: int = 2, acc_bytes: int = 4) -> tuple:
    """The candidates whose shared memory (without any reuse) fits a block on ``sm``."""
    return tuple(c for c in CANDIDATES if c.shared_bytes(in_bytes, acc_bytes) <= smem_limit(sm))


def ctas(cfg: TileConfig, batch: int, m: int, n: int) -> int:
    return batch * math.ceil(m / cfg.bm) * math.ceil(n / cfg.bn)


def padded(cfg: TileConfig, m: int | None, n: int) -> int:
    """The output elements ``cfg``'s grid covers per batch entry (``m`` None: columns only)."""
    rows = 1 if m is None else math.ceil(m / cfg.bm) * cfg.bm
    return rows * math.ceil(n / cfg.bn) * cfg.bn


def unpadded(options, m: int | None, n: int, slack: float | None) -> tuple:
    """``options`` without the tiles that cover more than ``slack`` times the output the
    least-padded one covers (``m`` None: judged on the columns alone); None: all of them."""
    if slack is None:
        return tuple(options)
    least = min(padded(c, m, n) for c in options)
    return tuple(c for c in options if padded(c, m, n) <= slack * least)


def choose_config(batch: int, m: int, n: int, k: int, sm: int,
                  acc_bytes: int = 4, narrow: bool = False, pad_slack: float | None = None,
                  pad_rows: bool = True) -> TileConfig | None:
    """Default tile for a GEMM: the largest candidate whose grid still fills the GPU (at least
    ``FULL_WAVE`` x SM count CTAs), else the one with the most CTAs; the pipeline is never deeper
    than the K loop. Calibrated on the H200 sweep (benchmarks/gemm_sweep.py): it picks the best or
    second-best (within 7%) tile on all 8 BERT-large / ResNet-50 shapes measured. ``pad_slack``
    (:data:`PAD_SLACK`, ``cuda.padding_aware_tiles``): only among the candidates that pad the
    output at most that much more than the least-padded one; ``pad_rows`` off, padding is
    judged on the columns alone (an M that varies, :func:`tile_variants`). None when no
    candidate fits the arch's shared memory."""
    sms = sm_count(sm)
    options = fitting(sm, 2, acc_bytes)
    if not options:
        return None
    options = unpadded(options, m if pad_rows else None, n, pad_slack)
    thin = next((c for c in NARROW if c.bn >= n), None) if narrow else None
    if thin is not None:
        cfg = thin  # N <= 32: the narrowest tile that covers it (see NARROW)
    else:
        cfg = next((c for c in options if ctas(c, batch, m, n) >= FULL_WAVE * sms), None)
    if cfg is None:
        cfg = max(options, key=lambda c: ctas(c, batch, m, n))
    cfg = deepen(cfg, k, sm, acc_bytes)
    k_steps = math.ceil(k / cfg.bk)
    if cfg.stages > k_steps:
        cfg = dataclasses.replace(cfg, stages=max(1, k_steps))
    return cfg


def tile_variants(sizes_at, lo: int, hi: int, n: int, k: int, sm: int,
                  acc_bytes: int = 4, pad_slack: float | None = None
                  ) -> list[tuple[int, TileConfig]]:
    """The tiles :func:`choose_config` picks for a GEMM whose row count or batch is symbolic,
    over its whole range: [(first value, tile), ...] ascending, one entry per run of values
    with the same tile. ``sizes_at(v)`` = (batch, M) when the symbolic size is ``v`` (in
    ``lo..hi``). Once the largest tile's grid fills the GPU (monotone in ``v``: found by
    bisection) the choice no longer changes; below that every value is evaluated."""
    options = fitting(sm, 2, acc_bytes)
    if not options or lo > hi:
        return []
    # rows' padding counts only where the rows are the same at every value (a symbolic batch
    # of static-M GEMMs): over a symbolic M it would switch tiles every few rows
    static_m = sizes_at(lo)[1] == sizes_at(hi)[1]
    options = unpadded(options, sizes_at(lo)[1] if static_m else None, n, pad_slack)
    wave = FULL_WAVE * sm_count(sm)

    def fills(v):
        batch, m = sizes_at(v)
        return ctas(options[0], batch, m, n) >= wave

    end = hi
    if fills(hi):
        a, b = lo - 1, hi  # the first value that fills is in (a, b]
        while b - a > 1:
            mid = (a + b) // 2
            a, b = (a, mid) if fills(mid) else (mid, b)
        end = b
    variants = []
    for v in range(lo, end + 1):
        cfg = choose_config(*sizes_at(v), n, k, sm, acc_bytes, pad_slack=pad_slack,
                            pad_rows=static_m)
        if cfg is not None and (not variants or variants[-1][1] != cfg):
            variants.append((v, cfg))
    return variants


# K step 64 instead of 32 (three stages instead of four) for long K loops: half the barriers and
# address arithmetic per MMA and conflict-free cp.async writes (docs/gpu-performance.md). The
# H200 sweep of 2026-12-03 measured it faster on the 128x64 tile at K=1024 (15.0 -> 12.6 us on
# 1024x1024x1024) and on the 128x128 tile at K=2048 (split-K partials of BERT-large's FFN-down:
# 39.2 -> 34.5 us), but slower on the 128x128 tile at K=1024 (QKV: 28.2 -> 29.3 us).
DEEP_K_MIN = {(128, 64): 1024, (128, 128): 2048}  # (BM, BN) -> smallest K that gets BK=64


def deepen(cfg: TileConfig, k: int, sm: int, acc_bytes: int = 4) -> TileConfig:
    """``cfg`` with a 64-deep K step where :data:`DEEP_K_MIN` says it pays, if it still fits."""
    floor = DEEP_K_MIN.get((cfg.bm, cfg.bn))
    if floor is None or k < floor or cfg.k_frags != 2:
        return cfg
    deep = dataclasses.replace(cfg, k_frags=4, stages=3)
    return deep if deep.shared_bytes(2, acc_bytes) <= smem_limit(sm) else cfg


# Split-K: a GEMM whose output is too small for the largest tile to fill the GPU runs as S
# partial GEMMs over K/S each (S x the CTAs of that tile) plus an elementwise sum of the fp32
# partials. Worth it only when K is long: the partials cost 2 x S x M x N x 4 bytes of traffic.
SPLIT_K_FACTORS = (2, 4)
MIN_SPLIT_K = 1024  # K per split, at least


def split_k_factor(batch: int, m: int, n: int, k: int, sm: int) -> int:
    """How many K splits (1 = none) let the largest tile fill the GPU: the smallest factor in
    ``SPLIT_K_FACTORS`` for which ``CANDIDATES[0]`` gets >= ``FULL_WAVE`` x SMs CTAs, keeping
    K/S >= ``MIN_SPLIT_K`` and a multiple of that tile's K step. Rationale (H200 sweep,
    docs/gpu-performance.md): the 128x128 tile reached 273 TFLOP/s where its grid filled the GPU
    and the tiles that fill a 1024x1024 output 137-147; the partials of a 1024x1024 output are
    8 MB each, L2-resident on Hopper."""
    big = CANDIDATES[0]
    if big not in fitting(sm):
        return 1
    wave = FULL_WAVE * sm_count(sm)
    if ctas(big, batch, m, n) >= wave:
        return 1
    for factor in SPLIT_K_FACTORS:
        part = k // factor
        if k % factor or part < MIN_SPLIT_K or part % big.bk:
            break
        if ctas(big, batch * factor, m, n) >= wave:
            return factor
    return 1
