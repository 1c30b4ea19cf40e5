"""Target parsing: ``cuda``, ``cuda:sm_90``, ``llvm``, ``llvm:<mcpu>`` or a TVM target JSON dict."""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field

from . import tvm_compat
from .errors import TargetError
from .hardware import host_llvm_target

CUDA_ARCHS = ("sm_70", "sm_75", "sm_80", "sm_86", "sm_87", "sm_89", "sm_90", "sm_90a",
              "sm_100", "sm_120")
DEFAULT_CUDA_ARCH = "sm_80"
KINDS = ("cuda", "llvm")


@dataclass
class ResolvedTarget:
    spec: dict  # what tvm.target.Target takes
    notes: list[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return self.spec["kind"]

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def arch(self) -> str | None:
        return self.spec.get("arch")

    def tvm_target(self):
        return tvm_compat.make_target(self.spec)

    def describe(self) -> str:
        return f"cuda {self.arch}" if self.is_cuda else f"llvm {self.spec.get('mcpu', '')}".strip()


def local_cuda_arch() -> str | None:
    version = tvm_compat.cuda_compute_version()  # "9.0"
    return "sm_" + version.replace(".", "") if version else None


# Where nvcc is looked for after PATH, CUDA_HOME and CUDA_PATH (the same places TVM looks).
CUDA_DEFAULT_ROOTS = ("/usr/local/cuda",)


def find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), *CUDA_DEFAULT_ROOTS):
        if root and os.path.isfile(os.path.join(root, "bin", "nvcc")):
            return os.path.join(root, "bin", "nvcc")
    return None


def resolve_target(text: str, check_toolchain: bool = True) -> ResolvedTarget:
    """Parse a --target value. ``cuda`` takes the local GPU's arch, else sm_80 (and says so)."""
    if not isinstance(text, str):
        raise TargetError(f"target must be a string such as cuda:sm_90 or llvm, got "
                          f"{type(text).__name__} ({text!r})")
    text = text.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TargetError(f"--target is not valid JSON: {exc.msg} at column {exc.colno}")
        if not isinstance(spec, dict) or "kind" not in spec:
            raise TargetError("--target JSON must be an object with a 'kind', e.g. "
                              '{"kind": "cuda", "arch": "sm_90"}')
    else:
        kind, _, rest = text.partition(":")
        spec = {"kind": kind}
        if kind == "cuda" and rest:
            spec["arch"] = rest
        elif kind == "llvm" and rest:
            spec["mcpu"] = rest
        elif rest:
            raise TargetError(f"unknown target '{text}'; use cuda, cuda:sm_XX, llvm or a JSON dict")
    kind = spec["kind"]
    if kind not in KINDS:
        raise TargetError(f"unknown target kind '{kind}'; amp supports: {', '.join(KINDS)} "
                          f"(e.g. --target cuda:sm_90)")
    notes = []
    if kind == "cuda":
        if "arch" not in spec:
            arch = local_cuda_arch()
            if arch is None:
                arch = DEFAULT_CUDA_ARCH
                notes.append(f"no GPU found: building for {arch} (pass --target cuda:sm_XX to "
                             f"choose)")
            else:
                notes.append(f"arch {arch} from the local GPU")
            spec["arch"] = arch
        if not re.fullmatch(r"sm_\d+a?", str(spec["arch"])) or spec["arch"] not in CUDA_ARCHS:
            raise TargetError(f"unknown CUDA arch '{spec['arch']}'; known: "
                              f"{', '.join(CUDA_ARCHS)}")
        if check_toolchain and find_nvcc() is None:
            raise TargetError("CUDA target needs nvcc, which is not on PATH (set CUDA_HOME or "
                              "add the CUDA toolkit's bin/ to PATH)")
    else:
        _check_llvm_cpu(spec.get("mcpu"))
        base = host_llvm_target(spec.get("mcpu"))
        base.update({k: v for k, v in spec.items() if k != "kind"})
        spec = base
    try:
        tvm_compat.make_target(spec)
    except Exception as exc:  # noqa: BLE001 - TVM's target parser
        raise TargetError(f"TVM rejects target {json.dumps(spec)}: "
                          f"{str(exc).strip().splitlines()[-1][:200]}") from None
    return ResolvedTarget(spec, notes)


def _check_llvm_cpu(mcpu) -> None:
    """LLVM only warns about an unknown -mcpu and builds for 'generic'; amp refuses it."""
    if mcpu is None:
        return
    if not isinstance(mcpu, str) or not mcpu:
        raise TargetError(f"llvm mcpu must be a CPU name such as skylake, got {mcpu!r}")
    codegen = tvm_compat.llvm_codegen()

    triple = codegen.llvm_get_system_triple()
    if not codegen.llvm_is_valid_cpu(mcpu, triple):
        import difflib

        known = list(codegen.llvm_get_cpu_archlist(tvm_compat.make_target({"kind": "llvm"})))
        close = difflib.get_close_matches(mcpu, known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else \
            "; omit it (llvm) to use this machine's CPU"
        raise TargetError(f"unknown llvm CPU '{mcpu}' for {triple}{hint}")


def cpu_target() -> ResolvedTarget:
    return resolve_target("llvm")
