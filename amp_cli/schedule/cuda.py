"""amp's Relax pipeline for CUDA.

TVM's own CUDA pipeline (tvm/relax/backend/cuda/pipeline.py) with these changes:

- convolutions become GEMMs first (``conv_gemm``: NHWC + im2col + an NT matmul), so fp16/bf16
  convs reach dlight's tensor-core matmul rule instead of SIMT fallback code;
- fp16/bf16 matmuls with a constant [K, N] weight or a transposed operand become NT GEMMs
  (``matmul_nt``), so tensor-core schedules copy both operands along contiguous K;
- tuning-record passes (MetaSchedule ApplyDatabase) run before the default rules, so tuned
  kernels keep their tuned schedules and only the rest get the defaults;
- the default matmul rule is amp's (``tensorcore.AmpMatmul``): dlight's, plus tensor cores for
  GEMMs with a side of 17..64 (dlight's cut-off is > 64 on every side) and for bf16 on sm_80+;
- Relax's CUDA-graph rewriting is on (``relax.backend.use_cuda_graph``): the kernels between the
  input and the output of a static-shape model are captured once and replayed as one graph;
- the pass list is assembled here, in one place, so convert and tune compile the same way.
"""
from __future__ import annotations

from .. import tvm_compat

CUDA_GRAPH_CONFIG = "relax.backend.use_cuda_graph"


def _fallible(rule, failures: list | None = None):
    """dlight applies rules in order and stops at the first that returns a schedule, but a rule
    that *raises* on a kernel it mis-matched (GEMV's assert on a 1-channel conv GEMM, Reduction's
    rfactor on a reduce-to-scalar: found by tests/test_fuzz.py) aborts the whole build. Wrapped,
    such a rule counts as not applicable and the next one gets the kernel. Rules schedule a fresh
    copy of the PrimFunc, so a failed attempt leaves nothing behind. Each failure is appended
    to ``failures`` as {rule, kernel, error} (the build report lists them), so a rule that
    breaks is visible instead of silently handing its kernels to a slower rule."""
    dl = tvm_compat.dlight()

    class Fallible(dl.ScheduleRule):
        def __init__(self):
            self.rule = rule

        def apply(self, func, target, tunable):
            try:
                return self.rule.apply(func, target, tunable)
            except Exception as exc:  # noqa: BLE001 - any rule bug means "not this rule"
                if failures is not None:
                    name = func.attrs.get(KERNEL_NAME_ATTR, None) if func.attrs else None
                    lines = str(exc).strip().splitlines()
                    failures.append({"rule": type(self.rule).__name__,
                                     "kernel": str(name) if name is not None else "?",
                                     "error": f"{type(exc).__name__}: "
                                              f"{lines[-1] if lines else ''}"[:200]})
                return None

        def __repr__(self):
            return f"Fallible({type(self.rule).__name__})"

    return Fallible()


KERNEL_NAME_ATTR = "amp.kernel"


def _name_kernels():
    """Give each PrimFunc its global name as an attribute (``_fallible``'s records name the
    kernel; dlight hands rules the function only). Runs after the tuning-record passes, so the
    functions they match against the records are unchanged."""
    from .rewrite import replace_functions

    tvm = tvm_compat.tvm()

    @tvm.transform.module_pass(opt_level=0, name="AmpNameKernels")
    def _pass(mod, _ctx):
        return replace_functions(mod, {gv: f.with_attr(KERNEL_NAME_ATTR, gv.name_hint)
                                       for gv, f in mod.functions_items()
                                       if isinstance(f, tvm_compat.prim_func_class())})

    return _pass


def cuda_schedule_passes(target, rule_failures: list | None = None,
                         small_gemm: bool = True, unroll_injective: bool = True) -> list:
    from .injective import AmpInjective
    from .tensorcore import AmpMatmul

    dl = tvm_compat.dlight()
    f = rule_failures
    named = [_name_kernels()] if rule_failures is not None else []
    return named + [dl.ApplyDefaultSchedule(
        _fallible(AmpMatmul(small_m=small_gemm), f),
        _fallible(dl.gpu.GEMV(), f),
        _fallible(dl.gpu.Reduction(), f),
        _fallible(dl.gpu.GeneralReduction(), f),
        *([_fallible(AmpInjective(), f)] if unroll_injective else []),
        dl.gpu.Fallback(),  # last resort: its errors are real errors
    )]


def cuda_graph_config(enabled: bool = True) -> dict:
    """PassContext config that turns Relax's CUDA-graph rewriting (RewriteCUDAGraph, one of the
    finalize passes) on or off."""
    return {CUDA_GRAPH_CONFIG: bool(enabled)}


