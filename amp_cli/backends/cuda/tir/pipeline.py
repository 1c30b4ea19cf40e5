"""amp's CUDA TIR pipeline: TVM 0.27's default s_tir pipeline + the lane legalizer (and, first,
the sign-keeping pow rewrite of exact_pow.py).

Why here: ``VectorizeLoop`` is the pass that turns ``T.vectorized`` loops into vector
expressions (Ramp/Broadcast/vector loads), so illegal lane counts first exist right after it;
everything before works on scalar loop bodies. The legalizer runs immediately after it, before
``InjectVirtualThread``/``StorageRewrite``/``UnrollLoop``/``CommonSubexprElim``: CSE would otherwise
bind illegal vectors to variables and spread them over several statements. A second, normally
no-op run sits at the end of the device finalization (after ``LowerIntrin``, right before
``target.build.cuda``) as a safety net for anything a later pass creates; after it, non-finite
bf16/fp8 constants become casts of fp32 ones, which TVM's codegen can spell (nonfinite_const.py).

tvm.compile -> tvm.tirx.build only accepts a *registered* pipeline name in 0.27 (it asserts
``isinstance(pipeline, str)``; a Pass object is rejected), and the default s_tir pipeline builds
its pass list inside a closure, so the list is reproduced here (``_s_tir_main_passes``) with the
legalizer inserted; ``tests/test_legalize.py::test_pipeline_matches_tvm_default`` runs both on a
module with pass instrumentation and fails if TVM's list drifts.
"""
from __future__ import annotations

import itertools

from .... import tvm_compat
from ....ir_attrs import ASYNC_COPY, TIRX_KERNEL
from . import index32
from .access_ptr import typed_access_ptr_pass
from .async_copy import sync_strided_async_copy_pass
from .exact_pow import exact_pow_pass
from .legalize import lane_legalize_pass
from .nonfinite_const import nonfinite_constants_pass

_COUNTER = itertools.count()


def _s_tir_main_passes(config, legalize_pass, async_guard=None):
    """apache-tvm 0.27.0.post1 ``tvm.s_tir.pipeline.default_s_tir_pipeline`` pass list, with
    ``legalize_pass`` inserted right after VectorizeLoop and ``async_guard`` right before
    InjectPTXAsyncCopy (None: stock list), and without LowerAsyncDMA (below)."""
    s_tir, tirx = tvm_compat.s_tir(), tvm_compat.tirx()
    passes = [
        s_tir.transform.CanonicalizeLoop(),
        s_tir.transform.LowerCrossThreadReduction(),
        s_tir.transform.LowerInitBlock(),
        s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
        s_tir.transform.ConvertBlocksToOpaque(),
        s_tir.transform.LiftThreadBinding(),
        s_tir.transform.ManifestSharedMemoryLocalStage(),
        s_tir.transform.CompactBufferAllocation(),
        s_tir.transform.LowerAutoCopy(),
        s_tir.transform.UnifyThreadBinding(),
        s_tir.transform.LowerMatchBuffer(),
        s_tir.transform.StmtSimplify(),
        s_tir.transform.InjectPermutedLayout(),
        s_tir.transform.AnnotateIrregularLoop(),
        s_tir.transform.InjectSoftwarePipeline(),
        s_tir.transform.TransformMmaBufferLayout(),
        s_tir.transform.LowerOpaqueBlock(),
        tirx.transform.FlattenBuffer(),
        tirx.transform.BF16ComputeLegalize(),
        index32.narrow_pass(),  # amp's: kernels over symbolic extents marked safe (index32.py)
        tirx.transform.NarrowDataType(32),
        s_tir.transform.LoopPartition(),
        tirx.transform.VectorizeLoop(not bool(config.get("tirx.disable_vectorize", False))),
    ]
    if legalize_pass is not None:
        passes.append(legalize_pass)
    passes += [
        s_tir.transform.InjectVirtualThread(),
        s_tir.transform.InjectDoubleBuffer(),
    ]
    if not bool(config.get("tirx.disable_storage_rewrite", False)):
        passes.append(tirx.transform.StorageRewrite())
    # not LowerAsyncDMA, which the stock list runs here with async copies on: it rewrites a
    # copy in an async stage that it proves contiguous into ``dma_copy``, a Hexagon builtin
    # that CUDA code cannot express, and leaves every other loop as it was -- on CUDA it can
    # only do nothing or break the build. Proving it costs iter-map analysis of every loop of
    # every pipelined kernel: 10.5 of the 42 s of a dynamic ResNet-50 build (symbolic batch)
    passes += [
        s_tir.transform.HoistIfThenElse(),
        tirx.transform.UnrollLoop(),
        s_tir.transform.RenormalizeSplitPattern(),
        tirx.transform.StmtSimplify(),
        tirx.transform.RemoveNoOp(),
        s_tir.transform.RewriteUnsafeSelect(),
    ]
    if bool(config.get("tirx.instrument_bound_checkers", False)):
        passes.append(s_tir.transform.InstrumentBoundCheckers())
    if bool(config.get("tirx.s_tir.ldg32", False)):
        passes.append(s_tir.transform.InjectPTXLDG32(True))
    if not bool(config.get("tirx.disable_cse_tir", False)):
        passes.append(tirx.transform.CommonSubexprElim())
    if bool(config.get("tirx.instrument_lwp", False)):
        passes.append(s_tir.transform.InstrumentProfileIntrinsics())
    passes += [
        tirx.transform.FP8ComputeLegalize(),
        s_tir.transform.VerifyVTCMLimit(),
        s_tir.transform.LowerVtcmAlloc(),
        tirx.transform.VerifyMemory(),
        tirx.transform.AnnotateEntryFunc(),
        s_tir.transform.ThreadSync("shared"),
        s_tir.transform.ThreadSync("shared.dyn"),
        s_tir.transform.ThreadSync("warp"),
        s_tir.transform.InferFragment(),
        s_tir.transform.LowerThreadAllreduce(),
    ]
    if bool(config.get(ASYNC_COPY, False)):
        if async_guard is not None:
            passes.append(async_guard)
        passes.append(s_tir.transform.InjectPTXAsyncCopy())
    if bool(config.get("tirx.s_tir.ldg32", False)):
        passes.append(s_tir.transform.InjectPTXLDG32())
    passes += [
        s_tir.transform.MergeSharedMemoryAllocations(),
        tirx.transform.SplitHostDevice(),
        tirx.transform.MakePackedAPI(),
        tirx.transform.FP8StorageLegalize(),
        tirx.transform.BF16StorageLegalize(),
    ]
    return passes




