"""amp's Relax pipeline for CUDA.

TVM's own CUDA pipeline (tvm/relax/backend/cuda/pipeline.py) with these changes:

- amp's graph rewrites run first (``rewrites/``: convolutions as GEMMs, flattening reshapes
  sunk, parallel GEMMs combined, attention fused, matmuls in NT form + split-K, layer norm +
  cast fused), so fp16/bf16 work reaches tensor-core schedules instead of SIMT fallback code;
- after FuseTIR, amp's TIR rewrites (``kernels/hopper_gemm``: sm_90a wgmma GEMMs) and then
  the tuning-record passes (MetaSchedule ApplyDatabase) run before the default rules, so tuned
  kernels keep their tuned schedules and only the rest get the defaults;
- the default rules are amp's (``rules/``): its GEMM rule first, then dlight's, with amp's
  large-injective rule before dlight's Fallback; a rule that raises is skipped (``fallible``);
- Relax's CUDA-graph rewriting is on (``relax.backend.use_cuda_graph``): the kernels between the
  input and the output of a static-shape model are captured once and replayed as one graph
  (in a dynamic build, the copy at the optimum shape: docs/dynamic-shapes.md);
- the pass list is assembled here, in one place, so convert and tune compile the same way;
- before anything else, every variable and buffer gets a name CUDA source can print
  (``frontend/names.py``): the model's own names (``onnx:/model.9/Concat``) stay in amp's IR
  until here, since precision decisions and reports are keyed on them.

Each rewrite and rule registers itself, with its place in its stage (``registry.py``); the
imports below load them.
"""
from __future__ import annotations

import dataclasses

from ... import tvm_compat
from ...config import CudaConfig
from ...dims import module_ranges
from ...frontend.names import make_identifiers
from ...hardware import arch_sm
from ...ir_attrs import CUDA_GRAPH, KERNEL_NAME
from ...ir_module import replace_functions
from . import registry
from .rules.fallible import fallible, recorded_fallback

# Importing a module registers its rewrites / rules (registry.py); each states its order.
from .kernels import hopper_gemm, index_width  # noqa: F401
from .rewrites import (cast_hoist, combine_gemm, conv1d, conv_gemm, depthwise_conv,  # noqa: F401
                       epilogue_split, fused_attention, matmul_nt, mean_as_sum, norm_cast,
                       permute_sink, reshape_sink)
from .rules import depthwise, dlight_rules, injective, matmul  # noqa: F401

RENAMED = "names_made_identifiers"  # build-report count of make_identifiers' renames


def name_kernels_pass():
    """Give each PrimFunc its global name as an attribute (``fallible``'s records name the
    kernel; dlight hands rules the function only). Runs after the tuning-record passes, so the
    functions they match against the records are unchanged."""
    tvm = tvm_compat.tvm()

    @tvm.transform.module_pass(opt_level=0, name="AmpNameKernels")
    def _pass(mod, _ctx):
        return replace_functions(mod, {gv: f.with_attr(KERNEL_NAME, gv.name_hint)
                                       for gv, f in mod.functions_items()
                                       if isinstance(f, tvm_compat.prim_func_class())})

    return _pass


def build_context(target, cuda: CudaConfig | None = None, stats: dict | None = None,
                  dims: dict | None = None, ranges: dict | None = None):
    return registry.BuildContext(target, arch_sm(target), cuda or CudaConfig(), stats,
                                 dict(dims or {}), dict(ranges or {}))


def optimum_sizes(mod) -> dict:
    """{symbolic dim: its range's optimum} of a dynamic module (empty for a static one)."""
    return {name: r.optimum for name, r in module_ranges(mod).items()}


def dim_ranges(mod) -> dict:
    """{symbolic dim: (lo, hi)} of a dynamic module (empty for a static one)."""
    return {name: (r.lo, r.hi) for name, r in module_ranges(mod).items()}


def cuda_schedule_passes(target, rule_failures: list | None = None,
                         cuda: CudaConfig | None = None, dims: dict | None = None,
                         ranges: dict | None = None, schedules: list | None = None) -> list:
    """dlight's ApplyDefaultSchedule with amp's registered rules (``rules/``), each wrapped so
    that one that raises is skipped (and recorded in ``rule_failures``), then dlight's Fallback,
    whose errors are real errors; ``schedules`` collects {kernel, rule, reduction} for every
    kernel a rule scheduled. ``dims``:
    :func:`optimum_sizes` of a dynamic module, ``ranges``: its :func:`dim_ranges`."""
    dl = tvm_compat.dlight()
    made = registry.made("rule", build_context(target, cuda, dims=dims, ranges=ranges))
    rules = [fallible(r, rule_failures, schedules) for r in made]
    named = [name_kernels_pass()] if rule_failures is not None or schedules is not None else []
    return named + [dl.ApplyDefaultSchedule(*rules, recorded_fallback(schedules))]


