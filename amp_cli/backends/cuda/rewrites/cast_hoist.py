"""Casts to fp16/bf16 moved above the layout op they follow, so they fuse with their producer.

Exporters put layout ops between an fp32 value and its cast to the low type: torchvision's ViT
runs ``layer_norm -> permute_dims -> astype(fp16)`` (its attention takes [S, B, E]), and
reshapes sit between a layer norm and its cast. A layout op is a copy kernel of its own (a
permute) or ends FuseOps' group (a reshape), so the fp32 value is written, read back by the
copy and cast there; the layer norm + cast kernel (``norm_cast``) never sees its cast.

This pass rewrites ``astype(layout(x), low)`` to ``layout(astype(x, low))`` for an fp32 ``x``
when the layout op's only user is the cast (``permute_dims``, ``reshape``, ``expand_dims``,
``squeeze``): the same values (a layout op moves elements, a cast maps each one), the copy
moves half the bytes, and the cast meets ``x``'s producer. Runs after the rewrites that read
casts on their operands (attention, GEMMs) and before ``norm_cast``.
"""
from __future__ import annotations

from .... import tvm_compat
from ....dtypes import LOW_TYPES
from ..registry import register
from .base import add_counts, bindings_and_users, module_pass, op_name, rewrite_calls

LAYOUT_OPS = ("relax.permute_dims", "relax.reshape", "relax.expand_dims", "relax.squeeze")


def hoist_casts(mod):
    """(``mod`` with casts moved above single-use layout ops, number moved); see above."""
    relax = tvm_compat.relax()
    _, users = bindings_and_users(mod)

    def rewrite(bb, call, lookup):
        if op_name(call) != "relax.astype" or str(call.attrs.dtype) not in LOW_TYPES:
            return None
        t = call.args[0]
        layout = lookup(t) if isinstance(t, relax.Var) else None
        if op_name(layout) not in LAYOUT_OPS or len(users.get(t, ())) != 1:
            return None
        x = layout.args[0]
        if getattr(x.ty, "dtype", None) != "float32":
            return None
        low = bb.emit(relax.op.astype(x, call.attrs.dtype))
        return relax.Call(layout.op, [low, *layout.args[1:]], layout.attrs)

    return rewrite_calls(mod, rewrite)


def hoist_casts_pass(stats: dict | None = None):
    def run(mod):
        new, count = hoist_casts(mod)
        add_counts(stats, casts_hoisted=count)
        return new

    return module_pass(run, "AmpHoistCasts")


@register("hoist_casts", "graph", 55,
          labels={"casts_hoisted": "fp16/bf16 casts moved above a layout op (fuse upward)"})
def make_pass(ctx):
    return hoist_casts_pass(ctx.stats)
