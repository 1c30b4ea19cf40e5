"""The runners ``amp bench`` times on the same inputs: the amp build itself, amp's fp32 build,
ONNX Runtime, PyTorch (eager and torch.compile); each measured against the fp32 reference."""
from __future__ import annotations

import numpy as np

from .. import tvm_compat
from ..accuracy import LibraryRunner, compare_outputs, flatten_outputs
from ..errors import AmpError
from ..frontend.ort_session import inference_session
from .results import LatencyStats, RunnerResult
from .subject import convert_for_bench
from .timing import host_timed, time_torch


def bench_library(name, kind, library, device, precision, feeds, order, batch, cfg, reference,
                   model) -> RunnerResult:
    """Time a Relax VM library with TVM's time_evaluator (device timer) after warm-up."""
    res = RunnerResult(name, kind, device, precision,
                       timer="tvm time_evaluator (" + ("CUDA events" if device == "cuda"
                                                       else "host clock") + ")")
    runner = LibraryRunner(library, device)
    vm, dev = runner.vm, runner.device
    args = [tvm_compat.to_tvm_tensor(feeds[n], dev) for n in order]
    outputs = [np.asarray(o.numpy()) for o in flatten_outputs(vm["main"](*args))]
    res.accuracy = compare_outputs(reference, outputs, model)
    saved = "amp_bench_main"
    vm.save_function("main", saved, *args)
    if cfg.warmup:
        vm.time_evaluator(saved, dev, number=cfg.warmup, repeat=1)()
    timed = vm.time_evaluator(saved, dev, number=cfg.number, repeat=cfg.repeat)()
    res.latency = LatencyStats.from_seconds(timed.results, batch, cfg.number)
    return res


def bench_amp_fp32(subject, device, feeds, order, batch, cfg, reference, step) -> RunnerResult:
    if subject.model is None:
        return RunnerResult("amp fp32", "amp-fp32", device, "float32",
                            skipped="model source not found: cannot build amp fp32")
    if subject.precision == "fp32":  # the benched build is amp's fp32 build: time it again
        step("time amp fp32")
        res = bench_library("amp fp32", "amp-fp32", subject.library, device, "float32", feeds,
                             order, batch, cfg, reference, subject.model)
        res.notes.append("the benched build is fp32 itself: timed the same library again")
        return res
    try:
        conv = convert_for_bench(subject.model, subject.convert_config, cfg, step,
                                  precision="fp32")
    except AmpError as exc:
        return RunnerResult("amp fp32", "amp-fp32", device, "float32", error=str(exc))
    try:
        step("time amp fp32")
        res = bench_library("amp fp32", "amp-fp32", conv.library, device, "float32", feeds,
                             order, batch, cfg, reference, subject.model)
        res.build_seconds = conv.build.seconds
        return res
    finally:
        conv.cleanup()


def bench_ort(model, device, feeds, batch, cfg, reference, step) -> list[RunnerResult]:
    if model is None or model.format != "onnx" or model.onnx_model is None:
        why = "model source not found" if model is None else \
            "ONNX Runtime runs ONNX models; this is a torch model"
        return [RunnerResult("onnxruntime", "ort", "cpu", "float32", skipped=why)]
    try:
        import onnxruntime as ort
    except ImportError:
        return [RunnerResult("onnxruntime", "ort", "cpu", "float32",
                             skipped="onnxruntime is not installed")]
    providers = [("cpu", "CPUExecutionProvider")]
    if device == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, ("cuda", "CUDAExecutionProvider"))
    blob = model.onnx_model.SerializeToString()
    out = []
    for dev, provider in providers:
        name = f"onnxruntime {dev}"
        step(f"time {name}")
        res = RunnerResult(name, "ort", dev, "float32",
                           timer="host clock around session.run (includes output copy)")
        try:
            opts = ort.SessionOptions()
            opts.log_severity_level = 3
            if cfg.threads:
                opts.intra_op_num_threads = cfg.threads
            sess = inference_session(blob, opts, providers=[provider])
            got = sess.run(None, feeds)
            res.accuracy = compare_outputs(reference, got, model)
            res.latency = LatencyStats.from_seconds(
                host_timed(lambda: sess.run(None, feeds), cfg), batch, cfg.number)
        except Exception as exc:  # noqa: BLE001 - a peer failing must not end the bench
            res.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
        out.append(res)
    return out


def bench_torch(model, device, feeds, order, batch, cfg, reference, step) -> list[RunnerResult]:
    if model is None or model.format != "torch" or model.torch_module is None:
        why = "model source not found" if model is None else \
            "no PyTorch module for an ONNX model (bench a torch model: .pt2 or pkg.mod:factory)"
        return [RunnerResult("torch", "torch", device, "float32", skipped=why)]
    try:
        import torch
    except ImportError:
        return [RunnerResult("torch", "torch", device, "float32",
                             skipped="torch is not installed")]
    gpu = device == "cuda" and torch.cuda.is_available()
    modes = [("eager", "float32")]
    if gpu:
        modes += [("eager", "float16"), ("compile", "float16")]
    out = []
    for mode, dtype in modes:
        name = f"torch {mode} {'fp16' if dtype == 'float16' else 'fp32'}"
        step(f"time {name}")
        res = RunnerResult(name, "torch", "cuda" if gpu else "cpu", dtype)
        try:
            res.latency, res.accuracy, res.timer = time_torch(
                model.torch_module, [feeds[n] for n in order], cfg, batch, dtype=dtype,
                device="cuda" if gpu else "cpu", compile_mode="default" if mode == "compile"
                else None, reference=reference, model=model)
        except Exception as exc:  # noqa: BLE001 - a peer failing must not end the bench
            res.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
        out.append(res)
    return out
