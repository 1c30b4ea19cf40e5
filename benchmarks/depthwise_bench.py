"""A/B of amp's depthwise/grouped convolution kernel (YAML ``cuda: {depthwise_conv: ...}``).

One invocation (~4 minutes on the H200's 16 cores), in this order:

1. the three torchvision models of issue 21 (mobilenet_v3_large, efficientnet_b0, convnext_tiny;
   weights=None, seeded, BatchNorm statistics calibrated by a few train-mode passes on random
   images, then eval) exported with ``torch.onnx.export(..., dynamo=False)`` at batch 8;
2. ``amp convert --precision fp16`` of each, with the switch on (the default) and off
   (``benchmarks/variants/no-depthwise-conv.yaml``), in parallel child processes;
3. meanwhile: the ONNX Runtime fp32 reference (CPU), and real depthwise layers (NHWC fp16 at
   batch 8, bias + the model's activation, cast back to fp16) as single kernels: amp's kernel,
   the switch-off kernel (TOPI + dlight's GeneralReduction) and torch fp16 channels-last eager
   (cuDNN, ``cudnn.benchmark`` on; torch.compile calls the same cuDNN convolution, so it is not
   compiled per layer: that would cost a minute of the budget). Every layer runner is captured
   20 calls at a time into
   one CUDA graph (amp's kernels through ``tvm_ffi.use_torch_stream``), so host launch costs
   are out and the kernels are compared alone; the bandwidth floor is the layer's bytes (input
   + output, fp16) at 4.8 TB/s;
4. torch.compile(mode="reduce-overhead") fp16 and torch eager fp16 of each model;
5. when the builds are done: p50 latency of each amp build (time_evaluator, CUDA graphs on, as
   amp ships) and of the torch runners (CUDA events), each after warm-up, with accuracy
   against the ONNX Runtime fp32 reference; then one table, last, and JSON to --json (default
   $OUT/depthwise_bench.json).

Usage (repository root):
  python benchmarks/depthwise_bench.py                  # on the GPU machine
  python benchmarks/depthwise_bench.py --models ''      # layers only
  python benchmarks/depthwise_bench.py --dry-run        # no GPU: a smoke test on the CPU
``--dry-run`` shrinks everything (batch 1, 64x64 images, layers at a quarter of their size),
compiles every amp build and layer kernel for ``--arch`` (default sm_90) exactly as a GPU run
would, runs torch eager on the CPU, and times nothing. Without torchvision the dry run exports a
small stand-in (inverted residual + squeeze-excite + 7x7 depthwise) instead; a GPU run without
it skips the models and says so.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu_suite import log, machine_info, reference_outputs, run_builds

MODELS = ("mobilenet_v3_large", "efficientnet_b0", "convnext_tiny")
# (label, channels, kernel, stride, input H=W, activation): real depthwise layers at 224x224
LAYERS = [
    ("mobilenet_v3 64ch 3x3/2 @112", 64, 3, 2, 112, "relu"),
    ("mobilenet_v3 72ch 5x5/2 @56", 72, 5, 2, 56, "relu"),
    ("mobilenet_v3 672ch 5x5/2 @14", 672, 5, 2, 14, "hardswish"),
    ("efficientnet_b0 96ch 3x3/2 @112", 96, 3, 2, 112, "silu"),
    ("efficientnet_b0 144ch 5x5/2 @56", 144, 5, 2, 56, "silu"),
    ("convnext_tiny 96ch 7x7 @56", 96, 7, 1, 56, None),
    ("convnext_tiny 384ch 7x7 @14", 384, 7, 1, 14, None),
]
OFF_CONFIG = ROOT / "benchmarks" / "variants" / "no-depthwise-conv.yaml"
HBM_BYTES_PER_S = 4.8e12  # H200
GRAPH_CALLS = 20          # layer runner calls per captured CUDA graph
ON, OFF, TORCH_RO = "amp fp16", "amp fp16 depthwise_conv off", "torch.compile fp16 reduce-overhead"


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help="comma list ('' for none)")
    ap.add_argument("--no-layers", action="store_true", help="skip the per-layer kernels")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--arch", default=None, help="CUDA arch (default: the local GPU's, else "
                    "sm_90)")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: tiny shapes, compile only")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--jobs", type=int, default=6, help="parallel amp builds")
    ap.add_argument("--budget-s", type=float, default=230,
                    help="builds still running then are killed and what is left is skipped, "
                         "so the table and the JSON always appear")
    ap.add_argument("--workdir", default=None, help="keep ONNX files and builds here")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


# ------------------------------------------------------------------------------------ models
def stand_in_model():
    """A small torchvision-free network with what the three models have: inverted residual
    (1x1 + BN + Hardswish, 3x3 depthwise + BN + ReLU, squeeze-excite, 1x1 + BN), a 5x5/2
    depthwise + SiLU, a ConvNeXt block (7x7 depthwise with bias, permute, LayerNorm, MLP with
    GELU, layer scale, residual), pooled classifier."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16),
                                      nn.Hardswish())
            self.expand = nn.Sequential(nn.Conv2d(16, 64, 1, bias=False), nn.BatchNorm2d(64),
                                        nn.Hardswish())
            self.dw = nn.Sequential(nn.Conv2d(64, 64, 3, 1, 1, groups=64, bias=False),
                                    nn.BatchNorm2d(64), nn.ReLU())
            self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(64, 16, 1), nn.ReLU(),
                                    nn.Conv2d(16, 64, 1), nn.Hardsigmoid())
            self.project = nn.Sequential(nn.Conv2d(64, 16, 1, bias=False), nn.BatchNorm2d(16))
            self.down = nn.Sequential(nn.Conv2d(16, 16, 5, 2, 2, groups=16, bias=False),
                                      nn.BatchNorm2d(16), nn.SiLU())
            # ConvNeXt: 7x7 depthwise, channels-last LayerNorm + MLP, layer scale, residual
            self.cnx = nn.Conv2d(16, 16, 7, 1, 3, groups=16)
            self.norm = nn.LayerNorm(16, eps=1e-6)
            self.mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
            self.gamma = nn.Parameter(torch.full((16,), 0.5))
            self.head = nn.Linear(16, 10)

        def forward(self, x):
            x = self.stem(x)
            y = self.dw(self.expand(x))
            x = x + self.project(y * self.se(y))
            x = self.down(x)
            y = self.norm(self.cnx(x).permute(0, 2, 3, 1))
            x = x + (self.gamma * self.mlp(y)).permute(0, 3, 1, 2)
            return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))

    return Block()


