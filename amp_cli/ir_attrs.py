"""Names amp writes into, or reads from, TVM IR and pass contexts: one module, so a key is spelled
once. (TVM 0.27 renamed ``tir.*`` keys to ``tirx.*``; a rename touches this file.)"""

# PrimFunc attributes
KERNEL_NAME = "amp.kernel"  # the kernel's global name, for schedule-rule failure records
IS_SCHEDULED = "tirx.is_scheduled"  # TVM's: dlight and MetaSchedule leave such kernels alone
LEGACY_IS_SCHEDULED = "tir.is_scheduled"  # the pre-0.27 spelling, still honoured on read
NOALIAS = "tirx.noalias"
IS_HOST_FUNC = "tirx.is_host_func"  # TVM's: a host-side PrimFunc (the VM's shape functions)
TIRX_KERNEL = "amp.tirx"  # written in TIRx: lowered by TVM's TIRx pipeline (hopper_gemm)
INDEX32 = "amp.index32"  # a kernel over symbolic extents whose ranges allow int32 indices
HOPPER_TILE = "amp.hopper_tile"  # the wgmma tile a Hopper GEMM kernel uses (for reports)
TUNED_WORKLOAD = "amp.tuned_workload"  # set on kernels that took a tuning record
OP_PATTERN = "op_pattern"  # Relax's fusion pattern of a PrimFunc

# Block annotations
GROUPED_CONV = "amp.grouped_conv"  # amp's grouped conv block; value: output channels per group

# Relax function attributes of ``main`` (dynamic dims, docs/dynamic-shapes.md)
TIR_VAR_UPPER_BOUND = "tir_var_upper_bound"  # TVM's: memory is planned for these sizes
TIR_VAR_LOWER_BOUND = "tir_var_lower_bound"  # TVM's
DIM_OPTIMUM = "amp.dim_optimum"  # the size each dynamic dim is optimized (tuned) for
CAPTURE_SYMBOLIC_VARS = "relax.rewrite_cuda_graph.capture_symbolic_vars"  # TVM's: CUDA graphs

# Relax functions amp adds to the library
INPUT_RANGES_FUNCTION = "amp_input_ranges"  # () -> JSON text: the dynamic dims and ranges

# Relax binding names
ONNX_NODE_PREFIX = "onnx:"  # the importer names each ONNX node's last binding "onnx:<node>"

# PassContext config keys
CUDA_GRAPH = "relax.backend.use_cuda_graph"
ASYNC_COPY = "tirx.use_async_copy"
