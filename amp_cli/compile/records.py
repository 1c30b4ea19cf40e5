"""Tuning records at build time: open the database ``amp tune`` writes (repairing a run that
was killed mid-write), apply its best schedules, and say which kernels took one.

DIR layout (a MetaSchedule JSON database, readable by TVM's own tools)::

    DIR/database_workload.json       one workload (a kernel's TIR) per line
    DIR/database_tuning_record.json  one measured candidate per line (appended as measured)
    DIR/summary.json                 per task: weight, records, best / default latency

The writing side (tuning runs, compaction, the summary) is ``amp_cli.tuning.database``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from .. import tvm_compat
from ..backends.cuda.kernels.intrinsics import register_tensor_intrinsics
from ..errors import TuneError, last_line
from ..ir_attrs import TUNED_WORKLOAD
from ..ir_module import replace_functions

WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"
SUMMARY_FILE = "summary.json"


def repair_database(db_dir: str | Path) -> list[str]:
    """Make DIR's JSON database readable after a crash: drop a truncated last line of either
    file and any unreadable record line. Returns notes on what was dropped."""
    notes = []
    for name in (WORKLOAD_FILE, RECORD_FILE):
        path = Path(db_dir) / name
        if not path.exists():
            continue
        raw = path.read_bytes()
        if not raw:
            continue
        lines = raw.split(b"\n")
        tail_ok = raw.endswith(b"\n")
        keep, dropped = [], 0
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except ValueError:
                last = i == len(lines) - 1 or (i == len(lines) - 2 and not lines[-1])
                if name == WORKLOAD_FILE and not last:
                    # records point at workloads by line number: cannot drop one in the middle
                    raise TuneError(f"{path}: line {i + 1} is not valid JSON; the tuning "
                                    f"database is damaged (move it away and tune again)")
                dropped += 1
                continue
            keep.append(line)
        if dropped or not tail_ok:
            tmp = path.with_name(f".{name}.tmp-{os.getpid()}")
            tmp.write_bytes(b"".join(k + b"\n" for k in keep))
            os.replace(tmp, path)
            if dropped:
                notes.append(f"{name}: dropped {dropped} unreadable line(s) (a run was "
                             f"interrupted while writing)")
    return notes


def open_database(db_dir: str | Path, create: bool = False):
    """The JSONDatabase in DIR (repaired first)."""
    ms = tvm_compat.meta_schedule()
    path = Path(db_dir)
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TuneError(f"cannot create tuning directory {path}: {exc.strerror}") from None
    elif not (path / WORKLOAD_FILE).exists():
        raise TuneError(f"{path} holds no tuning database ({WORKLOAD_FILE} is missing); "
                        f"write one with `amp tune ... --db {path}`")
    repair_database(path)
    register_tensor_intrinsics()  # records name them (tensor-core schedules)
    try:
        return ms.database.JSONDatabase(work_dir=str(path), allow_missing=create)
    except Exception as exc:  # noqa: BLE001 - TVM's reader
        raise TuneError(f"cannot read the tuning database in {path}: "
                        f"{last_line(exc)}") from None


def read_summary(db_dir: str | Path) -> dict:
    path = Path(db_dir) / SUMMARY_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def apply_database_passes(db_dir: str, target) -> list:
    """Relax passes that give every kernel with a record in DIR its best tuned schedule (and mark
    it scheduled, so amp's default rules that run next leave it alone) and tag it with
    ``amp.tuned_workload`` for :func:`tuned_kernel_summary`."""
    tvm = tvm_compat.tvm()
    relax = tvm_compat.relax()
    ms = tvm_compat.meta_schedule()
    tgt = target.tvm_target() if hasattr(target, "tvm_target") else target
    db = open_database(db_dir)
    # a record slower than amp's default schedule (as amp tune measured both) is not applied
    slower = {t.get("workload") for t in read_summary(db_dir).get("tasks", [])
              if t.get("best_us") and t.get("default_us") and t["best_us"] >= t["default_us"]}
    normalize = tvm.get_global_func("tvm.s_tir.meta_schedule.normalize_mod")
    prim_func = tvm_compat.prim_func_class()

    @tvm.transform.module_pass(opt_level=0, name="AmpApplyTuningDatabase")
    def _apply(mod, _ctx):
        tuned = {}
        for gv, func in mod.functions_items():
            if not isinstance(func, prim_func):
                continue
            wmod = normalize(func)
            wl = ms.utils.shash2hex(wmod)
            if wl not in slower and db.has_workload(wmod) and \
                    db.query_tuning_record(wmod, tgt, gv.name_hint):
                tuned[gv.name_hint] = wl
        if not tuned:
            return mod
        picked = tvm.IRModule({gv: f for gv, f in mod.functions_items()
                               if gv.name_hint in tuned})
        with tgt, db:
            # the C++ pass reads Target.current() when it is created, and the database in scope
            picked = relax.transform.MetaScheduleApplyDatabase()(picked)
        return replace_functions(mod, {gv: func.with_attr(TUNED_WORKLOAD, tuned[gv.name_hint])
                                       for gv, func in picked.functions_items()})

    return [_apply]


def tuned_kernel_summary(db_dir: str, lowered_mod, target) -> dict:  # noqa: ARG001
    """Per kernel of a built module: tuned (a record from DIR was applied) or default, and the
    expected speedup = amp's default schedule latency / best tuned latency, both as measured by
    ``amp tune`` (None when the default was not timed)."""
    summary = read_summary(db_dir)
    by_workload = {t.get("workload"): t for t in summary.get("tasks", [])}
    prim_func = tvm_compat.prim_func_class()
    kernels, tuned = [], 0
    for gv, func in sorted(lowered_mod.functions_items(), key=lambda kv: kv[0].name_hint):
        if not isinstance(func, prim_func):
            continue
        attrs = func.attrs
        wl = str(attrs[TUNED_WORKLOAD]) if attrs is not None and TUNED_WORKLOAD in attrs else None
        entry = {"kernel": gv.name_hint, "schedule": "tuned" if wl else "default",
                 "expected_speedup": None}
        if wl:
            tuned += 1
            t = by_workload.get(wl) or {}
            if t.get("best_us") and t.get("default_us"):
                entry["expected_speedup"] = round(t["default_us"] / t["best_us"], 3)
            entry["best_us"] = t.get("best_us")
            entry["default_us"] = t.get("default_us")
        kernels.append(entry)
    return {"tuned": tuned, "default": len(kernels) - tuned, "db": str(db_dir),
            "expected_speedup_means": "amp default schedule latency / best tuned latency, "
                                      "both measured by amp tune",
            "kernels": kernels}