def make_model(name: str, size: int, seed: int, dry_run: bool):
    """(nn.Module in eval mode with calibrated BatchNorm, the name it is reported under)."""
    import torch

    torch.manual_seed(seed)
    try:
        import torchvision
        module, label = getattr(torchvision.models, name)(weights=None), name
    except ImportError:
        if not dry_run:
            raise
        module, label = stand_in_model(), f"{name} (stand-in: no torchvision)"
    bns = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for bn in bns:  # random-init running stats let activations blow up or vanish
        bn.reset_running_stats()
        bn.momentum = None  # a cumulative average over the passes
    module.train()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(3 if bns else 0):
            module(torch.randn(4, 3, size, size, generator=gen))
    return module.eval(), label


def export_models(names, batch, size, work: Path, dry_run: bool, result: dict) -> dict:
    import torch

    out = {}
    for i, name in enumerate(names):
        t = time.perf_counter()
        try:
            module, label = make_model(name, size, i, dry_run)
        except ImportError:
            result["notes"].append(f"{name}: torchvision not installed: model skipped")
            continue
        x = np.random.default_rng(i).standard_normal((batch, 3, size, size)).astype("float32")
        path = work / f"{name}.onnx"
        with torch.no_grad():
            torch.onnx.export(module, (torch.from_numpy(x),), str(path), input_names=["input"],
                              dynamo=False)
        out[name] = {"module": module, "label": label, "onnx": path, "feed": {"input": x}}
        if label != name:
            result["notes"].append(f"{name}: {label}")
        log(f"exported {label} in {time.perf_counter() - t:.1f}s")
    return out


# ------------------------------------------------------------------------------------ layers
def layer_module(n, h, c, k, s, act, seed=0):
    """NHWC fp16 depthwise conv (OHWI filter) + fp32 bias + activation, cast to fp16."""
    from amp_cli import tvm_compat

    relax = tvm_compat.relax()
    rng = np.random.default_rng(seed)
    w = (rng.uniform(-1, 1, (c, k, k, 1)) / k).astype("float16")
    bias = rng.uniform(-0.5, 0.5, (c,)).astype("float32")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, h, h, c), "float16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, relax.const(w), strides=s, padding=k // 2,
                                           groups=c, data_layout="NHWC", kernel_layout="OHWI",
                                           out_dtype="float32"))
            y = bb.emit(relax.op.add(y, relax.const(bias)))
            if act == "relu":
                y = bb.emit(relax.op.nn.relu(y))
            elif act == "silu":
                y = bb.emit(relax.op.multiply(y, relax.op.sigmoid(y)))
            elif act == "hardswish":
                six = relax.const(6.0, "float32")
                y = bb.emit(relax.op.multiply(y, relax.op.divide(
                    relax.op.clip(relax.op.add(y, relax.const(3.0, "float32")), 0, 6), six)))
            gv = bb.emit_output(relax.op.astype(y, "float16"))
        bb.emit_func_output(gv)
    return bb.get(), w, bias


