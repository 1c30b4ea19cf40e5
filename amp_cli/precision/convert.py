"""Mixed-precision conversion of a Relax module: fp16 or bf16, with fp32 where needed.

Why not ``relax.transform.ToMixedPrecision`` alone: it only knows fp16, cannot exclude single
nodes, and reports nothing. This pass follows the same three-way policy (always / follow / never,
TVM's registered ``TMixedPrecisionPolicy`` as the fallback) and adds:

- bf16 as a real target type;
- per-node and per-op exclusions (ONNX node names survive import as Relax var names);
- constants checked against the target type's range: an op whose constant does not fit (a bias of
  70000 in fp16) stays in fp32 and the report says so; only tiny underflows are flushed
  (counted). Masking sentinels are the exception (below);
- a record of every decision (ops by dtype, casts inserted, nodes kept in fp32 and why).

Semantics per binding ``v = op(args)``, over every tensor *leaf* of the arguments (a tuple
argument -- concat's, stack's, call_tir's -- is its fields):
  always -> float leaves cast to the low type, output in the accumulate type (fp32 by default);
  follow -> low type when every float leaf is already low (or an always-op output meant to be
            narrowed, or a constant that fits), else fp32; so a tuple gets one dtype;
  never  -> every leaf back in the dtype it had. Ops with no policy (``call_tir``,
            ``call_dps_packed``, ops TVM registers nothing for) are "never": they see exactly
            the types the importer gave them, and keep their output type arguments.
Values that are not calls (``If``, inner functions, nested blocks) stay as imported, in fp32:
the variables they read from outside are cast back to their original dtypes first.

Masking sentinels. A finite constant of magnitude >= ``MASK_MAGNITUDE`` (``finfo(fp32).min``,
-1e9, -1e30 ...) feeding an additive, select or clamp op (``MASK_OPS``) is a mask, not a value:
it becomes the low type's largest finite value of the same sign (fp16: -65504), which keeps its
meaning (exp(-65504 - max) is 0 in fp32) where a cast would make it -inf (and 0 * -inf = NaN).
The report lists each such constant (action ``saturated-mask``). Any other out-of-range constant
keeps its op in fp32: values that matter are never clamped.
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from .. import tvm_compat
from ..config import PrecisionConfig
from ..dtypes import FLOAT_TYPES, np_to_dtype, type_range
from ..ir_attrs import ONNX_NODE_PREFIX
from ..ir_module import replace_main
from .policy import OpPolicy, short_name
from .records import ConstantIssue, KeptNode, PrecisionReport

# Ops whose attrs carry the output type of the computation.
OUT_DTYPE_OPS = {
    "relax.matmul", "relax.nn.conv1d", "relax.nn.conv2d", "relax.nn.conv3d",
    "relax.nn.conv1d_transpose", "relax.nn.conv2d_transpose", "relax.nn.conv3d_transpose",
}
# Ops through which a huge constant acts as a mask or a clamp bound (see the module docstring).
MASK_OPS = {"relax.add", "relax.subtract", "relax.multiply", "relax.where", "relax.maximum",
            "relax.minimum", "relax.clip"}
MASK_MAGNITUDE = 1e8  # far beyond any activation; finfo(fp32).min, -1e9, -1e30 qualify


def call_with_out_dtype(call, args, dtype: str):
    """A copy of ``call`` (an op in OUT_DTYPE_OPS) on ``args`` whose attrs say ``out_dtype``."""
    tvm = tvm_compat.tvm()
    attrs = call.attrs
    fields = {k: getattr(attrs, k) for k in dir(attrs) if not k.startswith("_") and
              k not in ("get_int", "get_int_tuple", "get_str", "id_", "is_", "same_as",
                        "out_dtype")}
    new_attrs = tvm.ir.make_node("relax.attrs." + type(attrs).__name__, out_dtype=dtype,
                                 **fields)
    return tvm.relax.Call(call.op, args, new_attrs, call.ty_args, call.span)


def with_args(call, args):
    """``call`` on ``args``, everything else kept: op, attrs, output type arguments (call_tir's
    output type lives there) and span."""
    return tvm_compat.relax().Call(call.op, args, call.attrs, call.ty_args, call.span)


def tensor_dtype(expr) -> str | None:
    """The dtype of a tensor-typed Relax expression, None for anything else."""
    return _type_dtype(getattr(expr, "ty", None))


def _type_dtype(ty) -> str | None:
    return str(ty.dtype) if ty is not None and type(ty).__name__ == "TensorType" else None


def _is_tuple_type(ty) -> bool:
    return ty is not None and type(ty).__name__ == "TupleType"


def _leaf_dtypes(ty) -> list:
    """The dtypes of the tensor leaves of a (possibly nested tuple) type, None for non-tensors."""
    if _is_tuple_type(ty):
        return [d for f in ty.fields for d in _leaf_dtypes(f)]
    return [_type_dtype(ty)]


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
        self.remap = {}  # old var -> new expr
        self.widen = set()  # new vars (fp32) produced by always-ops, to be narrowed downstream
        self.saturate = {}  # id(constant) -> constant: masking sentinels to saturate on cast
        self.cast_cache = {}
        self.const_cache = {}
        self.kept_rows = {}  # (node, op, reason) -> its KeptNode row

    tensor_dtype = staticmethod(tensor_dtype)

    # -- constants -----------------------------------------------------------------------
    def is_const(self, expr) -> bool:
        return isinstance(expr, self.tvm.ir.expr.Constant)

    def const_range(self, expr) -> tuple[bool, float, bool]:
        """(fits the low type, largest finite |value|, every out-of-range value a sentinel)."""
        arr = expr.value.numpy()
        if arr.dtype.kind != "f" or arr.size == 0:
            return True, 0.0, False
        finite = np.abs(arr[np.isfinite(arr)].astype(np.float64))
        max_abs = float(finite.max()) if finite.size else 0.0
        over = finite[finite > self.max_val]
        return not over.size, max_abs, bool(over.size) and bool(over.min() >= MASK_MAGNITUDE)

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
                self.report.underflow_flushed += int(np.count_nonzero(tiny))
                if id(expr) in self.saturate:
                    limit = type_range(dtype).max
                    big = np.isfinite(arr) & (np.abs(arr) > limit)
                    arr = np.where(big, np.sign(arr) * limit, arr).astype(arr.dtype)
            new = self.relax.const(np_to_dtype(arr, dtype), dtype)
            self.const_cache[(id(expr), dtype)] = (expr, new)  # holding expr keeps id stable
            return new
        hit = self.cast_cache.get((expr, dtype))
        if hit is None:
            hit = bb.emit(self.relax.op.astype(expr, dtype))
            self.cast_cache[(expr, dtype)] = hit
            self.report.casts_inserted += 1
        return hit

    # -- tensor leaves of (tuple) arguments ------------------------------------------------
    def leaves(self, expr) -> list:
        """(leaf expression or None, dtype) of every tensor leaf of ``expr``; the expression is
        None for a field of a tuple-typed variable (only its type is at hand)."""
        if isinstance(expr, self.relax.Tuple):
            return [leaf for f in expr.fields for leaf in self.leaves(f)]
        ty = getattr(expr, "ty", None)
        if _is_tuple_type(ty):
            return [(None, d) for d in _leaf_dtypes(ty) if d is not None]
        dt = _type_dtype(ty)
        return [(expr, dt)] if dt is not None else []

    def coerce(self, bb, new, old_ty, target):
        """``new`` with each tensor leaf cast to ``target(dtype the leaf had)`` (None: left as
        it is); tuples are rebuilt field by field (tuple variables through TupleGetItem)."""
        relax = self.relax
        if _is_tuple_type(old_ty):
            fields = list(old_ty.fields)
            if isinstance(new, relax.Tuple):
                items = list(new.fields)
            else:
                have, want = _leaf_dtypes(new.ty), [target(d) if d else None
                                                     for d in _leaf_dtypes(old_ty)]
                if all(w is None or w == h for h, w in zip(have, want)):
                    return new
                items = [bb.emit(relax.TupleGetItem(new, i)) for i in range(len(fields))]
            return relax.Tuple([self.coerce(bb, it, ft, target) for it, ft in zip(items, fields)])
        old = _type_dtype(old_ty)
        want = target(old) if old is not None else None
        return self.cast(bb, new, want) if want else new

    def to_low(self, bb, old, new):
        """``new`` (the remapped ``old``) with every float leaf in the low type."""
        return self.coerce(bb, new, old.ty, lambda d: self.low if d in FLOAT_TYPES else None)

    def restore(self, bb, old, new):
        """``new`` (the remapped ``old``) with every leaf back in the dtype ``old`` had."""
        return self.coerce(bb, new, getattr(old, "ty", None), lambda d: d)

    def low_eligible(self, expr, dtype) -> bool:
        """Whether a leaf lets a follow-op run low: already low, an always-op's output meant
        to be narrowed, or a constant (their range is :meth:`check_constants`' business)."""
        if dtype not in FLOAT_TYPES or dtype == self.low:
            return True  # ints, shapes, bools do not decide precision
        return expr is not None and (expr in self.widen or self.is_const(expr))

    # -- one binding ---------------------------------------------------------------------
    def convert_call(self, bb, node: str, call):
        new_args = [self.remap_expr(a) for a in call.args]
        if not isinstance(call.op, self.tvm.ir.Op):
            # calls of GlobalVars / packed functions: the types the callee was built for
            args = [self.restore(bb, o, n) for o, n in zip(call.args, new_args)]
            self.keep(node, "call", "opaque-call")
            return with_args(call, args), "fp32"
        name = call.op.name
        if name == "relax.astype":
            # The model's own cast: keep its output type, read whichever input is at hand.
            return with_args(call, new_args), "keep"
        float_leaves = [(e, d) for n in new_args for e, d in self.leaves(n) if d in FLOAT_TYPES]
        if not float_leaves:
            return with_args(call, new_args), "keep"
        mode, reason = self.policy.mode_of(name)
        ex = self.policy.exclusion(node, name)
        if ex:
            mode, reason = "never", ex
        if mode == "follow" and not all(self.low_eligible(e, d) for e, d in float_leaves):
            mode, reason = "never", "fp32-input"
        if mode != "never" or reason == "fp32-input":
            mode, reason = self.check_constants(node, name, float_leaves, mode, reason)
        explicit = getattr(call.attrs, "out_dtype", None) if call.attrs is not None else None
        explicit = str(explicit) if explicit not in (None, "") and str(explicit) not in (
            "void", "") else None
        if mode == "always" and name in OUT_DTYPE_OPS:
            args = [self.to_low(bb, o, n) for o, n in zip(call.args, new_args)]
            return call_with_out_dtype(call, args, self.acc if explicit is None else explicit), \
                "always"
        if mode in ("always", "follow") and explicit is None:
            args = [self.to_low(bb, o, n) for o, n in zip(call.args, new_args)]
            return with_args(call, args), mode
        args = [self.restore(bb, o, n) for o, n in zip(call.args, new_args)]
        self.keep(node, short_name(name), reason)
        return with_args(call, args), "fp32"

    def check_constants(self, node, name, float_leaves, mode, reason):
        """The call's mode after looking at its constants: a sentinel feeding a mask op of a
        call that runs low is saturated on cast; any other out-of-range constant keeps the op
        in fp32. Each is reported (also when the op is in fp32 for another reason)."""
        saturate = []
        for expr, _ in float_leaves:
            if expr is None or not self.is_const(expr):
                continue
            fits, max_abs, sentinel = self.const_range(expr)
            if fits:
                continue
            if sentinel and name in MASK_OPS:
                saturate.append((expr, max_abs))
                continue
            self.report.constants.append(ConstantIssue(
                node=node, op=short_name(name), max_abs=max_abs, limit=self.max_val,
                action="kept-fp32"))
            if mode != "never":
                mode, reason = "never", "constant-range"
        for expr, max_abs in saturate if mode != "never" else []:
            if id(expr) not in self.saturate:
                self.saturate[id(expr)] = expr  # holding expr keeps its id stable
                self.report.constants.append(ConstantIssue(
                    node=node, op=short_name(name), max_abs=max_abs, limit=self.max_val,
                    action="saturated-mask"))
        return mode, reason

    def keep(self, node: str, op: str, reason: str) -> None:
        """Record an op kept in fp32: one row per (node, op, reason), counted."""
        key = (node, op, reason)
        row = self.kept_rows.get(key)
        if row is None:
            row = self.kept_rows[key] = KeptNode(node=node, op=op, reason=reason, count=0)
            self.report.kept_fp32.append(row)
        row.count += 1

    def remap_expr(self, expr):
        relax = self.relax
        if isinstance(expr, relax.Var):
            return self.remap.get(expr, expr)
        if isinstance(expr, relax.Tuple):
            return relax.Tuple([self.remap_expr(f) for f in expr.fields])
        return expr

    def convert_value(self, bb, node, value):
        """The new value expression for one binding, and its mode."""
        relax = self.relax
        if isinstance(value, relax.Call):
            return self.convert_call(bb, node, value)
        if isinstance(value, relax.TupleGetItem):
            return relax.TupleGetItem(self.remap_expr(value.tuple_value), value.index), "keep"
        if isinstance(value, (relax.Var, relax.Tuple)):
            return self.remap_expr(value), "keep"
        if isinstance(value, (relax.If, relax.SeqExpr, relax.Function)):
            # left as imported (fp32), reading the original dtypes of what they use outside
            self.keep(node, type(value).__name__, "control-flow")
            return self.with_original_free_vars(bb, value), "fp32"
        return value, "keep"  # constants, shapes, other leaves

    def with_original_free_vars(self, bb, value):
        relax = self.relax
        mapping = {}
        for var in relax.analysis.free_vars(value):
            new = self.remap.get(var, var)
            if new is not var:
                mapping[var] = self.restore(bb, var, new)
        return tvm_compat.substitute_vars(value, mapping) if mapping else value

    # -- a whole function ----------------------------------------------------------------
    def convert_function(self, func):
        relax = self.relax
        body = func.body
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
            if self.cfg.keep_io_types:
                result = self.restore(bb, body.body, result)
            bb.emit_func_output(result)
        return bb.get()["main"]

    def convert_bindings(self, bb, block, owners, is_df):
        relax = self.relax
        escaping = []
        for binding in block.bindings:
            old_var = binding.var
            node = owners.get(old_var, old_var.name)
            if isinstance(binding, relax.MatchCast):
                val = self.restore(bb, binding.value, self.remap_expr(binding.value))
                self.remap[old_var] = bb.match_cast(val, binding.ty)
                continue
            new_val, mode = self.convert_value(bb, node, binding.value)
            if isinstance(binding.value, relax.Call) and isinstance(binding.value.op,
                                                                     self.tvm.ir.Op):
                self.report.total_ops += 1
                if mode in ("always", "follow"):
                    self.report.converted_ops += 1
            new_var = tvm_compat.emit_named(bb, new_val, old_var.name)  # exact ONNX names
            self.remap[old_var] = new_var
            if is_df and not isinstance(old_var, relax.DataflowVar):
                escaping.append((old_var, new_var))
            if mode == "always" and self.tensor_dtype(new_var) != self.low:
                self.widen.add(new_var)
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


def prepare_module(mod):
    """What the pass converts: inference-mode ops decomposed (BatchNorm becomes arithmetic) and
    constant subexpressions folded, so that a BatchNorm's ``sqrt(var + eps)`` is a constant
    instead of an fp32 op that would keep the normalization after it in fp32."""
    relax = tvm_compat.relax()
    return relax.transform.FoldConstant()(relax.transform.DecomposeOpsForInference()(mod))


def convert_precision(mod, cfg: PrecisionConfig, node_types: dict[str, str] | None = None):
    """Convert ``mod['main']`` to mixed precision. Returns (new IRModule, PrecisionReport)."""
    tvm = tvm_compat.tvm()
    relax = tvm.relax
    mod = prepare_module(mod)
    if cfg.precision == "fp32":
        rep = PrecisionReport(dtype="float32", accumulate="float32", note="fp32: no conversion")
        rep.ops_by_dtype = dict(count_ops(mod))
        rep.op_dtypes = op_dtype_table(mod)
        rep.total_ops = sum(rep.ops_by_dtype.values())
        return mod, rep
    conv = Converter(cfg, node_types)
    new_mod = replace_main(mod, conv.convert_function(mod["main"]))
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
            inputs = sorted({d for a in v.args for d in _leaf_dtypes(getattr(a, "ty", None))
                             if d in FLOAT_TYPES})
            ty = b.var.ty
            output = str(ty.dtype) if hasattr(ty, "dtype") else "tuple"
            counts[(short_name(v.op.name), ",".join(inputs) or "-", output)] += 1
    return counts
