"""Target -> the Relax and TIR pipelines amp compiles with, in one place, so that ``convert``,
``tune`` and the benchmarks compile the same way.

CUDA: ``backends/cuda/pipeline.py`` (graph rewrites, tensor-core rules, CUDA graphs) and amp's
TIR pipeline with the lane legalizer (``backends/cuda/tir``). CPU: ``backends/cpu/pipeline.py``.
Tuning records (``records.py``) run right before the default schedule rules. For tuning, the
pipeline can stop there instead (:func:`fused_module`): the kernels a build would schedule.
"""
from __future__ import annotations

from .. import tvm_compat
from ..backends.cpu import pipeline as cpu_backend
from ..backends.cpu.analysis import host_model
from ..backends.cpu.packing import constant_call_args as cpu_constant_call_args
from ..backends.cpu.rules import schedule_prim_func
from ..backends.cuda import pipeline as cuda_backend
from ..backends.cuda.kernels.hopper_gemm import build_target
from ..backends.cuda.tir import cuda_tir_pipeline
from ..config import CudaConfig
from ..ir_attrs import IS_SCHEDULED
from ..target import ResolvedTarget
from .dynamic import at_optimum, guard_pass
from .records import apply_database_passes


def relax_pipeline(target: ResolvedTarget, tuning_db: str | None = None,
                   cuda: CudaConfig | None = None, extra_schedule_passes=(),
                   rule_failures: list | None = None, rewrite_stats: dict | None = None,
                   stop_before_schedule: bool = False, specialize: bool = False,
                   schedules: list | None = None):
    """The whole Relax pipeline (a Pass) amp uses for ``target``. ``cuda``: the CUDA switches
    (None: defaults). Tuning records, then ``extra_schedule_passes``, run before amp's default
    schedules; ``rule_failures`` collects the CUDA schedule rules that raised on a kernel (the
    next rule scheduled it), ``schedules`` which CUDA rule scheduled each kernel,
    ``rewrite_stats`` the counts of amp's graph rewrites.
    ``stop_before_schedule``: end right before the records and schedule rules.
    A module with dynamic dims first gets its range check (``dynamic.py``) and, with
    ``specialize``, its copy at the optimum shape."""
    extra = [] if stop_before_schedule else [
        *(apply_database_passes(tuning_db, target) if tuning_db else []), *extra_schedule_passes]
    if target.is_cuda:
        backend = cuda_backend.cuda_relax_pipeline(
            compile_target(target, cuda), cuda, extra_schedule_passes=extra,
            rule_failures=rule_failures, rewrite_stats=rewrite_stats,
            stop_before_schedule=stop_before_schedule, schedules=schedules)
    else:
        backend = cpu_backend.cpu_relax_pipeline(target.tvm_target(), extra_schedule_passes=extra,
                                                 stop_before_schedule=stop_before_schedule)
    graphs = target.is_cuda and (cuda or CudaConfig()).cuda_graph
    return tvm_compat.tvm().transform.Sequential([guard_pass(specialize, graphs), backend])


def fused_module(mod, target: ResolvedTarget, cuda: CudaConfig | None = None):
    """``mod`` (converted) through amp's Relax pipeline up to the schedule rules: the fused
    kernels a build would schedule (what ``amp tune`` tunes). A module with dynamic dims is
    taken at its optimum shape: the kernels of the build's ``main_optimum``."""
    with target.tvm_target():
        return relax_pipeline(target, cuda=cuda, stop_before_schedule=True)(at_optimum(mod))


def compile_target(target: ResolvedTarget, cuda: CudaConfig | None = None):
    """The TVM target amp compiles for: sm_90 becomes sm_90a when the Hopper GEMMs are on
    (``cuda.hopper_gemm``), everything else is ``target`` itself."""
    if not target.is_cuda:
        return target.tvm_target()
    return build_target(target.tvm_target(), (cuda or CudaConfig()).hopper_gemm)


def tir_pipeline(target: ResolvedTarget, records: list):
    """What ``tvm.compile`` takes as ``tir_pipeline`` for ``target``; CUDA appends a record per
    kernel amp's TIR passes changed to ``records``."""
    if target.is_cuda:
        return cuda_tir_pipeline(target.tvm_target(), records)
    return "default"


def default_schedule_passes(target: ResolvedTarget, tvm_target) -> list:
    """amp's default schedule passes alone (for timing one kernel's default schedule)."""
    if target.is_cuda:
        return cuda_backend.cuda_schedule_passes(tvm_target)
    return cpu_backend.cpu_schedule_passes(tvm_target)


def schedule_packed_kernel(func, tvm_target, packable):
    """CPU: ``func`` scheduled the way the model runs it, with the parameters ``packable``
    (indices of constants in the model) pre-packed; None when no rule applies."""
    hw = host_model(tvm_target)
    hw.packable = set(packable)
    new, _rule = schedule_prim_func(func, tvm_target, hw)
    return None if new is None else new.with_attr(IS_SCHEDULED, True)


def constant_call_args(mod) -> dict:
    """Kernel name -> indices of its arguments that are constants at every call (the weights
    amp's CPU GEMM rule pre-packs)."""
    return cpu_constant_call_args(mod)


def report_labels(target: ResolvedTarget) -> dict:
    """What each build-report count of the target's graph rewrites means."""
    return cuda_backend.report_labels() if target.is_cuda else {}
