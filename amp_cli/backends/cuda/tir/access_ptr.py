"""Typed views for ``tvm_access_ptr`` after shared-memory reuse (a TVM 0.27 bug, worked around).

Symptom: ``LowerIntrin`` fails with ``tvm_access_ptr element type must match the source buffer
(T.float16 vs. T.float32)`` on tensor-core kernels: 26 of 32 MetaSchedule fp16 matmul candidates
(benchmarks/ms_build_failures.py) and some of amp's own GEMM tile shapes.

Cause (apache/tvm src/tirx/transform/storage_rewrite.cc and lower_intrin.cc, 0.27): when
``StorageRewrite`` lets the fp32 accumulator staging tile reuse the storage of an fp16 operand tile
(their lifetimes do not overlap), it points every ``tvm_access_ptr`` of the fp32 tile at the
storage entry's variable, which carries the *first* tenant's element type (fp16). Since buffers
became typed variables, ``LowerAccessPtr`` refuses an access whose element type differs from the
buffer variable's, although the address arithmetic (offsets in units of the access type) is right.

Fix: after the main TIR passes, for each such access ``tvm_access_ptr(T.type_annotation(t),
buffer_data(B), ...)`` with ``B.dtype != t``, declare a view ``B_as_t`` of the same storage right
after ``B``'s ``DeclBuffer`` and point the access at it. Nothing else changes, so the generated
code is the same pointer arithmetic with the right element type.
"""
from __future__ import annotations

from .... import tvm_compat

PASS_NAME = "amp.TypedAccessPtr"


def _ops():
    ir = tvm_compat.tvm().ir
    return ir.Op.get("tirx.tvm_access_ptr"), ir.Op.get("tirx.buffer_data")


def _source_buffer(call, buffer_data_op):
    """B of ``buffer_data(B)`` in an access_ptr's second argument, else None."""
    ir = tvm_compat.tvm().ir
    src = call.args[1]
    if isinstance(src, ir.Call) and src.op.same_as(buffer_data_op) and len(src.args) == 1:
        return src.args[0]
    return None


def _access_dtype(call) -> str:
    return str(call.args[0].ty.dtype) if hasattr(call.args[0].ty, "dtype") else str(call.args[0].ty)


def fix_func(func):
    """The PrimFunc with mismatched access pointers re-pointed at typed views (or unchanged)."""
    tvm = tvm_compat.tvm()
    ir, T = tvm.ir, tvm_compat.tirx()
    access_op, data_op = _ops()

    # 1. which buffers are accessed with which other element types
    wanted: dict = {}   # id key -> (buffer, {dtype: view})

    def key(buf):
        return buf.__hash__()

    def find(call, mutator):
        if call.op.same_as(access_op):
            buf = _source_buffer(call, data_op)
            dtype = _access_dtype(call)
            if buf is not None and hasattr(buf, "with_dtype") and str(buf.dtype) != dtype:
                entry = wanted.setdefault(key(buf), (buf, {}))
                if dtype not in entry[1]:
                    view = buf.with_dtype(dtype)
                    entry[1][dtype] = view
        return mutator.default_mutate(call)

    tvm_compat.structural_mutate(func.body, [(ir.Call, find)])
    if not wanted:
        return func

    # 2. declare the views next to their source declaration and re-point the accesses
    declared = set()

    def on_seq(seq, mutator):
        out = []
        for stmt in seq.seq:
            out.append(mutator.mutate(stmt))
            if isinstance(stmt, T.DeclBuffer) and key(stmt.buffer) in wanted:
                for view in wanted[key(stmt.buffer)][1].values():
                    out.append(tvm_compat.decl_buffer(view, stmt.data))
                declared.add(key(stmt.buffer))
        return T.SeqStmt(out)

    def on_call(call, mutator):
        call = mutator.default_mutate(call)
        if call.op.same_as(access_op):
            buf = _source_buffer(call, data_op)
            if buf is not None and key(buf) in wanted:
                view = wanted[key(buf)][1].get(_access_dtype(call))
                if view is not None:
                    args = list(call.args)
                    args[1] = T.buffer_data(view)
                    return ir.Call(call.op, args, call.attrs, list(call.ty_args), None, call.ty)
        return call

    body = tvm_compat.structural_mutate(func.body, [(T.SeqStmt, on_seq), (ir.Call, on_call)])
    if len(declared) != len(wanted):
        return func  # a source we could not find a declaration for: leave TVM's error visible
    return func.with_body(body)


def typed_access_ptr_pass():
    """A PrimFunc pass applying :func:`fix_func` (run after the main TIR passes, before
    LowerIntrin in the device finalization)."""
    return tvm_compat.prim_func_pass(lambda f, _m, _c: fix_func(f), PASS_NAME)
