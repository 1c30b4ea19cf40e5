"""The convert stage: load -> mixed precision -> build -> accuracy -> report, as one call.

>>> import amp_cli
>>> model = amp_cli.load("examples/generated/tiny_cnn.onnx")              # doctest: +SKIP
>>> conv = amp_cli.convert(model, amp_cli.ConvertConfig(target="llvm"))  # doctest: +SKIP
>>> conv.save("out/tiny")                                                # doctest: +SKIP
"""
from __future__ import annotations

import copy
import dataclasses
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import tvm_compat
from .accuracy import check_accuracy, first_nonfinite_call, random_inputs
from .compile import BuildResult, build
from .compile.dynamic import capture_note
from .config import ConvertConfig
from .errors import AccuracyError, OutputError
from .frontend import LoadedModel
from .hardware import set_num_threads
from .precision import PrecisionReport, convert_precision, resolve_config
from .precision.auto import auto_precision
from .precision.sensitivity import write_chart
from .report import build_report, render_markdown, write_json
from .target import ResolvedTarget, cpu_target, resolve_target

STAGES = ("mixed precision", "build", "cpu build for accuracy", "accuracy", "report")
Progress = Callable[[str], None]


@dataclass
class Conversion:
    """A converted, built model: the library in a staging dir until :meth:`save`."""

    model: LoadedModel
    config: ConvertConfig
    target: ResolvedTarget
    mod: object  # the converted Relax IRModule
    precision: PrecisionReport
    build: BuildResult
    accuracy: dict
    report: dict
    staging: str
    notes: list = field(default_factory=list)

    @property
    def library(self) -> str:
        return self.build.library

    def save(self, outdir: str | Path, force: bool = False) -> Path:
        """Write model.so, report.json and report.md into `outdir`, atomically: a failure or an
        interrupt leaves either the old OUTDIR or none, never a half-written one."""
        out = check_outdir(outdir, force)
        parent = out.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
        except OSError as exc:
            raise OutputError(f"cannot write {out}: {exc.strerror} ({exc.filename})") from None
        old = None
        try:
            # mkdtemp makes it 0700; OUTDIR gets the permissions any new directory gets
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o777 & ~umask)
            shutil.copy2(self.build.library, tmp / "model.so")
            report = copy.deepcopy(self.report)
            report["artifacts"] = {"model.so": os.path.getsize(tmp / "model.so")}
            write_json(tmp / "report.json", report)
            (tmp / "report.md").write_text(render_markdown(report))
            if report.get("auto_precision"):  # skipped without matplotlib
                write_chart(report["auto_precision"], tmp / "sensitivity.png")
            if out.exists():
                old = parent / f".{out.name}.old-{os.getpid()}"
                os.replace(out, old)
            os.replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if old is not None and not out.exists():
                os.replace(old, out)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return out

    def cleanup(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


def check_outdir(outdir: str | Path, force: bool = False) -> Path:
    """Fail early (before converting) when `outdir` cannot be written: it exists without
    `force`, it is not a directory, a parent is a file, or the nearest existing parent refuses a
    new directory (probed for real: root ignores permission bits but not read-only or virtual
    file systems). Creates nothing. Returns the resolved path."""
    out = Path(outdir).resolve()
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise OutputError(f"{out} exists and is not a directory")
        if not force:
            raise OutputError(f"{out} exists; pass --force to overwrite it")
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"cannot create {out}: {parent} is a file, not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".amp-probe-", dir=parent))
    except OSError as exc:
        raise OutputError(f"cannot create {out}: {parent} is not writable "
                          f"({exc.strerror})") from None
    return out


def convert(model: LoadedModel, cfg: ConvertConfig | None = None,
            progress: Progress | None = None, isolate: bool = True) -> Conversion:
    """Convert `model` to mixed precision and build it for ``cfg.target``.

    The accuracy check runs the build on the local GPU when the target is CUDA and one is
    present; otherwise a CPU build of the same converted module produces the numbers (the report
    says which device it was).

    Correct by default: when the plain conversion misses ``cfg.accuracy.rel_l2_tolerance`` or
    has inf/NaN outputs, amp runs its accuracy-guided search (``--auto-precision``) on its own
    and builds again with the nodes it keeps in fp32; if that still misses, AccuracyError (exit
    code 4) unless ``cfg.accuracy.enforce`` is off. Nothing is written in that case.
    """
    cfg = cfg or ConvertConfig()
    step = progress or (lambda _s: None)
    target = resolve_target(cfg.target)
    cfg = resolve_config(cfg, target.kind)
    if cfg.threads:
        set_num_threads(cfg.threads)
    notes = list(target.notes) + dynamic_notes(model, target, cfg)
    missing = [n for n in cfg.precision.policy.exclude_nodes if n not in model.node_types]
    if missing and model.node_types:
        notes.append(f"--exclude-node names no node of the model: {', '.join(missing)}")
    auto = None
    if cfg.auto_precision.enabled:  # choose the nodes kept in fp32/bf16 (docs/auto-precision.md)
        auto = auto_precision(model, cfg, isolate=isolate)
        notes.extend(auto.notes)
        if cfg.auto_precision.metric == "rel_l2":
            cfg.accuracy.rel_l2_tolerance = cfg.auto_precision.tolerance
    staging = tempfile.mkdtemp(prefix="amp-build-")
    try:
        attempt = _build_checked(model, cfg, target, auto, staging, isolate, step, notes)
        if attempt.missed and auto is None and cfg.auto_precision.when_inaccurate \
                and cfg.precision.precision != "fp32":
            auto = _auto_fallback(model, cfg, attempt, isolate, step, notes)
            if auto is not None:
                attempt = _build_checked(model, cfg, target, auto, staging, isolate, step,
                                         notes)
        if attempt.missed:
            _fail_or_mark(model, cfg, attempt, auto, notes)
        step("report")
        report = build_report(model, cfg, target, attempt.precision, attempt.build,
                              attempt.accuracy, notes,
                              timings={"convert_s": attempt.convert_seconds,
                                       "build_s": attempt.build.seconds},
                              auto_precision=auto.to_dict() if auto else None)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Conversion(model, cfg, target, attempt.mod, attempt.precision, attempt.build,
                      attempt.accuracy, report, staging, notes)


def dynamic_notes(model: LoadedModel, target: ResolvedTarget, cfg: ConvertConfig) -> list:
    """What the report says about a model with dynamic dims (docs/dynamic-shapes.md)."""
    if not model.dynamic:
        return []
    ranges = ", ".join(f"{n} {r}" for n, r in model.dynamic.items())
    notes = [f"dynamic dims {ranges}: one library for every shape in the ranges; a shape "
             f"outside them raises AssertionError naming the ranges; the accuracy check runs "
             f"at each dim's minimum, optimum and maximum"]
    if target.is_cuda and cfg.cuda.cuda_graph:
        notes.append(capture_note(model.dynamic, optimum_copy(cfg, target)))
    return notes


def optimum_copy(cfg: ConvertConfig, target: ResolvedTarget) -> bool:
    """Whether the build of a model with dynamic dims holds the static copy at the optimum
    (``dynamic.specialize_optimum``; unset: config.DynamicConfig.optimum_copy decides)."""
    return cfg.dynamic.optimum_copy(target.is_cuda, cfg.tuning_db)


@dataclass
class _Attempt:
    """One conversion + build + accuracy check."""

    mod: object
    precision: PrecisionReport
    build: BuildResult
    accuracy: dict
    convert_seconds: float

    @property
    def missed(self) -> bool:
        """The check ran and the conversion is wrong: inf/NaN outputs or above tolerance (a
        non-finite fp32 reference is not the conversion's fault: not judged)."""
        worst = self.accuracy.get("worst") or {}
        return bool(worst) and not worst.get("reference_nonfinite_share") and \
            not self.accuracy.get("within_tolerance")


def _build_checked(model, cfg, target, auto, staging, isolate, step, notes) -> _Attempt:
    t0 = time.perf_counter()
    step("mixed precision")
    mod, prec = auto.convert(model) if auto else \
        convert_precision(model.mod, cfg.precision, model.node_types)
    convert_seconds = time.perf_counter() - t0
    step("build")
    # a file per attempt: a process that loaded a library from a path keeps getting that one
    # from dlopen, so a second attempt written over it would be checked with the first's code
    attempt_dir = tempfile.mkdtemp(prefix="attempt-", dir=staging)
    specialize = optimum_copy(cfg, target)
    result = build(mod, target, os.path.join(attempt_dir, "model.so"), cfg.tuning_db,
                   isolate=isolate, cuda=cfg.cuda, specialize=specialize)
    accuracy = {}
    if cfg.check_accuracy:
        if target.is_cuda and tvm_compat.has_cuda_device():
            lib, device = result.library, "cuda"
        elif target.is_cuda:
            step("cpu build for accuracy")
            cpu = build(mod, cpu_target(), os.path.join(attempt_dir, "cpu_check.so"),
                        isolate=isolate, specialize=specialize)
            lib, device = cpu.library, "cpu"
            note = ("no GPU here: accuracy measured with a CPU (llvm) build of the same "
                    "converted module")
            if note not in notes:
                notes.append(note)
        else:
            lib, device = result.library, "cpu"
        step("accuracy")
        accuracy = check_accuracy(model, lib, device, cfg.accuracy.seed, cfg.accuracy.samples)
        worst = accuracy.get("worst", {})
        accuracy["tolerance_rel_l2"] = cfg.accuracy.rel_l2_tolerance
        accuracy["within_tolerance"] = bool(worst) and \
            worst["rel_l2"] <= cfg.accuracy.rel_l2_tolerance
        if device == "cuda" and worst.get("nonfinite_share"):
            notes.append(_locate_nonfinite(model, mod, cfg, target, attempt_dir, result, isolate))
        if accuracy.get("reference_degenerate"):
            notes.append(f"the fp32 reference is degenerate on the check's inputs "
                         f"({accuracy['reference_degenerate']}): its accuracy numbers say nothing "
                         f"about the conversion (random-init weights? check the library on "
                         f"real inputs: amp bench OUTDIR --inputs FILE.npz)")
        if worst.get("reference_nonfinite_share"):
            notes.append(f"{worst['reference_nonfinite_share']:.1%} of the fp32 reference's "
                         f"output values are inf/NaN on the check's inputs: those positions "
                         f"are not compared (a degenerate reference, not a conversion error)")
    return _Attempt(mod, prec, result, accuracy, convert_seconds)


def _locate_nonfinite(model, mod, cfg, target, attempt_dir, result, isolate) -> str:
    """A note naming the first kernel that writes inf/NaN on the GPU (built again without CUDA
    graphs when the build has them, so that each kernel can be watched)."""
    library = result.library
    if cfg.cuda.cuda_graph:
        plain = dataclasses.replace(cfg.cuda, cuda_graph=False)
        library = build(mod, target, os.path.join(attempt_dir, "diagnose.so"), cfg.tuning_db,
                        isolate=isolate, cuda=plain,
                        specialize=optimum_copy(cfg, target)).library
    feeds = random_inputs(model.example_inputs, cfg.accuracy.seed)
    found = first_nonfinite_call(library, "cuda", feeds, [s.name for s in model.inputs])
    if found is None:
        return ("inf/NaN on the GPU, but no single kernel wrote them in a run without CUDA "
                "graphs: --no-cuda-graph may avoid them")
    return (f"on the GPU, the first kernel writing inf/NaN is {found['kernel']} (call "
            f"{found['call']}, {found['nonfinite_share']:.1%} of an argument)")


def _describe(accuracy: dict) -> str:
    worst = accuracy["worst"]
    return (f"rel L2 {float(worst['rel_l2']):.3g} vs tolerance {accuracy['tolerance_rel_l2']:g}"
            f", {float(worst['nonfinite_share']):.1%} inf/NaN, on {accuracy['device']}")


def _auto_fallback(model, cfg, attempt, isolate, step, notes):
    """The accuracy-guided search, run because the plain conversion missed (or None when it
    cannot run on this model, with a note saying why)."""
    if model.onnx_model is None:
        notes.append("the accuracy-guided search needs an ONNX model; export the torch model "
                     "with torch.onnx.export to use it")
        return None
    notes.append(f"the plain {cfg.precision.precision} conversion missed the accuracy check "
                 f"({_describe(attempt.accuracy)}): amp ran its accuracy-guided search "
                 f"(--auto-precision) on its own")
    step("accuracy-guided search")
    auto_cfg = copy.deepcopy(cfg)
    auto_cfg.auto_precision.enabled = True
    auto_cfg.auto_precision.metric = "rel_l2"
    auto_cfg.auto_precision.tolerance = cfg.accuracy.rel_l2_tolerance
    auto = auto_precision(model, auto_cfg, isolate=isolate)
    notes.extend(auto.notes)
    return auto


def _fail_or_mark(model, cfg, attempt, auto, notes) -> None:
    kept = f" with {len(auto.exclude_nodes)} nodes kept in {auto.fallback}" if auto else ""
    what = f"accuracy check failed{kept}: {_describe(attempt.accuracy)}"
    if cfg.accuracy.enforce:
        raise AccuracyError(
            f"{model.source}: {what}; nothing written. Try --precision bf16 (fp32's range), "
            f"--exclude-node for the nodes the report names, a looser accuracy.rel_l2_tolerance,"
            f" or --allow-inaccurate to write it anyway")
    notes.append(f"{what}; written anyway (--allow-inaccurate)")
