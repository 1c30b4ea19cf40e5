"""The tune stage: MetaSchedule tuning of a converted model, with resumable records.

The tasks are the fused kernels of the *converted* module (amp's mixed-precision pass, then the
same Relax pipeline ``amp convert`` builds with, stopped right after FuseTIR), weighted by how
often each kernel is called. Candidates are compiled the way ``amp convert`` compiles: for CUDA
through amp's TIR pipeline with the lane legalizer (``amp_cli.legalize``).

DIR layout (a MetaSchedule JSON database, readable by TVM's own tools)::

    DIR/database_workload.json       one workload (a kernel's TIR) per line
    DIR/database_tuning_record.json  one measured candidate per line (appended as measured)
    DIR/summary.json                 per task: weight, records, best / default latency

Resuming: ``trials`` is the budget for the whole DIR. A rerun counts the records already in DIR
for the model's tasks, tunes only the rest of the budget, and drops candidates that are already
recorded before they are built or measured. A run killed at any moment (SIGKILL included)
loses at most the candidates in flight: records are appended line by line and a truncated last
line is dropped when DIR is opened again.

>>> import amp_cli
>>> from amp_cli.tune import TuneConfig, tune
>>> model = amp_cli.load("examples/generated/tiny_cnn.onnx")                 # doctest: +SKIP
>>> res = tune(model, amp_cli.ConvertConfig(target="llvm"),
...            TuneConfig(db_dir="tuning/", trials=64))                      # doctest: +SKIP
>>> conv = amp_cli.convert(model, amp_cli.ConvertConfig(target="llvm",
...                                                     tuning_db="tuning/"))  # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import tvm_compat
from .errors import AmpError, ConfigError, TuneError

WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"
SUMMARY_FILE = "summary.json"
SUMMARY_VERSION = 1
TUNED_ATTR = "amp.tuned_workload"  # set on PrimFuncs that got a schedule from the database

# user-facing name -> MetaSchedule search strategy
STRATEGIES = {
    "evolutionary": "evolutionary",
    "ansor": "evolutionary",
    "replay-trace": "replay-trace",
    "autotvm": "replay-trace",
    "replay-func": "replay-func",
}
COST_MODELS = ("auto", "xgb", "mlp", "random")
FAILED_SECS = 1e9  # MetaSchedule stores failed measurements as 1e10 s


@dataclass
class TuneConfig:
    """How to tune (the model, target and precision come from a ConvertConfig)."""

    db_dir: str
    trials: int = 64  # measured candidates in DIR for this model, over all runs
    time_budget_s: float | None = None  # wall-clock budget of this run
    strategy: str = "evolutionary"  # a key of STRATEGIES
    workers: int | None = None  # parallel candidate builds (and RPC sessions)
    rpc_tracker: str | None = None  # HOST:PORT
    rpc_key: str | None = None
    cost_model: str = "auto"  # auto: xgb if importable, else mlp (torch), else random
    trials_per_iter: int = 16  # candidates per search round of a task
    build_timeout_s: float = 60.0
    run_timeout_s: float = 30.0
    repeat: int = 3  # timing repeats per candidate (each >= min_repeat_ms)
    min_repeat_ms: int = 50
    seed: int | None = None
    population: int | None = None  # evolutionary search population (None: 8 x trials_per_iter)
    measure_default: bool = True  # also time amp's default schedule of each task

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


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
        return _estimate(self.tasks)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["tasks"] = [t.to_dict() for t in self.tasks]
        d["records_total"] = self.records_total
        d["estimated_default_ms"], d["estimated_tuned_ms"] = self.estimated_ms
        return d


Progress = Callable[[TuneProgress], None]


# ---------------------------------------------------------------------------------------------
# small parsers used by the CLI

def parse_duration(text: str) -> float:
    """'30m', '1h30m', '90s', '45' (seconds) -> seconds."""
    s = str(text).strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", s):
        return float(s)
    m = re.fullmatch(r"(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s)?", s)
    if not s or not m or not any(m.groups()):
        raise ConfigError(f"cannot read duration '{text}'; use e.g. 90s, 30m, 1h30m")
    h, mi, se = (float(g) if g else 0.0 for g in m.groups())
    return h * 3600 + mi * 60 + se


def parse_tracker(text: str) -> tuple[str, int]:
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"--rpc-tracker must be HOST:PORT, got '{text}'")
    return host, int(port)


def resolve_strategy(name: str) -> str:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ConfigError(f"unknown strategy '{name}'; choose one of "
                          f"{', '.join(STRATEGIES)}") from None


def choose_cost_model(requested: str) -> tuple[str, str]:
    """(MetaSchedule cost model kind, note). 'auto': xgb if xgboost imports, else mlp if torch
    imports, else random."""
    import importlib.util

    if requested not in COST_MODELS:
        raise ConfigError(f"unknown cost model '{requested}'; choose one of "
                          f"{', '.join(COST_MODELS)}")
    have_xgb = importlib.util.find_spec("xgboost") is not None
    have_torch = importlib.util.find_spec("torch") is not None
    if requested == "xgb" and not have_xgb:
        raise ConfigError("cost model 'xgb' needs xgboost (pip install xgboost); or use "
                          "--cost-model mlp/random")
    if requested == "mlp" and not have_torch:
        raise ConfigError("cost model 'mlp' needs torch; or use --cost-model xgb/random")
    if requested != "auto":
        return requested, f"cost model {requested} (requested)"
    if have_xgb:
        return "xgb", "cost model xgb (xgboost is installed)"
    if have_torch:
        return "mlp", "cost model mlp (xgboost is not installed; MetaSchedule's MLP on torch)"
    return "random", ("cost model random: neither xgboost nor torch is installed, so the "
                      "evolutionary search has no learned model (install xgboost for better "
                      "results)")


# ---------------------------------------------------------------------------------------------
# the database directory

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
    from .schedule.tensorcore import register_tensor_intrinsics

    register_tensor_intrinsics()  # records name them (tensor-core schedules)
    try:
        return ms.database.JSONDatabase(work_dir=str(path), allow_missing=create)
    except Exception as exc:  # noqa: BLE001 - TVM's reader
        raise TuneError(f"cannot read the tuning database in {path}: "
                        f"{_last_line(exc)}") from None


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
        os.chmod(tmp, _default_mode(0o777))  # mkdtemp makes it 0700
        dst = ms.database.JSONDatabase(work_dir=str(tmp), allow_missing=True)
        src.dump_pruned(dst)  # MetaSchedule's: the best valid record per workload and target
        kept = len(dst)
        summary = read_summary(db_dir)
        if summary:
            summary["compacted"] = {"from_records": len(src), "records": kept}
            _write_summary(tmp, summary)
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


def read_summary(db_dir: str | Path) -> dict:
    path = Path(db_dir) / SUMMARY_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_summary(db_dir: str | Path, data: dict) -> None:
    from .report import _clean

    path = Path(db_dir) / SUMMARY_FILE
    fd, tmp = tempfile.mkstemp(prefix=".summary.", dir=str(path.parent))
    with os.fdopen(fd, "w") as f:
        json.dump(_clean(data), f, indent=2)
        f.write("\n")
    os.chmod(tmp, _default_mode(0o666))  # mkstemp makes it 0600
    os.replace(tmp, path)


def _default_mode(mode: int) -> int:
    """MODE less the process umask: what a plain open() / mkdir() would create."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


