"""TIR kernels amp writes or schedules itself for CUDA (tensor-core GEMMs, small-M GEMMs, Hopper
wgmma GEMMs, fused attention), the tensor intrinsics they use and GEMM shape analysis."""
