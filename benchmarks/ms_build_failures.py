"""MetaSchedule fp16 candidate build-failure rate for CUDA, stock TVM vs amp's lane legalizer.

For each task (an fp16 TE workload with odd sizes) this script

1. builds MetaSchedule's CUDA design space with the default CUDA rules
   (``post-order-apply`` + ``ScheduleRule.create("cuda")``: multi-level tiling with
   cooperative shared-memory fetch, vector load lengths {1, 2, 3, 4, 8, 16}, auto-inline,
   cross-thread reduction, unroll, auto-bind);
2. draws N candidates with ``ReplayTrace`` (every sampling decision of the design-space trace
   re-drawn at random, seeded through ``TuneContext(rand_state=seed)``) and the default CUDA
   postprocs (``Postproc.create("cuda")``: cooperative-fetch rewrite, unbound-block binding,
   parallel/vectorize/unroll rewrite, reduction-block rewrite, VerifyGPUCode). Candidates a
   postproc rejects are re-drawn by ReplayTrace itself and never reach a build;
3. builds every candidate twice with ``tvm.compile(mod, target, tir_pipeline=...)``: stock
   ``"default"`` and ``amp_cli.backends.cuda.tir.cuda_tir_pipeline(target, records)``;
4. classifies build failures by message: ``lanes`` (CUDA codegen cannot print the vector
   type: ``lanes % 2 == 0`` / ``Cannot convert type ... to CUDA type``) vs ``other``.

Building needs no GPU and no nvcc (0.27 keeps the CUDA source in the module when no
``tvm_callback_cuda_compile`` is registered). Besides the counts, the script reports which
vector lengths the candidates actually contain (``T.vectorized`` loops of the scheduled
PrimFunc, by the dtype they store), so a zero lane-failure count can be told apart from
"no odd vector was sampled".

Tasks (``--tasks``):
  matmul : [128, 1000] x [1000, 1003] fp16, fp32 accumulation, fp16 output (cast epilogue)
  conv   : NHWC 1x30x30x13 fp16, 3x3 HWIO -> 21 channels, pad 1, fp32 accumulation, fp16 out
  cast   : fp16 [61, 1003] -> fp32 * const -> fp16 (elementwise, odd innermost extent)

Usage:
  python benchmarks/ms_build_failures.py [--tasks matmul,conv] [-n 64] [--seed 0]
                                         [--arch sm_90] [--json out.json]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

_LANE_ERR = re.compile(r"lanes\s*%\s*2\s*==\s*0|Cannot convert type \S+ to CUDA type|"
                       r"half type|bfloat16 type")


# --------------------------------------------------------------------------------------------
# Tasks (TE, so the PrimFuncs are what Relax legalization of the same ops would give)
# --------------------------------------------------------------------------------------------
def task_matmul(dtype: str = "float16", m: int = 128, k: int = 1000, n: int = 1003):
    from tvm import te

    a = te.placeholder((m, k), dtype, name="A")
    b = te.placeholder((k, n), dtype, name="B")
    r = te.reduce_axis((0, k), "k")
    acc = te.compute((m, n), lambda i, j: te.sum(
        a[i, r].astype("float32") * b[r, j].astype("float32"), axis=r), name="C")
    out = te.compute((m, n), lambda i, j: acc[i, j].astype(dtype), name="D")
    return te.create_prim_func([a, b, out]), f"matmul {dtype} [{m},{k}]x[{k},{n}] (fp32 acc)"


def task_conv(dtype: str = "float16", h: int = 30, w: int = 30, cin: int = 13, cout: int = 21,
              ks: int = 3):
    from tvm import te, topi

    x = te.placeholder((1, h, w, cin), dtype, name="X")
    wt = te.placeholder((ks, ks, cin, cout), dtype, name="W")
    pad = topi.nn.pad(x, [0, ks // 2, ks // 2, 0], [0, ks // 2, ks // 2, 0], name="pad")
    ry = te.reduce_axis((0, ks), "ry")
    rx = te.reduce_axis((0, ks), "rx")
    rc = te.reduce_axis((0, cin), "rc")
    acc = te.compute((1, h, w, cout), lambda nn, yy, xx, ff: te.sum(
        pad[nn, yy + ry, xx + rx, rc].astype("float32") * wt[ry, rx, rc, ff].astype("float32"),
        axis=[ry, rx, rc]), name="conv")
    out = te.compute(acc.shape, lambda *i: acc(*i).astype(dtype), name="out")
    return (te.create_prim_func([x, wt, out]),
            f"conv2d {dtype} NHWC 1x{h}x{w}x{cin} -> {cout}, {ks}x{ks} pad 1 (fp32 acc)")


def task_cast(dtype: str = "float16", m: int = 61, n: int = 1003):
    from tvm import te

    a = te.placeholder((m, n), dtype, name="A")
    out = te.compute((m, n), lambda i, j: (a[i, j].astype("float32") * 0.125).astype(dtype),
                     name="B")
    return te.create_prim_func([a, out]), f"{dtype}->fp32*c->{dtype} elementwise [{m},{n}]"


TASKS = {"matmul": task_matmul, "conv": task_conv, "cast": task_cast}


# --------------------------------------------------------------------------------------------
def cuda_target(arch: str):
    """MetaSchedule's CUDA rules need the per-block limits in the target (H100/H200 values)."""
    import tvm

    return tvm.target.Target({"kind": "cuda", "arch": arch, "max_threads_per_block": 1024,
                              "max_shared_memory_per_block": 49152,
                              "registers_per_block": 65536, "thread_warp_size": 32})