# ---------------------------------------------------------------------------------------------
# applying records (used by build.py)

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
        out = mod.clone()
        for gv, func in picked.functions_items():
            out[gv] = func.with_attr(TUNED_ATTR, tuned[gv.name_hint])
        return out

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
        wl = str(attrs[TUNED_ATTR]) if attrs is not None and TUNED_ATTR in attrs else None
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


# ---------------------------------------------------------------------------------------------
# building candidates (runs in MetaSchedule's builder worker processes)

_CUDA_PIPELINE: list = []


def build_candidate(mod, target, _params=None):
    """MetaSchedule f_build: amp's TIR pipeline (the lane legalizer on CUDA)."""
    tvm = tvm_compat.tvm()
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    if target.kind.name == "cuda":
        # tensor-core intrinsics (what MetaSchedule's default builder imports; ~30 s of CPU per
        # worker, so only where tensor-core traces can occur)
        from .schedule.tensorcore import register_tensor_intrinsics

        register_tensor_intrinsics()
        if not _CUDA_PIPELINE:  # one registration per worker process
            from .legalize import cuda_tir_pipeline

            _CUDA_PIPELINE.append(cuda_tir_pipeline(target))
        return tvm.tirx.build(mod, target=target, pipeline=_CUDA_PIPELINE[0])
    return tvm.tirx.build(mod, target=target)


