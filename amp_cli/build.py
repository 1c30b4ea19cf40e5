"""Compile a (converted) Relax module into a Relax VM library for CUDA or the CPU.

CUDA: amp's relax pipeline (dlight default schedules, tuning records first when given) and a TIR
pipeline with the lane legalizer (``amp_cli.legalize``), so fp16/bf16 vectors of any width
compile. CPU: amp's CPU schedules (``amp_cli.schedule.cpu``). Compilation runs in a sandboxed
child process: a TVM crash becomes a BuildError naming the stage.
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field

from . import tvm_compat
from .errors import BuildError
from .sandbox import note_step, run_isolated
from .target import ResolvedTarget

TENSOR_CORE_MARKERS = ("mma_sync", "mma.sync", "wmma::", "wgmma")


@dataclass
class BuildResult:
    target: dict
    library: str  # path of the exported Relax VM library
    seconds: float
    size_bytes: int
    kernels: list[str] = field(default_factory=list)
    legalized: list[dict] = field(default_factory=list)  # lane legalizer records (CUDA)
    tensor_core_kernels: int = 0
    cuda_source_bytes: int = 0
    schedule: dict = field(default_factory=dict)  # tuned / default counts, per kernel info
    rule_failures: list[dict] = field(default_factory=list)  # CUDA schedule rules that raised
    graph_rewrites: dict = field(default_factory=dict)  # CUDA graph rewrites: counts per kind

    def to_dict(self):
        return dataclasses.asdict(self)


def relax_pipeline(target: ResolvedTarget, tuning_db: str | None = None, cuda=None,
                   extra_schedule_passes=(), rule_failures: list | None = None,
                   rewrite_stats: dict | None = None):
    """The whole Relax pipeline (a Pass) amp uses for `target`. ``cuda``: a
    ``config.CudaConfig`` (CUDA graphs, conv-as-GEMM; None = defaults). Tuning records, then
    ``extra_schedule_passes``, run before amp's default schedules; ``rule_failures`` collects
    the CUDA schedule rules that raised on a kernel (the next rule scheduled it),
    ``rewrite_stats`` the counts of amp's graph rewrites."""
    extra = []
    if tuning_db:
        from .tune import apply_database_passes

        extra = apply_database_passes(tuning_db, target)
    extra = [*extra, *extra_schedule_passes]
    if target.is_cuda:
        from .config import CudaConfig
        from .schedule.cuda import cuda_relax_pipeline

        # CudaConfig's fields are cuda_relax_pipeline's switches, by name
        return cuda_relax_pipeline(compile_target(target, cuda), extra_schedule_passes=extra,
                                   rule_failures=rule_failures, rewrite_stats=rewrite_stats,
                                   **dataclasses.asdict(cuda or CudaConfig()))
    from .schedule.cpu import cpu_relax_pipeline

    return cpu_relax_pipeline(target.tvm_target(), extra_schedule_passes=extra)


def compile_target(target: ResolvedTarget, cuda=None):
    """The TVM target amp compiles for: sm_90 becomes sm_90a when the Hopper GEMMs are on
    (``cuda.hopper_gemm``, schedule/hopper_gemm.py), everything else is ``target`` itself."""
    if not target.is_cuda:
        return target.tvm_target()
    from .config import CudaConfig
    from .schedule.hopper_gemm import build_target

    return build_target(target.tvm_target(), (cuda or CudaConfig()).hopper_gemm)


def tir_pipeline(target: ResolvedTarget, records: list):
    if target.is_cuda:
        from .legalize import cuda_tir_pipeline

        return cuda_tir_pipeline(target.tvm_target(), records)
    return "default"


def _compile(mod, target: ResolvedTarget, out_path: str, tuning_db: str | None,
             cuda=None) -> BuildResult:
    tvm = tvm_compat.tvm()
    start = time.perf_counter()
    tgt = compile_target(target, cuda)
    note_step("relax pipeline")
    with tgt:
        failures: list = []
        rewrites: dict = {}
        lowered = relax_pipeline(target, tuning_db, cuda, rule_failures=failures,
                                 rewrite_stats=rewrites)(mod)
    kernels = sorted(gv.name_hint for gv, f in lowered.functions.items()
                     if isinstance(f, tvm_compat.prim_func_class()))
    note_step("codegen")
    records: list = []
    ex = tvm_compat.compile_relax(lowered, tgt, relax_pipeline=None,
                                  tir_pipeline=tir_pipeline(target, records))
    note_step("export")
    ex.export_library(out_path)
    src = tvm_compat.cuda_source(ex) if target.is_cuda else ""
    tc = 0
    if src:
        for chunk in src.split("__global__")[1:]:
            if any(m in chunk for m in TENSOR_CORE_MARKERS):
                tc += 1
    schedule = {}
    if tuning_db:
        from .tune import tuned_kernel_summary

        schedule = tuned_kernel_summary(tuning_db, lowered, target)
    return BuildResult(
        target=target.spec, library=out_path, seconds=time.perf_counter() - start,
        size_bytes=os.path.getsize(out_path), kernels=kernels,
        legalized=[r.to_dict() for r in records], tensor_core_kernels=tc,
        cuda_source_bytes=len(src), schedule=schedule, rule_failures=failures,
        graph_rewrites=rewrites)


def build(mod, target: ResolvedTarget, out_path: str, tuning_db: str | None = None,
          isolate: bool = True, cuda=None) -> BuildResult:
    """Compile `mod` for `target` into `out_path` (a .so). Crashes become BuildError.
    ``cuda``: a ``config.CudaConfig`` for CUDA targets (None: defaults)."""
    stage = f"build {target.describe()}"
    try:
        return run_isolated(_compile, mod, target, out_path, tuning_db, cuda, stage=stage,
                            isolate=isolate)
    except BuildError:
        raise
    except Exception as exc:  # noqa: BLE001 - not isolated: same contract
        raise BuildError(f"stage '{stage}' failed: {exc}", stage=stage) from exc
