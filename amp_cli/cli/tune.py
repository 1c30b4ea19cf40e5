"""`amp tune`: MetaSchedule tuning of a converted model into a resumable records directory."""
from __future__ import annotations

import click

from ..frontend import load as api_load
from ..tuning import TuneConfig, parse_duration
from ..tuning import tune as api_tune
from .common import EPILOG, build_config, convert_options, debug_option
from .progress import TuneBar

STRATEGY_HELP = (
    "MetaSchedule search strategy [default: evolutionary]. "
    "evolutionary (alias ansor): MetaSchedule's EvolutionarySearch, Ansor's method: schedule "
    "rules generate a design space (sketches), random decisions fill it in, a cost model ranks "
    "mutated candidates and the predicted best (plus a few random ones) are measured. "
    "replay-trace (alias autotvm): ReplayTrace, the AutoTVM-template style: the design space is "
    "one fixed schedule template (the rules' trace, its sampled tile sizes etc. being the knobs) "
    "and each trial replays it with freshly sampled knob values; no cost model. "
    "replay-func: ReplayFunc: reruns the schedule rules themselves with new random decisions for "
    "each trial; no cost model.")


@click.command(epilog=EPILOG)
@click.argument("model")
@click.option("--db", "db_dir", required=True, type=click.Path(file_okay=False),
              help="Tuning directory: MetaSchedule JSON database (workloads + records) and "
                   "summary.json. Rerunning the same command resumes it.")
@convert_options
@click.option("--trials", type=click.IntRange(min=0), default=64, show_default=True,
              help="Measured candidates for this model in DB, over all runs: a rerun tunes "
                   "only what is left.")
@click.option("--time-budget", default=None, metavar="DURATION",
              help="Stop this run after DURATION (90s, 30m, 1h30m); the candidates in flight "
                   "finish first.")
@click.option("--strategy", type=click.Choice(["evolutionary", "ansor", "replay-trace",
                                               "autotvm", "replay-func"]),
              default="evolutionary", help=STRATEGY_HELP)
@click.option("--cost-model", type=click.Choice(["auto", "xgb", "mlp", "random"]),
              default="auto", show_default=True,
              help="Cost model of the evolutionary search. auto: xgb when xgboost is "
                   "installed, else mlp (needs torch), else random; the summary says which.")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Parallel candidate builds (and RPC measurement sessions) [default: CPU "
                   "cores].")
@click.option("--rpc-tracker", default=None, metavar="HOST:PORT",
              help="Measure on the devices registered with this TVM RPC tracker.")
@click.option("--rpc-key", default=None, metavar="KEY",
              help="Device key of the RPC servers (with --rpc-tracker).")
@click.option("--trials-per-iter", type=click.IntRange(min=1), default=16, show_default=True,
              help="Candidates measured per search round of a kernel.")
@click.option("--population", type=click.IntRange(min=2), default=None,
              help="Schedules the evolutionary search samples, mutates and ranks per round "
                   "[default: 8 x --trials-per-iter]. A round's time grows with it; "
                   "MetaSchedule's own default is 512.")
@click.option("--seed", type=int, default=None, help="Random seed of the search.")
@debug_option
def tune(model, db_dir, target, precision, accumulate, config_file, input_shapes, dynamic_dims,
         keep_io_types, exclude_ops, exclude_nodes, trials, time_budget, strategy, cost_model,
         workers, rpc_tracker, rpc_key, trials_per_iter, population, seed):
    """Tune the kernels of MODEL, converted as `amp convert` converts it, with MetaSchedule.

    \b
    Kernels are weighted by how often the model calls them. Candidates are
    compiled with amp's pipeline (the lane legalizer on CUDA) and measured
    locally or through --rpc-tracker. A run killed at any moment leaves DB
    readable and loses at most the candidates in flight. Apply the records with:
      amp convert MODEL -o out/ --target T --tuning-db DB
    """
    cfg = build_config(target, precision, accumulate, config_file, input_shapes, keep_io_types,
                       exclude_ops, exclude_nodes, dynamic_dims=dynamic_dims)
    tcfg = TuneConfig(db_dir=db_dir, trials=trials, strategy=strategy, cost_model=cost_model,
                      workers=workers, rpc_tracker=rpc_tracker, rpc_key=rpc_key,
                      trials_per_iter=trials_per_iter, population=population, seed=seed,
                      time_budget_s=parse_duration(time_budget) if time_budget else None)
    loaded = api_load(model, input_shapes=cfg.input_shapes, simplify=cfg.simplify,
                      dims=cfg.dynamic.dims)
    bar = TuneBar()
    try:
        result = api_tune(loaded, cfg, tcfg, progress=bar.update)
    finally:
        bar.close()
    click.echo(summary_text(result))


def summary_text(r) -> str:
    d_ms, t_ms = r.estimated_ms
    lines = [f"amp: tuned {len(r.tasks)} kernels into {r.db_dir}: {r.trials_run} trials this run "
             f"({r.stopped}), {r.records_total} records in all, {r.seconds:.0f} s",
             f"  strategy {r.strategy}, {r.cost_model if r.strategy == 'evolutionary' else 'no'}"
             f" cost model; failed this run: {r.failed_builds} builds, {r.failed_runs} runs"
             + (f"; skipped {r.skipped_measured} already-measured candidates"
                if r.skipped_measured else "")]
    if d_ms is not None:
        lines.append(f"  kernel time per model run (sum of weight x latency): default "
                     f"{d_ms:.3f} ms, best tuned {t_ms:.3f} ms")
    for t in sorted(r.tasks, key=lambda t: -(t.weight * (t.default_us or t.best_us or 0))):
        best = f"{t.best_us:.1f} us" if t.best_us else "-"
        dflt = f"{t.default_us:.1f} us" if t.default_us else "-"
        sp = f" ({t.speedup:.2f}x)" if t.speedup else ""
        lines.append(f"  {t.task} x{t.weight}: {t.records} records, best {best}, default "
                     f"{dflt}{sp}")
    for n in r.notes:
        lines.append(f"  note: {n}")
    lines.append(f"  apply: amp convert MODEL -o OUT --tuning-db {r.db_dir}")
    return "\n".join(lines)
