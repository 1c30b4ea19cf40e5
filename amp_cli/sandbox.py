"""Run work that may crash (TVM compilation, tuning) in a child process.

TVM can segfault or abort inside compilation; in the parent that would kill the CLI with no
message and lose state. Here the child is forked (so it inherits the in-memory IRModule; nothing
is serialized; in-process once this process has used CUDA), runs ``fn``, and sends back a picklable result. A signal death or a Python error
in the child becomes a :class:`BuildError` naming the stage (and the kernel, when the child said
which one it was working on before it died).

The child dies with its parent (PR_SET_PDEATHSIG), so a killed CLI leaves no compiler running;
an interrupted parent kills the child. ``--debug`` shows the child's Python stack at a crash
(faulthandler).

Test hook: ``AMP_TEST_CRASH=<pattern>[:<SIGNAL>|abort]`` makes sandboxed work crash, on purpose,
when it notes a step or kernel whose name matches the glob ``pattern`` (build steps: ``relax
pipeline``, ``codegen``, ``export``; e.g. ``AMP_TEST_CRASH=codegen:SIGSEGV``). It fires only
inside a sandboxed child, never in the CLI process itself.
"""
from __future__ import annotations

import faulthandler
import fnmatch
import multiprocessing as mp
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import traceback
from typing import Any, Callable

from .errors import AmpError, BuildError
from .tvm_compat import cuda_touched, dlight_transform, has_cuda_device

_PROGRESS_ENV = "AMP_SANDBOX_PROGRESS"
_CRASH_ENV = "AMP_TEST_CRASH"


def note_kernel(name: str) -> None:
    """Called from inside sandboxed work: remember the kernel being compiled, so a crash can
    name it."""
    _note("kernel", name)


def note_step(name: str) -> None:
    """Called from inside sandboxed work: remember the step (not a single kernel) under way."""
    _note("step", name)


def _note(kind: str, name: str) -> None:
    path = os.environ.get(_PROGRESS_ENV)
    if not path:
        return
    with open(path, "w") as f:
        f.write(f"{kind}\t{name}")
    _maybe_crash(name)


def _maybe_crash(name: str) -> None:
    """The AMP_TEST_CRASH hook (see the module docstring)."""
    spec = os.environ.get(_CRASH_ENV)
    if not spec:
        return
    pattern, _, how = spec.partition(":")
    if not fnmatch.fnmatchcase(name, pattern):
        return
    if how == "abort":
        os.abort()
    os.kill(os.getpid(), getattr(signal, how or "SIGSEGV"))


def _note_scheduled_kernels() -> None:
    """In the child: note each kernel dlight schedules, so that a crash or an error while
    scheduling names the kernel. Best effort: wraps tvm.s_tir.dlight's (0.27) per-function
    ``_apply_rules``; another TVM layout only loses the kernel names."""
    if "tvm" not in sys.modules:
        return
    try:
        dl_transform = dlight_transform()
    except Exception:  # noqa: BLE001 - another TVM version
        return
    original = getattr(dl_transform, "_apply_rules", None)
    if original is None or getattr(original, "amp_notes_kernels", False):
        return

    def apply_rules(func, *args, **kwargs):
        try:  # the caller loops `for g_var, func in mod.functions_items()`
            name = getattr(sys._getframe(1).f_locals.get("g_var"), "name_hint", None)
        except Exception:  # noqa: BLE001
            name = None
        if name:
            note_kernel(str(name))
        return original(func, *args, **kwargs)

    apply_rules.amp_notes_kernels = True
    dl_transform._apply_rules = apply_rules


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this child when the thread that forked it exits (run_isolated is called from
    the main thread), so a SIGKILLed CLI leaves no compiler running."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's finally still kills us
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _child(fn, args, kwargs, conn, progress, crash_log, parent_pid):
    _die_with_parent(parent_pid)
    os.environ[_PROGRESS_ENV] = progress
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    # The child's stderr goes to a file: a crash's backtraces (faulthandler's Python stack,
    # TVM's own segfault handler) are --debug material, not the one-line error. The parent
    # replays it after a successful run.
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    fd = os.open(crash_log, os.O_WRONLY | os.O_TRUNC)
    os.dup2(fd, 2)
    os.close(fd)
    # disable first: enable() on an already enabled faulthandler keeps the old signal handler
    # registration, and TVM's own SIGSEGV handler (installed later) would run alone
    faulthandler.disable()
    faulthandler.enable(file=2, all_threads=False)  # fd 2: sys.stderr may be no real file
    try:
        _note_scheduled_kernels()
        result = fn(*args, **kwargs)
        conn.send(("ok", pickle.dumps(result)))
    except AmpError as exc:
        conn.send(("amp", pickle.dumps(exc)))
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc(),
                   _raised_at(exc.__traceback__)))
    finally:
        conn.close()


