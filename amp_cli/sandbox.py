"""Run work that may crash (TVM compilation, tuning) in a child process.

TVM can segfault or abort inside compilation; in the parent that would kill the CLI with no
message and lose state. Here the child is forked (so it inherits the in-memory IRModule; nothing
is serialized; in-process once this process has used CUDA), runs ``fn``, and sends back a picklable result. A signal death or a Python error
in the child becomes a :class:`BuildError` naming the stage (and the kernel, when the child said
which one it was working on before it died).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import tempfile
import traceback
from typing import Any, Callable

from .errors import AmpError, BuildError

_PROGRESS_ENV = "AMP_SANDBOX_PROGRESS"


def note_kernel(name: str) -> None:
    """Called from inside sandboxed work: remember the kernel being compiled, so a crash can
    name it."""
    path = os.environ.get(_PROGRESS_ENV)
    if path:
        with open(path, "w") as f:
            f.write(name)


def _child(fn, args, kwargs, conn, progress):
    os.environ[_PROGRESS_ENV] = progress
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        result = fn(*args, **kwargs)
        conn.send(("ok", pickle.dumps(result)))
    except AmpError as exc:
        conn.send(("amp", pickle.dumps(exc)))
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    finally:
        conn.close()


def run_isolated(fn: Callable, *args, stage: str, isolate: bool = True, **kwargs) -> Any:
    """``fn(*args, **kwargs)`` in a forked child; returns its result or raises BuildError."""
    from .tvm_compat import cuda_touched

    # A forked child cannot use a CUDA context its parent created: once this process has run
    # something on the GPU, later builds run in-process (uncontained).
    if not isolate or os.environ.get("AMP_NO_SANDBOX") or cuda_touched():
        return fn(*args, **kwargs)
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    with tempfile.NamedTemporaryFile(prefix="amp-progress-", delete=False) as f:
        progress = f.name
    proc = ctx.Process(target=_child, args=(fn, args, kwargs, child, progress), daemon=True)
    try:
        proc.start()
        child.close()
        msg = None
        try:
            msg = parent.recv()
        except EOFError:
            pass
        proc.join()
        if msg is None:
            kernel = _read(progress)
            sig = -proc.exitcode if proc.exitcode and proc.exitcode < 0 else None
            how = f"crashed with {signal.Signals(sig).name}" if sig else \
                f"died (exit code {proc.exitcode})"
            where = f" while compiling kernel '{kernel}'" if kernel else ""
            raise BuildError(f"stage '{stage}': TVM {how}{where}; rerun with --debug for "
                             f"details, or exclude the op/node with --exclude-op/--exclude-node",
                             stage=stage, kernel=kernel or None)
        kind = msg[0]
        if kind == "ok":
            return pickle.loads(msg[1])
        if kind == "amp":
            raise pickle.loads(msg[1])
        first = msg[1].strip().splitlines()
        line = first[-1] if first else "unknown error"
        err = BuildError(f"stage '{stage}' failed: {line[:400]}", stage=stage,
                         kernel=_read(progress) or None)
        err.child_traceback = msg[2]
        raise err
    except KeyboardInterrupt:
        proc.kill()
        proc.join()
        raise
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        try:
            os.unlink(progress)
        except OSError:
            pass


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""