def _stmt_children(node):
    for attr in ("body", "block", "init", "then_case", "else_case"):
        child = getattr(node, attr, None)
        if child is not None and not isinstance(child, (int, float, str)):
            yield child
    seq = getattr(node, "seq", None)
    if seq is not None:
        yield from seq


def _walk_stmts(stmt, fvisit) -> None:
    """Pre-order walk over TIR statements (0.27's Python API has no tirx stmt visitor)."""
    stack = [stmt]
    while stack:
        node = stack.pop()
        fvisit(node)
        stack.extend(_stmt_children(node))


def vector_loops(func) -> list[str]:
    """'dtype x extent' for every T.vectorized loop of a scheduled PrimFunc (the dtypes of
    the buffers its body stores)."""
    from tvm import tirx

    found = []

    def visit(node):
        if isinstance(node, tirx.For) and node.kind == tirx.ForKind.VECTORIZED:
            dtypes = set()

            def inner(n):
                if isinstance(n, tirx.BufferStore):
                    dtypes.add(str(n.buffer.dtype))

            _walk_stmts(node.body, inner)
            ext = node.extent.value if hasattr(node.extent, "value") else str(node.extent)
            found.append(f"{'/'.join(sorted(dtypes)) or '?'}x{ext}")

    _walk_stmts(func.body, visit)
    return found


def classify(exc: Exception) -> tuple[str, str]:
    text = str(exc).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    last = lines[-1] if lines else type(exc).__name__
    for ln in lines:
        if "Check failed" in ln or "Error" in ln:
            last = ln
    kind = "lanes" if _LANE_ERR.search(text) else "other"
    return kind, re.sub(r"\s+", " ", last)[:160]


def sample_candidates(func, target, n: int, seed: int, rules: str = "cuda"):
    from tvm.s_tir import meta_schedule as ms
    import tvm

    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    ctx = ms.TuneContext(
        mod=mod, target=target,
        space_generator=(ms.space_generator.PostOrderApply(
            sch_rules="cuda", postprocs="cuda", mutator_probs="cuda") if rules == "cuda"
            else ms.space_generator.PostOrderApply()),  # from-target: what `amp tune` uses
        search_strategy=ms.search_strategy.ReplayTrace(max_fail_count=1000),
        task_name="task", num_threads=1, rand_state=seed)
    spaces = ctx.generate_design_space()
    ctx.pre_tuning(max_trials=n, num_trials_per_iter=n, design_spaces=spaces)
    cands = []
    while len(cands) < n:
        batch = ctx.generate_measure_candidates()
        if not batch:
            break
        cands += [c.sch for c in batch]
    ctx.post_tuning()
    return spaces, cands[:n]


def build_one(mod, target, pipeline: str):
    import tvm

    t = time.perf_counter()
    try:
        tvm.compile(mod, target=target, tir_pipeline=pipeline)
        return None, time.perf_counter() - t
    except Exception as exc:  # noqa: BLE001 - TVMError subclasses of all kinds
        return classify(exc), time.perf_counter() - t


