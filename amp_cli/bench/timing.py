"""Timing helpers: the host clock, CUDA events, torch runners, and a per-kernel profile of a
Relax VM library."""
from __future__ import annotations

import copy
import time

import numpy as np

from .. import tvm_compat
from ..accuracy import LibraryRunner, compare_outputs
from .results import BenchConfig, LatencyStats


def host_timed(fn, cfg: BenchConfig) -> list[float]:
    for _ in range(cfg.warmup):
        fn()
    samples = []
    for _ in range(cfg.repeat):
        t0 = time.perf_counter()
        for _ in range(cfg.number):
            fn()
        samples.append((time.perf_counter() - t0) / cfg.number)
    return samples


def torch_callable(module, arrays, dtype: str = "float32", device: str = "cpu",
                   compile_mode: str | None = None):
    """A no-argument callable running a copy of ``module`` in ``dtype`` on ``device`` (eager, or
    ``torch.compile(mode=compile_mode)``) on ``arrays``; the first call compiles."""
    import torch

    tdt = getattr(torch, dtype)
    mod = copy.deepcopy(module).eval().to(device=device, dtype=tdt)
    xs = [torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays]
    xs = [x.to(tdt) if x.is_floating_point() else x for x in xs]
    fn = torch.compile(mod, mode=compile_mode) if compile_mode else mod

    def call():
        with torch.inference_mode():
            return fn(*xs)

    return call


def torch_outputs(out) -> list[np.ndarray]:
    outs = out if isinstance(out, (tuple, list)) else [out]
    return [o.detach().float().cpu().numpy() for o in outs]


def time_cuda(call, cfg: BenchConfig) -> list[float]:
    """Per-sample seconds of ``call`` measured with CUDA events (torch) after warm-up."""
    import torch

    for _ in range(cfg.warmup):
        call()
    torch.cuda.synchronize()
    samples = []
    for _ in range(cfg.repeat):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(cfg.number):
            call()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / cfg.number)
    return samples


def time_torch(module, arrays, cfg: BenchConfig, batch: int, dtype: str = "float32",
               device: str = "cpu", compile_mode: str | None = None, reference=None,
               model=None):
    """Time a torch module: CUDA events per call on a GPU, the host clock on the CPU.

    Returns (LatencyStats, accuracy dict or None, timer description). ``compile_mode`` None is
    eager; otherwise the ``torch.compile`` mode ("default", "reduce-overhead", ...).
    """
    call = torch_callable(module, arrays, dtype, device, compile_mode)
    acc = compare_outputs(reference, torch_outputs(call()), model)
    if device == "cuda":
        samples, timer = time_cuda(call, cfg), "CUDA events"
    else:
        samples, timer = host_timed(call, cfg), "host clock"
    return LatencyStats.from_seconds(samples, batch, cfg.number), acc, timer


def tensor_bytes(value) -> int:
    """Bytes of a runtime tensor argument (0 for shapes, scalars and the like)."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return 0
    try:
        bits = tvm_compat.dtype_bits(str(dtype))
    except (TypeError, ValueError):
        return 0
    return int(np.prod([int(d) for d in shape], dtype=np.int64)) * bits // 8


def profile_library(library: str, device: str, feeds: dict, order: list[str],
                    top: int = 20) -> list[dict]:
    """Per-kernel time of one call of a Relax VM library: the ``top`` kernels by total time, as
    {name, ms, count, percent, bytes, gbps}. A VM instrument synchronizes the device around
    every call, so each kernel's time includes its launch (a few us): use it for where the time
    goes, not for the end-to-end latency. ``bytes``: what one call of the kernel reads and
    writes at least (its tensor arguments, inputs and outputs, once each); ``gbps``: that over
    the measured time (a lower bound of the kernel's bandwidth, as the time includes the
    launch), to set against the GPU's peak."""
    runner = LibraryRunner(library, device)
    vm, dev = runner.vm, runner.device
    args = [tvm_compat.to_tvm_tensor(feeds[n], dev) for n in order]
    vm["main"](*args)  # warm-up: allocations, module loading
    per: dict[str, list] = {}
    started: list[float] = []

    def instrument(_func, symbol, before_run, _ret, *args):
        dev.sync()
        if before_run:
            started.append(time.perf_counter())
        else:
            acc = per.setdefault(str(symbol), [0.0, 0, 0])
            acc[0] += time.perf_counter() - started.pop()
            acc[1] += 1
            acc[2] += sum(tensor_bytes(a) for a in args)
        return 0  # VMInstrumentReturnKind.NO_OP

    vm.set_instrument(instrument)
    vm["main"](*args)
    vm.set_instrument(None)
    # builtins (vm.builtin.*) nest around nothing we can act on; kernels are what matters
    per = {k: v for k, v in per.items() if not k.startswith("vm.builtin.")} or per
    total = sum(v[0] for v in per.values()) or 1.0
    rows = sorted(per.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"name": k, "ms": v[0] * 1e3, "count": v[1], "percent": 100 * v[0] / total,
             "bytes": v[2] // max(v[1], 1), "gbps": v[2] / v[0] / 1e9 if v[0] > 0 else None}
            for k, v in rows]
