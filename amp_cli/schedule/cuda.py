"""amp's Relax pipeline for CUDA.

TVM's own CUDA pipeline (tvm/relax/backend/cuda/pipeline.py) with two changes: tuning-record
passes (MetaSchedule ApplyDatabase) run before dlight's default rules, so tuned kernels keep
their tuned schedules and only the rest get dlight's; and the pass list is assembled here, in one
place, so convert and tune compile the same way.
"""
from __future__ import annotations

from .. import tvm_compat


def cuda_schedule_passes(target) -> list:
    dl = tvm_compat.dlight()
    return [dl.ApplyDefaultSchedule(
        dl.gpu.Matmul(),
        dl.gpu.GEMV(),
        dl.gpu.Reduction(),
        dl.gpu.GeneralReduction(),
        dl.gpu.Fallback(),
    )]


def cuda_relax_pipeline(target, extra_schedule_passes=None):
    tvm = tvm_compat.tvm()
    relax = tvm.relax
    from tvm.relax.backend.cuda import pipeline as cuda  # noqa: PLC0415 - version-bound

    @tvm.transform.module_pass(opt_level=0, name="AmpCUDAPipeline")
    def _pipeline(mod, _ctx):
        with target:
            seq = tvm.transform.Sequential(
                cuda.library_dispatch_passes(target)
                + [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
                   relax.transform.FoldConstant(), relax.transform.FuseOps(),
                   relax.transform.FuseTIR()]
                + list(extra_schedule_passes or [])
                + cuda_schedule_passes(target)
                + cuda.dataflow_lower_passes(target)
                + cuda.finalize_passes(target))
            return seq(mod)

    return _pipeline
