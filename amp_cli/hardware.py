"""Hardware facts in one place: the host CPU (LLVM target, cores, TVM's thread pool) and NVIDIA
GPUs (SM counts, shared memory per block, the SM version of a target).

Leaf module: it knows about machines, nothing about models or schedules.
"""
from __future__ import annotations

import os

from . import tvm_compat

# ---- NVIDIA GPUs ------------------------------------------------------------------------------
# SMs of the largest part of each architecture (H100/H200 SXM: 132); a schedule that sizes its
# grid for it is at worst one partial wave off on a smaller part.
SM_COUNT = {70: 80, 75: 68, 80: 108, 86: 84, 87: 16, 89: 128, 90: 132, 100: 148, 120: 84}
# Dynamic shared memory a block may opt into, per arch, in KiB (CUDA programming guide, table
# 21); TVM's CUDA runtime raises the kernel's limit itself for launches above 48 KiB.
SMEM_LIMIT_KIB = {70: 96, 75: 64, 80: 163, 86: 99, 87: 163, 89: 99, 90: 227, 100: 227, 120: 99}


def sm_count(sm: int) -> int:
    """SMs of an ``sm`` GPU (108, an A100, if the arch is unknown)."""
    return SM_COUNT.get(sm, 108)


def smem_limit(sm: int) -> int:
    """Bytes of dynamic shared memory one block may use on ``sm`` (48 KiB if unknown)."""
    return SMEM_LIMIT_KIB.get(sm, 48) * 1024


def arch_sm(target) -> int:
    """The SM version of a CUDA target (``sm_90a`` -> 90), 0 for other targets."""
    arch = str(target.attrs.get("arch", "")) if target.kind.name == "cuda" else ""
    digits = "".join(ch for ch in arch.split("_")[-1] if ch.isdigit())
    return int(digits) if digits else 0


# ---- the host CPU -----------------------------------------------------------------------------
_CPUINFO_TO_LLVM = {
    "avx512f": "avx512f", "avx512bw": "avx512bw", "avx512vl": "avx512vl",
    "avx512dq": "avx512dq", "avx512_vnni": "avx512vnni", "avx512_bf16": "avx512bf16",
    "avx512_fp16": "avx512fp16", "amx_tile": "amx-tile", "amx_bf16": "amx-bf16",
    "amx_int8": "amx-int8", "avx2": "avx2", "fma": "fma", "f16c": "f16c",
    "avx_vnni": "avxvnni",
}


def _cpuinfo_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def host_llvm_target(mcpu: str | None = None) -> dict:
    """The llvm target dict for this machine.

    ``mcpu`` defaults to LLVM's host CPU name; features the host reports in /proc/cpuinfo
    (AVX-512 BF16/FP16/VNNI, AMX) that LLVM's CPU model lacks are added as ``mattr`` (LLVM
    sometimes names a virtualized Sapphire Rapids "rocketlake"). ``num-cores`` is the number
    of cores this process may run on, or TVM_NUM_THREADS when set.
    """
    tvm = tvm_compat.tvm()
    codegen = tvm_compat.llvm_codegen()

    spec: dict = {"kind": "llvm"}
    if mcpu is None:
        mcpu = codegen.llvm_get_system_cpu()
        flags = _cpuinfo_flags()
        mattr = []
        if mcpu and mcpu != "generic":
            probe = tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
            for flag, feat in _CPUINFO_TO_LLVM.items():
                if flag in flags:
                    try:
                        has = codegen.llvm_cpu_has_features(feat, probe)
                    except Exception:  # noqa: BLE001 - feature name unknown to this LLVM
                        continue
                    if not has:
                        mattr.append("+" + feat)
        if mattr:
            spec["mattr"] = mattr
    if mcpu:
        spec["mcpu"] = mcpu
    spec["num-cores"] = effective_num_threads(default_only=True)
    return spec


_THREADS_SET: int | None = None


def set_num_threads(n: int) -> int:
    """Resize TVM's CPU thread pool to ``n`` threads (also exported as TVM_NUM_THREADS so
    child processes and later-initialized pools agree). Returns the effective count."""
    global _THREADS_SET
    n = max(1, int(n))
    os.environ["TVM_NUM_THREADS"] = str(n)
    tvm = tvm_compat.tvm()
    cfg = tvm.get_global_func("runtime.config_threadpool", allow_missing=True)
    if cfg is not None:
        cfg(1, n)  # mode 1 (kBig): n threads pinned to the big cores
    _THREADS_SET = n
    return effective_num_threads()


def effective_num_threads(default_only: bool = False) -> int:
    """Threads TVM's runtime uses: the pool size if TVM is loaded, else TVM_NUM_THREADS, else
    the cores this process may use (TVM's own default)."""
    if not default_only:
        try:
            tvm = tvm_compat.tvm()
            return int(tvm.runtime.num_threads())
        except Exception:  # noqa: BLE001
            pass
    env = os.environ.get("TVM_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")
    if env and env.strip().isdigit() and int(env) > 0:
        return int(env)
    return available_cores()
