"""What every ``amp`` command shares: the error boundary (AmpError -> one line on stderr and its
exit code; signals -> 130/143), the shared options and how they become a ConvertConfig, and the
progress bar."""
from __future__ import annotations

import contextlib
import signal
import sys
import traceback

import click

from ..config import (
    ConvertConfig,
    apply_yaml,
    canonical_dim,
    parse_dynamic,
    parse_input_shape,
    parse_tolerance,
    read_yaml,
    validate,
)
from ..errors import EXIT_ERROR, EXIT_INTERRUPTED, AmpError, ConfigError, UsageError

EPILOG = """\b
Exit codes:
  0    success
  1    amp error: bad input, import or build failure (one line on stderr;
       --debug adds the traceback)
  2    usage error (bad option or argument)
  3    amp bench: a --max-latency-ratio / --max-rel-error gate failed
  4    amp convert: the converted model misses the accuracy tolerance even
       after the accuracy-guided search; nothing written (--allow-inaccurate)
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
        with signals_interrupt() as received:
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
                if debug_requested(ctx):
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
def signals_interrupt():
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


def debug_requested(ctx) -> bool:
    return "--debug" in sys.argv or bool(ctx.meta.get("amp.debug"))


def debug_option(f):
    def callback(ctx, _param, value):
        if value:
            ctx.meta["amp.debug"] = True
        return value

    return click.option("--debug", is_flag=True, expose_value=False, callback=callback,
                        is_eager=True, help="Show tracebacks for errors.")(f)


def progress_bar(total: int, desc: str):
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
                     help="Bind an input's shape, e.g. input:1x3x224x224 (repeatable). A dim "
                          "may be a range LO..HI or LO..HI(OPT) (OPT: the size to optimize "
                          "for, default HI; LO..HI@OPT needs no shell quoting): one library "
                          "for every shape in the ranges, e.g. input_ids:1..32x16..512(128)."),
        click.option("--dynamic", "dynamic_dims", multiple=True, metavar="DIM=LO..HI(OPT)",
                     help="A range for every input dim the model names DIM, e.g. "
                          "batch=1..32(8) (repeatable; a plain number fixes the dim)."),
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
                 exclude_ops, exclude_nodes, tuning_db=None, cuda_graph=None, dynamic_dims=()):
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
    try:  # a malformed option value is a usage error (exit 2)
        for text in input_shapes:
            name, dims = parse_input_shape(text)
            cfg.input_shapes[name] = [canonical_dim(d) for d in dims]
        for text in dynamic_dims:
            name, dim = parse_dynamic(text)
            cfg.dynamic.dims[name] = canonical_dim(dim)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    p.policy.exclude_ops = list(p.policy.exclude_ops) + list(exclude_ops)
    p.policy.exclude_nodes = list(p.policy.exclude_nodes) + list(exclude_nodes)
    if tuning_db:
        cfg.tuning_db = tuning_db
    if cuda_graph is not None:
        cfg.cuda.cuda_graph = cuda_graph
    validate(cfg)
    return cfg


def concrete_shapes(input_shapes, dynamic_dims) -> tuple[dict, dict]:
    """``--input-shape`` / ``--dynamic`` texts naming one shape (ints, no ranges): what
    ``amp bench OUTDIR`` times a build with dynamic dims at. Malformed: exit 2."""
    shapes, dims = {}, {}
    try:
        for text in input_shapes:
            name, parsed = parse_input_shape(text)
            if not all(isinstance(d, int) for d in parsed):
                raise ConfigError(f"--input-shape '{text}': an OUTDIR is timed at one shape; "
                                  f"give sizes, not ranges (e.g. {name}:8x128)")
            shapes[name] = parsed
        for text in dynamic_dims:
            name, dim = parse_dynamic(text)
            if not isinstance(dim, int):
                raise ConfigError(f"--dynamic '{text}': an OUTDIR is timed at one shape; give "
                                  f"a size, not a range (e.g. {name}=8)")
            dims[name] = dim
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    return shapes, dims


def auto_precision_options(f):
    """Accuracy-guided precision options (convert, inspect); see docs/auto-precision.md."""
    opts = [
        click.option("--auto-precision/--no-auto-precision", "auto_precision", default=None,
                     help="Keep in fp32 (or --fallback) the nodes whose values leave the "
                          "low type's range, then the fewest extra nodes that meet --tolerance "
                          "[default: only when the plain conversion misses the accuracy "
                          "check; --no-auto-precision: never]."),
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
    a = cfg.auto_precision
    if auto_precision is not None:
        a.enabled = auto_precision
        a.when_inaccurate = auto_precision  # --no-auto-precision: not even as the fallback
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
