"""The tune stage: MetaSchedule tuning of a converted model, with resumable records.

The tasks are the fused kernels of the *converted* module (amp's mixed-precision pass, then the
same Relax pipeline ``amp convert`` builds with, stopped right after FuseTIR), weighted by how
often each kernel is called. Candidates are compiled the way ``amp convert`` compiles: for CUDA
through amp's TIR pipeline with the lane legalizer (``amp_cli.legalize``).

DIR is a MetaSchedule JSON database plus amp's summary.json (``compile/records.py`` reads and
applies it, ``database.py`` writes the summary and compacts it).

Modules: ``config`` (TuneConfig and parsers), ``results``, ``tasks`` (what to tune),
``builder`` (building and measuring candidates), ``extensions`` (amp's MetaSchedule objects),
``search`` (one run), ``database`` (the summary, compaction).

Resuming: ``trials`` is the budget for the whole DIR. A rerun counts the records already in DIR
for the model's tasks, tunes only the rest of the budget, and drops candidates that are already
recorded before they are built or measured. A run killed at any moment (SIGKILL included)
loses at most the candidates in flight: records are appended line by line and a truncated last
line is dropped when DIR is opened again.

>>> import amp_cli
>>> from amp_cli.tuning import TuneConfig, tune
>>> model = amp_cli.load("examples/generated/tiny_cnn.onnx")                 # doctest: +SKIP
>>> res = tune(model, amp_cli.ConvertConfig(target="llvm"),
...            TuneConfig(db_dir="tuning/", trials=64))                      # doctest: +SKIP
>>> conv = amp_cli.convert(model, amp_cli.ConvertConfig(target="llvm",
...                                                     tuning_db="tuning/"))  # doctest: +SKIP
"""
from __future__ import annotations

from ..errors import AmpError, ConfigError, TuneError, last_line
from ..sandbox import run_isolated
from ..target import resolve_target
from .builder import check_tracker
from .config import TuneConfig, choose_cost_model, parse_duration, resolve_strategy
from .database import compact_database
from .results import Progress, TaskResult, TuneProgress, TuneResult
from .search import run_tuning

__all__ = ["TaskResult", "TuneConfig", "TuneProgress", "TuneResult", "compact_database",
           "parse_duration", "tune"]


def tune(model, cfg, tune_cfg: TuneConfig, progress: Progress | None = None,
         isolate: bool = True) -> TuneResult:
    """Tune the kernels of `model` converted with `cfg` (a ConvertConfig) into ``tune_cfg.db_dir``.

    Runs in a sandboxed child process: a TVM crash becomes a TuneError naming the stage, and the
    records written until then stay in DIR.
    """
    target = resolve_target(cfg.target)
    resolve_strategy(tune_cfg.strategy)
    choose_cost_model(tune_cfg.cost_model)
    if tune_cfg.trials < 0:
        raise ConfigError("--trials must be >= 0")
    if tune_cfg.rpc_tracker:
        check_tracker(tune_cfg.rpc_tracker)
        if not tune_cfg.rpc_key:
            raise ConfigError("--rpc-tracker needs --rpc-key (the device key the RPC servers "
                              "registered with)")
    stage = f"tune {target.describe()}"
    try:
        return run_isolated(run_tuning, model, cfg, target, tune_cfg, progress, stage=stage,
                            isolate=isolate)
    except AmpError as exc:
        if isinstance(exc, (TuneError, ConfigError)):
            raise
        raise TuneError(f"{exc} (records measured so far are kept in {tune_cfg.db_dir})") \
            from exc
    except Exception as exc:  # noqa: BLE001 - not isolated: same contract
        raise TuneError(f"stage '{stage}' failed: {last_line(exc)} (records measured so far "
                        f"are kept in {tune_cfg.db_dir})") from exc