def _build_and_export(mod, target) -> str:
    """Runs in a builder worker: build one candidate, export it (tar) for the runner."""
    from tvm.support.tar import tar

    rt_mod = build_candidate(mod, target)
    path = os.path.join(tempfile.mkdtemp(prefix="amp-cand-"), "cand." + tar.output_format)
    rt_mod.export_library(path, fcompile=tar)
    return path


def _make_builder(workers: int, timeout_s: float):
    """A MetaSchedule builder that builds candidates in worker processes with amp's pipeline.

    Unlike ms.builder.LocalBuilder (which starts fresh workers for every batch: several seconds
    of `import tvm` each time), the workers are kept and recycled every 32 builds. A candidate
    that crashes or hangs its worker becomes that candidate's build error; the run goes on.
    """
    if "builder" not in _CLASSES:
        ms = tvm_compat.meta_schedule()
        from tvm.ir.utils import derived_object  # noqa: PLC0415 - version-bound
        from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

        @derived_object
        class AmpBuilder(ms.builder.PyBuilder):
            def __init__(self, max_workers, timeout_sec):
                super().__init__()
                self.timeout_sec = timeout_sec
                self.pool = PopenPoolExecutor(max_workers=max_workers, timeout=timeout_sec,
                                              maximum_process_uses=32)

            def build(self, build_inputs):
                out = []
                jobs = [(b.mod, b.target) for b in build_inputs]
                for r in self.pool.map_with_error_catching(lambda x: _build_and_export(*x),
                                                           jobs):
                    if r.status == StatusKind.COMPLETE:
                        out.append(ms.builder.BuilderResult(r.value, None))
                    elif r.status == StatusKind.TIMEOUT:
                        out.append(ms.builder.BuilderResult(
                            None, f"amp builder: timeout after {self.timeout_sec} s"))
                    else:
                        out.append(ms.builder.BuilderResult(
                            None, f"amp builder: {_last_line(r.value)}"))
                return out

        _CLASSES["builder"] = AmpBuilder
    return _CLASSES["builder"](workers, timeout_s)


# ---------------------------------------------------------------------------------------------
# tuning

def tune(model, cfg, tune_cfg: TuneConfig, progress: Progress | None = None,
         isolate: bool = True) -> TuneResult:
    """Tune the kernels of `model` converted with `cfg` (a ConvertConfig) into ``tune_cfg.db_dir``.

    Runs in a sandboxed child process: a TVM crash becomes a TuneError naming the stage, and the
    records written until then stay in DIR.
    """
    from .sandbox import run_isolated
    from .target import resolve_target

    target = resolve_target(cfg.target)
    resolve_strategy(tune_cfg.strategy)
    choose_cost_model(tune_cfg.cost_model)
    if tune_cfg.trials < 0:
        raise ConfigError("--trials must be >= 0")
    if tune_cfg.rpc_tracker:
        _check_tracker(tune_cfg.rpc_tracker)
        if not tune_cfg.rpc_key:
            raise ConfigError("--rpc-tracker needs --rpc-key (the device key the RPC servers "
                              "registered with)")
    stage = f"tune {target.describe()}"
    try:
        return run_isolated(_tune, model, cfg, target, tune_cfg, progress, stage=stage,
                            isolate=isolate)
    except AmpError as exc:
        if isinstance(exc, (TuneError, ConfigError)):
            raise
        raise TuneError(f"{exc} (records measured so far are kept in {tune_cfg.db_dir})") \
            from exc
    except Exception as exc:  # noqa: BLE001 - not isolated: same contract
        raise TuneError(f"stage '{stage}' failed: {_last_line(exc)} (records measured so far "
                        f"are kept in {tune_cfg.db_dir})") from exc


