"""One tuning run: extract the model's tasks, time amp's default schedules, and let
MetaSchedule's gradient task scheduler search them into the database (resumably)."""
from __future__ import annotations

import datetime as _dt
import logging
import os
import time
from pathlib import Path

from .. import tvm_compat
from ..compile.pipeline import constant_call_args
from ..compile.records import open_database, read_summary, repair_database
from ..errors import TuneError, last_line
from .builder import make_builder, make_runner
from .config import TuneConfig, choose_cost_model, resolve_strategy
from .database import save_summary
from .extensions import guarded_cost_model, progress_callback, resumable_strategy
from .results import Progress, TaskResult, TuneProgress, TuneResult, estimate
from .tasks import (Task, count_records, fused_module, search_order, time_defaults,
                    tunable_tasks, tuning_target)


def run_tuning(model, cfg, target, tune_cfg: TuneConfig, progress: Progress | None) -> TuneResult:
    ms = tvm_compat.meta_schedule()
    logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)
    start = time.perf_counter()
    deadline = start + tune_cfg.time_budget_s if tune_cfg.time_budget_s else None
    report = progress or (lambda _p: None)
    strategy = resolve_strategy(tune_cfg.strategy)
    cost_kind, cost_note = choose_cost_model(tune_cfg.cost_model)
    if strategy != "evolutionary":
        cost_kind, cost_note = "random", f"no cost model ({strategy} does not use one)"
    notes = [cost_note]
    tgt = tuning_target(target)
    db_dir = Path(tune_cfg.db_dir)

    report(TuneProgress("extract"))
    fused = fused_module(model, cfg, target)
    extracted = tunable_tasks(ms.relax_integration.extract_tasks(fused, tgt))
    if not extracted:
        raise TuneError("the converted model has no kernels to tune")

    notes += repair_database(db_dir) if db_dir.exists() else []
    db = open_database(db_dir, create=True)
    summary = read_summary(db_dir)
    old_tasks = {t.get("workload"): t for t in summary.get("tasks", [])}

    workers = tune_cfg.workers or max(1, os.cpu_count() or 1)
    tasks: list[Task] = []
    for i, ext in enumerate(extracted):
        wmod = ext.dispatched[0]
        wl = ms.utils.shash2hex(wmod)
        db.commit_workload(wmod)  # workloads first, so every record line has its workload
        res = TaskResult(task=ext.task_name, workload=wl, weight=int(ext.weight))
        res.default_us = (old_tasks.get(wl) or {}).get("default_us")
        tasks.append(Task(ctx=None, result=res, measured=set()))
        tasks[-1].ctx = (wmod, ext.task_name, i)
    count_records(db, tasks)
    records_before = sum(t.result.records for t in tasks)

    builder = make_builder(workers, tune_cfg.build_timeout_s)
    runner = make_runner(tune_cfg, target)

    if tune_cfg.measure_default:
        todo = [t for t in tasks if t.result.default_us is None]
        if todo:
            report(TuneProgress("default schedules", 0, len(todo),
                                elapsed_s=time.perf_counter() - start))
            packable = None
            if not target.is_cuda:
                # the weights amp's CPU rules pre-pack in the model (constants at the call)
                consts = constant_call_args(fused)
                packable = [consts.get(t.result.task, set()) for t in todo]
            for t, us in zip(todo, time_defaults([t.ctx[0] for t in todo], target, builder,
                                                   runner, packable)):
                t.result.default_us = us
    tasks = [tasks[i] for i in search_order([t.result for t in tasks])]
    save_summary(db_dir, target, tune_cfg, strategy, cost_kind, tasks, summary, None)

    budget = max(0, tune_cfg.trials - records_before)
    stopped = "budget"
    counters = {"trials": 0, "skipped": 0, "failed_builds": 0, "failed_runs": 0,
                "exhausted": 0, "time": False, "cost_model_errors": 0}
    if budget == 0:
        stopped = "already tuned"
        notes.append(f"{db_dir} already holds {records_before} records for this model "
                     f"(--trials {tune_cfg.trials}); pass a larger --trials to tune further")
    elif deadline is not None and time.perf_counter() >= deadline:
        stopped = "time budget"
    else:
        contexts = []
        for t in tasks:
            wmod, name, i = t.ctx
            inner = search_strategy(strategy, tune_cfg)
            wrapper = resumable_strategy()(inner, t, deadline, counters)
            ctx = ms.TuneContext(mod=wmod, target=tgt, space_generator="post-order-apply",
                                 search_strategy=wrapper, task_name=name,
                                 rand_state=(tune_cfg.seed + i) if tune_cfg.seed is not None
                                 else -1,
                                 num_threads=workers, logger=quiet_logger())
            contexts.append(ctx)
        callbacks = list(ms.measure_callback.MeasureCallback.create("default"))
        state = {"tasks": tasks, "start": start, "budget": budget, "deadline": deadline,
                 "counters": counters, "report": report}
        callbacks.append(progress_callback()(state))
        cost_model = ms.cost_model.CostModel.create(cost_kind, num_tuning_cores=workers,
                                                    tree_method="auto") \
            if cost_kind == "xgb" else ms.cost_model.CostModel.create(cost_kind)
        if cost_kind == "mlp":
            cost_model = guarded_cost_model()(cost_model, counters)
        scheduler = ms.task_scheduler.TaskScheduler.create(
            "gradient", seed=tune_cfg.seed if tune_cfg.seed is not None else -1)
        report(TuneProgress("tune", 0, len(tasks), 0, budget,
                            elapsed_s=time.perf_counter() - start))
        try:
            scheduler.tune(tasks=contexts, task_weights=[float(t.result.weight) for t in tasks],
                           max_trials_global=budget, max_trials_per_task=budget,
                           num_trials_per_iter=max(1, min(tune_cfg.trials_per_iter, budget)),
                           builder=builder, runner=runner, measure_callbacks=callbacks,
                           database=db, cost_model=cost_model)
        except Exception as exc:  # noqa: BLE001 - MetaSchedule's own failure
            raise TuneError(f"stage 'tune {target.describe()}': MetaSchedule failed: "
                            f"{last_line(exc)} (records measured so far are kept in "
                            f"{db_dir})") from None
        if counters["time"]:
            stopped = "time budget"
        elif counters["trials"] < budget:
            stopped = "search space exhausted"
    if counters["cost_model_errors"]:
        notes.append(f"the {cost_kind} cost model failed {counters['cost_model_errors']} "
                     f"time(s); those rounds ranked candidates at random")
    count_records(db, tasks)
    seconds = time.perf_counter() - start
    run = {"started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "seconds": round(seconds, 2), "trials": counters["trials"],
           "skipped_measured": counters["skipped"], "failed_builds": counters["failed_builds"],
           "failed_runs": counters["failed_runs"], "stopped": stopped, "strategy": strategy,
           "cost_model": cost_kind}
    save_summary(db_dir, target, tune_cfg, strategy, cost_kind, tasks, summary, run)
    report(TuneProgress("done", sum(t.done for t in tasks), len(tasks), counters["trials"],
                        budget, estimate([t.result for t in tasks])[1], seconds, 0.0))
    if counters["trials"] and counters["failed_builds"] + counters["failed_runs"] \
            >= counters["trials"]:
        notes.append("every candidate of this run failed to build or run; see "
                     f"{db_dir}/summary.json and rerun with --debug")
    return TuneResult(
        db_dir=str(db_dir), target=target.spec, strategy=strategy, cost_model=cost_kind,
        tasks=[t.result for t in tasks], trials_budget=tune_cfg.trials,
        records_before=records_before, trials_run=counters["trials"],
        skipped_measured=counters["skipped"], failed_builds=counters["failed_builds"],
        failed_runs=counters["failed_runs"], seconds=seconds, stopped=stopped, notes=notes)


def search_strategy(strategy: str, tune_cfg: TuneConfig):
    """MetaSchedule's search strategy for one task. The evolutionary search keeps a population of
    ``tune_cfg.population`` (default 8 x trials_per_iter = 128) instead of MetaSchedule's 512:
    a round's time (sampling, mutating and post-processing every member) scales with it: one
    round of a tensor-core convolution took ~100 s of CPU on 2 cores at 512, ~30 s at 128."""
    ms = tvm_compat.meta_schedule()
    if strategy != "evolutionary":
        return ms.search_strategy.SearchStrategy.create(strategy)
    population = tune_cfg.population or max(64, 8 * tune_cfg.trials_per_iter)
    return ms.search_strategy.EvolutionarySearch(population_size=population,
                                                 init_min_unmeasured=min(50, population))


def quiet_logger():
    log = logging.getLogger("amp.tune.metaschedule")
    log.setLevel(logging.WARNING)
    return log
