"""``--fallback bf16``: nodes auto-precision keeps out of fp16 run in bf16 (fp32's range, 8
mantissa bits) instead of fp32."""
from __future__ import annotations

from .. import tvm_compat
from ..ir_attrs import ONNX_NODE_PREFIX
from .convert import OUT_DTYPE_OPS, call_with_out_dtype, tensor_dtype


def to_bf16_fallback(mod, nodes: set):
    """Run the fp32 ops of ``nodes`` in bf16 (fp32 range, 8 mantissa bits): float args cast to
    bf16, results cast back to fp32; matmul/conv keep their fp32 accumulation."""
    tvm = tvm_compat.tvm()
    relax = tvm.relax
    @relax.expr_functor.mutator
    class _ToBF16(relax.PyExprMutator):
        def visit_var_binding_(self, binding):
            name = binding.var.name
            value = binding.value
            node = name[len(ONNX_NODE_PREFIX):] if name.startswith(ONNX_NODE_PREFIX) else None
            if node in nodes and isinstance(value, relax.Call) and \
                    isinstance(value.op, tvm.ir.Op) and value.op.name != "relax.astype" and \
                    tensor_dtype(binding.var) == "float32":
                args = [self.visit_expr(a) for a in value.args]
                casts = {}
                for a in args:
                    if tensor_dtype(a) == "float32" and a not in casts:
                        casts[a] = self.builder_.emit(relax.op.astype(a, "bfloat16"))
                args = [casts.get(a, a) for a in args]
                if value.op.name in OUT_DTYPE_OPS:
                    call = call_with_out_dtype(value, args, "float32")
                    new = self.builder_.emit(call)
                else:
                    new = self.builder_.emit(relax.op.astype(
                        self.builder_.emit(relax.Call(value.op, args, value.attrs,
                                                      getattr(value, "sinfo_args", None))), "float32"))
                self.set_var_remap(binding.var, new)
                return
            super().visit_var_binding_(binding)

    m = _ToBF16(mod)
    new = {gv: f for gv, f in mod.functions.items()}
    for gv, f in mod.functions.items():
        if isinstance(f, relax.Function):
            new[gv] = m.visit_expr(f)
    return tvm.IRModule(new, attrs=mod.attrs)
