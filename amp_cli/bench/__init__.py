"""The bench stage: latency and accuracy of an amp build against fp32 and peer runtimes.

``bench()`` takes an OUTDIR written by ``amp convert`` (model.so + report.json), a model (path,
``pkg.mod:factory`` spec or :class:`~amp_cli.frontend.LoadedModel`, converted first) or a
:class:`~amp_cli.convert.Conversion`, times the amp build with TVM's own timer after warm-up,
optionally times the peers named in ``BenchConfig.compare`` on the same inputs, measures every
runner's outputs against the fp32 reference, and returns a :class:`BenchResult`.

>>> import amp_cli
>>> from amp_cli.bench import BenchConfig, bench
>>> res = bench("out/tiny", BenchConfig(repeat=50, compare=["fp32", "ort"]))  # doctest: +SKIP
>>> res.primary.latency.p50_ms                                               # doctest: +SKIP
0.41
>>> res.write_json("bench.json"); res.check_gates()                          # doctest: +SKIP

Timing. TVM builds: ``VirtualMachine.time_evaluator`` on a saved closure (inputs bound once, so
no host->device copies are timed); TVM times with the device's timer (CUDA events on a GPU) and
synchronizes. Each sample is the mean of ``number`` calls; with the default ``number=1`` every
sample is one call, so the percentiles are per-call percentiles. ONNX Runtime: host wall clock
around ``session.run`` (which returns host arrays, so it includes the output copy). PyTorch on a
GPU: CUDA events around each call; on the CPU: host wall clock.

JSON (``BenchResult.to_dict()``, ``schema_version`` 1; keys are only ever added)::

    schema_version  1
    created         ISO-8601 UTC time
    source          the OUTDIR or model benched
    model           the model summary (as in report.json: inputs, outputs, nodes ...)
    target          the resolved TVM target dict of the amp build
    device          "cpu" | "cuda" (where the amp build ran)
    bench           the BenchConfig (warmup, repeat, number, compare, inputs, seed, gates)
    convert_config  the ConvertConfig of the amp build
    inputs          {"source": "random (seed N)" | "<path>.npz", "tensors": [{name, shape,
                    dtype}], "batch": int}
    reference       what produced the fp32 reference outputs
    runners         [{name, kind, device, precision, timer, latency, accuracy, build_seconds,
                      skipped, error, notes}]; runners[0] is the amp build.
                    latency: {mean_ms, std_ms, min_ms, max_ms, p50_ms, p90_ms, p99_ms,
                      samples, number, batch, throughput_per_s} (throughput = batch / mean)
                    accuracy: {max_abs, rel_l2, cosine, nonfinite_share, outputs: [per
                      output, same keys + "output"]} vs the fp32 reference
                    skipped / error: a reason (string) when the runner did not run, else null
    gates           [{name, threshold, value, passed, reason}]
    passed          true unless a gate failed
    versions        amp, TVM, onnxruntime, torch ... versions
    notes           strings
"""
from __future__ import annotations

import copy
import datetime as _dt
from pathlib import Path
from typing import Any, Callable

from ..errors import InputError
from ..config import ConvertConfig
from ..convert import Conversion
from ..frontend import LoadedModel, load
from ..hardware import set_num_threads
from ..report import clean_json, versions
from .render import format_table, require_matplotlib, write_plot
from .results import (COMPARE_CHOICES, BenchConfig, BenchResult, GateResult, LatencyStats,
                      RunnerResult, evaluate_gates)
from .runners import bench_amp_fp32, bench_library, bench_ort, bench_torch
from .subject import (Subject, batch_of, check_runnable_target, convert_for_bench, is_outdir,
                      load_feeds)

__all__ = ["COMPARE_CHOICES", "BenchConfig", "BenchResult", "GateResult", "LatencyStats",
           "RunnerResult", "bench", "format_table", "require_matplotlib", "write_plot"]
Progress = Callable[[str], None]


