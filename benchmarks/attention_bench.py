"""amp's attention kernels alone: the row kernel (``kernels/attention.py``, S <= 256) against the
tiled online-softmax kernel (``kernels/flash_attention.py``, wmma) at several key-tile widths,
the mma.sync one (``kernels/mma_attention.py``, scores in registers; 16 and 32 query rows a
warp), and torch's
``scaled_dot_product_attention`` (fp16, flash / cuDNN backends) on the same shapes.

Shapes are the corpus transformers' at batch 8 (bert/gpt2 128 tokens, ViT 197, Whisper's encoder
1500 frames; 12 heads of 64) plus a few in between. Q/K/V are [B, S, H, D] views as exports
give them (the kernels read them through strides), random N(0, 1) fp16, no mask. Each kernel
is checked against a float64 reference on the GPU (max error / max |ref|, the same bound the
GPU tests use) before it is timed: p50 of ``--repeat`` time_evaluator runs of ``--number``
calls each, after warm-up. TFLOP/s counts the unpadded work (4 B H S^2 D).

Usage (repository root, on the GPU machine):
  python benchmarks/attention_bench.py                       # table last, JSON to $OUT
  python benchmarks/attention_bench.py --dry-run             # no GPU: compile every kernel
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SHAPES = [(8, 12, 128, 64), (8, 12, 197, 64), (8, 12, 256, 64), (8, 12, 512, 64),
          (8, 12, 1500, 64), (8, 16, 128, 64)]
BLOCK_KS = (64,)  # key-tile widths of the tiled kernel (64, the default, beat 32 on 12-05)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=None,
                    help="B,H,S,D;B,H,S,D;... (default: " +
                         ";".join(",".join(map(str, s)) for s in SHAPES) + ")")
    ap.add_argument("--number", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--arch", default=None, help="CUDA arch for --dry-run (default sm_90)")
    ap.add_argument("--dry-run", action="store_true", help="compile only (no GPU needed)")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def kernel(kind: str, block_k: int, b, h, s, d):
    """The PrimFunc of ``kind`` ("rows", "tiled", "mma" or "mma_wide": 32 query rows a warp)
    for [B, S, H, D] Q/K/V/out, or why not."""
    from amp_cli.backends.cuda.kernels import attention as ak
    from amp_cli.backends.cuda.kernels import flash_attention as fk
    from amp_cli.backends.cuda.kernels import mma_attention as mk

    opnd = ak.bshd(b, h, s, d)
    args = (b, h, s, d, 1 / np.sqrt(d), opnd, opnd, opnd, opnd)
    if kind == "rows":
        why = ak.supported(s, d, 227)
        return why if why else ak.attention_func(*args)
    if kind in ("mma", "mma_wide"):
        tiles = 2 if kind == "mma_wide" else 1
        why = mk.supported(d, 227, row_tiles=tiles)
        return why if why else mk.mma_attention_func(*args, row_tiles=tiles)
    old = fk.BLOCK_K
    fk.BLOCK_K = block_k  # the kernel reads the module constant when it is built
    try:
        return fk.flash_attention_func(*args)
    finally:
        fk.BLOCK_K = old


def reference(q, k, v, scale):
    q, k, v = (x.astype(np.float64).transpose(0, 2, 1, 3) for x in (q, k, v))
    sc = q @ k.transpose(0, 1, 3, 2) * scale
    p = np.exp(sc - sc.max(-1, keepdims=True))
    return ((p / p.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3)


def time_torch(q, k, v, number, repeat):
    import torch
    import torch.nn.functional as F

    qt, kt, vt = (torch.from_numpy(x).cuda().transpose(1, 2) for x in (q, k, v))
    call = lambda: F.scaled_dot_product_attention(qt, kt, vt)  # noqa: E731
    for _ in range(10):
        call()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeat):
        a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(number):
            call()
        e.record()
        e.synchronize()
        samples.append(a.elapsed_time(e) / 1e3 / number)
    out = call().transpose(1, 2).float().cpu().numpy()
    return float(np.median(samples)), out


def main(argv=None) -> int:
    args = parse_args(argv)
    import tvm

    from amp_cli import tvm_compat
    from amp_cli.backends.cuda.tir import cuda_tir_pipeline
    from amp_cli.report import versions

    shapes = SHAPES if not args.shapes else [tuple(int(x) for x in s.split(","))
                                             for s in args.shapes.split(";")]
    gpu = tvm_compat.has_cuda_device()
    if not gpu and not args.dry_run:
        print("attention_bench: no CUDA GPU; use --dry-run", file=sys.stderr)
        return 1
    arch = args.arch or ("sm_" + tvm.cuda(0).compute_version.replace(".", "") if gpu
                         else "sm_90")
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    rows, t0 = [], time.perf_counter()
    for b, h, s, d in shapes:
        flops = 4.0 * b * h * s * s * d
        variants = ([("rows", 64)] + [("tiled", bk) for bk in BLOCK_KS]
                    + [("mma", 64), ("mma_wide", 64)])
        rng = np.random.default_rng(s)
        q, k, v = (rng.standard_normal((b, s, h, d)).astype("float16") for _ in range(3))
        ref = None if args.dry_run else reference(q, k, v, 1 / np.sqrt(d))
        for kind, bk in variants:
            row = {"shape": [b, h, s, d],
                   "kernel": f"tiled BK={bk}" if kind == "tiled" else kind}
            rows.append(row)
            func = kernel(kind, bk, b, h, s, d)
            if isinstance(func, str):
                row["skipped"] = func
                continue
            try:
                mod = tvm.IRModule({"attention": func.with_attr("global_symbol", "attention")})
                lib = tvm.compile(mod, target=target, tir_pipeline=cuda_tir_pipeline(target))
            except Exception as exc:  # noqa: BLE001 - a variant that does not build is a row
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[-1][:200]}"
                continue
            if args.dry_run:
                row["built"] = True
                continue
            dev = tvm.cuda(0)
            arrays = [tvm.runtime.tensor(x, dev) for x in (q, k, v)]
            out = tvm.runtime.tensor(np.zeros((b, s, h, d), "float16"), dev)
            lib["attention"](*arrays, out)
            got = out.numpy().astype(np.float64)
            row["max_err"] = float(np.abs(got - ref).max() / np.abs(ref).max())
            f = lib.mod.time_evaluator("attention", dev, number=args.number, repeat=args.repeat,
                                       min_repeat_ms=0)
            f(*arrays, out)  # warm-up
            res = f(*arrays, out)
            row["us"] = float(np.median(res.results)) * 1e6
            row["tflops"] = flops / (row["us"] * 1e-6) / 1e12
        if not args.dry_run:
            row = {"shape": [b, h, s, d], "kernel": "torch sdpa fp16"}
            try:
                sec, out = time_torch(q, k, v, args.number, args.repeat)
                row.update(us=sec * 1e6, tflops=flops / sec / 1e12,
                           max_err=float(np.abs(out - ref).max() / np.abs(ref).max()))
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {exc}"[:200]
            rows.append(row)
    result = {"bench": "attention", "arch": arch, "versions": versions(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "rows": rows,
              "wall_s": time.perf_counter() - t0}
    out_env = os.environ.get("OUT")
    path = Path(args.json or (Path(out_env) / "attention_bench.json" if out_env
                              else "attention_bench.json"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"{'B,H,S,D':<16} {'kernel':<16} {'us':>9} {'TFLOP/s':>8} {'max err':>9}")
    for r in rows:
        shape = ",".join(map(str, r["shape"]))
        if "us" in r:
            print(f"{shape:<16} {r['kernel']:<16} {r['us']:9.1f} {r['tflops']:8.1f} "
                  f"{r['max_err']:9.2e}")
        else:
            print(f"{shape:<16} {r['kernel']:<16} "
                  f"{r.get('skipped') or r.get('error') or 'built'}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
