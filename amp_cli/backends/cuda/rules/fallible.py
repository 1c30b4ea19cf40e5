"""A dlight rule that raises counts as "not this rule" (the next rule gets the kernel)."""
from __future__ import annotations

from .... import tvm_compat
from ....ir_attrs import KERNEL_NAME


def fallible(rule, failures: list | None = None):
    """``rule`` wrapped so that an exception means "not applicable".

    dlight applies rules in order and stops at the first that returns a schedule, but a rule
    that *raises* on a kernel it mis-matched (GEMV's assert on a 1-channel conv GEMM, Reduction's
    rfactor on a reduce-to-scalar: found by tests/test_fuzz.py) aborts the whole build. Wrapped,
    such a rule counts as not applicable and the next one gets the kernel. Rules schedule a fresh
    copy of the PrimFunc, so a failed attempt leaves nothing behind. Each failure is appended
    to ``failures`` as {rule, kernel, error} (the build report lists them), so a rule that
    breaks is visible instead of silently handing its kernels to a slower rule."""
    dl = tvm_compat.dlight()

    class Fallible(dl.ScheduleRule):
        def __init__(self):
            self.rule = rule

        def apply(self, func, target, tunable):
            try:
                return self.rule.apply(func, target, tunable)
            except Exception as exc:  # noqa: BLE001 - any rule bug means "not this rule"
                if failures is not None:
                    name = func.attrs.get(KERNEL_NAME, None) if func.attrs else None
                    lines = str(exc).strip().splitlines()
                    failures.append({"rule": type(self.rule).__name__,
                                     "kernel": str(name) if name is not None else "?",
                                     "error": f"{type(exc).__name__}: "
                                              f"{lines[-1] if lines else ''}"[:200]})
                return None

        def __repr__(self):
            return f"Fallible({type(self.rule).__name__})"

    return Fallible()
