"""The convert stage: load -> mixed precision -> build -> accuracy -> report, as one call.

>>> import amp_cli
>>> model = amp_cli.load("examples/generated/tiny_cnn.onnx")              # doctest: +SKIP
>>> conv = amp_cli.convert(model, amp_cli.ConvertConfig(target="llvm"))  # doctest: +SKIP
>>> conv.save("out/tiny")                                                # doctest: +SKIP
"""
from __future__ import annotations

import copy
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import tvm_compat
from .accuracy import check_accuracy
from .compile import BuildResult, build
from .config import ConvertConfig
from .errors import OutputError
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
    """
    cfg = cfg or ConvertConfig()
    step = progress or (lambda _s: None)
    target = resolve_target(cfg.target)
    cfg = resolve_config(cfg, target.kind)
    if cfg.threads:
        set_num_threads(cfg.threads)
    notes = list(target.notes)
    missing = [n for n in cfg.precision.policy.exclude_nodes if n not in model.node_types]
    if missing and model.node_types:
        notes.append(f"--exclude-node names no node of the model: {', '.join(missing)}")
    auto = None
    if cfg.auto_precision.enabled:  # choose the nodes kept in fp32/bf16 (docs/auto-precision.md)
        auto = auto_precision(model, cfg, isolate=isolate)
        notes.extend(auto.notes)
        if cfg.auto_precision.metric == "rel_l2":
            cfg.accuracy.rel_l2_tolerance = cfg.auto_precision.tolerance
    t0 = time.perf_counter()
    step("mixed precision")
    mod, prec = auto.convert(model) if auto else \
        convert_precision(model.mod, cfg.precision, model.node_types)
    convert_seconds = time.perf_counter() - t0
    staging = tempfile.mkdtemp(prefix="amp-build-")
    try:
        step("build")
        result = build(mod, target, os.path.join(staging, "model.so"), cfg.tuning_db,
                       isolate=isolate, cuda=cfg.cuda)
        accuracy = {}
        if cfg.check_accuracy:
            if target.is_cuda and tvm_compat.has_cuda_device():
                lib, device = result.library, "cuda"
            elif target.is_cuda:
                step("cpu build for accuracy")
                cpu = build(mod, cpu_target(), os.path.join(staging, "cpu_check.so"),
                            isolate=isolate)
                lib, device = cpu.library, "cpu"
                notes.append("no GPU here: accuracy measured with a CPU (llvm) build of the same "
                             "converted module")
            else:
                lib, device = result.library, "cpu"
            step("accuracy")
            accuracy = check_accuracy(model, lib, device, cfg.accuracy.seed,
                                      cfg.accuracy.samples)
            worst = accuracy.get("worst", {})
            accuracy["tolerance_rel_l2"] = cfg.accuracy.rel_l2_tolerance
            accuracy["within_tolerance"] = bool(worst) and \
                worst["rel_l2"] <= cfg.accuracy.rel_l2_tolerance
            if worst and worst["nonfinite_share"] > 0:
                notes.append(f"{worst['nonfinite_share']:.1%} of output values are inf/NaN in "
                             f"{cfg.precision.precision}: activations overflow its range; keep "
                             f"the overflowing nodes in fp32 (--exclude-node) or use bf16")
        step("report")
        report = build_report(model, cfg, target, prec, result, accuracy, notes,
                              timings={"convert_s": convert_seconds, "build_s": result.seconds},
                              auto_precision=auto.to_dict() if auto else None)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Conversion(model, cfg, target, mod, prec, result, accuracy, report, staging, notes)
