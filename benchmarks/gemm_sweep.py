"""Sweep amp's tensor-core GEMM tile configurations on one GPU (issue 9).

For each GEMM shape (BERT-large and ResNet-50 GEMMs at batch 8 by default) this builds
``C = cast(A @ B^T)`` (fp16 in, fp32 accumulate, fp16 out: the shape amp's conv-GEMMs and dense
layers have) with every candidate of ``amp_cli.backends.cuda.kernels.tc_gemm`` plus dlight's
``MatmulTensorization``, checks each result against numpy fp32 (rel L2, random inputs), times it
with the module's time_evaluator (CUDA events, median) and prints TFLOP/s per config and which
config ``choose_config`` would pick. ``--compile-only`` builds and checks the CUDA source (cp.async
and wmma present) without a GPU.

    python benchmarks/gemm_sweep.py --json $OUT/gemm_sweep.json
    python benchmarks/gemm_sweep.py --compile-only --shapes 1024x1024x1024

``--configs "[MxNxK:]wm,wn,fm,fn,kf,st[,S];..."`` times explicit TileConfigs (warps_m, warps_n,
frags_m, frags_n, k_frags, stages) on every shape, or on the one shape an ``MxNxK:`` prefix names;
a seventh field S > 1 runs that tile on the S partial GEMMs of a K split (the partials kernel
only, as the default split-K row).
``--configs-only`` drops the candidate / stage / extra / dlight rows (the picked tile and the
default split-K row stay as the baseline).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from amp_cli import tvm_compat  # noqa: E402
from amp_cli.backends.cuda.kernels import tc_gemm  # noqa: E402
from amp_cli.hardware import smem_limit  # noqa: E402

# (name, M, N, K): M = tokens or N*H*W pixels, N = output features, K = reduction
DEFAULT_SHAPES = [
    ("bert qkv/out 1024x1024", 1024, 1024, 1024),
    ("bert ffn-up 1024->4096", 1024, 4096, 1024),
    ("bert ffn-down 4096->1024", 1024, 1024, 4096),
    ("bert qkv fused 1024->3072", 1024, 3072, 1024),
    ("resnet s1 1x1 64->256 (56^2)", 25088, 256, 64),
    ("resnet s3 3x3 256 (14^2)", 1568, 256, 2304),
    ("resnet s4 3x3 512 (7^2)", 392, 512, 4608),
    ("resnet s2 1x1 512->128 (28^2)", 6272, 128, 512),
]


# Larger tiles than the default heuristic considers, for the sweep only: 8 warps of 64x64
# (256x128, 128x256) and a 64-deep K step on the 128x128 tile (fewer barriers per MMA).
EXTRA_CONFIGS = (
    tc_gemm.TileConfig(4, 2, 4, 4, 2, 3),   # 256x128x32, 8 warps of 64x64
    tc_gemm.TileConfig(2, 4, 4, 4, 2, 3),   # 128x256x32, 8 warps of 64x64
    tc_gemm.TileConfig(2, 2, 4, 4, 4, 3),   # 128x128x64, 4 warps of 64x64
)


def gemm_func(m: int, n: int, k: int, dtype: str = "float16"):
    tvm = tvm_compat.tvm()
    from tvm import te

    a = te.placeholder((m, k), dtype, name="A")
    b = te.placeholder((n, k), dtype, name="B")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r].astype("float32") * b[j, r].astype("float32"),
                                                axis=r), name="C")
    d = te.compute((m, n), lambda i, j: c[i, j].astype(dtype), name="D")
    return te.create_prim_func([a, b, d]).with_attr("global_symbol", "main")


def split_gemm_func(m: int, n: int, k: int, factor: int, dtype: str = "float16"):
    """The partials of a K-split GEMM (amp's cuda.split_k): P[s, i, j] over K/factor each, fp32
    (the elementwise sum that follows in a model is not part of this kernel)."""
    tvm = tvm_compat.tvm()
    from tvm import te

    part = k // factor
    a = te.placeholder((m, k), dtype, name="A")
    b = te.placeholder((n, k), dtype, name="B")
    r = te.reduce_axis((0, part), name="k")
    c = te.compute((factor, m, n), lambda s, i, j: te.sum(
        a[i, s * part + r].astype("float32") * b[j, s * part + r].astype("float32"), axis=r),
        name="P")
    return te.create_prim_func([a, b, c]).with_attr("global_symbol", "main")


def build(sch_mod, target):
    tvm = tvm_compat.tvm()
    from amp_cli.backends.cuda.tir import cuda_tir_pipeline

    mod = tvm.IRModule({"main": sch_mod})
    return tvm.compile(mod, target=target, tir_pipeline=cuda_tir_pipeline(target))


def dlight_schedule(func, target):
    from tvm.s_tir.dlight.gpu.matmul import MatmulTensorization

    with target:
        sch = MatmulTensorization().apply(func, target, False)
    return None if sch is None else sch.mod["main"]


def parse_configs(spec: str) -> list:
    """``"[MxNxK:]wm,wn,fm,fn,kf,st[,S];..."`` -> [(shape or None, TileConfig, S)]: S = 1 is no
    K split; an entry with a shape prefix applies to that shape only."""
    out = []
    for item in (x.strip() for x in (spec or "").split(";")):
        if not item:
            continue
        shape, _, fields = item.rpartition(":")
        vals = [int(v) for v in fields.split(",")]
        if len(vals) not in (6, 7):
            raise SystemExit(f"--configs: {item!r} is not [MxNxK:]wm,wn,fm,fn,kf,st[,S]")
        dims = tuple(int(v) for v in shape.split("x")) if shape else None
        out.append((dims, tc_gemm.TileConfig(*vals[:6]), vals[6] if len(vals) == 7 else 1))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--shapes", default=None, help="comma list of MxNxK (default: BERT/ResNet set)")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--stages", default="2,4", type=lambda v: [int(x) for x in v.split(",") if x],
                    help="extra pipeline depths to try for the three largest tiles ('' = none)")
    ap.add_argument("--extra", action="store_true",
                    help="also try EXTRA_CONFIGS (256x128, 128x256, 128x128x64 tiles)")
    ap.add_argument("--configs", default="",
                    help='explicit tiles "[MxNxK:]wm,wn,fm,fn,kf,st[,S];..." (S: K splits, '
                         'partials only; MxNxK: that shape only)')
    ap.add_argument("--configs-only", action="store_true",
                    help="only the picked tile, the default split-K row and --configs")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    explicit = parse_configs(args.configs)

    tvm = tvm_compat.tvm()
    target = tvm.target.Target({"kind": "cuda", "arch": args.arch})
    sm = int(args.arch.split("_")[-1])
    shapes = DEFAULT_SHAPES
    if args.shapes:
        shapes = [(s, *map(int, s.split("x"))) for s in args.shapes.split(",")]
    dev = None if args.compile_only else tvm.cuda(0)
    rng = np.random.default_rng(0)
    rows = []
    for name, m, n, k in shapes:
        func = gemm_func(m, n, k)
        pick = tc_gemm.choose_config(1, m, n, k, sm)
        # (name, cfg, K splits); cfg None = dlight, an int = default split-K tile
        variants = []
        if not args.configs_only:
            variants += [(c.name(), c, 1) for c in tc_gemm.CANDIDATES]
            if args.stages:
                for c in tc_gemm.CANDIDATES[:3]:
                    for st in args.stages:
                        if st != c.stages:
                            v = dataclasses.replace(c, stages=st)
                            variants.append((v.name(), v, 1))
            if args.extra:
                variants += [(c.name(), c, 1) for c in EXTRA_CONFIGS
                             if c.shared_bytes() <= smem_limit(sm)]
            variants.append(("dlight", None, 1))
        elif pick is not None:
            variants.append((pick.name(), pick, 1))
        factor = tc_gemm.split_k_factor(1, m, n, k, sm)
        if factor > 1:
            variants.append((f"split-K {factor} partials", factor, factor))
        mine = [(c, sp) for dims, c, sp in explicit if dims in (None, (m, n, k))]
        for cfg, splits in mine:
            name_ = cfg.name() + (f" split-K {splits}" if splits > 1 else "")
            if all(v[0] != name_ for v in variants):
                variants.append((name_, cfg, splits))
        if dev is not None:
            a = rng.standard_normal((m, k)).astype("float16")
            b = rng.standard_normal((n, k)).astype("float16")
            ref = a.astype("float32") @ b.astype("float32").T
            ta, tb = tvm.runtime.tensor(a, dev), tvm.runtime.tensor(b, dev)
        for vname, cfg, splits in variants:
            row = {"shape": name, "m": m, "n": n, "k": k, "config": vname,
                   "picked": isinstance(cfg, tc_gemm.TileConfig) and cfg == pick and splits == 1}
            t0 = time.time()
            try:
                out_shape, out_dtype = (m, n), "float16"
                if isinstance(cfg, tc_gemm.TileConfig):
                    row["smem_est"] = cfg.shared_bytes()
                    if cfg.shared_bytes() > smem_limit(sm):
                        raise ValueError(f"{cfg.shared_bytes()} B of shared memory (tc_gemm "
                                         f"estimate) > {smem_limit(sm)} B on sm_{sm}")
                    part = k // splits
                    if k % splits or part % cfg.bk:
                        raise ValueError(f"K={k} does not split {splits} ways into whole "
                                         f"{cfg.bk}-deep K steps")
                    # as choose_config: the pipeline is never deeper than the K loop
                    cfg = dataclasses.replace(cfg, stages=max(1, min(cfg.stages, part // cfg.bk)))
                    row["tile"] = cfg.name()
                if isinstance(cfg, int) or splits > 1:  # split-K partials
                    out_shape, out_dtype = (splits, m, n), "float32"
                    sfunc = split_gemm_func(m, n, k, splits)
                    tile = cfg if isinstance(cfg, tc_gemm.TileConfig) else None
                    sch = tc_gemm.schedule_gemm(sfunc, "float16", "float32", splits,
                                                [m, n, k // splits], sm, tile)
                elif cfg is None:
                    sch = None
                    smod = dlight_schedule(func, target)
                else:
                    sch = tc_gemm.schedule(func, "float16", "float32", [m, n, k], sm, cfg)
                if cfg is not None:
                    smod = None if sch is None else sch.mod["main"]
                if smod is None:
                    row["error"] = "rule not applicable"
                    rows.append(row)
                    continue
                ex = build(smod, target)
                row["build_s"] = round(time.time() - t0, 1)
                src = tvm_compat.cuda_source(ex)
                row["cp_async"] = "cp.async" in src
                row["wmma"] = "mma_sync" in src
                if dev is not None:
                    tc = tvm.runtime.empty(out_shape, out_dtype, dev)
                    ex(ta, tb, tc)
                    out = tc.numpy().astype("float32")
                    if len(out_shape) == 3:
                        out = out.sum(axis=0)
                    row["rel_l2"] = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
                    ev = ex.jit().time_evaluator("main", dev, number=10, repeat=args.repeat)
                    med = float(np.median(np.array(ev(ta, tb, tc).results))) * 1e3
                    row["ms"] = med
                    row["tflops"] = 2.0 * m * n * k / (med * 1e-3) / 1e12
            except Exception as err:  # noqa: BLE001 - a failing config is a result
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print(f"{'shape':34} {'config':26} {'ms':>8} {'TFLOP/s':>8} {'relL2':>8} pick")
    for r in rows:
        ms = f"{r['ms']:.4f}" if "ms" in r else "-"
        tf = f"{r['tflops']:.0f}" if "tflops" in r else r.get("error", "built")[:8]
        err = f"{r['rel_l2']:.1e}" if "rel_l2" in r else "-"
        print(f"{r['shape'][:34]:34} {r['config']:26} {ms:>8} {tf:>8} {err:>8} "
              f"{'*' if r['picked'] else ''}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"arch": args.arch, "rows": rows}, fh, indent=1)
    bad = [r for r in rows if "error" in r and r["config"] != "dlight"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
