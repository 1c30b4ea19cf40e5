"""``amp convert``: build the config, convert (one library call), print a summary."""
from __future__ import annotations

import click

from ..convert import check_outdir
from ..convert import convert as api_convert
from ..frontend import load as api_load
from ..precision.auto import summary_text
from .common import (
    EPILOG,
    apply_auto_precision,
    auto_precision_options,
    build_config,
    convert_options,
    cuda_graph_option,
    debug_option,
    progress_bar,
)


@click.command(epilog=EPILOG)
@click.argument("model")
@click.option("-o", "--output", "outdir", required=True, type=click.Path(file_okay=False),
              help="Output directory: model.so, report.json, report.md.")
@convert_options
@click.option("--tuning-db", type=click.Path(file_okay=False),
              help="Apply tuning records written by `amp tune`.")
@click.option("--force", is_flag=True, help="Overwrite OUTDIR if it exists.")
@click.option("--no-accuracy", is_flag=True, help="Skip the accuracy check.")
@click.option("--allow-inaccurate", is_flag=True,
              help="Write the library even when it misses the accuracy tolerance after the "
                   "accuracy-guided search (the report says so) instead of exiting 4.")
@cuda_graph_option
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads for llvm runs (default: TVM_NUM_THREADS or all cores).")
@auto_precision_options
@debug_option
def convert(model, outdir, target, precision, accumulate, config_file, input_shapes,
            dynamic_dims, keep_io_types, exclude_ops, exclude_nodes, tuning_db, force,
            no_accuracy, allow_inaccurate, cuda_graph, threads, **auto_opts):
    """Convert MODEL (.onnx, .pt2, or pkg.module:factory) to a mixed-precision library.

    \b
    Writes OUTDIR/model.so (load with tvm.runtime.load_module and run with
    relax.VirtualMachine), OUTDIR/report.json and OUTDIR/report.md, atomically.
    Accuracy is checked against ONNX Runtime fp32 (torch fp32 for torch models)
    on seeded random inputs; on a machine without a GPU a CUDA build is checked
    through a CPU build of the same converted module. A conversion that misses
    the tolerance (or has inf/NaN outputs) runs the accuracy-guided search on
    its own; if it still misses, exit 4 and nothing is written.
    """
    cfg = build_config(target, precision, accumulate, config_file, input_shapes, keep_io_types,
                       exclude_ops, exclude_nodes, tuning_db, cuda_graph, dynamic_dims)
    cfg.check_accuracy = not no_accuracy
    if allow_inaccurate:
        cfg.accuracy.enforce = False
    cfg.threads = threads
    apply_auto_precision(cfg, **auto_opts)
    check_outdir(outdir, force)  # before minutes of work, not after
    bar, step = progress_bar(6, "amp convert")
    try:
        step("load")
        loaded = api_load(model, input_shapes=cfg.input_shapes, simplify=cfg.simplify,
                          dims=cfg.dynamic.dims)
        conv = api_convert(loaded, cfg, progress=step)
        try:
            out = conv.save(outdir, force=force)
        finally:
            conv.cleanup()
    finally:
        bar.close()
    click.echo(summary_line(conv.report, out))


def summary_line(report: dict, out) -> str:
    p, a, b = report["precision"], report.get("accuracy") or {}, report["build"]
    parts = [f"amp: wrote {out}/model.so ({b['size_bytes'] / 1e6:.1f} MB, {len(b['kernels'])} "
             f"kernels, {b['seconds']:.1f} s)",
             f"  precision {p['dtype']}: {p['converted_ops']}/{p['total_ops']} ops converted, "
             f"{sum(k.get('count', 1) for k in p['kept_fp32'])} kept in fp32, "
             f"{p['casts_inserted']} casts"]
    if report["target"].get("kind") == "cuda":
        parts.append(f"  cuda {report['target'].get('arch')}: {b['tensor_core_kernels']} "
                     f"tensor-core kernels, "
                     f"{len({r.get('kernel') for r in b['legalized']})} kernels legalized")
    if a:
        w = {k: float(v) for k, v in a["worst"].items()}  # the report has inf/nan as strings
        parts.append(f"  accuracy on {a['device']} vs fp32 reference: rel L2 {w['rel_l2']:.3g}, "
                     f"max abs {w['max_abs']:.3g}, cosine {w['cosine']:.6f}, non-finite "
                     f"{w['nonfinite_share']:.3g}"
                     + ("" if a.get("within_tolerance") else "  (ABOVE TOLERANCE)"))
    if report.get("auto_precision"):
        parts.append("  " + summary_text(report["auto_precision"]))
    for n in report.get("notes", []):
        parts.append(f"  note: {n}")
    parts.append(f"  report: {out}/report.md")
    return "\n".join(parts)
