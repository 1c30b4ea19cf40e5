"""Target-specific default (untuned) schedules for amp's Relax pipelines."""
from .cpu import (  # noqa: F401
    LAST_STATS,
    cpu_layout_passes,
    cpu_relax_pipeline,
    cpu_schedule_passes,
    effective_num_threads,
    host_llvm_target,
    schedule_prim_func,
    set_num_threads,
)
