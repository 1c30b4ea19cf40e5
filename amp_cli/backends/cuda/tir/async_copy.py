"""Keep strided vector copies out of ``cp.async`` (a TVM 0.27 bug, guarded against).

``InjectPTXAsyncCopy`` (apache/tvm src/s_tir/transform/inject_ptx_async_copy.cc, 0.27) turns every
global->shared vector copy inside a pipeline's ``async_scope`` into one ``cp.async`` of
``lanes x element size`` bytes from the *base* of the load's ``Ramp`` index: it never looks at
the ramp's stride. A copy that reads a strided vector (``A[ramp(base, 1024, 8)]``: a schedule that
vectorizes along a non-contiguous axis) becomes a 16-byte copy of 8 *consecutive* elements: wrong
data, and ``cudaErrorMisalignedAddress`` when ``base`` is not 16-byte aligned.

amp's own GEMM schedule (tc_gemm) never emits such copies, but tuning candidates and other
schedules may. This pass runs right before ``InjectPTXAsyncCopy`` and drops the ``async_scope``
marker from any scope holding such a copy, so that scope's copies stay ordinary (synchronous)
loads/stores: correct, and the pipeline's commit/wait calls around them wait for nothing.
"""
from __future__ import annotations

from .... import tvm_compat
from .records import LegalizeRecord

PASS_NAME = "amp.SyncStridedAsyncCopy"
ASYNC_SCOPE = "async_scope"


def _strided(index) -> bool:
    T = tvm_compat.tirx()
    if isinstance(index, T.Ramp):
        stride = index.stride
        return not (hasattr(stride, "value") and int(stride.value) == 1)
    return False


def _has_strided_copy(stmt) -> bool:
    T = tvm_compat.tirx()
    found = []

    def on_store(store, mutator):
        value = store.value
        if isinstance(value, tvm_compat.buffer_load_class()) and \
                str(value.source.scope()) == "global":
            if any(_strided(ix) for ix in list(value.indices) + list(store.indices)):
                found.append(store)
        return mutator.default_mutate(store)

    tvm_compat.structural_mutate(stmt, [(T.BufferStore, on_store)])
    return bool(found)


def fix_func(func, records: list | None = None):
    """``func`` with ``async_scope`` removed around strided copies (or unchanged). When it
    changes, a ``LegalizeRecord`` naming the kernel is appended to ``records`` (the list the
    lane legalizer fills, which the convert report prints)."""
    T = tvm_compat.tirx()
    dropped = []

    def on_attr(attr, mutator):
        if str(attr.attr_key) == ASYNC_SCOPE and _has_strided_copy(attr.body):
            dropped.append(attr)
            return mutator.mutate(attr.body)
        return mutator.default_mutate(attr)

    body = tvm_compat.structural_mutate(func.body, [(T.AttrStmt, on_attr)])
    if not dropped:
        return func
    if records is not None:
        name = func.attrs.get("global_symbol", None) if func.attrs is not None else None
        records.append(LegalizeRecord(
            str(name) if name is not None else "?",
            [f"{len(dropped)} cp.async scope(s) with strided copies made synchronous"],
            stage=f"before InjectPTXAsyncCopy ({PASS_NAME})"))
    return func.with_body(body)


def sync_strided_async_copy_pass(records: list | None = None):
    """A PrimFunc pass applying :func:`fix_func` (records: see there)."""
    return tvm_compat.prim_func_pass(lambda f, _m, _c: fix_func(f, records), PASS_NAME)
