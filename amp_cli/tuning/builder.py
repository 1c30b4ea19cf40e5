"""How candidates are built and measured: amp's builder (worker processes that compile with
amp's TIR pipeline, the lane legalizer on CUDA) and MetaSchedule's local or RPC runner."""
from __future__ import annotations

import os
import tempfile

from .. import tvm_compat
from ..backends.cuda.kernels.intrinsics import register_tensor_intrinsics
from ..backends.cuda.tir import cuda_tir_pipeline
from ..errors import TuneError, last_line
from .config import TuneConfig, parse_tracker

_CLASSES: dict = {}  # MetaSchedule subclasses, made once TVM is imported
_CUDA_PIPELINE: list = []


def build_candidate(mod, target, _params=None):
    """MetaSchedule f_build: amp's TIR pipeline (the lane legalizer on CUDA)."""
    tvm = tvm_compat.tvm()
    mod = tvm_compat.remove_weight_layout_rewrite_block(mod)
    if target.kind.name == "cuda":
        # tensor-core intrinsics (what MetaSchedule's default builder imports; ~30 s of CPU per
        # worker, so only where tensor-core traces can occur)
        register_tensor_intrinsics()
        if not _CUDA_PIPELINE:  # one registration per worker process
            _CUDA_PIPELINE.append(cuda_tir_pipeline(target))
        return tvm.tirx.build(mod, target=target, pipeline=_CUDA_PIPELINE[0])
    return tvm.tirx.build(mod, target=target)


def build_and_export(mod, target) -> str:
    """Runs in a builder worker: build one candidate, export it (tar) for the runner."""
    tar = tvm_compat.tar_module().tar

    rt_mod = build_candidate(mod, target)
    path = os.path.join(tempfile.mkdtemp(prefix="amp-cand-"), "cand." + tar.output_format)
    rt_mod.export_library(path, fcompile=tar)
    return path


def make_builder(workers: int, timeout_s: float):
    """A MetaSchedule builder that builds candidates in worker processes with amp's pipeline.

    Unlike ms.builder.LocalBuilder (which starts fresh workers for every batch: several seconds
    of `import tvm` each time), the workers are kept and recycled every 32 builds. A candidate
    that crashes or hangs its worker becomes that candidate's build error; the run goes on.
    """
    if "builder" not in _CLASSES:
        ms = tvm_compat.meta_schedule()
        pool = tvm_compat.popen_pool()
        PopenPoolExecutor, StatusKind = pool.PopenPoolExecutor, pool.StatusKind

        @tvm_compat.derived_object
        class AmpBuilder(ms.builder.PyBuilder):
            def __init__(self, max_workers, timeout_sec):
                super().__init__()
                self.timeout_sec = timeout_sec
                self.pool = PopenPoolExecutor(max_workers=max_workers, timeout=timeout_sec,
                                              maximum_process_uses=32)

            def build(self, build_inputs):
                out = []
                jobs = [(b.mod, b.target) for b in build_inputs]
                for r in self.pool.map_with_error_catching(lambda x: build_and_export(*x),
                                                           jobs):
                    if r.status == StatusKind.COMPLETE:
                        out.append(ms.builder.BuilderResult(r.value, None))
                    elif r.status == StatusKind.TIMEOUT:
                        out.append(ms.builder.BuilderResult(
                            None, f"amp builder: timeout after {self.timeout_sec} s"))
                    else:
                        out.append(ms.builder.BuilderResult(
                            None, f"amp builder: {last_line(r.value)}"))
                return out

        _CLASSES["builder"] = AmpBuilder
    return _CLASSES["builder"](workers, timeout_s)




def check_tracker(text: str) -> None:
    """Fail fast (TVM's own client retries for a minute) when nothing listens at HOST:PORT."""
    import socket

    host, port = parse_tracker(text)
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError as exc:
        raise TuneError(f"cannot reach the RPC tracker at {text}: {exc.strerror or exc}; start "
                        f"one with: python -m tvm.exec.rpc_tracker --host {host} --port "
                        f"{port}") from None


def make_runner(tune_cfg: TuneConfig, target):
    ms = tvm_compat.meta_schedule()
    evaluator = ms.runner.EvaluatorConfig(number=1 if target.is_cuda else 3,
                                          repeat=tune_cfg.repeat,
                                          min_repeat_ms=tune_cfg.min_repeat_ms,
                                          enable_cpu_cache_flush=not target.is_cuda)
    if tune_cfg.rpc_tracker:
        host, port = parse_tracker(tune_cfg.rpc_tracker)
        rpc = ms.runner.RPCConfig(tracker_host=host, tracker_port=port,
                                  tracker_key=tune_cfg.rpc_key,
                                  session_timeout_sec=int(tune_cfg.run_timeout_s))
        try:
            rpc.connect_tracker().summary()
        except Exception as exc:  # noqa: BLE001 - unreachable tracker
            raise TuneError(f"cannot reach the RPC tracker at {tune_cfg.rpc_tracker}: "
                            f"{last_line(exc)}") from None
        return ms.runner.RPCRunner(rpc_config=rpc, evaluator_config=evaluator,
                                   max_workers=tune_cfg.workers or 1)
    return ms.runner.LocalRunner(timeout_sec=tune_cfg.run_timeout_s,
                                 evaluator_config=evaluator)
