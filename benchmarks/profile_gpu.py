"""Per-kernel GPU profile of an amp CUDA build (issue 9: profile first).

    python benchmarks/profile_gpu.py --model resnet50 --batch 8 --precision fp16
    python benchmarks/profile_gpu.py --model bert-large --json out/bert.json

What it does: builds the model with amp's CUDA pipeline (precision conversion, conv-as-GEMM,
dlight + amp's tensor-core rule, the lane legalizer), once *without* CUDA graphs so that every
kernel launch is visible to the VM. One instrumented run records each kernel call (symbol and
argument tensors); each distinct call is then timed alone with the library's time_evaluator
(CUDA-event timing, warm-up discarded). Per kernel it prints time, share of the summed kernel
time, FLOPs (2*M*N*K for GEMMs, TVM's TIR estimate otherwise), achieved TFLOP/s and GB/s
(argument bytes read+written once; a lower bound on traffic) against the H200 ceilings. The
end-to-end latency of the whole model is measured for the same build and, with --cuda-graph
(default), for a second build with CUDA graphs on, so launch gaps show up as the difference
between "sum of kernels" and end-to-end.

TVM 0.27's Relax VM has no profiler (``vm.profile`` is gone); the VM instrument hook plus
per-kernel time_evaluator replaces it. Results go to stdout and, as JSON, to --json or
$OUT/profile_<model>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PEAK_TFLOPS = 790.0  # H200 fp16 dense tensor-core, measured (issue 9)
PEAK_GBS = 4300.0  # H200 HBM3e


def _bench_model(name: str, batch: int, layers: int):
    try:
        import models as bench_models  # benchmarks/models.py (same weights as the other benches)
    except ImportError:
        bench_models = None
    if bench_models is not None:
        if name == "resnet50":
            return bench_models.resnet50(batch=batch)
        if name.startswith("bert"):
            return bench_models.bert(batch=batch, layers=layers,
                                     name="bert-large" if layers == 24 else f"bert-{layers}L")
    raise SystemExit(f"unknown model {name!r} (or benchmarks/models.py missing)")


def build_library(mod, precision: str, arch: str, out_path: str, cuda_graph: bool,
                  conv_as_gemm: bool):
    """Precision conversion + amp's CUDA pipeline, as amp's build does (no sandbox here)."""
    import tvm

    from amp_cli import tvm_compat
    from amp_cli.config import CudaConfig, PrecisionConfig
    from amp_cli.backends.cuda.tir import cuda_tir_pipeline
    from amp_cli.precision import convert_precision
    from amp_cli.backends.cuda.pipeline import cuda_relax_pipeline
    from amp_cli.backends.cuda.kernels.hopper_gemm import build_target

    low, _ = convert_precision(mod, PrecisionConfig(precision=precision))
    # as amp's build: sm_90 becomes sm_90a when the Hopper GEMMs are on (the default)
    tgt = build_target(tvm.target.Target({"kind": "cuda", "arch": arch}), CudaConfig().hopper_gemm)
    with tgt:
        lowered = cuda_relax_pipeline(tgt, conv_as_gemm=conv_as_gemm, cuda_graph=cuda_graph)(low)
    records: list = []
    ex = tvm_compat.compile_relax(lowered, tgt, relax_pipeline=None,
                                  tir_pipeline=cuda_tir_pipeline(tgt, records))
    ex.export_library(out_path)
    prims = {gv.name_hint: f for gv, f in lowered.functions.items()
             if isinstance(f, tvm_compat.prim_func_class())}
    return out_path, prims, tvm_compat.cuda_source(ex)


def kernel_flops(func, out_shape) -> float:
    """2*K per output element for GEMM-like kernels, TVM's TIR FLOP estimate otherwise."""
    import tvm

    from amp_cli.backends.cuda.rules.matmul import gemm_extents

    info = gemm_extents(func)
    if info is not None and info[2][2] is not None:
        return 2.0 * info[2][2] * float(np.prod(out_shape))
    try:
        return float(tvm.s_tir.analysis.estimate_tir_flops(tvm.IRModule({"main": func})))
    except Exception:  # noqa: BLE001 - opaque kernels
        return 0.0