def layer_reference(x, w, bias, s, act):
    """float64 NHWC depthwise conv + bias + activation."""
    n, h, _, c = x.shape
    k = w.shape[1]
    p = k // 2
    xp = np.pad(x.astype(np.float64), ((0, 0), (p, p), (p, p), (0, 0)))
    ho = (h + 2 * p - k) // s + 1
    y = np.zeros((n, ho, ho, c))
    for i in range(k):
        for j in range(k):
            y += xp[:, i:i + s * (ho - 1) + 1:s, j:j + s * (ho - 1) + 1:s, :] * w[:, i, j, 0]
    y += bias
    if act == "relu":
        y = np.maximum(y, 0)
    elif act == "silu":
        y = y / (1 + np.exp(-y))
    elif act == "hardswish":
        y = y * np.clip(y + 3, 0, 6) / 6
    return y


def build_layer_kernels(mod, target, on: bool):
    """(the lowered module's conv kernel as a standalone CUDA executable, its name)."""
    from amp_cli import tvm_compat
    from amp_cli.backends.cuda.pipeline import cuda_relax_pipeline
    from amp_cli.backends.cuda.tir import cuda_tir_pipeline

    tvm = tvm_compat.tvm()
    with target:
        lowered = cuda_relax_pipeline(target, cuda_graph=False, depthwise_conv=on)(mod)
    kernels = [(gv.name_hint, f) for gv, f in lowered.functions_items()
               if isinstance(f, tvm_compat.prim_func_class())]
    assert len(kernels) == 1, [k for k, _ in kernels]  # the conv with its epilogue fused
    name, func = kernels[0]
    ex = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                     target=target, tir_pipeline=cuda_tir_pipeline(target, []))
    vm_ex = tvm_compat.compile_relax(lowered, target, relax_pipeline=None,
                                     tir_pipeline=cuda_tir_pipeline(target, []))
    return ex, func, vm_ex, name


def tw_sweep_kernels(mod, target, wo: int) -> dict:
    """{tw: standalone executable} of amp's kernel with each outputs-per-thread choice along W
    (``kernels/depthwise.TW_CHOICES`` dividing Wo), to check ``plan``'s heuristic."""
    from amp_cli import tvm_compat
    from amp_cli.backends.cuda.kernels import depthwise
    from amp_cli.backends.cuda.pipeline import cuda_relax_pipeline
    from amp_cli.backends.cuda.tir import cuda_tir_pipeline
    from amp_cli.hardware import arch_sm

    tvm = tvm_compat.tvm()
    with target:
        fused = cuda_relax_pipeline(target, cuda_graph=False, stop_before_schedule=True)(mod)
    func = next(f for gv, f in fused.functions_items() if "amp_dwconv" in gv.name_hint)
    out = {}
    for tw in depthwise.TW_CHOICES:
        sch = depthwise.schedule_conv(func, arch_sm(target), tw=tw)
        if sch is not None:
            out[tw] = tvm.compile(tvm.IRModule({"main": sch.mod["main"].with_attr(
                "global_symbol", "main")}), target=target,
                tir_pipeline=cuda_tir_pipeline(target, []))
    return out


