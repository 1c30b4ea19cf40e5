"""Time amp's few-rows GEMM schedule (amp_cli/schedule/small_gemm.py) against what the same GEMM
got before it (dlight's SIMT Matmul rule), per configuration, on one GPU.

``D = cast(A @ B^T + bias)`` with A [M, K], B [N, K] (ResNet-50's batch-8 classifier and other
small-batch dense layers). Each build is checked against float64 numpy (rel L2) before it is
timed with the module's time_evaluator (median of --repeat runs of --number calls each).

    python benchmarks/small_gemm_bench.py --json $OUT/small_gemm.json
    python benchmarks/small_gemm_bench.py --compile-only      # no GPU: builds only
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from amp_cli import tvm_compat  # noqa: E402
from amp_cli.backends.cuda.kernels import small_gemm  # noqa: E402
from benchmarks.gemm_sweep import build  # noqa: E402 - the same CUDA build as the GEMM sweep

SHAPES = [  # (name, M, N, K, dtype)
    ("resnet50 fc, batch 8", 8, 1000, 2048, "float16"),
    ("resnet50 fc, batch 8, fp32", 8, 1000, 2048, "float32"),
    ("resnet50 fc, batch 4", 4, 1000, 2048, "float16"),
    ("dense 1024->4096, 16 rows", 16, 4096, 1024, "float16"),
]
CONFIGS = [
    small_gemm.SmallConfig(),                               # the default
    small_gemm.SmallConfig(unroll_k=False),
    small_gemm.SmallConfig(warps=8),
    small_gemm.SmallConfig(warps=4, cols=2),
    small_gemm.SmallConfig(warps=2, cols=1),
]


def gemm_func(m, n, k, dtype):
    tvm = tvm_compat.tvm()
    from tvm import te

    a = te.placeholder((m, k), dtype, name="A")
    b = te.placeholder((n, k), dtype, name="B")
    bias = te.placeholder((n,), "float32", name="bias")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((m, n), lambda i, j: te.sum(
        a[i, r].astype("float32") * b[j, r].astype("float32"), axis=r), name="C")
    d = te.compute((m, n), lambda i, j: (c[i, j] + bias[j]).astype(dtype), name="D")
    return te.create_prim_func([a, b, bias, d]).with_attr("global_symbol", "main")


def schedules(m, n, k, dtype, sm):
    """(label, scheduled PrimFunc) for each config and for the rule amp used before."""
    tvm = tvm_compat.tvm()
    from amp_cli.backends.cuda.rules.matmul import AmpMatmul

    func = gemm_func(m, n, k, dtype)
    out = []
    for cfg in CONFIGS:
        sch = small_gemm.schedule_small_m(func, 1, [m, n, k], sm, cfg)
        if sch is not None:
            out.append((f"amp {cfg.name()}", sch.mod["main"]))
    target = tvm.target.Target({"kind": "cuda", "arch": f"sm_{sm}"})
    with target:
        stock = AmpMatmul(own_gemm=False).apply(func, target, False)
    out.append(("dlight Matmul (before)", stock.mod["main"]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default=None, help="default: the local GPU's, else sm_90")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--number", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    tvm = tvm_compat.tvm()
    version = None if args.compile_only else tvm_compat.cuda_compute_version()
    arch = args.arch or ("sm_" + version.replace(".", "") if version else "sm_90")
    sm = int(arch.split("_")[1])
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    rows = []
    for name, m, n, k, dtype in SHAPES:
        rng = np.random.default_rng(0)
        a = rng.standard_normal((m, k)).astype(dtype)
        b = rng.standard_normal((n, k)).astype(dtype)
        bias = rng.standard_normal(n).astype("float32")
        ref = a.astype("float64") @ b.astype("float64").T + bias
        moved = (a.nbytes + b.nbytes + m * n * a.itemsize)
        for label, prim in schedules(m, n, k, dtype, sm):
            ex = build(prim, target)
            row = {"shape": name, "m": m, "n": n, "k": k, "dtype": dtype, "schedule": label}
            if not args.compile_only:
                dev = tvm.cuda(0)
                args_dev = [tvm.runtime.tensor(x, dev) for x in (a, b, bias)]
                out = tvm.runtime.empty((m, n), dtype, dev)
                ex(*args_dev, out)
                got = out.numpy().astype("float64")
                row["rel_l2"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
                timer = ex.jit().time_evaluator("main", dev, number=args.number, repeat=args.repeat)
                us = float(np.median(timer(*args_dev, out).results)) * 1e6
                row.update(us=us, gb_s=moved / us / 1e3)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print(f"\n{'GEMM':30} {'schedule':26} {'us':>8} {'GB/s':>7} {'rel L2':>8}")
    for r in rows:
        print(f"{r['shape']:30} {r['schedule']:26} {r.get('us', float('nan')):8.2f} "
              f"{r.get('gb_s', float('nan')):7.0f} {r.get('rel_l2', float('nan')):8.1e}")
    path = args.json or (os.path.join(os.environ["OUT"], "small_gemm.json")
                         if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump({"arch": arch, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