def split_tirx_kernels(mod):
    """(module of the PrimFuncs marked ``amp.tirx`` or None, the rest of ``mod``): kernels written
    in TIRx go through TVM's TIRx lowering, everything else through the s_tir pipeline."""
    tvm = tvm_compat.tvm()
    marked = {gv: f for gv, f in mod.functions_items()
              if isinstance(f, tvm_compat.prim_func_class()) and f.attrs
              and f.attrs.get(TIRX_KERNEL)}
    if not marked:
        return None, mod
    rest = {gv: f for gv, f in mod.functions_items() if gv not in marked}
    return tvm.IRModule(marked, attrs=mod.attrs), tvm.IRModule(rest, attrs=mod.attrs)


def make_pipeline_factory(records: list | None, legalize: bool = True, only_cuda: bool = True,
                          async_copy: bool = True, typed_access_ptr: bool = True,
                          async_guard: bool = True):
    """A TIR pipeline factory in 0.27's form: () -> (main, finalize_host, finalize_device).

    async_copy: turn on ``tirx.use_async_copy`` (TVM's InjectPTXAsyncCopy/LowerAsyncDMA), so
    loads that a schedule puts in a ``software_pipeline_async_stages`` stage (amp's tensor-core
    GEMM, MetaSchedule's tensor-core rules) become ``cp.async``; other code is unaffected.
    typed_access_ptr: run amp's fix for TVM 0.27's access-pointer dtype error (access_ptr.py);
    off only to reproduce that error in tests. async_guard: keep strided vector copies out of
    cp.async (async_copy.py); off only to reproduce TVM's misaligned cp.async in tests."""
    tvm = tvm_compat.tvm()
    finalize_host, finalize_device = tvm_compat.default_tir_finalize_passes()

    def factory(**_kwargs):
        @tvm.transform.module_pass(opt_level=0, name="amp.CudaTIRPipeline")
        def _main(mod, _ctx):
            config = {str(k): v for k, v in tvm.transform.PassContext.current().config.items()}
            if async_copy:
                config[ASYNC_COPY] = True
            legal = lane_legalize_pass(records, stage="after VectorizeLoop", only_cuda=only_cuda) if legalize else None
            # + the access-pointer dtype fix for TVM 0.27's StorageRewrite (access_ptr.py)
            # + the strided-cp.async guard (async_copy.py)
            guard = sync_strided_async_copy_pass(records) if async_guard else None
            passes = list(_s_tir_main_passes(config, legal, guard))
            if typed_access_ptr:
                passes.append(typed_access_ptr_pass())
            # pow first, in every kernel whichever lowering it takes (the Hopper GEMMs' TIRx
            # included): fast math would make powf NaN for negative bases (exact_pow.py)
            tirx_mod, rest = split_tirx_kernels(exact_pow_pass()(mod))
            rest = tvm.ir.transform.Sequential(passes)(rest)
            if tirx_mod is None:
                return rest
            rest.update(tvm_compat.tirx_main_pipeline()(tirx_mod))
            return rest

        def _finalize_device():
            # last: nothing may fold the casts of non-finite bf16 constants back (nonfinite_const.py)
            passes = [finalize_device()]
            if legalize:
                passes.append(lane_legalize_pass(records, stage="before codegen", only_cuda=only_cuda))
            passes.append(nonfinite_constants_pass())
            return tvm.ir.transform.Sequential(passes)

        return _main, finalize_host, _finalize_device

    return factory


def cuda_tir_pipeline(target=None, records: list | None = None, legalize: bool = True,
                      only_cuda: bool = True, async_copy: bool = True,
                      typed_access_ptr: bool = True, async_guard: bool = True) -> str:
    """Register amp's CUDA TIR pipeline and return its name, the value tvm.compile takes as
    ``tir_pipeline=`` in 0.27. ``target`` is accepted for API stability (the pipeline is the
    same for every CUDA arch; non-CUDA PrimFuncs are left alone by the legalizer unless
    ``only_cuda=False``, which tests use to run legalized TIR on the CPU)."""
    del target
    name = f"amp_cuda_lane_safe_{next(_COUNTER)}"
    return tvm_compat.register_tir_pipeline(name, make_pipeline_factory(
        records, legalize, only_cuda, async_copy, typed_access_ptr, async_guard))