def time_in_graph(call, warmup: int, repeat: int) -> float:
    """Median seconds per ``call`` with ``GRAPH_CALLS`` calls captured in one CUDA graph (TVM
    kernels join the capture through tvm_ffi's torch stream context)."""
    import torch
    import tvm_ffi

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with tvm_ffi.use_torch_stream(torch.cuda.graph(graph)):
        for _ in range(GRAPH_CALLS):
            call()
    for _ in range(max(1, warmup // GRAPH_CALLS)):
        graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / GRAPH_CALLS)
    return float(np.median(samples))


def torch_layer(c, k, s, act, w, bias):
    import torch
    from torch import nn

    conv = nn.Conv2d(c, c, k, s, k // 2, groups=c, bias=True)
    with torch.no_grad():
        conv.weight.copy_(torch.from_numpy(w.astype("float32")).permute(0, 3, 1, 2))
        conv.bias.copy_(torch.from_numpy(bias))
    acts = {"relu": nn.ReLU(), "silu": nn.SiLU(), "hardswish": nn.Hardswish(), None: nn.Identity()}
    return nn.Sequential(conv, acts[act]).eval().half().cuda().to(memory_format=torch.channels_last)


def bench_layers(args, target, gpu: bool, result: dict) -> None:
    from amp_cli import tvm_compat

    tvm = tvm_compat.tvm()
    n = 1 if args.dry_run else args.batch
    for label, c, k, s, h, act in LAYERS:
        h = max(7, h // 4) if args.dry_run else h
        row = {"layer": label, "shape": [n, h, h, c], "kernel": k, "stride": s, "act": act}
        ho = (h + 2 * (k // 2) - k) // s + 1
        row["bytes"] = 2 * n * c * (h * h + ho * ho) + 2 * c * k * k
        row["floor_us"] = row["bytes"] / HBM_BYTES_PER_S * 1e6
        mod, w, bias = layer_module(n, h, c, k, s, act)
        x = np.random.default_rng(1).uniform(-1, 1, (n, h, h, c)).astype("float16")
        ref = layer_reference(x, w, bias, s, act)
        runners = {}
        for on, key in ((True, "amp"), (False, "amp_off")):
            t = time.perf_counter()
            try:
                ex, func, vm_ex, name = build_layer_kernels(mod, target, on)
            except Exception as exc:  # noqa: BLE001 - recorded in the row
                row[f"{key}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                continue
            row[f"{key}_kernel"], row[f"{key}_build_s"] = name, time.perf_counter() - t
            if gpu:
                dev = tvm.cuda(0)
                vm = tvm_compat.relax_vm(vm_ex, dev)
                got = vm["main"](tvm.runtime.tensor(x, dev)).numpy().astype(np.float64)
                row[f"{key}_max_rel_err"] = float(np.abs(got - ref).max() / np.abs(ref).max())
                rng = np.random.default_rng(2)
                kargs = [tvm.runtime.tensor(rng.uniform(-1, 1, [int(d) for d in p.shape])
                                            .astype(str(p.dtype)), dev) for p in func.params]
                runners[key] = (lambda f=ex["main"], a=kargs: f(*a))
            if on:
                from amp_cli.backends.cuda.kernels import depthwise
                from amp_cli.hardware import arch_sm

                row["amp_plan"] = vars(depthwise.plan(n, ho, ho, c, 1, "float16",
                                                      arch_sm(target)))
                try:
                    for tw, tw_ex in tw_sweep_kernels(mod, target, ho).items():
                        if gpu:
                            runners[f"amp_tw{tw}"] = (lambda f=tw_ex["main"], a=kargs: f(*a))
                        row.setdefault("tw_built", []).append(tw)
                except Exception as exc:  # noqa: BLE001
                    row["tw_sweep_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        if gpu:
            import torch

            torch.backends.cudnn.benchmark = True
            xt = torch.from_numpy(x).cuda().permute(0, 3, 1, 2)  # NCHW view of NHWC memory
            for key in ("torch_eager",):
                try:
                    fn = torch_layer(c, k, s, act, w, bias)
                    with torch.inference_mode():
                        fn(xt)
                    runners[key] = (lambda f=fn, a=xt: f(a))
                except Exception as exc:  # noqa: BLE001
                    row[f"{key}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            for key, call in runners.items():
                try:
                    with torch.inference_mode():
                        row[f"{key}_us"] = time_in_graph(call, args.warmup, args.repeat) * 1e6
                except Exception as exc:  # noqa: BLE001
                    row[f"{key}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        result["layers"].append(row)
        log(f"layer {label}: kernels {row.get('amp_kernel')} / {row.get('amp_off_kernel')}; "
            + ", ".join(f"{k} {row[k]:.2f}" for k in row
                        if k.endswith("_us") and k != "floor_us"))


# ------------------------------------------------------------------------------------ driver
def main(argv=None) -> int:
    args = parse_args(argv)
    from amp_cli import tvm_compat
    from amp_cli.accuracy import compare_outputs
    from amp_cli.bench import BenchConfig, LatencyStats, RunnerResult
    from amp_cli.bench.runners import bench_library
    from amp_cli.bench.timing import time_cuda, torch_callable, torch_outputs
    from amp_cli.report import versions, write_json

    t0 = time.perf_counter()
    deadline = t0 + args.budget_s
    gpu = tvm_compat.has_cuda_device() and not args.dry_run
    if not gpu and not args.dry_run:
        print("depthwise_bench: no CUDA GPU visible to TVM; use --dry-run", file=sys.stderr)
        return 1
    arch = args.arch or ("sm_" + tvm_compat.cuda_compute_version().replace(".", "")
                         if gpu else "sm_90")
    out_env = os.environ.get("OUT")
    json_path = Path(args.json or (Path(out_env) / "depthwise_bench.json" if out_env
                                   else "depthwise_bench.json"))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="amp-dw-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    batch, size = (1, 64) if args.dry_run else (args.batch, 224)
    cfg = BenchConfig(warmup=args.warmup, repeat=args.repeat, number=1)
    result = {"bench": "depthwise", "arch": arch, "dry_run": args.dry_run, "args": vars(args),
              "versions": versions(), "machine": machine_info(), "layers": [], "models": {},
              "builds": [], "notes": []}
    tvm = tvm_compat.tvm()
    target = tvm.target.Target({"kind": "cuda", "arch": arch})

    # 1-2. models and their builds, in the background
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    models = export_models(names, batch, size, work, args.dry_run, result) if names else {}
    jobs = []
    for name, m in models.items():
        for label, flags in ((ON, ()), (OFF, ("--config", str(OFF_CONFIG)))):
            jobs.append({"model": name, "label": label, "name": f"{name} {label}",
                         "onnx": m["onnx"], "target": f"cuda:{arch}", "precision": "fp16",
                         "tuning_db": None, "flags": list(flags),
                         "outdir": work / f"{name}-{'on' if label == ON else 'off'}"})
    import threading

    builder = threading.Thread(target=run_builds, args=(jobs, args.jobs, deadline), daemon=True)
    builder.start()

    # 3. references and layers while amp compiles
    for name, m in models.items():
        m["ref"] = reference_outputs(m["onnx"], m["feed"])
    if not args.no_layers:
        bench_layers(args, target, gpu, result)

    # 4. torch runners of the models
    for name, m in models.items():
        m["torch"] = {}
        modes = ([("torch eager fp16", None), (TORCH_RO, "reduce-overhead")] if gpu
                 else [("torch eager fp32 (cpu, dry run)", None)])
        for label, mode in modes:
            entry = {}
            t = time.perf_counter()
            try:
                if time.perf_counter() > deadline:
                    raise TimeoutError("over --budget-s")
                call = torch_callable(m["module"], [m["feed"]["input"]],
                                      "float16" if gpu else "float32",
                                      "cuda" if gpu else "cpu", mode)
                entry["outputs"] = torch_outputs(call())
                for _ in range(3 if mode else 0):  # reduce-overhead records its graph here
                    call()
                entry["call"] = call
            except Exception as exc:  # noqa: BLE001
                entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            entry["compile_s"] = time.perf_counter() - t
            m["torch"][label] = entry
            log(f"torch {name} {label}: ready in {entry['compile_s']:.1f}s")

    # 5. timing
    builder.join()
    for j in jobs:  # what each build did with the grouped convs (its report)
        rep = j["outdir"] / "report.json"
        if j.get("rc") == 0 and rep.is_file():
            b = json.loads(rep.read_text())["build"]
            j["grouped_convs"] = (b.get("graph_rewrites") or {}).get("grouped_convs", 0)
            j["rule_failures"] = b.get("rule_failures") or []
    result["builds"] = [{k: (str(v) if isinstance(v, Path) else v) for k, v in j.items()
                         if k not in ("proc", "log", "onnx", "cmd")} for j in jobs]
    for name, m in models.items():
        runners = []
        for j in [j for j in jobs if j["model"] == name]:
            r = RunnerResult(j["label"], "amp", "cuda", "float16")
            r.build_seconds = j.get("build_s")
            if j.get("rc") != 0:
                r.error = j.get("status")
            elif not gpu:
                r.skipped = "dry run: built, not timed"
            else:
                try:
                    r = bench_library(j["label"], "amp", str(j["outdir"] / "model.so"), "cuda",
                                      "float16", m["feed"], ["input"], batch, cfg, m["ref"], None)
                    r.build_seconds = j.get("build_s")
                except Exception as exc:  # noqa: BLE001
                    r.error = f"{type(exc).__name__}: {exc}"[:300]
            runners.append(r)
        for label, entry in m["torch"].items():
            r = RunnerResult(label, "torch", "cuda" if gpu else "cpu",
                             "float16" if gpu else "float32", timer="CUDA events")
            r.build_seconds = entry.get("compile_s")
            if entry.get("error"):
                r.error = entry["error"]
            else:
                r.accuracy = compare_outputs(m["ref"], entry["outputs"], None)
                if gpu:
                    r.latency = LatencyStats.from_seconds(time_cuda(entry["call"], cfg), batch, 1)
                else:
                    r.skipped = "dry run: not timed"
            runners.append(r)
        result["models"][name] = {"label": m["label"], "input": [batch, 3, size, size],
                                  "runners": [r.to_dict() for r in runners]}
        m.pop("torch", None)
    result["wall_s"] = time.perf_counter() - t0
    json_path.parent.mkdir(parents=True, exist_ok=True)
    write_json(json_path, result)
    print(render(result))
    print(f"wrote {json_path}")
    return 0


def _f(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def render(result: dict) -> str:
    dry = " (dry run: nothing timed)" if result["dry_run"] else ""
    title = (f"depthwise A/B: {result['arch']}{dry}, {result['machine'].get('nvidia_smi')}, "
             f"wall {result['wall_s']:.0f}s")
    lines = [title]
    if result["layers"]:
        head = (f"{'layer (NHWC fp16, bias+act fused)':<34} {'floor us':>8} {'amp us':>8} "
                f"{'off us':>8} {'cudnn us':>8} {'amp GB/s':>8} {'amp/off':>7} {'amp/cudnn':>9} "
                f"{'amp err':>8}  amp us at tw=4/2/1")
        lines += ["", head, "-" * len(head)]
        for r in result["layers"]:
            amp, off, cudnn = r.get("amp_us"), r.get("amp_off_us"), r.get("torch_eager_us")
            lines.append(
                f"{r['layer']:<34} {r['floor_us']:8.2f} {_f(amp):>8} {_f(off):>8} "
                f"{_f(cudnn):>8} {_f(r['bytes'] / amp / 1e3 if amp else None, '.0f'):>8} "
                f"{_f(amp / off if amp and off else None):>7} "
                f"{_f(amp / cudnn if amp and cudnn else None):>9} "
                f"{_f(r.get('amp_max_rel_err'), '.1e'):>8}  "
                + "/".join(_f(r.get(f"amp_tw{t}_us")) for t in (4, 2, 1))
                + f" (plan tw={(r.get('amp_plan') or {}).get('tw')})"
                + "".join(f"  [{k}: {v}]" for k, v in r.items() if k.endswith("_error")))
        lines.append("floor: input + output bytes at 4.8 TB/s; each runner timed as 20 calls in "
                     "one CUDA graph; off = TOPI + dlight (switch off); cudnn = torch fp16 eager "
                     "channels-last (conv + bias in cuDNN, the activation a second kernel)")
    if result["builds"]:
        lines += ["", "builds: " + "; ".join(
            f"{b['name']} {_f(b.get('build_s'), '.0f')}s"
            + (f", {b['grouped_convs']} grouped convs rewritten" if b.get("grouped_convs") else "")
            + (f", {len(b['rule_failures'])} rule failures" if b.get("rule_failures") else "")
            + ("" if b.get("rc") == 0 else f" [{b.get('status', 'not run')}]")
            for b in result["builds"])]
    if result["models"]:
        head = (f"{'model':<20} {'runner':<36} {'p50 ms':>8} {'rel L2':>9} {'build s':>8} "
                f"{'vs tc-ro':>8}")
        lines += ["", head, "-" * len(head)]
        for name, m in result["models"].items():
            rs = m["runners"]
            tc = next((r for r in rs if r["name"] == TORCH_RO and r.get("latency")), None)
            for r in rs:
                lat, acc = r.get("latency"), r.get("accuracy") or {}
                if not lat:
                    lines.append(f"{name:<20} {r['name']:<36} {r.get('error') or r.get('skipped')}"
                                 + (f" (rel L2 {acc['rel_l2']:.2e})" if acc.get("rel_l2")
                                    is not None else ""))
                    continue
                ratio = lat["p50_ms"] / tc["latency"]["p50_ms"] if tc else None
                lines.append(f"{name:<20} {r['name']:<36} {lat['p50_ms']:8.3f} "
                             f"{_f(acc.get('rel_l2'), '.2e'):>9} "
                             f"{_f(r.get('build_seconds'), '.0f'):>8} {_f(ratio):>8}")
    for n in result["notes"]:
        lines.append(f"note: {n}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