def cuda_relax_pipeline(target, extra_schedule_passes=None, conv_as_gemm=True, cuda_graph=True,
                        rule_failures: list | None = None, combine_gemms: bool = True,
                        split_k: bool = True, implicit_gemm: bool = True,
                        rewrite_stats: dict | None = None, sink_reshapes: bool = True,
                        fused_attention: bool = True, fused_norm_cast: bool = True,
                        small_gemm: bool = True, unroll_injective: bool = True,
                        hopper_gemm: bool = True):
    """The Relax pipeline (a module pass) amp uses for a CUDA ``target``.

    conv_as_gemm: rewrite fp16/bf16 conv2d (groups=1) into im2col + GEMM (see conv_gemm).
    cuda_graph: capture the static part of the model into a CUDA graph at the first run.
    combine_gemms: parallel constant-weight matmuls on one input (Q/K/V) become one GEMM.
    split_k: long-K GEMMs too small to fill the GPU run as K-split partials + a sum.
    implicit_gemm: convs with C % 8 == 0 read the image inside the GEMM (no im2col tensor).
    rewrite_stats: a dict that receives the graph rewrites' counts (for the build report).
    sink_reshapes: move flattening reshapes past GEMMs and epilogues so the epilogues fuse.
    fused_attention: softmax(Q K^T * scale) V as one kernel (see fused_attention).
    fused_norm_cast: an fp32 layer norm whose output is also cast to fp16/bf16 writes both from
    one kernel (see norm_cast).
    small_gemm: GEMMs of 2..16 rows get amp's lane-split schedule (see small_gemm).
    unroll_injective: large injective kernels take several elements per thread (see injective).
    hopper_gemm: on sm_90a, NT GEMMs (and their fused epilogues) become wgmma + TMA kernels
    written in TIRx (see hopper_gemm's docstring); amp's builds turn sm_90 into sm_90a for this
    (``hopper_gemm.build_target``). They run before tuning records are applied: a GEMM they take
    is not a tuning task, and a record for it (from a database tuned without them) is not used.
    rule_failures: a list that collects the schedule rules that raised (see ``_fallible``).
    Must run on the precision-converted module (the rewrite keys on fp16/bf16 convs).
    """
    tvm = tvm_compat.tvm()
    relax = tvm.relax
    from tvm.relax.backend.cuda import pipeline as cuda  # noqa: PLC0415 - version-bound

    from .combine_gemm import combine_parallel_gemms_pass
    from .conv_gemm import conv_to_gemm_pass
    from .fused_attention import fuse_attention_pass
    from .hopper_gemm import enabled_for, hopper_gemm_pass
    from .matmul_nt import matmul_to_nt_pass
    from .norm_cast import fuse_norm_cast_pass
    from .reshape_sink import sink_reshapes_pass
    from .tensorcore import arch_sm

    @tvm.transform.module_pass(opt_level=0, name="AmpCUDAPipeline")
    def _pipeline(mod, ctx):
        stats = rewrite_stats
        graph_passes = [conv_to_gemm_pass(implicit_gemm, stats)] if conv_as_gemm else []
        if sink_reshapes:
            graph_passes.append(sink_reshapes_pass(stats))
        if combine_gemms:
            graph_passes.append(combine_parallel_gemms_pass(stats))
        if fused_attention and arch_sm(target) >= 80:
            graph_passes.append(fuse_attention_pass(arch_sm(target), stats))
        hopper = hopper_gemm and enabled_for(target)
        graph_passes.append(matmul_to_nt_pass(arch_sm(target), split_k, stats, hopper))
        if fused_norm_cast:
            graph_passes.append(fuse_norm_cast_pass(stats))
        # RewriteCUDAGraph reads its switch from the PassContext; set it for our passes only,
        # keeping the caller's other config and instruments.
        config = {str(k): v for k, v in ctx.config.items()}
        config.update(cuda_graph_config(cuda_graph))
        with target, tvm.transform.PassContext(opt_level=ctx.opt_level, config=config,
                                               instruments=list(ctx.instruments)):
            seq = tvm.transform.Sequential(
                cuda.library_dispatch_passes(target)
                + graph_passes
                + [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
                   relax.transform.FoldConstant(), relax.transform.FuseOps(),
                   relax.transform.FuseTIR()]
                + ([hopper_gemm_pass(target, stats)] if hopper else [])
                + list(extra_schedule_passes or [])
                + cuda_schedule_passes(target, rule_failures, small_gemm, unroll_injective)
                + cuda.dataflow_lower_passes(target)
                + cuda.finalize_passes(target))
            return seq(mod)

    return _pipeline
