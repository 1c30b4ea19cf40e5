"""A dlight rule that raises counts as "not this rule" (the next rule gets the kernel)."""
from __future__ import annotations

from .... import tvm_compat
from ....ir_attrs import KERNEL_NAME


def fallible(rule, failures: list | None = None, scheduled: list | None = None):
    """``rule`` wrapped so that an exception means "not applicable".

    dlight applies rules in order and stops at the first that returns a schedule, but a rule
    that *raises* on a kernel it mis-matched (GEMV's assert on a 1-channel conv GEMM, Reduction's
    rfactor on a reduce-to-scalar: found by tests/test_fuzz.py) aborts the whole build. Wrapped,
    such a rule counts as not applicable and the next one gets the kernel. Rules schedule a fresh
    copy of the PrimFunc, so a failed attempt leaves nothing behind. Each failure is appended
    to ``failures`` as {rule, kernel, error} (the build report lists them), so a rule that
    breaks is visible instead of silently handing its kernels to a slower rule. Each kernel it
    schedules is appended to ``scheduled`` as {kernel, rule, reduction}."""
    dl = tvm_compat.dlight()

    class Fallible(dl.ScheduleRule):
        def __init__(self):
            self.rule = rule

        def apply(self, func, target, tunable):
            try:
                sch = self.rule.apply(func, target, tunable)
                if sch is not None and scheduled is not None:
                    scheduled.append(_record(func, type(self.rule).__name__))
                return sch
            except Exception as exc:  # noqa: BLE001 - any rule bug means "not this rule"
                if failures is not None:
                    lines = str(exc).strip().splitlines()
                    failures.append({"rule": type(self.rule).__name__,
                                     "kernel": _kernel_name(func),
                                     "error": f"{type(exc).__name__}: "
                                              f"{lines[-1] if lines else ''}"[:200]})
                return None

        def __repr__(self):
            return f"Fallible({type(self.rule).__name__})"

    return Fallible()


def reduction_extent(func) -> int:
    """Multiply-adds per output element of ``func``'s heaviest reduction block (the product of
    its reduction axes' extents; 0 for a kernel without one, or one whose extents are
    symbolic)."""
    tvm = tvm_compat.tvm()
    try:
        sch = tvm.s_tir.Schedule(func)
        blocks = sch.get_child_blocks(tvm_compat.dlight_analysis().get_root_block(sch))
    except Exception:  # noqa: BLE001 - not block-structured: no record
        return 0
    best = 0
    for blk in blocks:
        size, reduces = 1, False
        for iv in sch.get(blk).iter_vars:
            if int(iv.iter_type) == 2:
                reduces = True
                extent = getattr(iv.dom.extent, "value", None)
                size = size * int(extent) if extent is not None else 0
        if reduces:
            best = max(best, size)
    return best


def _kernel_name(func) -> str:
    """The kernel's name as the pipeline recorded it (``name_kernels_pass``), else "?"."""
    name = func.attrs.get(KERNEL_NAME, None) if func.attrs else None
    return str(name) if name is not None else "?"


def _record(func, rule: str) -> dict:
    return {"kernel": _kernel_name(func), "rule": rule, "reduction": reduction_extent(func)}


def recorded_fallback(records: list | None = None):
    """dlight's generic ``Fallback`` rule (every output element its own thread, nothing tiled
    or staged), appending {kernel, rule, reduction} to ``records`` for each kernel it
    schedules, as ``fallible`` does for the other rules: the build report names the compute
    kernels that only generic schedules took (a conv1d on one was most of Whisper's front end
    before ``rewrites/conv1d.py``)."""
    dl = tvm_compat.dlight()
    if records is None:
        return dl.gpu.Fallback()

    class RecordedFallback(dl.gpu.Fallback):
        def apply(self, func, target, tunable):
            sch = super().apply(func, target, tunable)
            if sch is not None:
                records.append(_record(func, "Fallback"))
            return sch

    return RecordedFallback()
