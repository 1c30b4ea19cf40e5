"""The ``amp`` command line: each command builds a config, makes one library call, renders it.

Exit codes: 0 ok, 1 amp error (one line on stderr), 2 usage error, 3 bench gate failed,
130 interrupted (Ctrl-C).
"""
from __future__ import annotations

import contextlib
import signal
import sys
import traceback

import click

from .errors import EXIT_ERROR, EXIT_INTERRUPTED, AmpError

EPILOG = """\b
Exit codes:
  0    success
  1    amp error: bad input, import or build failure (one line on stderr;
       --debug adds the traceback)
  2    usage error (bad option or argument)
  3    amp bench: a --max-latency-ratio / --max-rel-error gate failed
  130  interrupted (Ctrl-C); nothing half-written is left behind
  143  terminated (SIGTERM); likewise
"""


class AmpGroup(click.Group):
    """Turns AmpError into one line on stderr and its exit code.

    Ctrl-C (SIGINT) and SIGTERM raise KeyboardInterrupt, so every cleanup path (staging dirs,
    OUTDIR temp dirs, the sandboxed child) runs; the exit code is 128 + the signal (130 for
    Ctrl-C). TVM turns a KeyboardInterrupt raised inside one of its Python callbacks into a
    plain RuntimeError, so any error after a signal counts as the interrupt. Any other
    unexpected exception is one line too (``--debug`` shows the traceback).
    """

    def invoke(self, ctx):
        with _signals_interrupt() as received:
            try:
                return super().invoke(ctx)
            except (click.exceptions.Exit, click.ClickException, click.Abort):
                raise
            except (KeyboardInterrupt, Exception) as exc:  # noqa: BLE001 - the boundary
                if received:
                    click.echo("amp: interrupted" if received[0] == signal.SIGINT else
                               f"amp: terminated ({signal.Signals(received[0]).name})", err=True)
                    ctx.exit(128 + received[0])
                if isinstance(exc, KeyboardInterrupt):
                    click.echo("amp: interrupted", err=True)
                    ctx.exit(EXIT_INTERRUPTED)
                if _debug_requested(ctx):
                    traceback.print_exc()
                    tb = getattr(exc, "child_traceback", None)
                    if tb:
                        click.echo(tb, err=True)
                if isinstance(exc, AmpError):
                    click.echo(f"amp: error: {exc}", err=True)
                    ctx.exit(exc.exit_code)
                first = (str(exc).strip().splitlines() or [""])[-1][:300]
                click.echo(f"amp: error: internal error: {type(exc).__name__}"
                           f"{': ' + first if first else ''} (a bug in amp or TVM; rerun with "
                           f"--debug for the traceback)", err=True)
                ctx.exit(EXIT_ERROR)


@contextlib.contextmanager
def _signals_interrupt():
    """While a command runs, SIGINT and SIGTERM raise KeyboardInterrupt; yields the list of
    signals received."""
    received: list[int] = []

    def handler(signum, _frame):
        received.append(signum)
        raise KeyboardInterrupt

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            if signal.getsignal(sig) in (signal.default_int_handler, signal.SIG_DFL):
                previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread: leave signals alone
            pass
    try:
        yield received
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _debug_requested(ctx) -> bool:
    return "--debug" in sys.argv or bool(ctx.meta.get("amp.debug"))


def _debug_option(f):
    def callback(ctx, _param, value):
        if value:
            ctx.meta["amp.debug"] = True
        return value

    return click.option("--debug", is_flag=True, expose_value=False, callback=callback,
                        is_eager=True, help="Show tracebacks for errors.")(f)


@click.group(cls=AmpGroup, epilog=EPILOG, context_settings={"help_option_names": ["-h",
                                                                                  "--help"]})
@click.version_option(package_name="amp-cli", prog_name="amp")
def main():
    """amp: convert ONNX / PyTorch models to fp16 / bf16 mixed precision with Apache TVM,
    compile them safely for NVIDIA GPUs (any vector width, tensor cores) or the CPU, tune,
    and benchmark against fp32 and ONNX Runtime.

    \b
    Typical use:
      amp convert model.onnx -o out/ --target cuda:sm_90
      amp convert model.onnx -o out/ --target llvm --precision bf16
      amp tune model.onnx --target cuda:sm_90 --db tuning/ --trials 200
      amp bench out/ --compare fp32,ort --max-rel-error 1e-2
    """


