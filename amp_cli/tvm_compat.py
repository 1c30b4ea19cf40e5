"""Every TVM-version-sensitive import and call lives here.

amp is written against apache-tvm 0.27 (Relax + s_tir: MetaSchedule and dlight moved under
``tvm.s_tir``; targets are dicts). A TVM upgrade should touch this file only. Imports are lazy
so ``amp --help`` never pays for TVM.
"""
from __future__ import annotations

import functools
import os

from .errors import AmpError

TVM_VERSION = "0.27.0.post1"
# apache-tvm 0.27.0.post1 only asks for apache-tvm-ffi>=0.1.14.post0, but 0.1.15.x changed the
# PrimType hash/equal hook ABI: anything that serializes TIR (sch.tensorize, save_json) segfaults.
TVM_FFI_VERSION = "0.1.14.post1"


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check_versions() -> None:
    """Raise a clear AmpError when the TVM / tvm-ffi pair is not the pinned, known-good one."""
    if os.environ.get("AMP_SKIP_VERSION_CHECK"):
        return
    ffi = _dist_version("apache-tvm-ffi")
    if ffi is not None and ffi != TVM_FFI_VERSION:
        raise AmpError(
            f"apache-tvm-ffi {ffi} is installed but amp needs {TVM_FFI_VERSION} "
            f"(newer ffi releases crash apache-tvm {TVM_VERSION} when compiling tensor-core "
            f"kernels); run: pip install apache-tvm-ffi=={TVM_FFI_VERSION}"
        )


@functools.lru_cache(maxsize=None)
def tvm():
    check_versions()
    try:
        import tvm as _tvm
    except ImportError as exc:  # pragma: no cover - install problem
        raise AmpError(f"cannot import TVM ({exc}); run: pip install apache-tvm=={TVM_VERSION}")
    return _tvm


def relax():
    return tvm().relax


def dlight():
    tvm()
    from tvm.s_tir import dlight as dl

    return dl


def meta_schedule():
    tvm()
    from tvm.s_tir import meta_schedule as ms

    return ms


def from_onnx(model, shape_dict=None, dtype_dict="float32", opset=None):
    tvm()
    from tvm.relax.frontend.onnx import from_onnx as _from_onnx

    return _from_onnx(model, shape_dict=shape_dict, dtype_dict=dtype_dict, opset=opset,
                      keep_params_in_input=False)


def from_exported_program(exported_program):
    tvm()
    from tvm.relax.frontend.torch import from_exported_program as _fep

    return _fep(exported_program, keep_params_as_input=False)


def make_target(spec: dict):
    """A tvm.target.Target from a dict such as {"kind": "cuda", "arch": "sm_90"}."""
    return tvm().target.Target(spec)


def target_to_dict(target) -> dict:
    """Plain-JSON view of a Target (for reports)."""
    import json

    return json.loads(str(target))


def relax_vm(executable_or_module, device):
    return relax().VirtualMachine(executable_or_module, device)


def load_module(path: str):
    return tvm().runtime.load_module(path)


def cpu_device():
    return tvm().cpu(0)


def cuda_device():
    return tvm().cuda(0)


def has_cuda_device() -> bool:
    try:
        return bool(tvm().cuda(0).exist)
    except Exception:  # noqa: BLE001 - no driver is the same as no device
        return False


def to_tvm_tensor(array, device):
    return tvm().runtime.tensor(array, device)


def save_json(obj) -> str:
    return tvm().ir.save_json(obj)


def load_json(text: str):
    return tvm().ir.load_json(text)


def compile_relax(mod, target, relax_pipeline, tir_pipeline="default"):
    return tvm().compile(mod, target=target, relax_pipeline=relax_pipeline,
                         tir_pipeline=tir_pipeline)
