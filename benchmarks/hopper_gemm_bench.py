"""Time amp's Hopper GEMM kernels (schedule/hopper_gemm.py) on the GPU: bert-large's GEMM shapes
with a bias epilogue, each against float64 numpy (rel L2) and, when torch is there, torch's
``a @ b.T`` on the same inputs. Needs an sm_90 GPU. Prints a table; --json writes the rows.

    python benchmarks/hopper_gemm_bench.py [--shapes 1024x4096x1024,...] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = "1024x4096x1024,1024x3072x1024,1024x1024x1024,1024x1024x4096"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--number", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    import tvm

    from amp_cli.backends.cuda.kernels import hopper_gemm as hg
    from benchmarks.gemm_sweep import build
    from benchmarks.small_gemm_bench import gemm_func  # D = cast(A @ B^T + bias)

    rows = []
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        m, n, k = (int(x) for x in shape.split("x"))
        made = hg.hopper_func(gemm_func(m, n, k, "float16"))
        if isinstance(made, str):
            print(f"{shape}: not taken ({made})")
            continue
        ex = build(made, tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}))
        dev = tvm.cuda(0)
        a = (rng.standard_normal((m, k)) / 8).astype("float16")
        b = (rng.standard_normal((n, k)) / 8).astype("float16")
        bias = rng.standard_normal(n).astype("float32")
        ref = a.astype("float64") @ b.astype("float64").T + bias
        targs = [tvm.runtime.tensor(x, dev) for x in (a, b, bias)]
        out = tvm.runtime.empty((m, n), "float16", dev)
        ex(*targs, out)
        rel = float(np.linalg.norm(out.numpy() - ref) / np.linalg.norm(ref))
        timer = ex.mod.time_evaluator("main", dev, number=args.number, repeat=args.repeat)
        us = float(np.median(timer(*targs, out).results)) * 1e6
        row = {"shape": shape, "tile": made.attrs["amp.hopper_tile"], "us": us,
               "tflops": 2 * m * n * k / us / 1e6, "rel_l2": rel}
        try:
            import torch

            ta, tb = torch.from_numpy(a).cuda(), torch.from_numpy(b).cuda()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(10):
                ta @ tb.T
            start.record()
            for _ in range(args.number):
                ta @ tb.T
            end.record()
            torch.cuda.synchronize()
            row["torch_us"] = start.elapsed_time(end) / args.number * 1e3
        except Exception:  # noqa: BLE001 - torch is optional
            pass
        rows.append(row)
        print(f"{shape:18s} {row['tile']:14s} {us:8.1f} us {row['tflops']:6.0f} TFLOP/s "
              f"rel L2 {rel:.1e}" + (f"  torch {row['torch_us']:.1f} us" if "torch_us" in row
                                     else ""), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
