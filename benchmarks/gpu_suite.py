"""The H200 benchmark suite: amp vs PyTorch on resnet50 (8x3x224x224) and bert-large (8x128).

One invocation does everything, in this order, to fit in ~8 minutes:

1. builds both models in code from seeded random weights (benchmarks/models.py): an ONNX graph
   for amp and a hand-written torch nn.Module with the *same* weights for PyTorch;
2. starts the TVM builds in parallel child processes (``amp convert`` for cuda:<arch>: fp32,
   fp16 with default schedules, and fp16 with ``--tuning-db`` when one is given);
3. meanwhile computes the fp32 reference (ONNX Runtime, CPU) and compiles the torch runners
   (eager fp32 / fp16, torch.compile fp16 mode="default" and mode="reduce-overhead");
4. when the builds are done, times every runner with the GPU idle otherwise (TVM
   time_evaluator on the amp builds, CUDA events for torch), each after warm-up, on the same
   inputs, and measures each against the fp32 reference; profiles amp fp16 per kernel;
5. prints one table last and writes everything as JSON to --json (default
   $OUT/gpu_suite.json, else ./gpu_suite.json).

torch fp32 runs with TF32 off (strict fp32, like amp fp32); cudnn.benchmark is on.

Usage (on the GPU machine, from the repo root):
  python benchmarks/gpu_suite.py                       # both models, arch of the local GPU
  python benchmarks/gpu_suite.py --layers 12           # a shorter bert (faster TVM build)
  python benchmarks/gpu_suite.py --tuning-db tuning/   # adds "amp fp16 tuned"
  python benchmarks/gpu_suite.py --variant no-combine=benchmarks/variants/no-combine.yaml
  python benchmarks/gpu_suite.py --variant bert-large:no-split-k=benchmarks/variants/no-split-k.yaml
  python benchmarks/gpu_suite.py --build-only --arch sm_90   # compile times only, no GPU
  python benchmarks/gpu_suite.py --models '' --corpus default --amp-precisions fp16,bf16
      # issue 21: real exports (benchmarks/corpus) vs torch, geometric mean printed last
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Stock TVM 0.27 fp16 on the H200 in ms (dlight defaults, pinned ffi; issue 9), for the goal
# lines: the first milestone is amp fp16 >= 2x faster than it.
STOCK_TVM_FP16 = {"resnet50": 3.6, "bert-large": 16.1}
BEST_TORCH = "torch.compile fp16 reduce-overhead"  # issue 9's bar
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50,bert-large",
                    help="comma-separated subset of resnet50,bert-large")
    ap.add_argument("--corpus", default="",
                    help="also time these real-model corpus models (benchmarks/corpus; "
                         "'default' = " + "issue 21's set), built at full scale and exported "
                         "in the run; e.g. --models '' --corpus default")
    ap.add_argument("--exporter", default="dynamo", choices=["dynamo", "legacy", "both"],
                    help="torch.onnx.export path for --corpus models [default: dynamo, "
                         "torch's default]")
    ap.add_argument("--max-autotune", action="store_true",
                    help="add torch.compile fp16 mode='max-autotune' (long compiles: its "
                         "row says so when it misses --budget-s)")
    ap.add_argument("--layers", type=int, default=24, help="bert-large encoder layers")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--arch", default=None, help="CUDA arch (default: the local GPU's)")
    ap.add_argument("--tuning-db", default=None, help="amp tuning records: adds amp fp16 tuned")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=100)
    ap.add_argument("--number", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=4, help="parallel TVM builds")
    ap.add_argument("--budget-s", type=float, default=540,
                    help="wall-clock budget: builds still running then are killed and the "
                         "remaining runners skipped, so the table and JSON always appear")
    ap.add_argument("--amp-precisions", default="fp32,fp16",
                    help="amp builds to time (comma list of fp32, fp16, bf16)")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch runners")
    ap.add_argument("--no-compile-modes", action="store_true",
                    help="skip torch.compile (eager only)")
    ap.add_argument("--torch-modes", default=None,
                    help="comma list of the PyTorch runners to build, from " +
                         ", ".join(TORCH_MODES) + " [default: all but max-autotune]")
    ap.add_argument("--ort", action="store_true",
                    help="also time ONNX Runtime (CUDA provider if installed, else CPU)")
    ap.add_argument("--no-profile", action="store_true", help="skip amp's per-kernel profile")
    ap.add_argument("--profile-precisions", default="fp16",
                    help="comma list of the amp precisions profiled per kernel (each from a "
                         "build without CUDA graphs), of those in --amp-precisions [fp16]")
    ap.add_argument("--variant", action="append", default=[], metavar="[MODEL:]NAME=CONFIG.yaml",
                    help="also build and time amp fp16 with this --config (e.g. a cuda: section "
                         "turning one optimization off, for an A/B in the same run), for every "
                         "model or only MODEL; repeatable")
    ap.add_argument("--build-only", action="store_true",
                    help="only build (no GPU needed): measures TVM compile times")
    ap.add_argument("--workdir", default=None, help="keep ONNX files and builds here")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


# the PyTorch runners: short name -> (row label, dtype, torch.compile mode or None for eager)
TORCH_MODES = {
    "eager-fp32": ("torch eager fp32", "float32", None),
    "eager-fp16": ("torch eager fp16", "float16", None),
    "default": ("torch.compile fp16", "float16", "default"),
    "reduce-overhead": ("torch.compile fp16 reduce-overhead", "float16", "reduce-overhead"),
    "max-autotune": ("torch.compile fp16 max-autotune", "float16", "max-autotune"),
}


def torch_modes(args) -> list[tuple]:
    """The PyTorch runners ``args`` asks for, as (label, dtype, mode) in TORCH_MODES order."""
    if args.torch_modes is not None:
        wanted = [m.strip() for m in args.torch_modes.split(",") if m.strip()]
        unknown = [m for m in wanted if m not in TORCH_MODES]
        if unknown:
            raise SystemExit(f"--torch-modes: unknown {', '.join(unknown)}; choose from "
                             f"{', '.join(TORCH_MODES)}")
    else:
        wanted = ["eager-fp32", "eager-fp16"]
        if not args.no_compile_modes:
            wanted += ["default", "reduce-overhead"] + (["max-autotune"] if args.max_autotune
                                                         else [])
    return [TORCH_MODES[m] for m in TORCH_MODES if m in wanted]


# ---------------------------------------------------------------------------------------------
def no_graph_label(precision: str) -> str:
    return f"amp {precision}, no CUDA graph"


def profiled_precisions(args) -> list[str]:
    """The amp precisions profiled per kernel: --profile-precisions that are built at all."""
    if args.no_profile:
        return []
    built = args.amp_precisions.split(",")
    return [p for p in args.profile_precisions.split(",") if p and p in built]


def start_build(onnx_path: Path, outdir: Path, target: str, precision: str,
                tuning_db: str | None, flags=()) -> dict:
    cmd = [sys.executable, "-m", "amp_cli", "convert", str(onnx_path), "-o", str(outdir),
           "--target", target, "--precision", precision, "--no-accuracy", "--force", *flags]
    if tuning_db:
        cmd += ["--tuning-db", tuning_db]
    logf = open(outdir.parent / f"{outdir.name}.log", "w")
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=str(ROOT))
    return {"cmd": cmd, "proc": proc, "log": logf, "start": time.perf_counter(),
            "outdir": outdir}


def run_builds(jobs: list[dict], max_parallel: int, deadline: float) -> None:
    """jobs: dicts with onnx, outdir, target, precision, tuning_db; fills status/seconds."""
    pending, running = list(jobs), []
    while pending or running:
        while pending and len(running) < max_parallel:
            j = pending.pop(0)
            j.update(start_build(j["onnx"], j["outdir"], j["target"], j["precision"],
                                 j["tuning_db"], j.get("flags", ())))
            log(f"build started: {j['name']}")
            running.append(j)
        time.sleep(1.0)
        for j in list(running):
            rc = j["proc"].poll()
            if rc is None and time.perf_counter() < deadline:
                continue
            if rc is None:
                j["proc"].kill()
                j["proc"].wait()
                rc = "killed (over --budget-s)"
            j["log"].close()
            j["wall_s"] = time.perf_counter() - j["start"]
            j["rc"] = rc
            tail = Path(j["log"].name).read_text().strip().splitlines()[-3:]
            j["status"] = "ok" if rc == 0 else f"failed ({rc}): {' | '.join(tail)[-300:]}"
            rep = j["outdir"] / "report.json"
            if rc == 0 and rep.is_file():
                r = json.loads(rep.read_text())
                j["build_s"] = r["build"]["seconds"]
                j["kernels"] = len(r["build"]["kernels"])
                j["tensor_core_kernels"] = r["build"].get("tensor_core_kernels")
                if j["tuning_db"]:  # how many kernels took a record (the rest: amp's default)
                    j["tuned_kernels"] = (r["build"].get("schedule") or {}).get("tuned")
                j["convert_s"] = r.get("timings", {}).get("convert_s")
            log(f"build done: {j['name']}: {j['status']} in {j['wall_s']:.0f}s wall")
            running.remove(j)


def reference_outputs(onnx_path: Path, feeds: dict):
    import numpy as np
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    from amp_cli.frontend.ort_session import inference_session

    sess = inference_session(str(onnx_path), opts)
    return [np.asarray(o) for o in sess.run(None, feeds)]


def main(argv=None) -> int:
    args = parse_args(argv)
    import onnx

    from amp_cli import tvm_compat
    from amp_cli.accuracy import compare_outputs, random_inputs
    from amp_cli.bench import BenchConfig, LatencyStats, RunnerResult
    from amp_cli.bench.runners import bench_library
    from amp_cli.bench.timing import profile_library, time_cuda
    from amp_cli.frontend import InputSpec
    from amp_cli.report import versions
    from benchmarks import models as bm

    deadline = T0 + args.budget_s
    out_env = os.environ.get("OUT")
    json_path = Path(args.json or (Path(out_env) / "gpu_suite.json" if out_env
                                   else "gpu_suite.json"))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="amp-gpu-suite-"))
    work.mkdir(parents=True, exist_ok=True)
    gpu = tvm_compat.has_cuda_device()
    if not gpu and not args.build_only:
        print("gpu_suite: no CUDA GPU visible to TVM; use --build-only to measure compile "
              "times without one", file=sys.stderr)
        return 1
    arch = args.arch or ("sm_" + tvm_compat.cuda_device().compute_version.replace(".", "")
                         if gpu else "sm_90")
    target = f"cuda:{arch}"
    cfg = BenchConfig(warmup=args.warmup, repeat=args.repeat, number=args.number)
    wanted = [m.strip() for m in args.models.split(",") if m.strip()]
    suite = [m for m in bm.gpu_suite(layers=args.layers, batch=args.batch)
             if m.name.split("-")[0] in {w.split("-")[0] for w in wanted}]
    if args.corpus:
        from benchmarks.corpus import suite as corpus_suite

        exporters = ["dynamo", "legacy"] if args.exporter == "both" else [args.exporter]
        suite += [corpus_suite.bench_model(n, args.batch, e)
                  for n in corpus_suite.names(args.corpus) for e in exporters]
    result = {"suite": "gpu", "schema_version": 1, "target": target, "bench": cfg.to_dict(),
              "args": vars(args), "versions": versions(), "machine": machine_info(),
              "models": {}, "builds": [], "notes": []}

    # 1. models -----------------------------------------------------------------------------
    weights, feeds, specs = {}, {}, {}
    for m in suite:
        t = time.perf_counter()
        try:
            w = m.make_weights()
            path = work / f"{m.name}.onnx"
            onnx.save(m.make_onnx(w), str(path))
        except Exception as exc:  # noqa: BLE001 - an export that fails is a row, not the end
            result["notes"].append(f"{m.name}: not built: {type(exc).__name__}: "
                                   f"{str(exc).splitlines()[0][:300] if str(exc) else ''}")
            log(f"model {m.name}: not built ({type(exc).__name__})")
            continue
        weights[m.name] = w
        if m.make_feeds is not None:  # corpus models: valid ids and 0/1 masks
            feeds[m.name] = m.make_feeds(w)
            specs[m.name] = [InputSpec(n, list(a.shape), str(a.dtype))
                             for n, a in feeds[m.name].items()]
        else:
            specs[m.name] = [InputSpec(n, list(s), "int64" if n == "input_ids" else "float32")
                             for n, s in m.input_shapes.items()]
            feeds[m.name] = random_inputs(specs[m.name], seed=0)
        result["models"][m.name] = {"description": m.description, "onnx": str(path),
                                    "onnx_bytes": path.stat().st_size,
                                    "inputs": [s.to_dict() for s in specs[m.name]],
                                    "make_s": time.perf_counter() - t, "runners": []}
        log(f"model {m.name}: {m.description}; ONNX {path.stat().st_size / 1e6:.0f} MB")

    suite = [m for m in suite if m.name in weights]
    # 2. TVM builds in the background -----------------------------------------------------------
    jobs = []
    for m in suite:
        variants = [(p, None, f"amp {p}", ()) for p in args.amp_precisions.split(",") if p]
        if args.tuning_db:
            variants.append(("fp16", args.tuning_db, "amp fp16 tuned", ()))
        for spec in args.variant:
            vname, _, vcfg = spec.partition("=")
            if not vcfg:
                raise SystemExit(f"--variant {spec!r}: expected [MODEL:]NAME=CONFIG.yaml")
            only, _, vname = vname.rpartition(":")
            if only and only != m.name:
                continue
            variants.append(("fp16", None, f"amp fp16 {vname}",
                             ("--config", str(Path(vcfg).resolve()))))
        for prec in profiled_precisions(args):
            # CUDA graphs hide the kernels from the VM's instrument (one capture call): the
            # per-kernel profile needs a build without them, timed too (graphs' share)
            variants.append((prec, None, no_graph_label(prec), ("--no-cuda-graph",)))
        for prec, db, label, flags in variants:
            jobs.append({"model": m.name, "label": label, "name": f"{m.name} {label}",
                         "onnx": work / f"{m.name}.onnx", "target": target, "precision": prec,
                         "tuning_db": db, "flags": list(flags),
                         "outdir": work / f"{m.name}-{label.replace(' ', '-').replace(',', '')}"})
    # the longest builds first (bert fp16, then bert fp32, ...)
    jobs.sort(key=lambda j: (not j["model"].startswith("bert"), j["precision"] != "fp16"))
    import threading

    builder = threading.Thread(target=run_builds, args=(jobs, args.jobs, deadline), daemon=True)
    builder.start()

    # 3. reference + torch preparation while TVM compiles ---------------------------------------
    refs = {}
    for m in suite:
        try:
            refs[m.name] = reference_outputs(work / f"{m.name}.onnx", feeds[m.name])
            log(f"reference {m.name}: ONNX Runtime fp32 (CPU)")
        except Exception as exc:  # noqa: BLE001
            refs[m.name] = None
            result["notes"].append(f"{m.name}: no ONNX Runtime reference ({exc})")
    torch_runs = {}
    if not args.build_only and not args.no_torch:
        torch_runs = prepare_torch(suite, weights, feeds, specs, args, result, deadline)

    builder.join()
    result["builds"] = [{k: (str(v) if isinstance(v, Path) else v) for k, v in j.items()
                         if k not in ("proc", "log", "onnx")} for j in jobs]
    if args.build_only:
        finish(result, json_path, build_only=True)
        return 0

    # 4. timing ------------------------------------------------------------------------------
    for m in suite:
        runners = []
        feed, order = feeds[m.name], [s.name for s in specs[m.name]]
        for j in [j for j in jobs if j["model"] == m.name]:
            if j.get("rc") != 0:
                runners.append(RunnerResult(j["label"], "amp", "cuda", j["precision"],
                                            error=j.get("status")))
                continue
            if time.perf_counter() > deadline:
                runners.append(RunnerResult(j["label"], "amp", "cuda", j["precision"],
                                            skipped="over --budget-s"))
                continue
            try:
                r = bench_library(j["label"], "amp", str(j["outdir"] / "model.so"), "cuda",
                                  "float16" if j["precision"] == "fp16" else "float32", feed,
                                  order, m.batch, cfg, refs[m.name], None)
                r.build_seconds = j.get("build_s")
                runners.append(r)
                log(f"timed {m.name} {j['label']}: p50 {r.latency.p50_ms:.3f} ms")
            except Exception as exc:  # noqa: BLE001
                runners.append(RunnerResult(j["label"], "amp", "cuda", j["precision"],
                                            error=f"{type(exc).__name__}: {exc}"[:300]))
        for name, entry in torch_runs.get(m.name, {}).items():
            res = RunnerResult(name, "torch", "cuda", entry["dtype"], timer="CUDA events")
            res.build_seconds = entry.get("compile_s")
            if entry.get("error"):
                res.error = entry["error"]
            elif time.perf_counter() > deadline:
                res.skipped = "over --budget-s"
            else:
                try:
                    res.accuracy = compare_outputs(refs[m.name], entry["outputs"], None)
                    res.latency = LatencyStats.from_seconds(time_cuda(entry["call"], cfg),
                                                            m.batch, cfg.number)
                    log(f"timed {m.name} {name}: p50 {res.latency.p50_ms:.3f} ms")
                except Exception as exc:  # noqa: BLE001
                    res.error = f"{type(exc).__name__}: {exc}"[:300]
            runners.append(res)
        if args.ort:
            runners.append(time_ort(work / f"{m.name}.onnx", feed, m.batch, cfg, refs[m.name]))
        result["models"][m.name]["runners"] = [r.to_dict() for r in runners]
        for prec in profiled_precisions(args):
            job = next((j for j in jobs if j["model"] == m.name
                        and j["label"] == no_graph_label(prec) and j.get("rc") == 0), None)
            if job is None or time.perf_counter() >= deadline:
                continue
            try:
                result["models"][m.name][f"amp_{prec}_profile"] = profile_library(
                    str(job["outdir"] / "model.so"), "cuda", feed, order, top=15)
            except Exception as exc:  # noqa: BLE001
                result["notes"].append(f"{m.name}: {prec} profile failed: {exc}")
        torch_runs.pop(m.name, None)
        _free_torch()
    finish(result, json_path)
    return 0


def prepare_torch(suite, weights, feeds, specs, args, result, deadline) -> dict:
    """Build the torch runners and make their first call (torch.compile compiles then)."""
    from amp_cli.bench.timing import torch_callable, torch_outputs

    try:
        import torch
    except ImportError:
        result["notes"].append("torch not installed: no PyTorch runners")
        return {}
    if not torch.cuda.is_available():
        result["notes"].append("torch sees no CUDA device: no PyTorch runners")
        return {}
    torch.backends.cuda.matmul.allow_tf32 = False  # torch fp32 = strict fp32, like amp fp32
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    result["torch_settings"] = {"allow_tf32": False, "cudnn.benchmark": True,
                                "torch": torch.__version__, "cuda": torch.version.cuda,
                                "gpu": torch.cuda.get_device_name(0)}
    modes = torch_modes(args)
    runs: dict = {}
    for m in suite:
        module = m.make_torch(weights[m.name])
        arrays = [feeds[m.name][s.name] for s in specs[m.name]]
        runs[m.name] = {}
        for name, dtype, mode in modes:
            entry = {"dtype": dtype}
            if time.perf_counter() > deadline:
                entry["error"] = "over --budget-s before compiling"
                runs[m.name][name] = entry
                continue
            t = time.perf_counter()
            try:
                call = torch_callable(module, arrays, dtype, "cuda", mode)
                entry["outputs"] = torch_outputs(call())  # compiles for torch.compile
                for _ in range(3 if mode else 1):  # reduce-overhead records its graph here
                    call()
                torch.cuda.synchronize()
                entry["call"] = call
            except Exception as exc:  # noqa: BLE001
                entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            entry["compile_s"] = time.perf_counter() - t
            runs[m.name][name] = entry
            log(f"torch {m.name} {name}: ready in {entry['compile_s']:.1f}s"
                + (f" ({entry['error']})" if "error" in entry else ""))
        del module
    return runs


def _free_torch():
    try:
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


def time_ort(onnx_path, feed, batch, cfg, ref):
    from amp_cli.accuracy import compare_outputs
    from amp_cli.bench import LatencyStats, RunnerResult
    from amp_cli.bench.timing import host_timed

    import onnxruntime as ort

    cuda = "CUDAExecutionProvider" in ort.get_available_providers()
    res = RunnerResult(f"onnxruntime {'cuda' if cuda else 'cpu'}", "ort",
                       "cuda" if cuda else "cpu", "float32", timer="host clock")
    try:
        from amp_cli.frontend.ort_session import inference_session

        sess = inference_session(str(onnx_path), providers=[
            "CUDAExecutionProvider" if cuda else "CPUExecutionProvider"])
        res.accuracy = compare_outputs(ref, sess.run(None, feed), None)
        small = type(cfg)(warmup=min(cfg.warmup, 3), repeat=min(cfg.repeat, 10)) if not cuda \
            else cfg
        res.latency = LatencyStats.from_seconds(host_timed(lambda: sess.run(None, feed), small),
                                                batch, small.number)
    except Exception as exc:  # noqa: BLE001
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    return res


def machine_info() -> dict:
    import platform

    info = {"host": platform.node(), "cpu_count": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        info["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        info["nvidia_smi"] = None
    return info


def finish(result: dict, json_path: Path, build_only: bool = False) -> None:
    from amp_cli.report import write_json

    result["wall_s"] = time.perf_counter() - T0
    json_path.parent.mkdir(parents=True, exist_ok=True)
    write_json(json_path, result)
    print(render(result, build_only))
    print(f"wrote {json_path}")


def _f(v, spec=".3f"):
    return "-" if v is None else format(v, spec)


def render(result: dict, build_only: bool = False) -> str:
    lines = [f"amp GPU suite: target {result['target']}, {result['machine'].get('nvidia_smi')}, "
             f"wall {result['wall_s']:.0f}s"]
    lines.append("builds (s, wall in parallel): " + "; ".join(
        f"{b['name']} {_f(b.get('wall_s'), '.0f')}"
        + (f" ({b['tuned_kernels']} of {b.get('kernels')} kernels from the records)"
           if b.get("tuned_kernels") is not None else "")
        + ("" if b.get("rc") == 0 else f" [{b.get('status', 'not run')}]")
        for b in result["builds"]))
    if build_only:
        return "\n".join(lines)
    head = f"{'model':<12} {'runner':<36} {'p50 ms':>8} {'mean':>8} {'p99':>8} {'items/s':>9} " \
           f"{'rel L2':>9} {'cosine':>9} {'build s':>8} {'vs tc-ro':>8}"
    lines += [head, "-" * len(head)]
    for name, m in result["models"].items():
        rs = m["runners"]
        tc = next((r for r in rs if r["name"] == BEST_TORCH and r["latency"]), None)
        for r in rs:
            lat, acc = r.get("latency"), r.get("accuracy") or {}
            if not lat:
                lines.append(f"{name:<12} {r['name']:<36} {r.get('error') or r.get('skipped')}")
                continue
            ratio = lat["p50_ms"] / tc["latency"]["p50_ms"] if tc else None
            lines.append(f"{name:<12} {r['name']:<36} {lat['p50_ms']:8.3f} {lat['mean_ms']:8.3f} "
                         f"{lat['p99_ms']:8.3f} {lat['throughput_per_s']:9.1f} "
                         f"{_f(acc.get('rel_l2'), '.2e'):>9} {_f(acc.get('cosine'), '.6f'):>9} "
                         f"{_f(r.get('build_seconds'), '.0f'):>8} {_f(ratio, '.2f'):>8}")
        amp16 = next((r for r in rs if r["name"] == "amp fp16" and r["latency"]), None)
        stock = STOCK_TVM_FP16.get(name)  # only for the reference shapes (bert-large: 24 layers)
        if amp16:
            a = amp16["latency"]["p50_ms"]
            goal = f"{'':<12} goal: amp fp16 {a:.3f} ms"
            if tc:
                t = tc["latency"]["p50_ms"]
                goal += f" vs {BEST_TORCH} {t:.3f} ms: {a / t:.2f}x (goal <= 1.00x)"
            if stock:
                goal += f"; vs stock TVM fp16 {stock} ms: {stock / a:.2f}x faster (milestone >= 2x)"
            lines.append(goal)
        for prec in ("fp16", "bf16", "fp32"):
            prof = m.get(f"amp_{prec}_profile")
            if prof:
                lines.append(f"{'':<12} amp {prec} top kernels (no CUDA graph build; synced, "
                             f"incl. launch): " + ", ".join(
                    f"{p['name']} {p['ms']:.3f}ms x{p['count']} ({p['percent']:.0f}%"
                    + (f", >={p['gbps']:.0f} GB/s" if p.get("gbps") else "") + ")"
                    for p in prof[:5]))
    lines += summary_lines(result)
    for n in result.get("notes", []):
        lines.append(f"note: {n}")
    return "\n".join(lines)


def _p50(runners: list, name: str):
    r = next((r for r in runners if r["name"] == name and r.get("latency")), None)
    return r["latency"]["p50_ms"] if r else None


def summary_lines(result: dict) -> list[str]:
    """Issue 21's acceptance in numbers: amp fp16 / reduce-overhead per model and their
    geometric mean (goal <= 0.85x, every model <= 1.0x), and amp bf16 / amp fp16 (goal within
    5 %); models without both rows are left out and named."""
    ratios, bf16, missing = {}, {}, []
    for name, m in result["models"].items():
        rs = m.get("runners") or []
        amp, tc, b = _p50(rs, "amp fp16"), _p50(rs, BEST_TORCH), _p50(rs, "amp bf16")
        if amp and tc:
            ratios[name] = amp / tc
        else:
            missing.append(name)
        if amp and b:
            bf16[name] = b / amp
    lines = []
    if ratios:
        geo = math.exp(sum(math.log(r) for r in ratios.values()) / len(ratios))
        worst = max(ratios, key=ratios.get)
        lines.append(f"amp fp16 / {BEST_TORCH}: geometric mean {geo:.2f}x over {len(ratios)} "
                     f"models (goal <= 0.85x); worst {worst} {ratios[worst]:.2f}x (goal <= 1.00x)"
                     + (f"; not compared: {', '.join(missing)}" if missing else ""))
    if bf16:
        lines.append("amp bf16 / amp fp16: " + ", ".join(f"{n} {r:.2f}x" for n, r in bf16.items())
                     + " (goal <= 1.05x)")
    return lines


if __name__ == "__main__":
    sys.exit(main())
