"""amp's one error boundary.

Library code raises these; the CLI prints ``amp: error: <message>`` on one line and exits with
``exit_code``. Messages name the file / op / node / stage and say what to try.
"""
from __future__ import annotations

EXIT_OK = 0
EXIT_ERROR = 1  # an AmpError: bad input, failed import, failed build ...
EXIT_USAGE = 2  # bad command line (click's own code)
EXIT_GATE = 3  # `amp bench` gate failed (latency ratio or error above threshold)
EXIT_INACCURATE = 4  # `amp convert`: the converted model misses the accuracy tolerance
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT); SIGTERM exits 143 (128 + signal)


class AmpError(Exception):
    """Base class of every error amp reports to a user."""

    exit_code = EXIT_ERROR

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:  # one line, always
        return " ".join(self.message.split("\n")).strip()


class InputError(AmpError):
    """The model file, a shape, an .npz or another user input is unusable."""


class ConfigError(AmpError):
    """A config file or option is invalid."""


class UsageError(ConfigError):
    """A command-line option's value is malformed (``--input-shape``, ``--dynamic``): exit 2,
    as click's own usage errors, in amp's one-line form."""

    exit_code = EXIT_USAGE


class ModelLoadError(AmpError):
    """The model could not be parsed or imported into TVM."""


class UnsupportedOpError(ModelLoadError):
    """The model uses ops TVM's importer cannot handle."""

    def __init__(self, message: str, ops: list[tuple[str, str]] | None = None):
        super().__init__(message)
        self.ops = ops or []  # (op_type, node_name)


class TargetError(AmpError):
    """Unknown target / arch, or a toolchain (nvcc) is missing."""


class BuildError(AmpError):
    """Compilation failed or crashed; names the stage and, where known, the kernel."""

    def __init__(self, message: str, stage: str = "", kernel: str | None = None):
        super().__init__(message)
        self.stage = stage
        self.kernel = kernel


class OutputError(AmpError):
    """OUTDIR cannot be written (exists without --force, not writable ...)."""


class TuneError(AmpError):
    """Tuning failed."""


class AccuracyError(AmpError):
    """The converted model misses the accuracy tolerance even after the accuracy-guided
    search: nothing is written unless the user allows it."""

    exit_code = EXIT_INACCURATE


class GateError(AmpError):
    """A bench gate (--max-latency-ratio / --max-rel-error) failed."""

    exit_code = EXIT_GATE


def last_line(exc) -> str:
    """The last non-empty line of an exception's text (TVM puts the message after a backtrace),
    at most 400 characters."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:400]