def run_task(name: str, dtype: str, n: int, seed: int, arch: str, rules: str) -> dict:
    from amp_cli.backends.cuda.tir import cuda_tir_pipeline

    target = cuda_target(arch)
    func, desc = TASKS[name](dtype)
    t0 = time.perf_counter()
    spaces, cands = sample_candidates(func, target, n, seed, rules)
    t_sample = time.perf_counter() - t0
    res = {"task": name, "dtype": dtype, "rules": rules, "desc": desc, "arch": arch, "seed": seed, "n_requested": n,
           "n": len(cands), "design_spaces": len(spaces), "sample_s": round(t_sample, 1),
           "vector_loops": collections.Counter(), "candidates": []}
    for variant in ("stock", "amp"):
        res[variant] = {"ok": 0, "lanes": 0, "other": 0, "messages": collections.Counter(),
                        "build_s": 0.0}
    res["legalized_candidates"] = 0
    res["rewrites"] = collections.Counter()
    for i, sch in enumerate(cands):
        vl = vector_loops(sch.mod["main"])
        res["vector_loops"].update(set(vl))
        row = {"i": i, "vector_loops": vl}
        for variant in ("stock", "amp"):
            records: list = []
            pipe = "default" if variant == "stock" else cuda_tir_pipeline(target, records)
            err, dt = build_one(sch.mod, target, pipe)
            agg = res[variant]
            agg["build_s"] += dt
            if err is None:
                agg["ok"] += 1
            else:
                agg[err[0]] += 1
                agg["messages"][err[1]] += 1
            row[variant] = "ok" if err is None else f"{err[0]}: {err[1]}"
            if variant == "amp":
                rw = [w for r in records for w in r.rewrites]
                if rw:
                    res["legalized_candidates"] += 1
                    res["rewrites"].update(re.sub(r"^(\w+) ", r"\1 ", w) for w in set(rw))
                row["amp_rewrites"] = sorted(set(rw))
        res["candidates"].append(row)
    for variant in ("stock", "amp"):
        res[variant]["build_s"] = round(res[variant]["build_s"], 1)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", default="matmul,conv")
    ap.add_argument("-n", type=int, default=64, help="candidates per task")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--dtypes", default="float16,bfloat16",
                    help="storage dtypes (fp32 accumulation either way)")
    ap.add_argument("--rules", default="cuda", choices=["cuda", "from-target"],
                    help="cuda: ScheduleRule/Postproc.create('cuda') (SIMT); from-target: "
                         "MetaSchedule's default for the target (sm_90: cuda-tensorcore rules "
                         "+ SIMT, what `amp tune` uses)")
    ap.add_argument("--json", default=None, help="write the full results here")
    args = ap.parse_args(argv)

    import tvm

    from amp_cli import tvm_compat

    tvm_compat.check_versions()
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "tvm": tvm.__version__,
              "python": platform.python_version(), "loadavg_start": os.getloadavg(),
              "argv": sys.argv, "results": []}
    t0 = time.perf_counter()
    for name, dtype in [(t, d) for t in args.tasks.split(",") for d in args.dtypes.split(",")]:
        r = run_task(name, dtype, args.n, args.seed, args.arch, args.rules)
        report["results"].append(r)
        print(f"[{name} {dtype}] {r['n']} candidates from {r['design_spaces']} design space(s) in "
              f"{r['sample_s']} s; vector loops sampled: "
              f"{dict(sorted(r['vector_loops'].items()))}", flush=True)
    report["total_s"] = round(time.perf_counter() - t0, 1)
    report["loadavg_end"] = os.getloadavg()

    print(f"\nMetaSchedule CUDA ({args.arch}, rules {args.rules}) candidates, tvm "
          f"{tvm.__version__}, seed {args.seed}")
    print("| task | dtype | N | stock ok | stock lane fail | stock other fail | amp ok | amp lane fail "
          "| amp other fail | candidates legalized |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in report["results"]:
        s, a = r["stock"], r["amp"]
        print(f"| {r['task']} | {r['dtype']} | {r['n']} | {s['ok']} | {s['lanes']} | {s['other']} | {a['ok']} "
              f"| {a['lanes']} | {a['other']} | {r['legalized_candidates']} |")
    for r in report["results"]:
        for variant in ("stock", "amp"):
            for msg, cnt in r[variant]["messages"].most_common(5):
                print(f"  {r['task']} {r['dtype']} {variant}: {cnt} x {msg}")
        if r["rewrites"]:
            print(f"  {r['task']} {r['dtype']} amp rewrites (candidates): {dict(r['rewrites'].most_common(8))}")
    print(f"total {report['total_s']} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=1, default=lambda o: dict(o) if isinstance(o, dict)
                      else str(o))
        print("wrote", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