def cuda_graph_config(enabled: bool = True) -> dict:
    """PassContext config that turns Relax's CUDA-graph rewriting (RewriteCUDAGraph, one of the
    finalize passes) on or off."""
    return {CUDA_GRAPH: bool(enabled)}


def cuda_relax_pipeline(target, cuda: CudaConfig | None = None, extra_schedule_passes=None,
                        rule_failures: list | None = None, rewrite_stats: dict | None = None,
                        stop_before_schedule: bool = False, schedules: list | None = None,
                        **switches):
    """The Relax pipeline (a module pass) amp uses for a CUDA ``target``.

    ``cuda``: the switches (``config.CudaConfig``; None: defaults); keyword ``switches``
    override single fields (``cuda_relax_pipeline(t, split_k=False)``). ``extra_schedule_passes``
    (tuning records) run after FuseTIR and amp's TIR rewrites, before the default rules.
    ``rewrite_stats`` receives the rewrites' counts (for the build report), ``rule_failures``
    the schedule rules that raised (see ``rules/fallible.py``), ``schedules`` which rule scheduled
    each kernel. Must run on the
    precision-converted module (the rewrites key on fp16/bf16 operands).
    ``stop_before_schedule``: end after FuseTIR and the TIR rewrites (what tuning extracts).
    """
    tvm = tvm_compat.tvm()
    relax = tvm.relax
    cuda_pipe = tvm_compat.relax_cuda_pipeline()
    # dlight's MatmulTensorization imports TVM's ~250 tensor intrinsics on first use, through
    # TVMScript's slow inspect.stack(): 30-40 s of a build. Import them the fast way first.
    tvm_compat.cuda_tensor_intrin()
    cuda = dataclasses.replace(cuda or CudaConfig(), **switches)
    ctx = build_context(target, cuda, rewrite_stats)

    @tvm.transform.module_pass(opt_level=0, name="AmpCUDAPipeline")
    def _pipeline(mod, pass_ctx):
        # RewriteCUDAGraph reads its switch from the PassContext; set it for our passes only,
        # keeping the caller's other config and instruments.
        config = {str(k): v for k, v in pass_ctx.config.items()}
        # dynamic dims too: TVM captures only regions whose shapes are all static (symbolic
        # ones only when named in capture_symbolic_vars, which amp never sets), so a dynamic
        # build captures main_optimum and the static parts of main_dynamic, one graph each
        config.update(cuda_graph_config(cuda.cuda_graph))
        # a dynamic module's optima and ranges, for the passes whose kernels serve every size
        # (the Hopper GEMMs' plans, the index width)
        mod_ctx = dataclasses.replace(ctx, dims=optimum_sizes(mod), ranges=dim_ranges(mod))
        with target, tvm.transform.PassContext(opt_level=pass_ctx.opt_level, config=config,
                                               instruments=list(pass_ctx.instruments)):
            # first: the passes below name kernels' buffers after these variables
            mod, renamed = make_identifiers(mod)
            if ctx.stats is not None:
                ctx.stats[RENAMED] = len(renamed)
            # CanonicalizeBindings before and after amp's rewrites: the importers and the
            # rewrites (a reshape pair that cancels) leave aliases `y = x`; the rewrites'
            # pattern matching stops at one, and FuseOps ends a kernel at one, so the ops
            # after it (a GEMM's GELU, a residual add) would run as kernels of their own
            passes = (cuda_pipe.library_dispatch_passes(target)
                      + [relax.transform.CanonicalizeBindings()]
                      + registry.made("graph", mod_ctx)
                      + [relax.transform.CanonicalizeBindings(),
                         relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
                         relax.transform.FoldConstant(), relax.transform.FuseOps()]
                      + registry.made("fused", mod_ctx)
                      + [relax.transform.FuseTIR()]
                      + registry.made("tir", mod_ctx))
            if not stop_before_schedule:
                passes += (list(extra_schedule_passes or [])
                           + cuda_schedule_passes(target, rule_failures, cuda,
                                                  optimum_sizes(mod), dim_ranges(mod),
                                                  schedules)
                           + cuda_pipe.dataflow_lower_passes(target)
                           + cuda_pipe.finalize_passes(target))
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline


def switch_names() -> set[str]:
    """Every CudaConfig field the pipeline reads: the registered entries' and ``cuda_graph``."""
    return registry.switches() | {"cuda_graph"}


def report_labels() -> dict:
    return {**registry.report_labels(),
            RENAMED: "tensor names made C identifiers"}