def _nbytes(t) -> int:
    try:
        return int(np.prod(t.shape)) * np.dtype(str(t.dtype)).itemsize if t.shape else 0
    except Exception:  # noqa: BLE001 - bf16 and friends
        return int(np.prod(t.shape)) * (int(t.dtype.bits) // 8 if hasattr(t.dtype, "bits") else 2)


def record_calls(vm, inputs):
    """One instrumented run: [(symbol, [tensor args])] for every kernel launch, in order."""
    import tvm
    from tvm.relax import VMInstrumentReturnKind

    calls = []

    def instrument(func, name, before_run, ret_val, *args):
        if before_run and not name.startswith("vm.builtin.") and not name.startswith("vm."):
            tensors = [a for a in args if isinstance(a, tvm.runtime.Tensor)]
            if tensors:
                calls.append((str(name), tensors))
        return VMInstrumentReturnKind.NO_OP

    vm.set_instrument(instrument)
    vm["main"](*inputs)
    return calls  # the VM keeps the instrument: time end-to-end on a fresh VM


def kernel_module(lib, name: str):
    """The module that defines kernel ``name`` (the VM executable's compiled library)."""
    for mod in [*lib.imports, lib]:
        try:
            mod.get_function(name, query_imports=True)
            return mod
        except Exception:  # noqa: BLE001 - not in this one
            continue
    return lib


def time_kernels(lib, calls, dev, number: int, repeat: int):
    timings = {}
    for name, args in calls:
        key = (name, tuple(tuple(a.shape) for a in args))
        if key in timings:
            timings[key]["calls"] += 1
            continue
        try:
            f = kernel_module(lib, name).time_evaluator(name, dev, number=number, repeat=repeat)
            sec = float(np.median(f(*args).results))
        except Exception as exc:  # noqa: BLE001 - e.g. a builtin that is not a kernel
            sec, err = float("nan"), str(exc).splitlines()[0][:120]
        else:
            err = ""
        timings[key] = {"kernel": name, "calls": 1, "seconds": sec, "error": err,
                        "bytes": sum(_nbytes(a) for a in args),
                        "out_shape": [int(d) for d in args[-1].shape]}
    return list(timings.values())


def time_e2e(vm, dev, inputs, number: int, repeat: int) -> float:
    vm.set_input("main", *inputs)
    f = vm.time_evaluator("invoke_stateful", dev, number=number, repeat=repeat)
    return float(np.median(f("main").results))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50", choices=["resnet50", "bert-large"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=24, help="BERT layers")
    ap.add_argument("--precision", default="fp16", choices=["fp16", "bf16", "fp32"])
    ap.add_argument("--arch", default=None, help="sm_XX (default: the local GPU's)")
    ap.add_argument("--no-conv-gemm", action="store_true", help="stock conv lowering")
    ap.add_argument("--no-cuda-graph", action="store_true", help="skip the CUDA-graph e2e build")
    ap.add_argument("--number", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import tvm

    from amp_cli import load

    dev = tvm.cuda(0)
    if not dev.exist:
        raise SystemExit("no CUDA device")
    arch = args.arch or "sm_" + dev.compute_version.replace(".", "")
    bm = _bench_model(args.model, args.batch, args.layers)
    work = Path(tempfile.mkdtemp(prefix="amp_profile_"))
    t0 = time.perf_counter()
    onnx_path = work / f"{bm.name}.onnx"
    import onnx

    onnx.save(bm.make_onnx(bm.make_weights()), str(onnx_path), save_as_external_data=True,
              location=f"{bm.name}.data")
    model = load(str(onnx_path), input_shapes=bm.input_shapes)
    rng = np.random.default_rng(0)
    feeds = []
    for spec in model.inputs:
        shape = [int(d) for d in spec.shape]
        if "int" in spec.dtype:
            feeds.append(rng.integers(0, 1000, shape).astype(spec.dtype))
        else:
            feeds.append(rng.standard_normal(shape).astype(spec.dtype))
    t_load = time.perf_counter() - t0

    t0 = time.perf_counter()
    lib_path, prims, src = build_library(model.mod, args.precision, arch,
                                         str(work / "model.so"), cuda_graph=False,
                                         conv_as_gemm=not args.no_conv_gemm)
    t_build = time.perf_counter() - t0
    tc_kernels = {}
    for chunk in src.split("__global__")[1:]:
        m = re.search(r"void (?:__launch_bounds__\(\d+\) )?(\w+?)(?:_kernel)?\(", chunk)
        if m:
            tc_kernels[m.group(1)] = tc_kernels.get(m.group(1), False) or any(
                t in chunk.split("__global__")[0] for t in ("wmma::", "mma.sync", "mma_sync",
                                                             "wgmma"))

    lib = tvm.runtime.load_module(lib_path)
    vm = tvm.relax.VirtualMachine(lib, dev)
    inputs = [tvm.runtime.tensor(f, dev) for f in feeds]
    calls = record_calls(vm, inputs)
    rows = time_kernels(lib, calls, dev, args.number, args.repeat)
    e2e = time_e2e(tvm.relax.VirtualMachine(lib, dev), dev, inputs, args.number, args.repeat)

    e2e_graph, t_build_graph = None, 0.0
    if not args.no_cuda_graph:
        t0 = time.perf_counter()
        gpath, _, _ = build_library(model.mod, args.precision, arch, str(work / "model_g.so"),
                                    cuda_graph=True, conv_as_gemm=not args.no_conv_gemm)
        t_build_graph = time.perf_counter() - t0
        glib = tvm.runtime.load_module(gpath)
        e2e_graph = time_e2e(tvm.relax.VirtualMachine(glib, dev), dev, inputs, args.number,
                             args.repeat)

    total = sum(r["seconds"] * r["calls"] for r in rows if r["seconds"] == r["seconds"])
    for r in rows:
        f = prims.get(r["kernel"])
        r["flops"] = kernel_flops(f, r["out_shape"]) if f is not None else 0.0
        sec = r["seconds"]
        ok = sec == sec and sec > 0
        r["tflops"] = r["flops"] / sec / 1e12 if ok else 0.0
        r["gbs"] = r["bytes"] / sec / 1e9 if ok else 0.0
        r["share"] = sec * r["calls"] / total if ok and total else 0.0
        r["pct_peak_flops"] = 100 * r["tflops"] / PEAK_TFLOPS
        r["pct_peak_bw"] = 100 * r["gbs"] / PEAK_GBS
        r["tensor_cores"] = bool(tc_kernels.get(r["kernel"], False))
    rows.sort(key=lambda r: -(r["share"]))

    print(f"{bm.name} batch {args.batch} {args.precision} {arch}: build {t_build:.0f}s "
          f"(+{t_build_graph:.0f}s with CUDA graphs), load {t_load:.0f}s")
    print(f"end-to-end: {e2e * 1e3:.3f} ms" + (f", with CUDA graphs {e2e_graph * 1e3:.3f} ms"
                                                if e2e_graph else "")
          + f"; sum of kernels {total * 1e3:.3f} ms over {sum(r['calls'] for r in rows)} "
            f"launches ({len(rows)} distinct)")
    hdr = f"{'kernel':58s} {'n':>3s} {'us':>9s} {'share':>6s} {'TFLOP/s':>8s} {'%pk':>5s} " \
          f"{'GB/s':>7s} {'%bw':>5s} tc"
    print(hdr)
    for r in rows[: args.top]:
        print(f"{r['kernel'][:58]:58s} {r['calls']:3d} {r['seconds'] * 1e6:9.1f} "
              f"{100 * r['share']:5.1f}% {r['tflops']:8.1f} {r['pct_peak_flops']:5.1f} "
              f"{r['gbs']:7.0f} {r['pct_peak_bw']:5.1f} {'y' if r['tensor_cores'] else '-'}"
              + (f"  ERR {r['error']}" if r["error"] else ""))

    out = {"model": bm.name, "batch": args.batch, "precision": args.precision, "arch": arch,
           "device": str(dev.device_name) if hasattr(dev, "device_name") else "cuda",
           "tvm": tvm.__version__, "conv_as_gemm": not args.no_conv_gemm,
           "e2e_ms": e2e * 1e3, "e2e_cuda_graph_ms": e2e_graph * 1e3 if e2e_graph else None,
           "sum_kernels_ms": total * 1e3, "build_s": t_build, "build_cuda_graph_s": t_build_graph,
           "peaks": {"tflops": PEAK_TFLOPS, "gbs": PEAK_GBS}, "kernels": rows}
    path = args.json or (os.path.join(os.environ["OUT"], f"profile_{bm.name}.json")
                         if os.environ.get("OUT") else None)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(out, indent=1))
        print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
