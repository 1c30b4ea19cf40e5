"""A GEMM over a symbolic row count against the same GEMM at a static one, both scheduled by
amp's CPU rules (backends/cpu/rules.py) and timed on this machine's CPU (llvm): what a dynamic
build's GEMMs cost on the CPU (issue 22, docs/dynamic-shapes.md).

    python benchmarks/cpu_symbolic_gemm.py --rows 96,200,1000 [--k 512 --n 512]
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform

import numpy as np


def gemm(tvm, m, k: int, n: int):
    te = tvm.te
    k, n = tvm.tirx.IntImm("int64", k), tvm.tirx.IntImm("int64", n)  # Relax's shapes: int64
    m = tvm.tirx.IntImm("int64", m) if isinstance(m, int) else m
    a = te.placeholder((m, k), "float32", name="A")
    b = te.placeholder((k, n), "float32", name="B")
    r = te.reduce_axis((tvm.tirx.IntImm("int64", 0), k), "r")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r), name="C")
    return te.create_prim_func([a, b, c]).with_attr("global_symbol", "main")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="96,200,1000", help="row counts timed")
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()

    from amp_cli import hardware, tvm_compat
    from amp_cli.backends.cpu.rules import schedule_prim_func

    tvm = tvm_compat.tvm()
    target = tvm.target.Target(hardware.host_llvm_target())
    dev = tvm.cpu()
    symbolic = None
    rows = []
    for m in (int(r) for r in args.rows.split(",")):
        times = {}
        for kind in ("static", "symbolic"):
            if kind == "symbolic" and symbolic is None:
                func, _ = schedule_prim_func(gemm(tvm, tvm.tirx.Var("m", "int64"), args.k,
                                                  args.n), target)
                symbolic = tvm.compile(tvm.IRModule({"main": func}), target=target)
            if kind == "static":
                func, _ = schedule_prim_func(gemm(tvm, m, args.k, args.n), target)
                lib = tvm.compile(tvm.IRModule({"main": func}), target=target)
            else:
                lib = symbolic
            rng = np.random.default_rng(0)
            arrays = [tvm.runtime.tensor(rng.standard_normal(s).astype("float32"), dev)
                      for s in ((m, args.k), (args.k, args.n))]
            out = tvm.runtime.empty((m, args.n), "float32", dev)
            mod = lib.mod if hasattr(lib, "mod") else lib
            t = mod.time_evaluator("main", dev, number=20, repeat=5)(*arrays, out)
            times[kind] = t.median * 1e3
        rows.append({"m": m, "k": args.k, "n": args.n, "static_ms": times["static"],
                     "symbolic_ms": times["symbolic"],
                     "ratio": times["symbolic"] / times["static"]})
        print(f"M={m:5d} K={args.k} N={args.n}: static {times['static']:.3f} ms, "
              f"symbolic {times['symbolic']:.3f} ms, {rows[-1]['ratio']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                       "machine": platform.processor() or platform.machine(),
                       "target": str(target), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
