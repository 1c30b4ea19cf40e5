"""The bench stage: latency and accuracy of an amp build against fp32 and peer runtimes.

``bench()`` takes an OUTDIR written by ``amp convert`` (model.so + report.json), a model (path,
``pkg.mod:factory`` spec or :class:`~amp_cli.load.LoadedModel`, converted first) or a
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
import dataclasses
import datetime as _dt
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .config import ConvertConfig, apply_yaml
from .errors import AmpError, ConfigError, GateError, InputError, TargetError

SCHEMA_VERSION = 1
COMPARE_CHOICES = ("fp32", "ort", "torch")
Progress = Callable[[str], None]


@dataclass
class BenchConfig:
    """Settings of one bench run (defaults live here once)."""

    warmup: int = 10  # untimed calls before timing
    repeat: int = 50  # timed samples
    number: int = 1  # calls per sample (a sample is their mean)
    compare: list[str] = field(default_factory=list)  # subset of COMPARE_CHOICES
    inputs: str | None = None  # .npz with the model's inputs; default: seeded random inputs
    seed: int = 0
    max_latency_ratio: float | None = None  # gate: amp p50 / amp fp32 p50
    max_rel_error: float | None = None  # gate: amp worst rel L2 vs the fp32 reference
    threads: int | None = None  # CPU threads (TVM and ONNX Runtime)

    def validate(self) -> None:
        for name in ("warmup", "repeat", "number"):
            v = getattr(self, name)
            low = 0 if name == "warmup" else 1
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ConfigError(f"--{name} must be an integer >= {low}, got {v!r}")
        bad = [c for c in self.compare if c not in COMPARE_CHOICES]
        if bad:
            raise ConfigError(f"--compare: unknown runner(s) {', '.join(bad)}; choose from "
                              f"{', '.join(COMPARE_CHOICES)}")
        for name in ("max_latency_ratio", "max_rel_error"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive number, got "
                                  f"{v!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class LatencyStats:
    """Latency statistics over timed samples (milliseconds) and throughput."""

    mean_ms: float
    std_ms: float
    min_ms: float
    max_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    samples: int
    number: int  # calls averaged into each sample
    batch: int
    throughput_per_s: float  # batch / mean latency

    @classmethod
    def from_seconds(cls, seconds, batch: int, number: int = 1) -> "LatencyStats":
        ms = np.asarray(list(seconds), dtype=np.float64) * 1e3
        if ms.size == 0:
            raise ValueError("no timing samples")
        mean = float(ms.mean())
        return cls(mean_ms=mean, std_ms=float(ms.std()), min_ms=float(ms.min()),
                   max_ms=float(ms.max()), p50_ms=float(np.percentile(ms, 50)),
                   p90_ms=float(np.percentile(ms, 90)), p99_ms=float(np.percentile(ms, 99)),
                   samples=int(ms.size), number=int(number), batch=int(batch),
                   throughput_per_s=batch / (mean / 1e3) if mean > 0 else float("inf"))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class RunnerResult:
    """One runner (the amp build, amp fp32, ONNX Runtime, a PyTorch mode) on the bench inputs."""

    name: str  # "amp fp16", "amp fp32", "onnxruntime cpu", "torch eager fp32" ...
    kind: str  # "amp" | "amp-fp32" | "ort" | "torch"
    device: str
    precision: str
    timer: str = ""
    latency: LatencyStats | None = None
    accuracy: dict | None = None  # worst-case metrics + per output
    build_seconds: float | None = None
    skipped: str | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.latency is not None and not self.skipped and not self.error

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["latency"] = self.latency.to_dict() if self.latency else None
        return d


@dataclass
class GateResult:
    name: str  # "max_latency_ratio" | "max_rel_error"
    threshold: float
    value: float | None
    passed: bool
    reason: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class BenchResult:
    """Everything one bench run measured; ``to_dict()`` is the documented JSON schema."""

    source: str
    model: dict
    target: dict
    device: str
    config: BenchConfig
    convert_config: dict
    inputs: dict
    reference: str
    runners: list[RunnerResult]
    gates: list[GateResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    versions: dict = field(default_factory=dict)
    created: str = ""

    @property
    def primary(self) -> RunnerResult:
        """The amp build being benched."""
        return self.runners[0]

    def runner(self, kind: str) -> RunnerResult | None:
        return next((r for r in self.runners if r.kind == kind), None)

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.gates)

    def to_dict(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, "created": self.created,
                "source": self.source, "model": self.model, "target": self.target,
                "device": self.device, "bench": self.config.to_dict(),
                "convert_config": self.convert_config, "inputs": self.inputs,
                "reference": self.reference, "runners": [r.to_dict() for r in self.runners],
                "gates": [g.to_dict() for g in self.gates], "passed": self.passed,
                "versions": self.versions, "notes": list(self.notes)}

    def write_json(self, path: str | Path) -> Path:
        """Write the JSON atomically (a temp file renamed into place)."""
        from .report import write_json

        out = Path(path)
        if out.parent and not out.parent.exists():
            try:
                out.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise InputError(f"cannot create {out.parent}: {exc.strerror}") from None
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        try:
            write_json(tmp, self.to_dict())
            os.replace(tmp, out)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise InputError(f"cannot write {out}: {exc.strerror}") from None
        return out

    def check_gates(self) -> None:
        """Raise GateError (exit code 3) with a one-line reason when a gate failed; AmpError
        (exit code 1) when a gate could not be evaluated (e.g. the fp32 build failed)."""
        unknown = [g for g in self.gates if g.value is None]
        if unknown:  # a gate that could not be evaluated is a setup problem, not a regression
            raise AmpError("; ".join(g.reason for g in unknown))
        failed = [g for g in self.gates if not g.passed]
        if failed:
            raise GateError("; ".join(g.reason for g in failed))


# ---------------------------------------------------------------------------------------------
# The bench call


def bench(target_or_model: Any, cfg: BenchConfig | None = None,
          convert_config: ConvertConfig | None = None,
          progress: Progress | None = None) -> BenchResult:
    """Bench an OUTDIR, a model (converted first with ``convert_config``) or a Conversion.

    Raises AmpError subclasses for unusable input (bad .npz, CUDA library without a GPU ...).
    Gates are evaluated into ``result.gates``; call ``result.check_gates()`` to raise.
    """
    from .convert import Conversion
    from .load import LoadedModel

    cfg = copy.deepcopy(cfg or BenchConfig())
    cfg.validate()
    step = progress or (lambda _s: None)
    notes: list[str] = []
    if cfg.max_latency_ratio is not None and "fp32" not in cfg.compare:
        cfg.compare = ["fp32"] + list(cfg.compare)
        notes.append("--max-latency-ratio needs amp's fp32 build: added fp32 to --compare")
    if cfg.threads:
        from .schedule.cpu import set_num_threads

        set_num_threads(cfg.threads)

    owned = None  # a Conversion made here, cleaned up at the end
    if isinstance(target_or_model, Conversion):
        subject = _Subject.from_conversion(target_or_model)
    elif _is_outdir(target_or_model):
        subject = _Subject.from_outdir(Path(target_or_model), step)
    else:
        from .load import load

        ccfg = convert_config or ConvertConfig()
        _check_runnable_target(ccfg.target)
        loaded = target_or_model
        if not isinstance(loaded, LoadedModel):
            step("load")
            loaded = load(loaded, input_shapes=ccfg.input_shapes, simplify=ccfg.simplify)
        if cfg.inputs:
            _load_feeds(cfg, loaded.inputs)  # a bad .npz fails before anything compiles
        owned = _convert_for_bench(loaded, ccfg, cfg, step)
        subject = _Subject.from_conversion(owned)
    try:
        return _run(subject, cfg, notes, step)
    finally:
        if owned is not None:
            owned.cleanup()


def _is_outdir(x) -> bool:
    return isinstance(x, (str, Path)) and Path(x).is_dir()


def _check_runnable_target(target_text: str) -> None:
    from . import tvm_compat
    from .target import resolve_target

    if resolve_target(target_text, check_toolchain=False).is_cuda and \
            not tvm_compat.has_cuda_device():
        raise TargetError("amp bench runs the build, and there is no GPU here for a cuda "
                          "target; pass --target llvm to bench on the CPU")


def _convert_for_bench(loaded, ccfg: ConvertConfig | None, cfg: BenchConfig, step,
                       precision: str | None = None):
    from .convert import convert

    ccfg = copy.deepcopy(ccfg or ConvertConfig())
    _check_runnable_target(ccfg.target)
    ccfg.check_accuracy = False  # bench measures accuracy itself, on the bench inputs
    if cfg.threads:
        ccfg.threads = cfg.threads
    if precision:
        ccfg.precision.precision = precision
    step(f"convert {ccfg.precision.precision}")
    return convert(loaded, ccfg)


@dataclass
class _Subject:
    """What is being benched, normalized: the library, its target, and (when known) the model."""

    source: str
    library: str
    target: dict
    convert_config: ConvertConfig
    precision: str
    model: Any  # LoadedModel or None (an OUTDIR whose source is gone)
    model_summary: dict
    input_specs: list
    build_seconds: float | None
    notes: list[str] = field(default_factory=list)

    @classmethod
    def from_conversion(cls, conv) -> "_Subject":
        return cls(source=conv.model.source, library=conv.library, target=conv.target.spec,
                   convert_config=conv.config, precision=conv.config.precision.precision,
                   model=conv.model, model_summary=conv.model.summary(),
                   input_specs=list(conv.model.inputs), build_seconds=conv.build.seconds)

    @classmethod
    def from_outdir(cls, outdir: Path, step) -> "_Subject":
        from . import tvm_compat
        from .load import InputSpec, load

        lib, rep = outdir / "model.so", outdir / "report.json"
        if not lib.is_file() or not rep.is_file():
            raise InputError(f"{outdir} is a directory but not an amp OUTDIR (needs model.so "
                             f"and report.json from `amp convert`)")
        try:
            report = json.loads(rep.read_text())
            target = dict(report["target"])
            specs = [InputSpec(i["name"], list(i["shape"]), i["dtype"])
                     for i in report["model"]["inputs"]]
            ccfg = apply_yaml(ConvertConfig(), report["config"], str(rep))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InputError(f"{rep}: not a readable amp report ({type(exc).__name__}: "
                             f"{exc})") from None
        if target.get("kind") == "cuda" and not tvm_compat.has_cuda_device():
            raise TargetError(f"{outdir} holds a CUDA library ({target.get('arch')}) and there "
                              f"is no GPU here to run it; bench it on a GPU machine, or bench "
                              f"the model on the CPU: amp bench {report['model']['source']} "
                              f"--target llvm")
        notes = []
        model = None
        src = _find_source(report["model"].get("source_path") or report["model"]["source"],
                           outdir)
        if src is None:
            notes.append(f"model source {report['model']['source']} not found: no fp32 "
                         f"reference, accuracy not measured")
        else:
            step("load source")
            model = load(src, input_shapes=ccfg.input_shapes, simplify=ccfg.simplify)
        # the amp fp32 build must be for the very same target
        ccfg.target = json.dumps(target)
        return cls(source=str(outdir), library=str(lib), target=target, convert_config=ccfg,
                   precision=ccfg.precision.precision, model=model,
                   model_summary=report["model"], input_specs=specs,
                   build_seconds=(report.get("build") or {}).get("seconds"), notes=notes)


def _find_source(source: str, outdir: Path) -> str | None:
    from .load import _SPEC

    if not Path(source).exists() and _SPEC.match(source):
        return source  # pkg.module:factory
    for cand in (Path(source), outdir / source, outdir.parent / source):
        if cand.is_file():
            return str(cand)
    return None


def _load_feeds(cfg: BenchConfig, specs) -> dict[str, np.ndarray]:
    from .accuracy import load_inputs, random_inputs

    if cfg.inputs:
        return load_inputs(cfg.inputs, specs)
    return random_inputs(specs, cfg.seed)


def _batch_of(specs) -> int:
    if specs and specs[0].shape:
        return int(specs[0].shape[0])
    return 1


def _run(subject: _Subject, cfg: BenchConfig, notes: list[str], step) -> BenchResult:
    from .report import _clean, versions

    notes = list(notes) + list(subject.notes)
    feeds = _load_feeds(cfg, subject.input_specs)
    order = [s.name for s in subject.input_specs]
    batch = _batch_of(subject.input_specs)
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
            runners.append(_bench_amp_fp32(subject, device, feeds, order, batch, cfg, reference,
                                           step))
        elif name == "ort":
            runners.extend(_bench_ort(model, device, feeds, batch, cfg, reference, step))
        elif name == "torch":
            runners.extend(_bench_torch(model, device, feeds, order, batch, cfg, reference, step))

    result = BenchResult(
        source=subject.source, model=subject.model_summary, target=subject.target, device=device,
        config=cfg, convert_config=_clean(subject.convert_config.to_dict()),
        inputs={"source": cfg.inputs or f"random (seed {cfg.seed})",
                "tensors": [s.to_dict() for s in subject.input_specs], "batch": batch},
        reference=ref_name, runners=runners, notes=notes, versions=versions(),
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    result.gates = evaluate_gates(result)
    return result


def evaluate_gates(result: BenchResult) -> list[GateResult]:
    """The --max-latency-ratio / --max-rel-error gates of ``result.config``."""
    cfg, amp, gates = result.config, result.primary, []
    if cfg.max_latency_ratio is not None:
        fp32 = result.runner("amp-fp32")
        r = cfg.max_latency_ratio
        if not amp.ok or fp32 is None or not fp32.ok:
            why = (fp32.error or fp32.skipped) if fp32 is not None and not fp32.ok else \
                (amp.error or "no timing")
            gates.append(GateResult("max_latency_ratio", r, None, False,
                                    f"latency-ratio gate: cannot compare with amp fp32 ({why})"))
        else:
            ratio = amp.latency.p50_ms / fp32.latency.p50_ms
            passed = ratio <= r
            gates.append(GateResult(
                "max_latency_ratio", r, ratio, passed,
                f"latency ratio {ratio:.3g} ({amp.name} p50 "
                f"{amp.latency.p50_ms:.3g} ms / amp fp32 p50 {fp32.latency.p50_ms:.3g} ms) "
                f"{'<=' if passed else 'above'} --max-latency-ratio {r:g}"))
    if cfg.max_rel_error is not None:
        e = cfg.max_rel_error
        if not amp.accuracy:
            gates.append(GateResult("max_rel_error", e, None, False,
                                    "rel-error gate: amp's accuracy was not measured"))
        else:
            rel = float(amp.accuracy["rel_l2"])
            passed = rel <= e
            gates.append(GateResult(
                "max_rel_error", e, rel, passed,
                f"rel L2 error {rel:.3g} of {amp.name} vs the fp32 reference "
                f"{'<=' if passed else 'above'} --max-rel-error {e:g}"))
    return gates


# ---------------------------------------------------------------------------------------------
# Runners


def _accuracy(reference, outputs, model) -> dict | None:
    from .accuracy import metrics, summarize

    if reference is None:
        return None
    if len(reference) != len(outputs):
        return {"max_abs": float("inf"), "rel_l2": float("inf"), "cosine": 0.0,
                "nonfinite_share": 0.0, "outputs": [],
                "error": f"{len(outputs)} outputs, the reference has {len(reference)}"}
    names = list(getattr(model, "outputs", []) or [])
    per = []
    for i, (r, g) in enumerate(zip(reference, outputs)):
        per.append({"output": names[i] if i < len(names) else f"output{i}",
                    **metrics(r, np.asarray(g, dtype=np.float32)
                              if np.asarray(g).dtype.kind == "f" else g)})
    return {**summarize(per), "outputs": per}


def bench_library(name, kind, library, device, precision, feeds, order, batch, cfg, reference,
                   model) -> RunnerResult:
    """Time a Relax VM library with TVM's time_evaluator (device timer) after warm-up."""
    from . import tvm_compat
    from .accuracy import LibraryRunner, _flatten

    res = RunnerResult(name, kind, device, precision,
                       timer="tvm time_evaluator (" + ("CUDA events" if device == "cuda"
                                                       else "host clock") + ")")
    runner = LibraryRunner(library, device)
    vm, dev = runner.vm, runner.device
    args = [tvm_compat.to_tvm_tensor(feeds[n], dev) for n in order]
    outputs = [np.asarray(o.numpy()) for o in _flatten(vm["main"](*args))]
    res.accuracy = _accuracy(reference, outputs, model)
    saved = "amp_bench_main"
    vm.save_function("main", saved, *args)
    if cfg.warmup:
        vm.time_evaluator(saved, dev, number=cfg.warmup, repeat=1)()
    timed = vm.time_evaluator(saved, dev, number=cfg.number, repeat=cfg.repeat)()
    res.latency = LatencyStats.from_seconds(timed.results, batch, cfg.number)
    return res


