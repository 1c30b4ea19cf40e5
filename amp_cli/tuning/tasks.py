"""The tuning tasks of a model: its converted module through amp's pipeline up to the schedule
rules (what a build would schedule), the kernels worth tuning in it, their order, and the
records and default-schedule latency of each."""
from __future__ import annotations

import os
from dataclasses import dataclass

from .. import tvm_compat
from ..compile.pipeline import default_schedule_passes, fused_module as pipeline_fused_module
from ..compile.pipeline import schedule_packed_kernel
from ..ir_attrs import IS_SCHEDULED
from ..precision import convert_precision, resolve_config
from .results import FAILED_SECS, TaskResult


def fused_module(model, cfg, target):
    """``model`` converted as ``amp convert`` converts it (``cfg``: a ConvertConfig), through
    amp's Relax pipeline up to the schedule rules: the kernels a build would schedule."""
    cfg = resolve_config(cfg, target.kind)
    mod, _report = convert_precision(model.mod, cfg.precision, model.node_types)
    return pipeline_fused_module(mod, target, cfg.cuda)


@dataclass
class Task:
    ctx: object
    result: TaskResult
    measured: set  # structural hashes of candidates already in the database
    done: bool = False


def tunable_tasks(tasks) -> list:
    """MetaSchedule's extracted tasks less amp's own kernels (attention, layer norm + cast),
    which are scheduled already (``tirx.is_scheduled`` on the PrimFunc): nothing to tune."""
    return [t for t in tasks
            if not any(f.attrs and f.attrs.get(IS_SCHEDULED, False)
                       for _, f in t.mod.functions_items())]


def search_order(results: list[TaskResult]) -> list[int]:
    """Indices of the tasks, the largest share of the model's default kernel time first (weight x
    default latency; tasks without a default time last, in extraction order).

    MetaSchedule's gradient scheduler gives every task one search round in list order before it
    chooses by gradient, and a round of a GEMM task takes seconds; under --time-budget this order
    decides which kernels get tuned at all (in extraction order a 4 us cast went before the
    convolutions)."""
    return sorted(range(len(results)),
                  key=lambda i: -(results[i].weight * (results[i].default_us or 0.0)))


def tuning_target(target):
    """The target MetaSchedule tunes for: amp's, plus the CUDA limits its schedule rules read
    (0.27's cuda target carries max_num_threads but not max_threads_per_block)."""
    spec = dict(target.spec)
    if target.is_cuda:
        spec.setdefault("max_threads_per_block", 1024)
        spec.setdefault("max_shared_memory_per_block", 49152)
        spec.setdefault("thread_warp_size", 32)
    return tvm_compat.make_target(spec)


def count_records(db, tasks: list[Task]) -> None:
    """Per task: records in the database, valid ones, best latency, and the structural hashes of
    the candidates already measured (so a resumed run does not measure them again)."""
    ms = tvm_compat.meta_schedule()
    index = {t.result.workload: t for t in tasks}
    for t in tasks:
        t.result.records = t.result.valid_records = 0
        t.result.best_us = None
    hashes: dict = {}
    for rec in db.get_all_tuning_records():
        w = rec.workload
        key = w.__chandle__() if hasattr(w, "__chandle__") else id(w)
        if key not in hashes:
            hashes[key] = ms.utils.shash2hex(w.mod)
        t = index.get(hashes[key])
        if t is None:
            continue
        t.result.records += 1
        secs = [float(s) for s in (rec.run_secs or [])]
        if secs and max(secs) < FAILED_SECS:
            t.result.valid_records += 1
            us = sum(secs) / len(secs) * 1e6
            if t.result.best_us is None or us < t.result.best_us:
                t.result.best_us = us
        try:
            cand = rec.as_measure_candidate()
            t.measured.add(tvm_compat.structural_hash(cand.sch.mod))
        except Exception:  # noqa: BLE001 - a trace that no longer replays: just not deduped
            pass


def time_defaults(wmods, target, builder, runner, packable=None) -> list:
    """Latency (us) of amp's default schedule of each kernel, with the tuning builder and runner
    (None where it could not be built or run).

    ``packable`` (CPU): per kernel, the indices of its parameters that are constants in the
    model. amp's CPU GEMM/conv rule pre-packs those weights at compile time, so the default is
    timed as the model runs it: the packed kernel, fed weights already in the packed layout.
    (Without this the isolated default reads unpacked weights and looks up to ~2.4x slower than
    it runs in the model, and slower tuned records get applied.)"""
    tvm = tvm_compat.tvm()
    ms = tvm_compat.meta_schedule()
    tgt = target.tvm_target()
    out = [None] * len(wmods)
    inputs, where = [], []
    for i, wmod in enumerate(wmods):
        try:
            with tgt:
                passes = default_schedule_passes(target, tgt)
                if packable and packable[i]:
                    (gv, func), = list(wmod.functions_items())
                    new = schedule_packed_kernel(func, tgt, packable[i])
                    if new is None:
                        continue
                    sched = tvm.IRModule({gv: new})
                else:
                    # a fresh module: amp's CPU scheduling pass assigns into the module it is
                    # given
                    fresh = tvm.IRModule({gv: f for gv, f in wmod.functions_items()})
                    sched = tvm.transform.Sequential(passes)(fresh)
            args = ms.arg_info.ArgInfo.from_entry_func(sched, remove_preproc=True)
        except Exception:  # noqa: BLE001 - no default number for this kernel
            continue
        inputs.append((ms.builder.BuilderInput(sched, tgt), args))
        where.append(i)
    if not inputs:
        return out
    try:
        built = builder.build([b for b, _ in inputs])
        run_in, run_at = [], []
        for (_b, args), res, i in zip(inputs, built, where):
            if not res.error_msg:
                run_in.append(ms.runner.RunnerInput(res.artifact_path,
                                                    "cuda" if target.is_cuda else "cpu", args))
                run_at.append(i)
        futures = runner.run(run_in) if run_in else []
        for fut, i in zip(futures, run_at):
            res = fut.result()
            if not res.error_msg and res.run_secs:
                secs = [float(s) for s in res.run_secs]
                out[i] = sum(secs) / len(secs) * 1e6
        for res in built:
            remove_artifact(res.artifact_path)
    except Exception:  # noqa: BLE001 - tuning still proceeds without default numbers
        pass
    return out


def remove_artifact(path) -> None:
    import shutil

    if path:
        shutil.rmtree(os.path.dirname(str(path)), ignore_errors=True)