def fused_module(model, cfg, target):
    """The converted module after amp's Relax pipeline up to FuseTIR (what build schedules)."""
    from .convert import prepare_config
    from .precision import convert_precision

    tvm = tvm_compat.tvm()
    cfg = prepare_config(cfg, target)
    mod, _report = convert_precision(model.mod, cfg.precision, model.node_types)
    captured = {}

    @tvm.transform.module_pass(opt_level=0, name="AmpCaptureFused")
    def _capture(m, _ctx):
        captured["mod"] = m
        raise _Captured()  # stop the pipeline here (TVM re-raises it as a RuntimeError)

    from .build import relax_pipeline

    with target.tvm_target():
        pipeline = relax_pipeline(target, cuda=cfg.cuda, extra_schedule_passes=[_capture])
        try:
            pipeline(mod)
        except Exception:  # noqa: BLE001 - the capture's stop, or a real error
            if "mod" not in captured:
                raise
    return captured["mod"]


class _Captured(Exception):
    pass


@dataclass
class _Task:
    ctx: object
    result: TaskResult
    measured: set  # structural hashes of candidates already in the database
    done: bool = False


def tunable_tasks(tasks) -> list:
    """MetaSchedule's extracted tasks less amp's own kernels (attention, layer norm + cast),
    which are scheduled already (``tirx.is_scheduled`` on the PrimFunc): nothing to tune."""
    return [t for t in tasks
            if not any(f.attrs and f.attrs.get("tirx.is_scheduled", False)
                       for _, f in t.mod.functions_items())]


def _tune(model, cfg, target, tune_cfg: TuneConfig, progress: Progress | None) -> TuneResult:
    tvm = tvm_compat.tvm()
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
    tasks: list[_Task] = []
    for i, ext in enumerate(extracted):
        wmod = ext.dispatched[0]
        wl = ms.utils.shash2hex(wmod)
        db.commit_workload(wmod)  # workloads first, so every record line has its workload
        res = TaskResult(task=ext.task_name, workload=wl, weight=int(ext.weight))
        res.default_us = (old_tasks.get(wl) or {}).get("default_us")
        tasks.append(_Task(ctx=None, result=res, measured=set()))
        tasks[-1].ctx = (wmod, ext.task_name, i)
    _count_records(db, tasks)
    records_before = sum(t.result.records for t in tasks)

    builder = _make_builder(workers, tune_cfg.build_timeout_s)
    runner = _make_runner(tune_cfg, target)

    if tune_cfg.measure_default:
        todo = [t for t in tasks if t.result.default_us is None]
        if todo:
            report(TuneProgress("default schedules", 0, len(todo),
                                elapsed_s=time.perf_counter() - start))
            packable = None
            if not target.is_cuda:
                # the weights amp's CPU rules pre-pack in the model (constants at the call)
                from .schedule.cpu import _constant_call_args

                consts = _constant_call_args(fused)
                packable = [consts.get(t.result.task, set()) for t in todo]
            for t, us in zip(todo, _time_defaults([t.ctx[0] for t in todo], target, builder,
                                                   runner, packable)):
                t.result.default_us = us
    tasks = [tasks[i] for i in search_order([t.result for t in tasks])]
    _save_summary(db_dir, target, tune_cfg, strategy, cost_kind, tasks, summary, None)

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
            wrapper = _resumable_strategy()(inner, t, deadline, counters)
            ctx = ms.TuneContext(mod=wmod, target=tgt, space_generator="post-order-apply",
                                 search_strategy=wrapper, task_name=name,
                                 rand_state=(tune_cfg.seed + i) if tune_cfg.seed is not None
                                 else -1,
                                 num_threads=workers, logger=_quiet_logger())
            contexts.append(ctx)
        callbacks = list(ms.measure_callback.MeasureCallback.create("default"))
        state = {"tasks": tasks, "start": start, "budget": budget, "deadline": deadline,
                 "counters": counters, "report": report}
        callbacks.append(_progress_callback()(state))
        cost_model = ms.cost_model.CostModel.create(cost_kind, num_tuning_cores=workers,
                                                    tree_method="auto") \
            if cost_kind == "xgb" else ms.cost_model.CostModel.create(cost_kind)
        if cost_kind == "mlp":
            cost_model = _guarded_cost_model()(cost_model, counters)
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
                            f"{_last_line(exc)} (records measured so far are kept in "
                            f"{db_dir})") from None
        if counters["time"]:
            stopped = "time budget"
        elif counters["trials"] < budget:
            stopped = "search space exhausted"
    if counters["cost_model_errors"]:
        notes.append(f"the {cost_kind} cost model failed {counters['cost_model_errors']} "
                     f"time(s); those rounds ranked candidates at random")
    _count_records(db, tasks)
    seconds = time.perf_counter() - start
    run = {"started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "seconds": round(seconds, 2), "trials": counters["trials"],
           "skipped_measured": counters["skipped"], "failed_builds": counters["failed_builds"],
           "failed_runs": counters["failed_runs"], "stopped": stopped, "strategy": strategy,
           "cost_model": cost_kind}
    _save_summary(db_dir, target, tune_cfg, strategy, cost_kind, tasks, summary, run)
    report(TuneProgress("done", sum(t.done for t in tasks), len(tasks), counters["trials"],
                        budget, _estimate([t.result for t in tasks])[1], seconds, 0.0))
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


