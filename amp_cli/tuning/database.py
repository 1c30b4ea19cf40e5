"""The tuning database directory, writing side: the summary amp tune keeps beside MetaSchedule's
JSON files, and compaction to the best record per kernel (reading and applying records is
``amp_cli.compile.records``)."""
from __future__ import annotations

import datetime as _dt
import json
import os
import tempfile
from pathlib import Path

from .. import tvm_compat
from ..compile.records import SUMMARY_FILE, open_database, read_summary
from ..report import clean_json
from .results import estimate

SUMMARY_VERSION = 1


def compact_database(db_dir: str | Path, out_dir: str | Path) -> int:
    """Write the best record of every kernel in DB_DIR (and the workloads of those kernels
    only) to OUT_DIR, with DB_DIR's summary.json: the small database to commit next to a model
    (``--tuning-db`` applies the same schedules from it; ``amp tune --db OUT_DIR`` resumes from
    it, with the search history dropped). OUT_DIR may be DB_DIR; it is replaced only once the
    new database is complete. Returns the number of records kept."""
    import shutil

    ms = tvm_compat.meta_schedule()
    src = open_database(db_dir)
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.compact-", dir=str(out.parent)))
    try:
        os.chmod(tmp, default_mode(0o777))  # mkdtemp makes it 0700
        dst = ms.database.JSONDatabase(work_dir=str(tmp), allow_missing=True)
        src.dump_pruned(dst)  # MetaSchedule's: the best valid record per workload and target
        kept = len(dst)
        summary = read_summary(db_dir)
        if summary:
            summary["compacted"] = {"from_records": len(src), "records": kept}
            write_summary(tmp, summary)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return kept


def write_summary(db_dir: str | Path, data: dict) -> None:
    path = Path(db_dir) / SUMMARY_FILE
    fd, tmp = tempfile.mkstemp(prefix=".summary.", dir=str(path.parent))
    with os.fdopen(fd, "w") as f:
        json.dump(clean_json(data), f, indent=2)
        f.write("\n")
    os.chmod(tmp, default_mode(0o666))  # mkstemp makes it 0600
    os.replace(tmp, path)


def default_mode(mode: int) -> int:
    """MODE less the process umask: what a plain open() / mkdir() would create."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def save_summary(db_dir, target, tune_cfg, strategy, cost_kind, tasks, old, run) -> None:
    runs = list(old.get("runs", []))
    if run is not None:
        runs.append(run)
    # keep tasks of other models tuned into the same DIR
    mine = {t.result.workload for t in tasks}
    others = [t for t in old.get("tasks", []) if t.get("workload") not in mine]
    d, b = estimate([t.result for t in tasks])
    write_summary(db_dir, {
        "summary_version": SUMMARY_VERSION,
        "updated": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "target": target.spec, "strategy": strategy, "cost_model": cost_kind,
        "trials_budget": tune_cfg.trials,
        "records": sum(t.result.records for t in tasks),
        "estimated_default_ms": d, "estimated_tuned_ms": b,
        "latency_means": "mean run time in microseconds per kernel call; default = amp's "
                         "default schedule, best = best tuned record",
        "tasks": [t.result.to_dict() for t in tasks] + others,
        "runs": runs[-50:],
    })
