"""amp's MetaSchedule extension objects: a search strategy that resumes (skips candidates already
in the database, stops at the time budget), a cost model that survives MetaSchedule's MLP errors,
and the measure callback that feeds amp's progress bar."""
from __future__ import annotations

import time

from .. import tvm_compat
from ..errors import last_line
from .results import FAILED_SECS, TaskResult, TuneProgress, estimate

_CLASSES: dict = {}  # made lazily: they subclass TVM classes


def resumable_strategy():
    """A search strategy around MetaSchedule's: drops candidates already in the database, stops
    at the time budget, and notes when its task is done."""
    if "strategy" in _CLASSES:
        return _CLASSES["strategy"]
    ms = tvm_compat.meta_schedule()

    @tvm_compat.derived_object
    class ResumableSearch(ms.search_strategy.PySearchStrategy):
        def __init__(self, inner, task, deadline, counters, empty_limit: int = 5):
            self.inner, self.task, self.deadline = inner, task, deadline
            self.counters, self.empty_limit = counters, empty_limit

        def _initialize_with_tune_context(self, context):
            self.inner._initialize_with_tune_context(context)

        def pre_tuning(self, max_trials, num_trials_per_iter, design_spaces, database=None,
                       cost_model=None):
            self.inner.pre_tuning(max_trials, num_trials_per_iter, design_spaces, database,
                                  cost_model)

        def post_tuning(self):
            self.task.done = True
            self.inner.post_tuning()

        def generate_measure_candidates(self):
            for _ in range(self.empty_limit):
                if self.deadline is not None and time.perf_counter() >= self.deadline:
                    self.counters["time"] = True
                    return None
                cands = self.inner.generate_measure_candidates()
                if cands is None:
                    return None
                fresh = [c for c in cands
                         if tvm_compat.structural_hash(c.sch.mod) not in self.task.measured]
                self.counters["skipped"] += len(cands) - len(fresh)
                if fresh:
                    return fresh
                self.inner.notify_runner_results([], [])
            self.counters["exhausted"] += 1
            return None

        def notify_runner_results(self, measure_candidates, results):
            for c in measure_candidates:
                self.task.measured.add(tvm_compat.structural_hash(c.sch.mod))
            self.inner.notify_runner_results(measure_candidates, results)

        def clone(self):
            return ResumableSearch(self.inner.clone(), self.task, self.deadline, self.counters,
                                   self.empty_limit)

    _CLASSES["strategy"] = ResumableSearch
    return ResumableSearch


def guarded_cost_model():
    """MetaSchedule's MLP cost model raises on a batch of one measured candidate (an IndexError
    in its ranking loss); an error in it must not end the run. Batches of one are not learned
    from, and a failing update or prediction falls back to random scores for that call."""
    if "cost" in _CLASSES:
        return _CLASSES["cost"]
    import numpy as np

    ms = tvm_compat.meta_schedule()

    @tvm_compat.derived_object
    class GuardedCostModel(ms.cost_model.PyCostModel):
        def __init__(self, inner, counters):
            super().__init__()
            self.inner, self.counters = inner, counters
            self.rng = np.random.default_rng(0)

        def load(self, path):
            self.inner.load(path)

        def save(self, path):
            self.inner.save(path)

        def update(self, context, candidates, results):
            if len(candidates) < 2:
                return
            try:
                self.inner.update(context, candidates, results)
            except Exception:  # noqa: BLE001 - see the class docstring
                self.counters["cost_model_errors"] += 1

        def predict(self, context, candidates):
            try:
                return np.asarray(self.inner.predict(context, candidates), dtype="float64")
            except Exception:  # noqa: BLE001 - see the class docstring
                self.counters["cost_model_errors"] += 1
                return self.rng.random(len(candidates))

    _CLASSES["cost"] = GuardedCostModel
    return GuardedCostModel


def progress_callback():
    if "callback" in _CLASSES:
        return _CLASSES["callback"]
    ms = tvm_compat.meta_schedule()

    @tvm_compat.derived_object
    class ProgressCallback(ms.measure_callback.PyMeasureCallback):
        def __init__(self, state):
            self.state = state

        def apply(self, task_scheduler, task_id, measure_candidates, builder_results,
                  runner_results):
            st = self.state
            c = st["counters"]
            task = st["tasks"][int(task_id)].result
            for b, r in zip(builder_results, runner_results):
                c["trials"] += 1
                task.trials_this_run += 1
                task.records += 1
                if b.error_msg:
                    c["failed_builds"] += 1
                    task.failed_builds += 1
                    note_error(task, "build: " + last_line(b.error_msg))
                    continue
                secs = [float(s) for s in (r.run_secs or [])]
                if r.error_msg or not secs or max(secs) >= FAILED_SECS:
                    c["failed_runs"] += 1
                    task.failed_runs += 1
                    note_error(task, "run: " + last_line(r.error_msg or "no timing"))
                    continue
                task.valid_records += 1
                us = sum(secs) / len(secs) * 1e6
                if task.best_us is None or us < task.best_us:
                    task.best_us = us
            elapsed = time.perf_counter() - st["start"]
            done = c["trials"]
            eta = elapsed / done * max(0, st["budget"] - done) if done else None
            if st["deadline"] is not None:
                left = max(0.0, st["deadline"] - time.perf_counter())
                eta = left if eta is None else min(eta, left)
            results = [t.result for t in st["tasks"]]
            st["report"](TuneProgress("tune", sum(t.done for t in st["tasks"]),
                                      len(st["tasks"]), done, st["budget"],
                                      estimate(results)[1], elapsed, eta))

    _CLASSES["callback"] = ProgressCallback
    return ProgressCallback


def note_error(task: TaskResult, text: str, keep: int = 3) -> None:
    if text not in task.errors and len(task.errors) < keep:
        task.errors.append(text)