def search_order(results: list[TaskResult]) -> list[int]:
    """Indices of the tasks, the largest share of the model's default kernel time first (weight x
    default latency; tasks without a default time last, in extraction order).

    MetaSchedule's gradient scheduler gives every task one search round in list order before it
    chooses by gradient, and a round of a GEMM task takes seconds; under --time-budget this order
    decides which kernels get tuned at all (in extraction order a 4 us cast went before the
    convolutions)."""
    return sorted(range(len(results)),
                  key=lambda i: -(results[i].weight * (results[i].default_us or 0.0)))


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


def tuning_target(target):
    """The target MetaSchedule tunes for: amp's, plus the CUDA limits its schedule rules read
    (0.27's cuda target carries max_num_threads but not max_threads_per_block)."""
    spec = dict(target.spec)
    if target.is_cuda:
        spec.setdefault("max_threads_per_block", 1024)
        spec.setdefault("max_shared_memory_per_block", 49152)
        spec.setdefault("thread_warp_size", 32)
    return tvm_compat.make_target(spec)


def _count_records(db, tasks: list[_Task]) -> None:
    """Per task: records in the database, valid ones, best latency, and the structural hashes of
    the candidates already measured (so a resumed run does not measure them again)."""
    tvm = tvm_compat.tvm()
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
            t.measured.add(_shash(cand.sch.mod))
        except Exception:  # noqa: BLE001 - a trace that no longer replays: just not deduped
            pass


def _check_tracker(text: str) -> None:
    """Fail fast (TVM's own client retries for a minute) when nothing listens at HOST:PORT."""
    import socket

    host, port = parse_tracker(text)
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError as exc:
        raise TuneError(f"cannot reach the RPC tracker at {text}: {exc.strerror or exc}; start "
                        f"one with: python -m tvm.exec.rpc_tracker --host {host} --port "
                        f"{port}") from None


def _make_runner(tune_cfg: TuneConfig, target):
    ms = tvm_compat.meta_schedule()
    evaluator = ms.runner.EvaluatorConfig(number=1 if target.is_cuda else 3,
                                          repeat=tune_cfg.repeat,
                                          min_repeat_ms=tune_cfg.min_repeat_ms,
                                          enable_cpu_cache_flush=not target.is_cuda)
    if tune_cfg.rpc_tracker:
        host, port = parse_tracker(tune_cfg.rpc_tracker)
        rpc = ms.runner.RPCConfig(tracker_host=host, tracker_port=port,
                                  tracker_key=tune_cfg.rpc_key,
                                  session_timeout_sec=int(tune_cfg.run_timeout_s))
        try:
            rpc.connect_tracker().summary()
        except Exception as exc:  # noqa: BLE001 - unreachable tracker
            raise TuneError(f"cannot reach the RPC tracker at {tune_cfg.rpc_tracker}: "
                            f"{_last_line(exc)}") from None
        return ms.runner.RPCRunner(rpc_config=rpc, evaluator_config=evaluator,
                                   max_workers=tune_cfg.workers or 1)
    return ms.runner.LocalRunner(timeout_sec=tune_cfg.run_timeout_s,
                                 evaluator_config=evaluator)


