"""amp's Relax pipeline for llvm targets: TVM's cpu_generic pipeline with amp's layout passes and
deterministic schedule rules (``rules.py``) after FuseTIR."""
from __future__ import annotations

from ... import tvm_compat
from ...dims import module_ranges
from ...ir_attrs import IS_SCHEDULED, LEGACY_IS_SCHEDULED
from ..layout import convert_layout_pass
from ..permute_sink import sink_permutes_pass
from .analysis import host_model
from .packing import constant_call_args, rewrite_packed_callers
from .rules import schedule_prim_func

# Statistics of the last run of the scheduling pass (per process): rule name -> count, and
# the names of PrimFuncs that fell back; "layout": what the guarded ConvertLayout rewrote
# (``backends/layout.py``).
LAST_STATS: dict = {}
CPU_CONV_LAYOUTS = {"relax.nn.conv2d": ["NHWC", "HWIO"]}


def is_scheduled(func) -> bool:
    attrs = func.attrs
    if attrs is None:
        return False
    for key in (IS_SCHEDULED, LEGACY_IS_SCHEDULED):
        if key in attrs and int(attrs[key]) == 1:
            return True
    return False


def cpu_schedule_passes(target, layout_stats: dict | None = None) -> list:
    """Inserted into amp's relax pipeline right after FuseTIR (where CUDA's pipeline runs
    dlight.ApplyDefaultSchedule); schedules every PrimFunc for the llvm target.

    PrimFuncs already marked scheduled (e.g. by MetaScheduleApplyDatabase) are left alone.
    Counts per rule (and fallbacks) land in :data:`LAST_STATS`, with ``layout_stats`` (what
    the layout passes of the same run rewrote) under ``"layout"``.
    """
    tvm = tvm_compat.tvm()
    if isinstance(target, dict):
        target = tvm.target.Target(target)

    @tvm.transform.module_pass(opt_level=0, name="AmpCpuSchedule")
    def _amp_cpu_schedule(mod, _ctx):
        hw = host_model(target)
        hw.dim_bounds = {name: r.hi for name, r in module_ranges(mod).items()}
        stats: dict = {"rules": {}, "fallback": [], "unscheduled": [], "pre_scheduled": 0,
                       "layout": dict(layout_stats or {})}
        updates, packs = {}, {}
        const_args = constant_call_args(mod)
        for gv, func in mod.functions_items():
            if not isinstance(func, tvm.tirx.PrimFunc):
                continue
            if is_scheduled(func):
                stats["pre_scheduled"] += 1
                continue
            hw.packable = const_args.get(gv.name_hint, set())
            new, rule = schedule_prim_func(func, target, hw)
            if new is not None and hw.pack:
                packs[gv.name_hint] = list(hw.pack)
            stats["rules"][rule] = stats["rules"].get(rule, 0) + 1
            if rule == "fallback-parallel":
                stats["fallback"].append(gv.name_hint)
            if new is None:
                stats["unscheduled"].append(gv.name_hint)
                continue
            updates[gv] = new.with_attr(IS_SCHEDULED, True)
        for gv, func in updates.items():
            if gv.name_hint not in packs:  # (packed ones: see below; BlockBuilder.add_func
                mod[gv] = func              # would dedup against an in-place update)
        if packs:
            # packed functions change signature; a GlobalVar keeps the type it was created
            # with, so they are re-added under fresh GlobalVars and their call sites rewritten
            mod = rewrite_packed_callers(mod, packs, updates)
            stats["packed_weights"] = sum(len(v) for v in packs.values())
        if packs:
            # legalize + fold the new layout_transforms; schedule what stays (non-constant)
            relax = tvm.relax
            mod = tvm.transform.Sequential([
                relax.transform.LegalizeOps(), relax.transform.FoldConstant(),
                relax.transform.DeadCodeElimination()])(mod)
            hw.allow_pack = False
            for gv, func in list(mod.functions_items()):
                if isinstance(func, tvm.tirx.PrimFunc) and not is_scheduled(func):
                    new, rule = schedule_prim_func(func, target, hw)
                    stats["rules"][rule] = stats["rules"].get(rule, 0) + 1
                    if new is not None:
                        mod[gv] = new.with_attr(IS_SCHEDULED, True)
        LAST_STATS.clear()
        LAST_STATS.update(stats)
        return mod

    return [_amp_cpu_schedule]


def cpu_layout_passes(target=None, stats: dict | None = None) -> list:
    """Relax passes before legalization: inference-mode op decomposition (BatchNorm becomes
    elementwise ops that fuse into the conv epilogue), NHWC/HWIO convolutions through amp's
    guarded ConvertLayout (``backends/layout.py``; ``stats`` counts its rewrites), and the
    transposes that leaves sunk until they cancel (``backends/permute_sink.py``)."""
    relax = tvm_compat.relax()
    return [
        relax.transform.DecomposeOpsForInference(),
        relax.transform.CanonicalizeBindings(),
        convert_layout_pass(CPU_CONV_LAYOUTS, stats),
        relax.transform.CanonicalizeBindings(),
        # the transposes ConvertLayout and the model's own permutes leave, cancelled
        sink_permutes_pass(stats),
    ]


def cpu_relax_pipeline(target, extra_schedule_passes=None, *, convert_layout: bool = True,
                       fast_math: bool = False, stop_before_schedule: bool = False):
    """The whole Relax pipeline for llvm (what ``tvm.compile(..., relax_pipeline=...)`` takes).

    cpu_generic's library dispatch -> [layout passes] -> LegalizeOps -> AnnotateTIROpPattern ->
    FoldConstant -> FuseOps -> FuseTIR -> ``extra_schedule_passes`` (e.g. a MetaSchedule
    database) -> :func:`cpu_schedule_passes` -> cpu_generic's dataflow lowering + finalize.
    ``fast_math`` swaps exp/erf/tanh/softmax for TOPI's polynomial approximations (not
    bit-compatible; off by default). ``stop_before_schedule``: end after FuseTIR.
    """
    tvm = tvm_compat.tvm()
    relax = tvm.relax
    cpu_pipe = tvm_compat.relax_cpu_pipeline()

    if isinstance(target, dict):
        target = tvm.target.Target(target)
    extra = list(extra_schedule_passes or [])

    @tvm.transform.module_pass(opt_level=0, name="AmpCpuRelaxPipeline")
    def _pipeline(mod, _ctx):
        with target:
            layout_stats: dict = {}
            passes = list(cpu_pipe.library_dispatch_passes(target))
            if fast_math:
                passes.append(relax.transform.FastMathTransform())
            if convert_layout:
                passes += cpu_layout_passes(target, layout_stats)
            passes += [
                relax.transform.LegalizeOps(),
                relax.transform.AnnotateTIROpPattern(),
                relax.transform.FoldConstant(),
                relax.transform.FuseOps(),
                relax.transform.FuseTIR(),
                relax.transform.DeadCodeElimination(),
            ]
            if not stop_before_schedule:
                passes += extra
                passes += cpu_schedule_passes(target, layout_stats)
                passes += cpu_pipe.dataflow_lower_passes(target)
                passes += cpu_pipe.finalize_passes(target)
            mod = tvm.transform.Sequential(passes)(mod)
        return mod

    return _pipeline