def _bench_amp_fp32(subject, device, feeds, order, batch, cfg, reference, step) -> RunnerResult:
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
        conv = _convert_for_bench(subject.model, subject.convert_config, cfg, step,
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


def _host_timed(fn, cfg: BenchConfig) -> list[float]:
    for _ in range(cfg.warmup):
        fn()
    samples = []
    for _ in range(cfg.repeat):
        t0 = time.perf_counter()
        for _ in range(cfg.number):
            fn()
        samples.append((time.perf_counter() - t0) / cfg.number)
    return samples


def _bench_ort(model, device, feeds, batch, cfg, reference, step) -> list[RunnerResult]:
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
            sess = ort.InferenceSession(blob, opts, providers=[provider])
            got = sess.run(None, feeds)
            res.accuracy = _accuracy(reference, got, model)
            res.latency = LatencyStats.from_seconds(
                _host_timed(lambda: sess.run(None, feeds), cfg), batch, cfg.number)
        except Exception as exc:  # noqa: BLE001 - a peer failing must not end the bench
            res.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
        out.append(res)
    return out


def _bench_torch(model, device, feeds, order, batch, cfg, reference, step) -> list[RunnerResult]:
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
    acc = _accuracy(reference, torch_outputs(call()), model)
    if device == "cuda":
        samples, timer = time_cuda(call, cfg), "CUDA events"
    else:
        samples, timer = _host_timed(call, cfg), "host clock"
    return LatencyStats.from_seconds(samples, batch, cfg.number), acc, timer


def profile_library(library: str, device: str, feeds: dict, order: list[str],
                    top: int = 20) -> list[dict]:
    """Per-kernel time of one call of a Relax VM library: the ``top`` kernels by total time, as
    {name, ms, count, percent}. A VM instrument synchronizes the device around every call, so
    each kernel's time includes its launch (a few us): use it for where the time goes, not for
    the end-to-end latency."""
    from . import tvm_compat
    from .accuracy import LibraryRunner

    runner = LibraryRunner(library, device)
    vm, dev = runner.vm, runner.device
    args = [tvm_compat.to_tvm_tensor(feeds[n], dev) for n in order]
    vm["main"](*args)  # warm-up: allocations, module loading
    per: dict[str, list] = {}
    started: list[float] = []

    def instrument(_func, symbol, before_run, _ret, *_args):
        dev.sync()
        if before_run:
            started.append(time.perf_counter())
        else:
            acc = per.setdefault(str(symbol), [0.0, 0])
            acc[0] += time.perf_counter() - started.pop()
            acc[1] += 1
        return 0  # VMInstrumentReturnKind.NO_OP

    vm.set_instrument(instrument)
    vm["main"](*args)
    vm.set_instrument(None)
    # builtins (vm.builtin.*) nest around nothing we can act on; kernels are what matters
    per = {k: v for k, v in per.items() if not k.startswith("vm.builtin.")} or per
    total = sum(v[0] for v in per.values()) or 1.0
    rows = sorted(per.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"name": k, "ms": v[0] * 1e3, "count": v[1], "percent": 100 * v[0] / total}
            for k, v in rows]