def _time_defaults(wmods, target, builder, runner, packable=None) -> list:
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
                if target.is_cuda:
                    from .schedule.cuda import cuda_schedule_passes

                    passes = cuda_schedule_passes(tgt)
                else:
                    from .schedule.cpu import cpu_schedule_passes

                    passes = cpu_schedule_passes(tgt)
                if packable and packable[i]:
                    from .schedule.cpu import _hw_from_target, schedule_prim_func

                    (gv, func), = list(wmod.functions_items())
                    hw = _hw_from_target(tgt)
                    hw.packable = set(packable[i])
                    new, _rule = schedule_prim_func(func, tgt, hw)
                    if new is None:
                        continue
                    sched = tvm.IRModule({gv: new.with_attr("tirx.is_scheduled", True)})
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
            _remove_artifact(res.artifact_path)
    except Exception:  # noqa: BLE001 - tuning still proceeds without default numbers
        pass
    return out


def _remove_artifact(path) -> None:
    import shutil

    if path:
        shutil.rmtree(os.path.dirname(str(path)), ignore_errors=True)


def _estimate(tasks) -> tuple[float | None, float | None]:
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


def _save_summary(db_dir, target, tune_cfg, strategy, cost_kind, tasks, old, run) -> None:
    runs = list(old.get("runs", []))
    if run is not None:
        runs.append(run)
    # keep tasks of other models tuned into the same DIR
    mine = {t.result.workload for t in tasks}
    others = [t for t in old.get("tasks", []) if t.get("workload") not in mine]
    d, b = _estimate([t.result for t in tasks])
    _write_summary(db_dir, {
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


def _quiet_logger():
    log = logging.getLogger("amp.tune.metaschedule")
    log.setLevel(logging.WARNING)
    return log


def _last_line(exc) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:400]


# ---------------------------------------------------------------------------------------------
# MetaSchedule extension objects (built lazily: they need TVM)

_CLASSES: dict = {}


def _resumable_strategy():
    """A search strategy around MetaSchedule's: drops candidates already in the database, stops
    at the time budget, and notes when its task is done."""
    if "strategy" in _CLASSES:
        return _CLASSES["strategy"]
    tvm = tvm_compat.tvm()
    ms = tvm_compat.meta_schedule()
    from tvm.ir.utils import derived_object  # noqa: PLC0415 - version-bound

    @derived_object
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
                         if _shash(c.sch.mod) not in self.task.measured]
                self.counters["skipped"] += len(cands) - len(fresh)
                if fresh:
                    return fresh
                self.inner.notify_runner_results([], [])
            self.counters["exhausted"] += 1
            return None

        def notify_runner_results(self, measure_candidates, results):
            for c in measure_candidates:
                self.task.measured.add(_shash(c.sch.mod))
            self.inner.notify_runner_results(measure_candidates, results)

        def clone(self):
            return ResumableSearch(self.inner.clone(), self.task, self.deadline, self.counters,
                                   self.empty_limit)

    _CLASSES["strategy"] = ResumableSearch
    return ResumableSearch


def _guarded_cost_model():
    """MetaSchedule's MLP cost model raises on a batch of one measured candidate (an IndexError
    in its ranking loss); an error in it must not end the run. Batches of one are not learned
    from, and a failing update or prediction falls back to random scores for that call."""
    if "cost" in _CLASSES:
        return _CLASSES["cost"]
    import numpy as np

    ms = tvm_compat.meta_schedule()
    from tvm.ir.utils import derived_object  # noqa: PLC0415 - version-bound

    @derived_object
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


def _progress_callback():
    if "callback" in _CLASSES:
        return _CLASSES["callback"]
    ms = tvm_compat.meta_schedule()
    from tvm.ir.utils import derived_object  # noqa: PLC0415 - version-bound

    @derived_object
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
                    _note_error(task, "build: " + _last_line(b.error_msg))
                    continue
                secs = [float(s) for s in (r.run_secs or [])]
                if r.error_msg or not secs or max(secs) >= FAILED_SECS:
                    c["failed_runs"] += 1
                    task.failed_runs += 1
                    _note_error(task, "run: " + _last_line(r.error_msg or "no timing"))
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
                                      _estimate(results)[1], elapsed, eta))

    _CLASSES["callback"] = ProgressCallback
    return ProgressCallback


def _note_error(task: TaskResult, text: str, keep: int = 3) -> None:
    if text not in task.errors and len(task.errors) < keep:
        task.errors.append(text)


def _shash(obj) -> int:
    tvm_compat.tvm()
    import tvm_ffi

    return tvm_ffi.structural_hash(obj)
