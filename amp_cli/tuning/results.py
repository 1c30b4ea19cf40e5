"""What a tuning run reports: progress events, per-kernel results, the run's result."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

FAILED_SECS = 1e9  # MetaSchedule stores failed measurements as 1e10 s


@dataclass
class TuneProgress:
    """What a progress callback receives, after each measured batch (and at phase changes)."""

    phase: str  # "extract", "default schedules", "tune", "done"
    tasks_done: int = 0
    tasks_total: int = 0
    trials_done: int = 0  # this run
    trials_total: int = 0  # this run's budget
    best_ms: float | None = None  # sum over tasks of weight x best latency so far
    elapsed_s: float = 0.0
    eta_s: float | None = None


@dataclass
class TaskResult:
    task: str  # kernel name (the first one, when several kernels share the workload)
    workload: str  # structural hash of the kernel's TIR (the database's key)
    weight: int  # calls per model run
    records: int = 0  # measured candidates in DIR
    valid_records: int = 0  # ... that built and ran
    trials_this_run: int = 0
    best_us: float | None = None
    default_us: float | None = None  # amp's default schedule, same runner
    failed_builds: int = 0  # this run
    failed_runs: int = 0  # this run
    errors: list[str] = field(default_factory=list)  # first distinct build/run errors, this run

    @property
    def speedup(self) -> float | None:
        if self.best_us and self.default_us:
            return self.default_us / self.best_us
        return None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["speedup"] = self.speedup
        return d


@dataclass
class TuneResult:
    db_dir: str
    target: dict
    strategy: str  # MetaSchedule's name
    cost_model: str
    tasks: list[TaskResult]
    trials_budget: int
    records_before: int
    trials_run: int
    skipped_measured: int  # candidates dropped because DIR already had them
    failed_builds: int
    failed_runs: int
    seconds: float
    stopped: str  # "budget", "time budget", "search space exhausted", "already tuned"
    notes: list[str] = field(default_factory=list)

    @property
    def records_total(self) -> int:
        return sum(t.records for t in self.tasks)

    @property
    def estimated_ms(self) -> tuple[float | None, float | None]:
        """(default, tuned) sums of weight x kernel latency over tasks with both numbers."""
        return estimate(self.tasks)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["tasks"] = [t.to_dict() for t in self.tasks]
        d["records_total"] = self.records_total
        d["estimated_default_ms"], d["estimated_tuned_ms"] = self.estimated_ms
        return d


Progress = Callable[[TuneProgress], None]


def estimate(tasks) -> tuple[float | None, float | None]:
    default = tuned = 0.0
    have = False
    for t in tasks:
        if t.default_us is None and t.best_us is None:
            continue
        have = True
        d = t.default_us if t.default_us is not None else t.best_us
        b = min(x for x in (t.best_us, t.default_us) if x is not None)
        default += t.weight * d
        tuned += t.weight * b
    if not have:
        return None, None
    return default / 1e3, tuned / 1e3
