"""Mixed-precision conversion of a Relax module: fp16 or bf16, with fp32 where needed.

Why not ``relax.transform.ToMixedPrecision`` alone: it only knows fp16, cannot exclude single
nodes, and reports nothing. This pass follows the same three-way policy (always / follow / never,
TVM's registered ``TMixedPrecisionPolicy`` as the fallback) and adds:

- bf16 as a real target type;
- per-node and per-op exclusions (ONNX node names survive import as Relax var names);
- constants checked against the target type's range: an op whose constant does not fit (a bias of
  70000 in fp16) stays in fp32 and the report says so; only tiny underflows are flushed (counted);
- a record of every decision (ops by dtype, casts inserted, nodes kept in fp32 and why).

Semantics per binding ``v = op(args)``:
  always -> float args cast to the low type, output in the accumulate type (fp32 by default);
  follow -> low type when every float tensor arg is already low (or an always-op output meant to
            be narrowed, or a constant that fits), else fp32;
  never  -> every arg back in its original type.
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from .. import tvm_compat
from ..config import PrecisionConfig
from ..dtypes import FLOAT_TYPES, np_to_dtype, type_range
from ..errors import AmpError
from ..ir_attrs import ONNX_NODE_PREFIX
from .policy import OpPolicy, short_name
from .records import ConstantIssue, KeptNode, PrecisionReport

# Ops whose attrs carry the output type of the computation.
OUT_DTYPE_OPS = {
    "relax.matmul", "relax.nn.conv1d", "relax.nn.conv2d", "relax.nn.conv3d",
    "relax.nn.conv1d_transpose", "relax.nn.conv2d_transpose", "relax.nn.conv3d_transpose",
}


def call_with_out_dtype(call, args, dtype: str):
    """A copy of ``call`` (an op in OUT_DTYPE_OPS) on ``args`` whose attrs say ``out_dtype``."""
    tvm = tvm_compat.tvm()
    attrs = call.attrs
    fields = {k: getattr(attrs, k) for k in dir(attrs) if not k.startswith("_") and
              k not in ("get_int", "get_int_tuple", "get_str", "id_", "is_", "same_as",
                        "out_dtype")}
    new_attrs = tvm.ir.make_node("relax.attrs." + type(attrs).__name__, out_dtype=dtype,
                                 **fields)
    return tvm.relax.Call(call.op, args, new_attrs, getattr(call, "sinfo_args", None))


def tensor_dtype(expr) -> str | None:
    """The dtype of a tensor-typed Relax expression, None for anything else."""
    ty = getattr(expr, "ty", None)
    return str(ty.dtype) if ty is not None and hasattr(ty, "dtype") and hasattr(ty, "ndim") \
        and type(ty).__name__ == "TensorType" else None


class Converter:
    """The pass over one Relax function (see the module docstring); ``auto.py`` drives it node
    by node."""

    def __init__(self, cfg: PrecisionConfig, node_types: dict[str, str] | None):
        self.tvm = tvm_compat.tvm()
        self.relax = self.tvm.relax
        self.cfg = cfg
        self.low = cfg.dtype
        self.acc = cfg.accumulate_dtype
        self.node_types = node_types or {}
        self.policy = OpPolicy(cfg.policy, self.node_types)
        rng = type_range(self.low)
        self.max_val, self.min_sub = rng.max, rng.smallest_subnormal
        self.report = PrecisionReport(dtype=self.low, accumulate=self.acc)
        self.ops = Counter()
        self.remap = {}  # old var -> new expr
        self.orig_dtype = {}  # new var -> dtype the old var had
        self.widen = set()  # new vars (fp32) produced by always-ops, to be narrowed downstream
        self.cast_cache = {}
        self.const_cache = {}
        self.seen_nodes = set()

    # -- helpers -------------------------------------------------------------------------
    tensor_dtype = staticmethod(tensor_dtype)

    def is_const(self, expr) -> bool:
        return isinstance(expr, self.tvm.ir.expr.Constant)

    def const_fits(self, expr) -> tuple[bool, float]:
        arr = expr.value.numpy()
        if arr.dtype.kind != "f" or arr.size == 0:
            return True, 0.0
        finite = arr[np.isfinite(arr)]
        max_abs = float(np.max(np.abs(finite))) if finite.size else 0.0
        return max_abs <= self.max_val, max_abs

    def cast(self, bb, expr, dtype: str):
        src = self.tensor_dtype(expr)
        if src is None or src == dtype or src not in FLOAT_TYPES:
            return expr
        if self.is_const(expr):
            hit = self.const_cache.get((id(expr), dtype))
            if hit is not None:
                return hit[1]
            arr = expr.value.numpy()
            if dtype in ("float16", "bfloat16"):
                tiny = (arr != 0) & np.isfinite(arr) & (np.abs(arr) < self.min_sub / 2)
                n_tiny = int(np.count_nonzero(tiny))
                if n_tiny:
                    self.report.underflow_flushed += n_tiny
            new = self.relax.const(np_to_dtype(arr, dtype), dtype)
            self.const_cache[(id(expr), dtype)] = (expr, new)  # holding expr keeps id stable
            return new
        hit = self.cast_cache.get((expr, dtype))
        if hit is None:
            hit = bb.emit(self.relax.op.astype(expr, dtype))
            self.cast_cache[(expr, dtype)] = hit
            self.report.casts_inserted += 1
        return hit

    def restore(self, bb, old, new):
        """`new` converted back to the dtype `old` had."""
        want = self.tensor_dtype(old)
        if want is None:
            return new
        return self.cast(bb, new, want)

    def low_eligible(self, expr) -> bool:
        dt = self.tensor_dtype(expr)
        if dt is None or dt not in FLOAT_TYPES:
            return True  # ints, shapes, bools do not decide precision
        if dt == self.low or expr in self.widen:
            return True
        return self.is_const(expr) and self.const_fits(expr)[0]

    # -- one binding ---------------------------------------------------------------------
    def convert_call(self, bb, node: str, call):
        relax = self.relax
        new_args = [self.remap_expr(a) for a in call.args]
        op = call.op
        if not isinstance(op, self.tvm.ir.Op):
            # call_tir, packed functions, sub-functions: original types in, untouched.
            args = [self.restore(bb, o, n) for o, n in zip(call.args, new_args)]
            return relax.Call(op, args, call.attrs, getattr(call, "sinfo_args", None)), "fp32"
        name = op.name
        float_args = [(o, n) for o, n in zip(call.args, new_args)
                      if self.tensor_dtype(o) in FLOAT_TYPES]
        mode = self.policy.mode_of(name)
        reason = "policy"
        ex = self.policy.exclusion(node, name)
        if ex:
            mode, reason = "never", ex
        if name == "relax.astype":
            # The model's own cast: keep its output type, read whichever input is at hand.
            return relax.Call(op, new_args, call.attrs), "keep"
        if not float_args:
            return relax.Call(op, new_args, call.attrs, getattr(call, "sinfo_args", None)), "keep"
        if mode != "never" and self.cfg.precision != "fp32":
            for o, n in float_args:
                if self.is_const(n):
                    fits, max_abs = self.const_fits(n)
                    if not fits:
                        self.report.constants.append(ConstantIssue(
                            node=node, op=short_name(name), max_abs=max_abs, limit=self.max_val,
                            action="kept-fp32"))
                        mode, reason = "never", "constant-range"
                        break
        explicit = getattr(call.attrs, "out_dtype", None) if call.attrs is not None else None
        explicit = str(explicit) if explicit not in (None, "") and str(explicit) not in (
            "void", "") else None
        if mode == "follow" and not all(self.low_eligible(n) for _, n in float_args):
            mode, reason = "never", "fp32-input"
        if self.cfg.precision == "fp32":
            mode = "never"
        if mode == "always" and name in OUT_DTYPE_OPS:
            args = [self.cast(bb, n, self.low) if self.tensor_dtype(o) in FLOAT_TYPES else n
                    for o, n in zip(call.args, new_args)]
            out = self.acc if explicit is None else explicit
            return call_with_out_dtype(call, args, out), "always"
        if mode in ("always", "follow") and explicit is None:
            args = [self.cast(bb, n, self.low) if self.tensor_dtype(o) in FLOAT_TYPES else n
                    for o, n in zip(call.args, new_args)]
            return relax.Call(op, args, call.attrs, getattr(call, "sinfo_args", None)), mode
        args = [self.restore(bb, o, n) for o, n in zip(call.args, new_args)]
        if self.cfg.precision != "fp32":
            self.report.kept_fp32.append(KeptNode(node=node, op=short_name(name), reason=reason))
        return relax.Call(op, args, call.attrs, getattr(call, "sinfo_args", None)), "fp32"

    def remap_expr(self, expr):
        relax = self.relax
        if isinstance(expr, relax.Var):
            return self.remap.get(expr, expr)
        if isinstance(expr, relax.Tuple):
            return relax.Tuple([self.remap_expr(f) for f in expr.fields])
        return expr

    def convert_value(self, bb, node, value):
        """Returns the new value expression for one binding."""
        relax = self.relax
        if isinstance(value, relax.Call):
            new, mode = self.convert_call(bb, node, value)
            return new, mode
        if isinstance(value, relax.TupleGetItem):
            return relax.TupleGetItem(self.remap_expr(value.tuple_value), value.index), "keep"
        if isinstance(value, (relax.Var, relax.Tuple)):
            return self.remap_expr(value), "keep"
        if isinstance(value, (relax.If, relax.SeqExpr, relax.Function)):
            raise Unsupported(type(value).__name__)
        return value, "keep"

    # -- a whole function ----------------------------------------------------------------
    def convert_function(self, func):
        relax = self.relax
        body = func.body
        if not isinstance(body, relax.SeqExpr):
            raise Unsupported("function body")
        owners = self.attribute_nodes(body)
        bb = relax.BlockBuilder()
        params = list(func.params)
        attrs = {k: func.attrs[k] for k in func.attrs.keys()} if func.attrs is not None else {}
        with bb.function("main", params=params, attrs=attrs, pure=func.is_pure
                         if hasattr(func, "is_pure") else True):
            for block in body.blocks:
                is_df = isinstance(block, relax.DataflowBlock)
                if is_df:
                    with bb.dataflow():
                        outs = self.convert_bindings(bb, block, owners, is_df)
                        for old_var, new_val in outs:
                            self.remap[old_var] = bb.emit_output(new_val)
                else:
                    self.convert_bindings(bb, block, owners, is_df)
            result = self.remap_expr(body.body)
            ret = self.finish_outputs(bb, body.body, result)
            bb.emit_func_output(ret)
        return bb.get()["main"]

    def finish_outputs(self, bb, old, new):
        relax = self.relax
        if not self.cfg.keep_io_types:
            return new
        if isinstance(old, relax.Tuple):
            return relax.Tuple([self.finish_outputs(bb, o, n) for o, n in zip(old.fields,
                                                                               new.fields)])
        old_ty = old.ty
        if type(old_ty).__name__ == "TupleType":
            items = []
            for i in range(len(old_ty.fields)):
                item = bb.emit(relax.TupleGetItem(new, i))
                want = str(old_ty.fields[i].dtype) if hasattr(old_ty.fields[i], "dtype") else None
                items.append(self.cast(bb, item, want) if want in FLOAT_TYPES else item)
            return relax.Tuple(items)
        return self.restore(bb, old, new)

    def convert_bindings(self, bb, block, owners, is_df):
        relax = self.relax
        escaping = []
        for binding in block.bindings:
            old_var = binding.var
            node = owners.get(old_var, old_var.name)
            if isinstance(binding, relax.MatchCast):
                val = self.restore(bb, binding.value, self.remap_expr(binding.value))
                new_var = bb.match_cast(val, binding.ty)
                self.remap[old_var] = new_var
                continue
            new_val, mode = self.convert_value(bb, node, binding.value)
            if isinstance(binding.value, relax.Call) and isinstance(binding.value.op,
                                                                     self.tvm.ir.Op):
                self.report.total_ops += 1
                if mode in ("always", "follow"):
                    self.report.converted_ops += 1
            is_output = is_df and not isinstance(old_var, relax.DataflowVar)
            if is_output:
                new_val = bb.emit(new_val, name_hint=old_var.name)
                escaping.append((old_var, new_val))
                self.remap[old_var] = new_val
            else:
                new_var = bb.emit(new_val, name_hint=old_var.name)
                self.remap[old_var] = new_var
                new_val = new_var
            if mode == "always" and self.tensor_dtype(new_val) != self.low:
                self.widen.add(new_val)
            if isinstance(binding.value, relax.Call) and isinstance(binding.value.op,
                                                                     self.tvm.ir.Op):
                dt = self.tensor_dtype(new_val) or "tuple"
                self.ops[f"{short_name(binding.value.op.name)}:{dt}"] += 1
        return escaping

    def attribute_nodes(self, body) -> dict:
        """var -> ONNX node name: the importer names each node's final binding 'onnx:NAME';
        helper bindings it emitted just before belong to the same node."""
        owners = {}
        for block in body.blocks:
            pending = []
            for binding in block.bindings:
                name = binding.var.name
                pending.append(binding.var)
                if name.startswith(ONNX_NODE_PREFIX):
                    node = name[len(ONNX_NODE_PREFIX):]
                    for v in pending:
                        owners[v] = node
                    pending = []
            for v in pending:
                owners[v] = v.name
        return owners


class Unsupported(Exception):
    """A construct the pass does not convert (control flow)."""

    pass


def convert_precision(mod, cfg: PrecisionConfig, node_types: dict[str, str] | None = None):
    """Convert ``mod['main']`` to mixed precision. Returns (new IRModule, PrecisionReport)."""
    tvm = tvm_compat.tvm()
    relax = tvm.relax
    mod = relax.transform.DecomposeOpsForInference()(mod)
    if cfg.precision == "fp32":
        rep = PrecisionReport(dtype="float32", accumulate="float32", note="fp32: no conversion")
        rep.ops_by_dtype = dict(count_ops(mod))
        rep.op_dtypes = op_dtype_table(mod)
        rep.total_ops = sum(rep.ops_by_dtype.values())
        return mod, rep
    conv = Converter(cfg, node_types)
    try:
        new_main = conv.convert_function(mod["main"])
    except Unsupported as exc:
        if cfg.precision != "fp16":
            raise AmpError(f"amp's {cfg.precision} conversion does not handle a '{exc}' in the "
                           f"model's main function yet; use --precision fp16 or fp32") from None
        out = relax.transform.ToMixedPrecision(out_dtype=cfg.accumulate_dtype)(mod)
        rep = PrecisionReport(dtype=cfg.dtype, accumulate=cfg.accumulate_dtype,
                              note=f"model has control flow ({exc}): used TVM's "
                                   f"ToMixedPrecision; per-node policy not applied")
        rep.ops_by_dtype = dict(count_ops(out))
        rep.op_dtypes = op_dtype_table(out)
        return out, rep
    new_mod = tvm.IRModule({**{gv.name_hint: mod[gv] for gv in mod.get_global_vars()
                               if gv.name_hint != "main"}, "main": new_main})
    new_mod = relax.transform.DeadCodeElimination(["main"])(new_mod)
    new_mod = relax.transform.FoldConstant()(new_mod)
    rep = conv.report
    rep.ops_by_dtype = dict(count_ops(new_mod))
    rep.op_dtypes = op_dtype_table(new_mod)
    return new_mod, rep


def count_ops(mod) -> Counter:
    """'op:output dtype' -> count over main's bindings (astype counted as casts)."""
    counts = Counter()
    for (op, _inputs, output), n in _op_dtypes(mod).items():
        counts[f"{op}:{output}"] += n
    return counts


def op_dtype_table(mod) -> list[dict]:
    """One row per (op, float input dtypes, output dtype) of main's op calls, with its count:
    a conv reading fp16 and accumulating into fp32 is ``nn.conv2d float16 -> float32``."""
    return [{"op": op, "inputs": inputs, "output": output, "count": n}
            for (op, inputs, output), n in sorted(_op_dtypes(mod).items())]


def _op_dtypes(mod) -> Counter:
    tvm = tvm_compat.tvm()
    relax = tvm.relax
    counts = Counter()
    for block in mod["main"].body.blocks:
        for b in block.bindings:
            v = b.value
            if not (isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op)):
                continue
            leaves = [f for a in v.args for f in (a.fields if isinstance(a, relax.Tuple)
                                                  else [a])]
            inputs = sorted({d for d in map(tensor_dtype, leaves) if d in FLOAT_TYPES})
            ty = b.var.ty
            output = str(ty.dtype) if hasattr(ty, "dtype") else "tuple"
            counts[(short_name(v.op.name), ",".join(inputs) or "-", output)] += 1
    return counts