def _progress_bar(total: int, desc: str):
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="stage", leave=False, file=sys.stderr,
               disable=None, bar_format="{desc}: {n_fmt}/{total_fmt} {bar} {postfix}")

    started = []

    def step(name: str):
        if started:
            bar.update(1)
        started.append(name)
        bar.set_postfix_str(name)

    return bar, step


def convert_options(f):
    """Options shared by convert, tune, inspect and bench (when given a model)."""
    opts = [
        click.option("--target", "-t", default=None,
                     help="cuda (arch of the local GPU, else sm_80), cuda:sm_90, llvm, "
                          "llvm:<mcpu>, or a TVM target JSON dict [default: the --config "
                          "file's target, else cuda]."),
        click.option("--precision", type=click.Choice(["fp16", "bf16", "fp32"]), default=None,
                     help="Low-precision type [default: fp16]."),
        click.option("--accumulate", type=click.Choice(["fp32", "fp16"]), default=None,
                     help="Accumulation/output type of matmul and conv [default: fp32]."),
        click.option("--config", "config_file", type=click.Path(dir_okay=False),
                     help="YAML config (see configs/); flags override it."),
        click.option("--input-shape", "input_shapes", multiple=True, metavar="NAME:DxDxD",
                     help="Bind an input's shape, e.g. input:1x3x224x224 (repeatable)."),
        click.option("--keep-io-types/--no-keep-io-types", default=None,
                     help="Keep model inputs/outputs in fp32 [default: keep]."),
        click.option("--exclude-op", "exclude_ops", multiple=True, metavar="OP",
                     help="Keep this op in fp32: a Relax op (nn.softmax) or ONNX op type "
                          "(Softmax). Repeatable."),
        click.option("--exclude-node", "exclude_nodes", multiple=True, metavar="NAME",
                     help="Keep this ONNX node in fp32. Repeatable."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def cuda_graph_option(f):
    """``--cuda-graph/--no-cuda-graph`` (convert, bench): the YAML key ``cuda.cuda_graph``."""
    return click.option(
        "--cuda-graph/--no-cuda-graph", "cuda_graph", default=None,
        help="CUDA targets: capture the static middle of the model into one CUDA graph at its "
             "first run, replayed after (removes launch gaps) [default: on]. Off to profile "
             "per kernel, or when other threads launch CUDA work during that first run.")(f)


def build_config(target, precision, accumulate, config_file, input_shapes, keep_io_types,
                 exclude_ops, exclude_nodes, tuning_db=None, cuda_graph=None):
    from .config import ConvertConfig, apply_yaml, parse_input_shape, read_yaml, validate

    cfg = ConvertConfig()
    if config_file:
        apply_yaml(cfg, read_yaml(config_file), config_file)
    if target is not None:
        cfg.target = target
    p = cfg.precision
    if precision:
        p.precision = precision
    if accumulate:
        p.accumulate = accumulate
    if keep_io_types is not None:
        p.keep_io_types = keep_io_types
    for text in input_shapes:
        name, dims = parse_input_shape(text)
        cfg.input_shapes[name] = dims
    p.policy.exclude_ops = list(p.policy.exclude_ops) + list(exclude_ops)
    p.policy.exclude_nodes = list(p.policy.exclude_nodes) + list(exclude_nodes)
    if tuning_db:
        cfg.tuning_db = tuning_db
    if cuda_graph is not None:
        cfg.cuda.cuda_graph = cuda_graph
    validate(cfg)
    return cfg


def auto_precision_options(f):
    """Accuracy-guided precision options (convert, inspect); see docs/auto-precision.md."""
    opts = [
        click.option("--auto-precision/--no-auto-precision", "auto_precision", default=None,
                     help="Keep in fp32 (or --fallback) the nodes whose values leave the "
                          "low type's range, then the fewest extra nodes that meet --tolerance."),
        click.option("--tolerance", metavar="METRIC=VALUE", default=None,
                     help="rel_l2, max_abs or cosine (a minimum) on held-out calibration "
                          "inputs [default: rel_l2=1e-2]."),
        click.option("--calibration", type=click.Path(dir_okay=False, exists=True),
                     default=None, help=".npz of calibration inputs (a leading axis of samples "
                                        "allowed)."),
        click.option("--calibration-samples", type=click.IntRange(min=1), default=None,
                     help="Random calibration input sets without --calibration [default: 4]."),
        click.option("--calibration-range", metavar="LO,HI", default=None,
                     help="Random float calibration inputs ~ U(LO, HI) [default: N(0, 1)]."),
        click.option("--fallback", type=click.Choice(["fp32", "bf16"]), default=None,
                     help="Type the kept nodes run in [default: fp32]."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def apply_auto_precision(cfg, auto_precision=None, tolerance=None, calibration=None,
                         calibration_samples=None, calibration_range=None, fallback=None):
    from .config import parse_tolerance, validate

    a = cfg.auto_precision
    if auto_precision is not None:
        a.enabled = auto_precision
    if tolerance:
        a.metric, a.tolerance = parse_tolerance(tolerance)
    if calibration:
        a.calibration = calibration
    if calibration_samples:
        a.samples = calibration_samples
    if calibration_range:
        a.input_range = calibration_range
    if fallback:
        a.fallback = fallback
    validate(cfg)
    return cfg


@main.command(epilog=EPILOG)
@click.argument("model")
@click.option("-o", "--output", "outdir", required=True, type=click.Path(file_okay=False),
              help="Output directory: model.so, report.json, report.md.")
@convert_options
@click.option("--tuning-db", type=click.Path(file_okay=False),
              help="Apply tuning records written by `amp tune`.")
@click.option("--force", is_flag=True, help="Overwrite OUTDIR if it exists.")
@click.option("--no-accuracy", is_flag=True, help="Skip the accuracy check.")
@cuda_graph_option
@click.option("--threads", type=int, default=None,
              help="CPU threads for llvm runs (default: TVM_NUM_THREADS or all cores).")
@auto_precision_options
@_debug_option
def convert(model, outdir, target, precision, accumulate, config_file, input_shapes,
            keep_io_types, exclude_ops, exclude_nodes, tuning_db, force, no_accuracy, cuda_graph,
            threads, **auto_opts):
    """Convert MODEL (.onnx, .pt2, or pkg.module:factory) to a mixed-precision library.

    \b
    Writes OUTDIR/model.so (load with tvm.runtime.load_module and run with
    relax.VirtualMachine), OUTDIR/report.json and OUTDIR/report.md, atomically.
    Accuracy is checked against ONNX Runtime fp32 (torch fp32 for torch models)
    on seeded random inputs; on a machine without a GPU a CUDA build is checked
    through a CPU build of the same converted module.
    """
    from .convert import check_outdir
    from .convert import convert as api_convert
    from .load import load as api_load

    cfg = build_config(target, precision, accumulate, config_file, input_shapes, keep_io_types,
                       exclude_ops, exclude_nodes, tuning_db, cuda_graph)
    cfg.check_accuracy = not no_accuracy
    cfg.threads = threads
    apply_auto_precision(cfg, **auto_opts)
    check_outdir(outdir, force)  # before minutes of work, not after
    bar, step = _progress_bar(6, "amp convert")
    try:
        step("load")
        loaded = api_load(model, input_shapes=cfg.input_shapes, simplify=cfg.simplify)
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
             f"{len(p['kept_fp32'])} kept in fp32, {p['casts_inserted']} casts"]
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
        from .autoprecision import summary_text

        parts.append("  " + summary_text(report["auto_precision"]))
    for n in report.get("notes", []):
        parts.append(f"  note: {n}")
    parts.append(f"  report: {out}/report.md")
    return "\n".join(parts)


# Commands living in their own modules (amp_cli/cli_<name>.py), each defining a click command
# named like the module.
COMMAND_MODULES = ("tune", "bench", "inspect")


def _register_commands():
    import importlib

    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"{__package__}.cli_{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__package__}.cli_{name}":
                raise
            continue
        main.add_command(getattr(module, name))


_register_commands()


def run():  # pragma: no cover - console entry
    main(prog_name="amp")


if __name__ == "__main__":  # pragma: no cover
    run()
