"""amp's schedule rule for its depthwise/grouped conv kernels (``kernels/depthwise.py``).

It takes exactly the PrimFuncs that hold one reduction block annotated by
``rewrites/depthwise_conv.py`` (``ir_attrs.GROUPED_CONV``; fused producers and the elementwise
epilogue around it are fine) with static extents, on CUDA; anything else -- another target, a
symbolic extent, a fused neighbour it cannot inline -- is left to the next rule (dlight's
Fallback schedules the same compute, correctly and slowly). It comes first: no other rule should
see these kernels (dlight's reduction rules would take the kh x kw reduction for a row sum).
"""
from __future__ import annotations

from .... import tvm_compat
from ....hardware import arch_sm
from ..kernels import depthwise
from ..registry import register


def _make_rule():
    dl = tvm_compat.dlight()

    class AmpGroupedConv(dl.ScheduleRule):
        """Depthwise/grouped NHWC convolutions: vectors of channels on threadIdx.x, filter and
        input rows in registers (``kernels/depthwise.py``)."""

        def apply(self, func, target, tunable):
            if not isinstance(func, tvm_compat.prim_func_class()) or target.kind.name != "cuda":
                return None
            return depthwise.schedule_conv(func, arch_sm(target))

    return AmpGroupedConv


def AmpGroupedConv():
    """amp's depthwise/grouped convolution rule (an instance of a dlight ``ScheduleRule``)."""
    return _make_rule()()


@register("depthwise_conv_rule", "rule", 5, switch="depthwise_conv")
def make_rule(_ctx):
    return AmpGroupedConv()