# ---------------------------------------------------------------------------------------------
# Rendering (pure functions: strings and files, no printing)


def _f(v, spec=".3g") -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return format(v, spec)


def format_table(result: BenchResult) -> str:
    """The human-readable table printed by ``amp bench``."""
    where = result.target.get("arch") or result.target.get("mcpu") or ""
    lines = [f"amp bench: {result.source} on {result.device}" + (f" ({where})" if where else ""),
             f"  inputs: {result.inputs['source']}, batch {result.inputs['batch']}; "
             f"warmup {result.config.warmup}, repeat {result.config.repeat}, number "
             f"{result.config.number}; accuracy vs {result.reference}"]
    head = ("runner", "mean ms", "std", "min", "p50", "p90", "p99", "items/s", "rel L2",
            "max abs", "cosine", "non-fin")
    rows = []
    fast = {}
    for r in result.runners:
        if not r.ok:
            rows.append((r.name, f"{'skipped' if r.skipped else 'error'}: {r.skipped or r.error}"))
            continue
        s, a = r.latency, r.accuracy or {}
        fast[r.name] = s.p50_ms
        rows.append((r.name, _f(s.mean_ms, ".4g"), _f(s.std_ms), _f(s.min_ms, ".4g"),
                     _f(s.p50_ms, ".4g"), _f(s.p90_ms, ".4g"), _f(s.p99_ms, ".4g"),
                     _f(s.throughput_per_s, ".4g"), _f(a.get("rel_l2")), _f(a.get("max_abs")),
                     _f(a.get("cosine"), ".6f") if a else "-", _f(a.get("nonfinite_share"))))
    widths = [max(len(head[i]), *(len(r[i]) for r in rows if len(r) > 2)) if
              any(len(r) > 2 for r in rows) else len(head[i]) for i in range(len(head))]
    lines.append("  " + "  ".join(h.ljust(w) if i == 0 else h.rjust(w)
                                  for i, (h, w) in enumerate(zip(head, widths))))
    for r in rows:
        if len(r) == 2:
            lines.append("  " + r[0].ljust(widths[0]) + "  " + r[1])
        else:
            lines.append("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                          for i, (c, w) in enumerate(zip(r, widths))))
    amp = result.primary
    if amp.ok and len(fast) > 1:
        rel = ", ".join(f"{n} {amp.latency.p50_ms / v:.2f}x" for n, v in fast.items()
                        if n != amp.name and v > 0)
        lines.append(f"  {amp.name} p50 latency relative to: {rel}")
    for g in result.gates:
        lines.append(f"  gate {g.name}: {'pass' if g.passed else 'FAIL'}: {g.reason}")
    for r in result.runners:
        for n in r.notes:
            lines.append(f"  note ({r.name}): {n}")
    for n in result.notes:
        lines.append(f"  note: {n}")
    return "\n".join(lines)


def require_matplotlib() -> None:
    """Raise a clear AmpError when matplotlib (the ``bench`` extra) is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise AmpError("--plot needs matplotlib, which is not installed: pip install matplotlib "
                       "(or pip install -e .[bench])") from None


def write_plot(result: BenchResult, path: str | Path) -> Path:
    """A bar chart of p50 latency per runner (error bars: p90 and min) as an image file."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in result.runners if r.ok]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(ok) + 2), 3.5))
    names = [r.name for r in ok]
    p50 = [r.latency.p50_ms for r in ok]
    lo = [r.latency.p50_ms - r.latency.min_ms for r in ok]
    hi = [r.latency.p90_ms - r.latency.p50_ms for r in ok]
    ax.bar(names, p50, yerr=[lo, hi], capsize=4,
           color=["tab:green" if r is result.primary else "tab:gray" for r in ok])
    ax.set_ylabel("latency ms (p50; bars min..p90)")
    ax.set_title(f"{Path(result.source).name} on {result.device}, batch "
                 f"{result.inputs['batch']}")
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    out = Path(path)
    try:
        fig.savefig(out, dpi=120)
    except OSError as exc:
        raise InputError(f"cannot write {out}: {exc.strerror}") from None
    finally:
        plt.close(fig)
    return out
