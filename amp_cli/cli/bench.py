"""``amp bench``: build the bench config, make one library call (amp_cli.bench.bench), render."""
from __future__ import annotations

import click

from ..bench import (
    COMPARE_CHOICES,
    BenchConfig,
    format_table,
    require_matplotlib,
    write_plot,
)
from ..bench import bench as run_bench
from .common import (
    EPILOG,
    build_config,
    concrete_shapes,
    convert_options,
    cuda_graph_option,
    debug_option,
    progress_bar,
)

POSITIVE = click.FloatRange(min=0, min_open=True)  # a bad gate value is a usage error (exit 2)

# convert options that only mean something when bench converts a model itself
_MODEL_ONLY = {"target": "--target", "precision": "--precision", "accumulate": "--accumulate",
               "config_file": "--config", "keep_io_types": "--keep-io-types", "exclude_ops": "--exclude-op",
               "exclude_nodes": "--exclude-node", "tuning_db": "--tuning-db",
               "cuda_graph": "--cuda-graph/--no-cuda-graph"}


def _compare_list(_ctx, _param, value):
    if not value:
        return []
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in COMPARE_CHOICES]
    if bad:
        raise click.BadParameter(f"unknown runner(s) {', '.join(bad)}; choose from "
                                 f"{', '.join(COMPARE_CHOICES)} (comma-separated)")
    return list(dict.fromkeys(items))


@click.command(epilog=EPILOG)
@click.argument("target_or_model", metavar="TARGET_OR_MODEL")
@convert_options
@click.option("--tuning-db", type=click.Path(file_okay=False),
              help="Apply tuning records when converting a model.")
@cuda_graph_option
@click.option("--warmup", type=click.IntRange(min=0), default=10, show_default=True,
              help="Untimed calls before timing.")
@click.option("--repeat", type=click.IntRange(min=1), default=50, show_default=True,
              help="Timed samples (percentiles are over these).")
@click.option("--number", type=click.IntRange(min=1), default=1, show_default=True,
              help="Calls per sample (a sample is their mean; 1 = per-call percentiles).")
@click.option("--compare", callback=_compare_list, default="", metavar="fp32,ort,torch",
              help="Also time amp's fp32 build (fp32), ONNX Runtime (ort) and PyTorch for torch "
                   "models (torch), on the same inputs.")
@click.option("--inputs", "inputs_npz", type=click.Path(dir_okay=False),
              help=".npz with one array per model input (names, shapes, dtypes checked); "
                   "default: seeded random inputs.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of random inputs.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False),
              help="Write the results as JSON (schema_version 1; see amp_cli/bench/__init__.py).")
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False),
              help="Write a latency chart (PNG; needs matplotlib).")
@click.option("--max-latency-ratio", type=POSITIVE, default=None, metavar="R",
              help="Gate: exit 3 if amp p50 latency / amp fp32 p50 latency > R.")
@click.option("--max-rel-error", type=POSITIVE, default=None, metavar="E",
              help="Gate: exit 3 if amp's relative L2 error vs the fp32 reference > E.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads for TVM and ONNX Runtime (default: TVM_NUM_THREADS or all "
                   "cores).")
@debug_option
@click.pass_context
def bench(ctx, target_or_model, target, precision, accumulate, config_file, input_shapes,
          dynamic_dims, keep_io_types, exclude_ops, exclude_nodes, tuning_db, cuda_graph, warmup, repeat,
          number, compare, inputs_npz, seed, json_out, plot_out, max_latency_ratio,
          max_rel_error, threads):
    """Time and check TARGET_OR_MODEL: an OUTDIR written by `amp convert`, or a model
    (.onnx, .pt2, pkg.module:factory), converted first with the convert options.

    \b
    Prints latency (mean, std, min, p50, p90, p99), throughput and accuracy vs the
    fp32 reference for the amp build and each --compare runner. Timing uses TVM's
    time_evaluator (the device's timer) after --warmup calls. An OUTDIR with
    dynamic dims is timed at --input-shape / --dynamic sizes (each dim not given:
    its optimum); a model converted here is timed at its optimum.
    \b
    Examples:
      amp bench out/ --compare fp32,ort --json bench.json
      amp bench model.onnx --target llvm --input-shape input:8x3x224x224 \\
          --max-latency-ratio 1.0 --max-rel-error 1e-2
      amp bench dyn_out/ --input-shape input_ids:8x128
    """
    from pathlib import Path

    cfg = BenchConfig(warmup=warmup, repeat=repeat, number=number, compare=compare,
                      inputs=inputs_npz, seed=seed, max_latency_ratio=max_latency_ratio,
                      max_rel_error=max_rel_error, threads=threads)
    cfg.validate()
    convert_cfg = None
    if Path(target_or_model).is_dir():
        given = [p for p in _MODEL_ONLY if ctx.get_parameter_source(p) is not None and
                 ctx.get_parameter_source(p).name not in ("DEFAULT", "DEFAULT_MAP")]
        if given:
            flags = ", ".join(_MODEL_ONLY[p] for p in given)
            raise click.UsageError(f"{target_or_model} is an OUTDIR, already converted with the "
                                   f"settings in its report.json; {flags}: only when benching "
                                   f"a model (e.g. amp bench model.onnx --target llvm)")
        # an OUTDIR with dynamic dims: the shape to time
        cfg.shapes, cfg.dims = concrete_shapes(input_shapes, dynamic_dims)
    else:
        convert_cfg = build_config(target, precision, accumulate, config_file, input_shapes,
                                   keep_io_types, exclude_ops, exclude_nodes, tuning_db,
                                   cuda_graph, dynamic_dims)
    if plot_out:
        require_matplotlib()
    total = 4 + 2 * ("fp32" in compare or max_latency_ratio is not None) + \
        ("ort" in compare) + 3 * ("torch" in compare)
    bar, step = progress_bar(total, "amp bench")
    try:
        result = run_bench(target_or_model, cfg, convert_cfg, progress=step)
    finally:
        bar.close()
    click.echo(format_table(result))
    if json_out:
        click.echo(f"amp: wrote {result.write_json(json_out)}")
    if plot_out:
        click.echo(f"amp: wrote {write_plot(result, plot_out)}")
    result.check_gates()
