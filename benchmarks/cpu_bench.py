"""CPU benchmark: amp llvm (untuned, tuned, bf16) vs ONNX Runtime fp32, in one run.

Models are built in code with random weights (amp_cli.models.GraphBuilder; nothing is
downloaded):
  * resnet50: a ResNet-50 v1.5-shaped graph (Conv+BatchNormalization+Relu, bottlenecks
    [3, 4, 6, 3], MaxPool, GlobalAveragePool, Gemm 2048->1000) at 1x3x224x224.
  * bert: a BERT-base-shaped encoder (hidden 768, 12 heads, FFN 3072, GELU via Erf,
    LayerNormalization) at 1x128 taking the embedding output [1, 128, 768] as input
    (no embedding gather / attention mask).

Rows per model, all with the same thread count (--threads sets TVM's pool, the tuner's
measurements via TVM_NUM_THREADS, and ORT's intra_op_num_threads):
  * onnxruntime fp32 (CPUExecutionProvider), timed before and after the amp rows;
  * amp llvm P (untuned) for each P in --precisions: the path of
    `amp convert MODEL --target llvm --precision P` (amp_cli.load, the shipped cpu policy,
    convert_precision, amp_cli.compile.build, the exported model.so loaded back);
  * with --tune-budget B: `amp tune MODEL --target llvm --precision fp32 --db DIR/<model>
    --time-budget B --trials N` (amp_cli.tuning.tune) per model, then the build of
    `amp convert ... --precision fp32 --tuning-db DIR/<model>`, timed. Rerunning with the same
    --tune-db resumes the tuning; --tune-budget 0 applies the records already there.

Usage:
  python benchmarks/cpu_bench.py [--models resnet50,bert] [--bert-layers 12] [--threads N]
                                 [--precisions fp32,bf16] [--tune-budget 10m]
                                 [--tune-db DIR] [--tune-trials 5000] [--stock-tvm]
                                 [--fast-math] [--repeat 20] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


# --------------------------------------------------------------------------------------------
# Model builders (amp_cli.models.GraphBuilder: the same graphs and weights as the earlier
# private builder of this file; only tensor/node names differ)
# --------------------------------------------------------------------------------------------
from amp_cli.models import GraphBuilder  # noqa: E402


def _conv_bn(g: GraphBuilder, x: str, cin: int, cout: int, k: int, stride: int, relu: bool) -> str:
    r = g.rng
    w = (r.standard_normal((cout, cin, k, k)) * math.sqrt(2.0 / (cin * k * k))).astype("float32")
    pad = k // 2
    y = g.op("Conv", [x, g.const(w)], kernel_shape=[k, k], strides=[stride, stride],
             pads=[pad] * 4)
    gamma = r.uniform(0.5, 1.0, cout).astype("float32")
    beta = r.uniform(-0.1, 0.1, cout).astype("float32")
    mean = r.uniform(-0.1, 0.1, cout).astype("float32")
    var = r.uniform(0.5, 1.5, cout).astype("float32")
    y = g.op("BatchNormalization", [y, g.const(gamma), g.const(beta), g.const(mean),
                                    g.const(var)], epsilon=1e-5)
    return g.op("Relu", [y]) if relu else y


def build_resnet50(seed: int = 0, blocks=(3, 4, 6, 3), num_classes: int = 1000,
                   image: int = 224):
    """ResNet-50 v1.5 topology (stride on the 3x3 conv) with random weights, NCHW."""
    g = GraphBuilder(seed)
    x = _conv_bn(g, "input", 3, 64, 7, 2, True)
    x = g.op("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for stage, nblk in enumerate(blocks):
        width = 64 * 2 ** stage
        for b in range(nblk):
            stride = 2 if (b == 0 and stage > 0) else 1
            y = _conv_bn(g, x, cin, width, 1, 1, True)
            y = _conv_bn(g, y, width, width, 3, stride, True)
            y = _conv_bn(g, y, width, width * 4, 1, 1, False)
            sc = _conv_bn(g, x, cin, width * 4, 1, stride, False) if b == 0 else x
            x = g.op("Relu", [g.op("Add", [y, sc])])
            cin = width * 4
    x = g.op("GlobalAveragePool", [x])
    x = g.op("Flatten", [x], axis=1)
    fw = (g.rng.standard_normal((num_classes, cin)) / math.sqrt(cin)).astype("float32")
    fb = g.rng.uniform(-0.1, 0.1, num_classes).astype("float32")
    x = g.op("Gemm", [x, g.const(fw), g.const(fb)], transB=1)
    return g.model([("input", [1, 3, image, image], "float32")],
                   [(x, [1, num_classes], "float32")], "resnet50")


def _layernorm(g: GraphBuilder, x: str, hidden: int) -> str:
    gamma = g.rng.uniform(0.8, 1.2, hidden).astype("float32")
    beta = g.rng.uniform(-0.1, 0.1, hidden).astype("float32")
    return g.op("LayerNormalization", [x, g.const(gamma), g.const(beta)], axis=-1,
                epsilon=1e-12)


def _dense(g: GraphBuilder, x: str, din: int, dout: int) -> str:
    w = (g.rng.standard_normal((din, dout)) * 0.02 * math.sqrt(768 / din)).astype("float32")
    b = g.rng.uniform(-0.02, 0.02, dout).astype("float32")
    return g.op("Add", [g.op("MatMul", [x, g.const(w)]), g.const(b)])


def build_bert(seed: int = 0, layers: int = 12, seq: int = 128, hidden: int = 768,
               heads: int = 12, ffn: int = 3072):
    """BERT-base encoder stack (post-LN) on the embedding output [1, seq, hidden]."""
    g = GraphBuilder(seed)
    dh = hidden // heads
    x = "hidden_states"
    split = g.const(np.array([1, seq, heads, dh], "int64"), "shape")
    merge = g.const(np.array([1, seq, hidden], "int64"), "shape")
    scale = g.const(np.array(1.0 / math.sqrt(dh), "float32"), "scale")
    half = g.const(np.array(0.5, "float32"), "c")
    one = g.const(np.array(1.0, "float32"), "c")
    rsqrt2 = g.const(np.array(1.0 / math.sqrt(2.0), "float32"), "c")
    for _ in range(layers):
        q = g.op("Transpose", [g.op("Reshape", [_dense(g, x, hidden, hidden), split])],
                 perm=[0, 2, 1, 3])
        k = g.op("Transpose", [g.op("Reshape", [_dense(g, x, hidden, hidden), split])],
                 perm=[0, 2, 3, 1])
        v = g.op("Transpose", [g.op("Reshape", [_dense(g, x, hidden, hidden), split])],
                 perm=[0, 2, 1, 3])
        s = g.op("Mul", [g.op("MatMul", [q, k]), scale])
        p = g.op("Softmax", [s], axis=-1)
        ctx = g.op("Transpose", [g.op("MatMul", [p, v])], perm=[0, 2, 1, 3])
        ctx = g.op("Reshape", [ctx, merge])
        x = _layernorm(g, g.op("Add", [x, _dense(g, ctx, hidden, hidden)]), hidden)
        h = _dense(g, x, hidden, ffn)
        h = g.op("Mul", [g.op("Mul", [h, half]),
                         g.op("Add", [g.op("Erf", [g.op("Mul", [h, rsqrt2])]), one])])
        x = _layernorm(g, g.op("Add", [x, _dense(g, h, ffn, hidden)]), hidden)
    x = g.op("Identity", [x])
    return g.model([("hidden_states", [1, seq, hidden], "float32")],
                   [(x, [1, seq, hidden], "float32")], "bert")


# --------------------------------------------------------------------------------------------
# Runners
# --------------------------------------------------------------------------------------------
def _time(fn, warmup: int, repeat: int) -> dict:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    ts.sort()
    return {"median_ms": ts[len(ts) // 2], "min_ms": ts[0], "runs": repeat}


def run_ort(model, x, threads, warmup, repeat):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    from amp_cli.frontend.ort_session import inference_session

    sess = inference_session(model, so)
    name = sess.get_inputs()[0].name
    out = sess.run(None, {name: x})[0]
    return out, _time(lambda: sess.run(None, {name: x}), warmup, repeat)


def build_tvm(model, stock: bool, fast_math: bool = False):
    from amp_cli import tvm_compat
    from amp_cli import hardware
    from amp_cli.backends.cpu import pipeline as sched

    tvm = tvm_compat.tvm()
    mod = tvm_compat.from_onnx(model)
    target = tvm.target.Target(hardware.host_llvm_target())
    t0 = time.perf_counter()
    if stock:
        from tvm.relax.backend.cpu_generic import get_default_pipeline

        ex = tvm_compat.compile_relax(mod, target, get_default_pipeline(target))
        stats = {}
    else:
        ex = tvm_compat.compile_relax(mod, target,
                                      sched.cpu_relax_pipeline(target, fast_math=fast_math))
        stats = dict(sched.LAST_STATS)
    return ex, time.perf_counter() - t0, stats, str(target)


def run_tvm(ex, x, warmup, repeat):
    """Time main() of a Relax VM executable (or a loaded library)."""
    from amp_cli import tvm_compat

    tvm = tvm_compat.tvm()
    vm = tvm.relax.VirtualMachine(ex, tvm.cpu())
    xt = tvm.runtime.tensor(x)
    out = vm["main"](xt).numpy()
    return out, _time(lambda: vm["main"](xt), warmup, repeat)


def convert_config(precision: str, tuning_db: str | None = None):
    """The ConvertConfig of `amp convert --target llvm --precision P [--tuning-db DIR]`."""
    from amp_cli.config import ConvertConfig

    cfg = ConvertConfig(target="llvm", tuning_db=tuning_db)
    cfg.precision.precision = precision
    return cfg


def build_amp(loaded, precision: str, workdir: str, tuning_db: str | None = None):
    """Build the way `amp convert MODEL --target llvm --precision P [--tuning-db DIR]` builds:
    resolve_config (the shipped cpu policy) -> convert_precision -> amp_cli.compile.build (amp's
    Relax pipeline, tuned records applied first when DIR is given) -> model.so, loaded back.
    The accuracy check and report of `amp convert` are skipped (accuracy is measured here)."""
    from amp_cli import tvm_compat
    from amp_cli.compile import build
    from amp_cli.precision import resolve_config
    from amp_cli.precision import convert_precision
    from amp_cli.target import resolve_target

    tvm = tvm_compat.tvm()
    target = resolve_target("llvm")
    cfg = resolve_config(convert_config(precision, tuning_db), target.kind)
    t0 = time.perf_counter()
    mod, _prec = convert_precision(loaded.mod, cfg.precision, loaded.node_types)
    os.makedirs(workdir, exist_ok=True)
    res = build(mod, target, os.path.join(workdir, "model.so"), tuning_db, isolate=False)
    lib = tvm.runtime.load_module(res.library)
    sched_info = {k: v for k, v in (res.schedule or {}).items() if k != "kernels"}
    if res.schedule:
        sched_info["tuned_kernels"] = [k for k in res.schedule.get("kernels", [])
                                       if k.get("schedule") == "tuned"]
    return lib, time.perf_counter() - t0, sched_info, str(target.tvm_target())


def tune_amp(loaded, db_dir: str, budget_s: float, trials: int, strategy: str,
             cost_model: str, seed: int | None, label: str) -> dict:
    """Tune as `amp tune MODEL --target llvm --precision fp32 --db DIR --time-budget B
    --trials N` does (amp_cli.tuning.tune, in its sandboxed child). A rerun with the same DIR
    resumes: records already there count against --tune-trials and are not measured again."""
    import amp_cli.cli  # noqa: F401 - cli_tune is imported through cli (circular otherwise)
    from amp_cli.cli.tune import summary_text
    from amp_cli.tuning import TuneConfig, tune

    tcfg = TuneConfig(db_dir=db_dir, trials=trials, time_budget_s=budget_s, strategy=strategy,
                      cost_model=cost_model, seed=seed)
    last = {"t": 0.0, "phase": None}

    def progress(p):
        now = time.perf_counter()
        if p.phase != last["phase"] or now - last["t"] >= 60:
            best = f", best {p.best_ms:.2f} ms" if p.best_ms is not None else ""
            print(f"[tune {label}] {p.phase}: tasks {p.tasks_done}/{p.tasks_total}, trials "
                  f"{p.trials_done}/{p.trials_total}{best}, {p.elapsed_s:.0f} s",
                  file=sys.stderr, flush=True)
            last.update(t=now, phase=p.phase)

    res = tune(loaded, convert_config("fp32"), tcfg, progress=progress)
    print(summary_text(res), file=sys.stderr, flush=True)
    d = res.to_dict()
    return {k: d[k] for k in ("db_dir", "strategy", "cost_model", "trials_budget",
                              "records_before", "trials_run", "records_total",
                              "skipped_measured", "failed_builds", "failed_runs", "seconds",
                              "stopped", "notes", "estimated_default_ms",
                              "estimated_tuned_ms")} | {"tasks": len(res.tasks)}


def _rel_err(out, ref) -> float:
    out = out.astype("float32")
    return float(np.abs(out - ref).max() / max(1e-12, np.abs(ref).max()))


def _fmt_loads(la) -> str:
    return "/".join(f"{v:.2f}" for v in la)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="resnet50,bert")
    ap.add_argument("--bert-layers", type=int, default=12)
    ap.add_argument("--threads", type=int, default=None,
                    help="threads for TVM (and the tuner's measurements) and ORT (default: "
                         "TVM_NUM_THREADS or all cores)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--precisions", default="fp32",
                    help="comma list of fp32,bf16,fp16: one untuned amp row each, built as "
                         "`amp convert --target llvm --precision P` builds")
    ap.add_argument("--tune-budget", default=None, metavar="DURATION",
                    help="also tune each model (fp32) with amp's tuner for DURATION per model "
                         "(90s, 10m; 0 = no new trials, just apply what --tune-db holds), then "
                         "build with the records and time it in the same run")
    ap.add_argument("--tune-db", default="benchmarks/cpu_tune_db", metavar="DIR",
                    help="tuning directories, one per model (DIR/<model>); a rerun resumes")
    ap.add_argument("--tune-trials", type=int, default=5000,
                    help="trial cap per model over all runs (amp tune --trials); the time "
                         "budget normally stops first")
    ap.add_argument("--tune-strategy", default="evolutionary")
    ap.add_argument("--tune-cost-model", default="auto")
    ap.add_argument("--tune-seed", type=int, default=0)
    ap.add_argument("--stock-tvm", action="store_true",
                    help="also time TVM's stock cpu_generic pipeline (slow: a 1-layer BERT only)")
    ap.add_argument("--fast-math", action="store_true",
                    help="also time amp with fast_math=True (approximate exp/erf/tanh)")
    ap.add_argument("--json", default="benchmarks/cpu_bench.json")
    args = ap.parse_args(argv)
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    for p in precisions:
        if p not in ("fp32", "bf16", "fp16"):
            ap.error(f"--precisions: unknown precision '{p}' (fp32, bf16, fp16)")
    budget_s = None
    if args.tune_budget is not None:
        from amp_cli.errors import ConfigError
        from amp_cli.tuning import parse_duration

        try:
            budget_s = parse_duration(args.tune_budget)
        except ConfigError as exc:
            ap.error(f"--tune-budget: {exc}")

    import tempfile

    import onnx

    import amp_cli
    from amp_cli import tvm_compat
    from amp_cli import hardware

    tvm = tvm_compat.tvm()
    cores = hardware.available_cores()
    all_cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    threads = args.threads or hardware.effective_num_threads(default_only=True)
    # before the target is made (it records num-cores); TVM also pins this process to
    # `threads` cores, which ORT, run in the same process, then shares
    hardware.set_num_threads(threads)
    rng = np.random.default_rng(0)
    cpu_model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                      if ln.startswith("model name")), platform.processor())
    import onnxruntime

    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpu": cpu_model,
              "cores_available": cores, "os_cpu_count": os.cpu_count(),
              "threads": threads, "tvm_threads": hardware.effective_num_threads(),
              "tvm": tvm.__version__, "onnxruntime": onnxruntime.__version__,
              "python": platform.python_version(), "loadavg_start": os.getloadavg(),
              "argv": sys.argv, "tune_budget_s_per_model": budget_s, "results": [],
              "tuning": {}}
    print(f"[cpu_bench] {cpu_model}, {cores} cores, {threads} thread(s), "
          f"load {_fmt_loads(os.getloadavg())}", file=sys.stderr, flush=True)
    work = tempfile.mkdtemp(prefix="amp-cpu-bench-")
    builders = {"resnet50": lambda: build_resnet50(),
                "bert": lambda: build_bert(layers=args.bert_layers)}
    t_start = time.perf_counter()
    for name in args.models.split(","):
        model = builders[name]()
        label = f"{name}" + (f"-{args.bert_layers}L" if name == "bert" else "")
        shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
        x = rng.uniform(-1, 1, shape).astype("float32")
        path = os.path.join(work, f"{label}.onnx")
        onnx.save(model, path)
        loaded = amp_cli.load(path)  # what `amp convert/tune MODEL.onnx` load
        ref, t_ort = run_ort(model, x, threads, args.warmup, args.repeat)
        rows = [{"model": label, "engine": "onnxruntime fp32", **t_ort,
                 "loadavg": os.getloadavg()}]

        def amp_row(engine, precision, tuning_db=None, _label=label, _loaded=loaded, _x=x,
                    _ref=ref):
            sub = os.path.join(work, f"{_label}-{precision}-{'tuned' if tuning_db else 'def'}")
            print(f"[cpu_bench] {_label}: building {engine}", file=sys.stderr, flush=True)
            lib, ct, info, tgt = build_amp(_loaded, precision, sub, tuning_db)
            out, t = run_tvm(lib, _x, args.warmup, args.repeat)
            return {"model": _label, "engine": engine, **t, "compile_s": ct,
                    "max_rel_err_vs_ort": _rel_err(out, _ref), "schedule": info,
                    "target": tgt, "loadavg": os.getloadavg()}

        for prec in precisions:
            rows.append(amp_row(f"amp llvm {prec} (untuned)", prec))
            print(f"[cpu_bench] {label}: {rows[-1]['engine']} {rows[-1]['median_ms']:.2f} ms",
                  file=sys.stderr, flush=True)
        if args.fast_math:
            ex, ct, stats, tgt = build_tvm(model, stock=False, fast_math=True)
            out, t = run_tvm(ex, x, args.warmup, args.repeat)
            rows.append({"model": label, "engine": "amp llvm fp32 (untuned, fast_math)", **t,
                         "compile_s": ct, "max_rel_err_vs_ort": _rel_err(out, ref),
                         "schedule_stats": stats, "target": tgt, "loadavg": os.getloadavg()})
        if budget_s is not None:
            db = os.path.join(args.tune_db, label)
            la0 = os.getloadavg()
            info = {"loadavg_before": la0}
            if budget_s > 0:
                # the tuner's builder workers get every core (TVM pinned this process to
                # `threads` of them); its measurements run with TVM_NUM_THREADS=threads
                if all_cpus:
                    os.sched_setaffinity(0, all_cpus)
                try:
                    info.update(tune_amp(loaded, db, budget_s, args.tune_trials,
                                         args.tune_strategy, args.tune_cost_model,
                                         args.tune_seed, label))
                finally:
                    hardware.set_num_threads(threads)
            else:
                info["note"] = "no new trials (--tune-budget 0): records already in the DB"
            info["loadavg_after"] = os.getloadavg()
            report["tuning"][label] = info
            engine = (f"amp llvm fp32 (tuned, {args.tune_budget} budget)" if budget_s > 0
                      else "amp llvm fp32 (tuned, records from --tune-db)")
            rows.append(amp_row(engine, "fp32", tuning_db=db))
            rows[-1]["tuning"] = {k: info.get(k) for k in ("trials_run", "records_total",
                                                             "stopped", "seconds")}
            print(f"[cpu_bench] {label}: {engine} {rows[-1]['median_ms']:.2f} ms",
                  file=sys.stderr, flush=True)
        # ORT again after TVM, so background load hits both
        _, t_ort2 = run_ort(model, x, threads, 1, args.repeat)
        rows[0]["median_ms_rerun"] = t_ort2["median_ms"]
        rows[0]["min_ms_rerun"] = t_ort2["min_ms"]
        if args.stock_tvm and name == "bert":
            small = build_bert(layers=1)
            xs = x
            ex, ct, _, tgt = build_tvm(small, stock=True)
            _, t = run_tvm(ex, xs, 0, 2)
            rows.append({"model": "bert-1L", "engine": "stock TVM cpu_generic (no schedule)",
                         **t, "compile_s": ct})
            ex, ct, stats, tgt = build_tvm(small, stock=False)
            _, t = run_tvm(ex, xs, 1, args.repeat)
            rows.append({"model": "bert-1L", "engine": "amp llvm fp32 (untuned)", **t,
                         "compile_s": ct})
        report["results"] += rows
        for r in rows:
            print(f"{r['model']:10s} {r['engine']:44s} {r['median_ms']:9.2f} ms "
                  f"(min {r['min_ms']:.2f})", flush=True)
    report["loadavg_end"] = os.getloadavg()
    report["wall_s"] = time.perf_counter() - t_start
    ort_ms = {r["model"]: min(r["median_ms"], r.get("median_ms_rerun", 1e9))
              for r in report["results"] if r["engine"] == "onnxruntime fp32"}
    print(f"\n{cpu_model}, {report['cores_available']} cores, {threads} thread(s); load "
          f"average {_fmt_loads(report['loadavg_start'])} -> "
          f"{_fmt_loads(report['loadavg_end'])}; wall {report['wall_s']:.0f} s")
    print("\n| model | engine | median ms | min ms | vs ORT (best of its 2 medians) | "
          "max rel err vs ORT |\n|---|---|---|---|---|---|")
    for r in report["results"]:
        base = ort_ms.get(r["model"])
        ratio = f"{r['median_ms'] / base:.2f}x" if base else "-"
        med = f"{r['median_ms']:.2f}"
        if "median_ms_rerun" in r:
            med += f" (rerun {r['median_ms_rerun']:.2f})"
        err = f"{r['max_rel_err_vs_ort']:.1e}" if "max_rel_err_vs_ort" in r else "-"
        print(f"| {r['model']} | {r['engine']} | {med} | {r['min_ms']:.2f} | {ratio} | {err} |")
    for lbl, info in report["tuning"].items():
        print(f"tuning {lbl}: {info.get('trials_run', 0)} trials this run, "
              f"{info.get('records_total', '?')} records, {info.get('tasks', '?')} tasks, "
              f"stopped: {info.get('stopped', '-')}, {info.get('seconds', 0):.0f} s; est. "
              f"kernel time default {info.get('estimated_default_ms')} ms -> tuned "
              f"{info.get('estimated_tuned_ms')} ms")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=1, default=str)
        print("wrote", args.json)
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
