"""Compile a (converted) Relax module into a Relax VM library for CUDA or the CPU, in a
sandboxed child process: a TVM crash becomes a BuildError naming the stage. The pipelines
themselves are ``pipeline.py``'s."""
from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from dataclasses import dataclass, field

from .. import tvm_compat
from ..errors import BuildError
from ..sandbox import note_step, run_isolated
from ..target import ResolvedTarget
from .dynamic import kernels_by_function, noalias_shape_functions
from .pipeline import compile_target, relax_pipeline, report_labels, tir_pipeline
from .records import tuned_kernel_summary

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
    # CUDA: which rule scheduled each kernel, {kernel, rule, reduction (MACs per output)}
    kernel_schedules: list[dict] = field(default_factory=list)
    graph_rewrites: dict = field(default_factory=dict)  # CUDA graph rewrites: counts per kind
    graph_rewrite_labels: dict = field(default_factory=dict)  # count key -> what it counts
    # dynamic dims with the optimum copy: {"main_optimum": [kernels], "main_dynamic": [...]}
    variants: dict = field(default_factory=dict)

    def to_dict(self):
        return dataclasses.asdict(self)


def _compile(mod, target: ResolvedTarget, out_path: str, tuning_db: str | None,
             cuda=None, specialize: bool = False) -> BuildResult:
    start = time.perf_counter()
    tgt = compile_target(target, cuda)
    note_step("relax pipeline")
    with tgt:
        failures: list = []
        schedules: list = []
        rewrites: dict = {}
        lowered = relax_pipeline(target, tuning_db, cuda, rule_failures=failures,
                                 rewrite_stats=rewrites, specialize=specialize,
                                 schedules=schedules)(mod)
    lowered = tvm_compat.dedup_constants(lowered)  # weights read by two copies of main: once
    lowered = noalias_shape_functions(lowered)  # else LLVM's kernels lose restrict (dynamic.py)
    kernels = sorted(gv.name_hint for gv, f in lowered.functions.items()
                     if isinstance(f, tvm_compat.prim_func_class()))
    variants = kernels_by_function(lowered)
    note_step("codegen")
    records: list = []
    ex = tvm_compat.compile_relax(lowered, tgt, relax_pipeline=None,
                                  tir_pipeline=tir_pipeline(target, records))
    note_step("export")
    ex.export_library(out_path)
    src = tvm_compat.cuda_source(ex) if target.is_cuda else ""
    if src and os.environ.get("AMP_DUMP_CUDA"):
        Path(os.environ["AMP_DUMP_CUDA"]).write_text(src)
    tc = 0
    if src:
        for chunk in src.split("__global__")[1:]:
            if any(m in chunk for m in TENSOR_CORE_MARKERS):
                tc += 1
    schedule = {}
    if tuning_db:
        schedule = tuned_kernel_summary(tuning_db, lowered, target)
    return BuildResult(
        target=target.spec, library=out_path, seconds=time.perf_counter() - start,
        size_bytes=os.path.getsize(out_path), kernels=kernels,
        legalized=[r.to_dict() for r in records], tensor_core_kernels=tc,
        cuda_source_bytes=len(src), schedule=schedule, rule_failures=failures,
        kernel_schedules=schedules,
        graph_rewrites=rewrites, variants=variants,
        graph_rewrite_labels={k: v for k, v in report_labels(target).items() if k in rewrites})


def build(mod, target: ResolvedTarget, out_path: str, tuning_db: str | None = None,
          isolate: bool = True, cuda=None, specialize: bool = False) -> BuildResult:
    """Compile `mod` for `target` into `out_path` (a .so). Crashes become BuildError.
    ``cuda``: a ``config.CudaConfig`` for CUDA targets (None: defaults). ``specialize``: a
    module with dynamic dims also gets a copy compiled at its optimum shape
    (``dynamic.py``)."""
    stage = f"build {target.describe()}"
    if target.is_cuda:  # once here: forked build children inherit them (pipeline.py says why)
        tvm_compat.cuda_tensor_intrin()
    try:
        return run_isolated(_compile, mod, target, out_path, tuning_db, cuda, specialize,
                            stage=stage, isolate=isolate)
    except BuildError:
        raise
    except Exception as exc:  # noqa: BLE001 - not isolated: same contract
        raise BuildError(f"stage '{stage}' failed: {exc}", stage=stage) from exc