def bench(target_or_model: Any, cfg: BenchConfig | None = None,
          convert_config: ConvertConfig | None = None,
          progress: Progress | None = None) -> BenchResult:
    """Bench an OUTDIR, a model (converted first with ``convert_config``) or a Conversion.

    Raises AmpError subclasses for unusable input (bad .npz, CUDA library without a GPU ...).
    Gates are evaluated into ``result.gates``; call ``result.check_gates()`` to raise.
    """
    cfg = copy.deepcopy(cfg or BenchConfig())
    cfg.validate()
    step = progress or (lambda _s: None)
    notes: list[str] = []
    if cfg.max_latency_ratio is not None and "fp32" not in cfg.compare:
        cfg.compare = ["fp32"] + list(cfg.compare)
        notes.append("--max-latency-ratio needs amp's fp32 build: added fp32 to --compare")
    if cfg.threads:
        set_num_threads(cfg.threads)

    owned = None  # a Conversion made here, cleaned up at the end
    if isinstance(target_or_model, Conversion):
        subject = Subject.from_conversion(target_or_model)
    elif is_outdir(target_or_model):
        subject = Subject.from_outdir(Path(target_or_model), step)
    else:
        ccfg = convert_config or ConvertConfig()
        check_runnable_target(ccfg.target)
        loaded = target_or_model
        if not isinstance(loaded, LoadedModel):
            step("load")
            loaded = load(loaded, input_shapes=ccfg.input_shapes, simplify=ccfg.simplify,
                          dims=ccfg.dynamic.dims)
        if cfg.inputs and not loaded.dynamic:
            load_feeds(cfg, loaded.inputs)  # a bad .npz fails before anything compiles
        owned = convert_for_bench(loaded, ccfg, cfg, step)
        subject = Subject.from_conversion(owned)
    try:
        return run_bench(subject, cfg, notes, step)
    finally:
        if owned is not None:
            owned.cleanup()


def run_bench(subject: Subject, cfg: BenchConfig, notes: list[str], step) -> BenchResult:
    notes = list(notes) + list(subject.notes)
    specs = subject.timed_specs(cfg)  # a dynamic build: the shape to time
    if subject.dynamic:
        notes.append("dynamic dims: timed at " + ", ".join(
            f"{s.name} {'x'.join(map(str, s.shape))}" for s in specs))
    feeds = load_feeds(cfg, specs)
    order = [s.name for s in specs]
    batch = batch_of(specs)
    device = "cuda" if subject.target.get("kind") == "cuda" else "cpu"
    model = subject.model

    reference, ref_name = None, "none (model source not available)"
    if model is not None:
        step("fp32 reference")
        reference = model.reference(feeds)
        ref_name = ("ONNX Runtime fp32 (CPU)" if model.format == "onnx"
                    else "PyTorch fp32 eager (CPU)")
    if cfg.max_rel_error is not None and reference is None:
        raise InputError(f"--max-rel-error needs the fp32 reference, but the model source of "
                         f"{subject.source} was not found")

    dt = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
    step(f"time amp {subject.precision}")
    amp = bench_library(f"amp {subject.precision}", "amp", subject.library, device,
                         dt.get(subject.precision, subject.precision), feeds, order, batch, cfg,
                         reference, model)
    amp.build_seconds = subject.build_seconds
    runners = [amp]

    for name in cfg.compare:
        if name == "fp32":
            runners.append(bench_amp_fp32(subject, device, feeds, order, batch, cfg, reference,
                                           step))
        elif name == "ort":
            runners.extend(bench_ort(model, device, feeds, batch, cfg, reference, step))
        elif name == "torch":
            runners.extend(bench_torch(model, device, feeds, order, batch, cfg, reference, step))

    result = BenchResult(
        source=subject.source, model=subject.model_summary, target=subject.target, device=device,
        config=cfg, convert_config=clean_json(subject.convert_config.to_dict()),
        inputs={"source": cfg.inputs or f"random (seed {cfg.seed})",
                "tensors": [s.to_dict() for s in specs], "batch": batch},
        reference=ref_name, runners=runners, notes=notes, versions=versions(),
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    result.gates = evaluate_gates(result)
    return result
