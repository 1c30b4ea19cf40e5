"""How to tune: ``TuneConfig`` and the parsers of its command-line values."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from ..errors import ConfigError

# user-facing name -> MetaSchedule search strategy
STRATEGIES = {
    "evolutionary": "evolutionary",
    "ansor": "evolutionary",
    "replay-trace": "replay-trace",
    "autotvm": "replay-trace",
    "replay-func": "replay-func",
}
COST_MODELS = ("auto", "xgb", "mlp", "random")


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
