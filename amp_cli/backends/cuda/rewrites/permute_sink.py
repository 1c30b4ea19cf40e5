"""Transposes sunk through elementwise ops until they cancel, in the CUDA graph stage: the
mechanism is shared with the CPU pipeline (``backends/permute_sink.py``, which says why); here it
runs after ``conv_gemm`` / ``depthwise_conv`` made the convolutions NHWC.
"""
from __future__ import annotations

from ...permute_sink import sink_permutes_pass
from ..registry import register


@register("sink_permutes", "graph", 17, switch="sink_permutes",
          labels={"permutes_sunk": "transposes moved through elementwise ops or cancelled"})
def make_pass(ctx):
    return sink_permutes_pass(ctx.stats)