def run_isolated(fn: Callable, *args, stage: str, isolate: bool = True, **kwargs) -> Any:
    """``fn(*args, **kwargs)`` in a forked child; returns its result or raises BuildError."""
    if not isolate or os.environ.get("AMP_NO_SANDBOX"):
        return fn(*args, **kwargs)
    # On a machine with a GPU, `import tvm` initializes CUDA, and a forked child of a process
    # that has initialized CUDA cannot use it (cudaErrorInitializationError, seen on the H200).
    # There the child is a fresh interpreter (spawn) and the arguments are pickled (IRModules
    # pickle through TVM's JSON); work that does not pickle runs in-process, uncontained.
    method = "spawn" if (cuda_touched() or has_cuda_device()) else "fork"
    if method == "spawn":
        try:
            pickle.dumps((fn, args, kwargs))
        except Exception:  # noqa: BLE001 - closures, live TVM runtime objects
            return fn(*args, **kwargs)
    ctx = mp.get_context(method)
    work, proc, parent = None, None, None
    try:  # everything, temp files included, inside: an interrupt anywhere leaves nothing
        work = tempfile.mkdtemp(prefix="amp-sandbox-")
        progress, crash_log = os.path.join(work, "progress"), os.path.join(work, "stderr")
        for path in (progress, crash_log):
            open(path, "w").close()
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, daemon=True,
                           args=(fn, args, kwargs, child, progress, crash_log, os.getpid()))
        proc.start()
        child.close()
        msg = None
        try:
            msg = parent.recv()
        except EOFError:
            pass
        proc.join(timeout=None if msg is None else 30)
        if msg is None:
            sig = -proc.exitcode if proc.exitcode and proc.exitcode < 0 else None
            if sig == signal.SIGINT:  # Ctrl-C reached the child's process group first
                raise KeyboardInterrupt
            kind, name = _read_progress(progress)
            how = f"crashed with {signal.Signals(sig).name}" if sig else \
                f"died (exit code {proc.exitcode})"
            where = f" while compiling kernel '{name}'" if kind == "kernel" else \
                f" during {name}" if name else ""
            err = BuildError(f"stage '{stage}': TVM {how}{where}; rerun with --debug for "
                             f"details, or exclude the op/node with --exclude-op/--exclude-node",
                             stage=stage, kernel=name if kind == "kernel" else None)
            err.child_traceback = _read(crash_log) or None
            raise err
        kind = msg[0]
        if kind == "ok":
            captured = _read(crash_log)
            if captured:
                sys.stderr.write(captured + "\n")
            return pickle.loads(msg[1])
        if kind == "amp":
            exc = pickle.loads(msg[1])
            exc.child_traceback = _read(crash_log) or None
            raise exc
        line = error_line(msg[1])
        if line.endswith(":"):  # an empty message (a bare assert): say where it was raised
            line = f"{line[:-1]} at {msg[3]}"
        kind, name = _read_progress(progress)
        kernel = name if kind == "kernel" else None
        err = BuildError(f"stage '{stage}' failed"
                         + (f" on kernel '{kernel}'" if kernel else "")
                         + f": {line[:400]}", stage=stage, kernel=kernel)
        err.child_traceback = "\n".join(t for t in (_read(crash_log), msg[2]) if t)
        raise err
    finally:
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join()
        if parent is not None:
            parent.close()
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


_ERROR_LINE = re.compile(r"^\s*[\w.]*(Error|Exception|Interrupt|Exit): ")


def error_line(text: str) -> str:
    """The line of an exception's text that says what went wrong: the last 'SomeError: ...'
    line (TVM errors carry a C++ backtrace before it and sometimes a TIR dump after it), else
    the last line that is not a source-caret marker."""
    lines = [ln.strip() for ln in text.strip().splitlines()]
    named = [ln for ln in lines if _ERROR_LINE.match(ln)]
    if named:
        return named[-1]
    plain = [ln for ln in lines if ln and set(ln) - set("^~ ")]
    return plain[-1] if plain else "unknown error"


def _raised_at(tb) -> str:
    frames = traceback.extract_tb(tb)
    if not frames:
        return "unknown location"
    f = frames[-1]
    path = f.filename.split("site-packages/")[-1]
    return f"{path}:{f.lineno}" + (f" ({f.line.strip()[:120]})" if f.line else "")


def _read_progress(path: str) -> tuple[str, str]:
    kind, sep, name = _read(path).partition("\t")
    return (kind, name) if sep else ("kernel" if kind else "", kind)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""
