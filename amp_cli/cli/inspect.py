"""``amp inspect MODEL``: the per-node range / sensitivity analysis and the auto-precision
search, printed; no library is written."""
from __future__ import annotations

import json

import click

from ..frontend import load as api_load
from ..precision.auto import inspect_model
from ..precision.sensitivity import render_markdown_section
from ..report import clean_json
from .common import (
    EPILOG,
    apply_auto_precision,
    auto_precision_options,
    build_config,
    convert_options,
    debug_option,
)


@click.command(epilog=EPILOG)
@click.argument("model")
@convert_options
@auto_precision_options
@click.option("--search/--no-search", default=True,
              help="Also find the nodes the tolerance needs (builds CPU variants in a temporary "
                   "directory) [default: search]; --no-search: ranges and estimates only.")
@click.option("--top", type=click.IntRange(min=1), default=25, show_default=True,
              help="Rows of the per-node table (highest error score first).")
@click.option("--json", "as_json", is_flag=True, help="Print the analysis as JSON.")
@debug_option
def inspect(model, target, precision, accumulate, config_file, input_shapes, dynamic_dims,
            keep_io_types, exclude_ops, exclude_nodes, search, top, as_json, **auto_opts):
    """Print MODEL's per-node fp16/bf16 analysis: each node's fp32 max |x| against the low
    type's range, its error contribution, the first node producing inf/NaN when every node is
    converted, and the nodes --auto-precision keeps in fp32 and why.

    \b
    Example:
      amp inspect model.onnx --target llvm --tolerance rel_l2=1e-3
    """
    cfg = build_config(target, precision, accumulate, config_file, input_shapes, keep_io_types,
                       exclude_ops, exclude_nodes, dynamic_dims=dynamic_dims)
    apply_auto_precision(cfg, **auto_opts)
    loaded = api_load(model, input_shapes=cfg.input_shapes, simplify=cfg.simplify,
                      dims=cfg.dynamic.dims)
    result = inspect_model(loaded, cfg, search=search)
    data = result.to_dict()
    if as_json:
        click.echo(json.dumps(clean_json(data), indent=2))
        return
    click.echo("\n".join(render_markdown_section(data, max_rows=top)).rstrip())
