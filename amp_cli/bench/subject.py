"""What is being benched, normalized (``Subject``): an OUTDIR written by ``amp convert``, a
Conversion, or a model converted here; and the inputs it is benched on."""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import tvm_compat
from ..accuracy import load_inputs, random_inputs
from ..config import ConvertConfig, apply_yaml, parse_dim
from ..convert import convert
from ..dims import describe_ranges
from ..errors import InputError, TargetError
from ..frontend import InputSpec, is_factory_spec, load
from ..target import resolve_target
from .results import BenchConfig


def is_outdir(x) -> bool:
    return isinstance(x, (str, Path)) and Path(x).is_dir()


def check_runnable_target(target_text: str) -> None:
    if resolve_target(target_text, check_toolchain=False).is_cuda and \
            not tvm_compat.has_cuda_device():
        raise TargetError("amp bench runs the build, and there is no GPU here for a cuda "
                          "target; pass --target llvm to bench on the CPU")


def convert_for_bench(loaded, ccfg: ConvertConfig | None, cfg: BenchConfig, step,
                       precision: str | None = None):
    ccfg = copy.deepcopy(ccfg or ConvertConfig())
    check_runnable_target(ccfg.target)
    # converted exactly as `amp convert` would (its accuracy check may run the accuracy-guided
    # search); a miss is shown by bench's own accuracy columns, not an error here
    ccfg.accuracy.enforce = False
    if cfg.threads:
        ccfg.threads = cfg.threads
    if precision:
        ccfg.precision.precision = precision
    step(f"convert {ccfg.precision.precision}")
    return convert(loaded, ccfg)


@dataclass
class Subject:
    """What is being benched, normalized: the library, its target, and (when known) the model."""

    source: str
    library: str
    target: dict
    convert_config: ConvertConfig
    precision: str
    model: Any  # LoadedModel or None (an OUTDIR whose source is gone)
    model_summary: dict
    input_specs: list
    build_seconds: float | None
    notes: list[str] = field(default_factory=list)
    dynamic: dict = field(default_factory=dict)  # dim name -> DimRange (a dynamic build)

    @classmethod
    def from_conversion(cls, conv) -> "Subject":
        return cls(source=conv.model.source, library=conv.library, target=conv.target.spec,
                   convert_config=conv.config, precision=conv.config.precision.precision,
                   model=conv.model, model_summary=conv.model.summary(),
                   input_specs=list(conv.model.inputs), build_seconds=conv.build.seconds,
                   dynamic=dict(conv.model.dynamic))

    @classmethod
    def from_outdir(cls, outdir: Path, step) -> "Subject":
        lib, rep = outdir / "model.so", outdir / "report.json"
        if not lib.is_file() or not rep.is_file():
            raise InputError(f"{outdir} is a directory but not an amp OUTDIR (needs model.so "
                             f"and report.json from `amp convert`)")
        try:
            report = json.loads(rep.read_text())
            target = dict(report["target"])
            specs = [InputSpec(i["name"], list(i["shape"]), i["dtype"])
                     for i in report["model"]["inputs"]]
            dynamic = {n: parse_dim(r, f"{rep}: model.dynamic.{n}")
                       for n, r in (report["model"].get("dynamic") or {}).items()}
            ccfg = apply_yaml(ConvertConfig(), report["config"], str(rep))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InputError(f"{rep}: not a readable amp report ({type(exc).__name__}: "
                             f"{exc})") from None
        if target.get("kind") == "cuda" and not tvm_compat.has_cuda_device():
            raise TargetError(f"{outdir} holds a CUDA library ({target.get('arch')}) and there "
                              f"is no GPU here to run it; bench it on a GPU machine, or bench "
                              f"the model on the CPU: amp bench {report['model']['source']} "
                              f"--target llvm")
        notes = []
        model = None
        src = find_source(report["model"].get("source_path") or report["model"]["source"],
                           outdir)
        if src is None:
            notes.append(f"model source {report['model']['source']} not found: no fp32 "
                         f"reference, accuracy not measured")
        else:
            step("load source")
            # bound as the build was: its inputs' dims, dynamic ones by their ranges
            shapes = {s.name: [dynamic.get(d, d) if isinstance(d, str) else d for d in s.shape]
                      for s in specs}
            model = load(src, input_shapes=shapes, simplify=ccfg.simplify)
        # the amp fp32 build must be for the very same target
        ccfg.target = json.dumps(target)
        return cls(source=str(outdir), library=str(lib), target=target, convert_config=ccfg,
                   precision=ccfg.precision.precision, model=model,
                   model_summary=report["model"], input_specs=specs,
                   build_seconds=(report.get("build") or {}).get("seconds"), notes=notes,
                   dynamic=dynamic)

    def timed_specs(self, cfg: BenchConfig) -> list[InputSpec]:
        """The inputs the run times: a dynamic build's at ``cfg.shapes`` / ``cfg.dims``, each
        dim not named at its optimum; a static build's as they are."""
        if not self.dynamic:
            if cfg.shapes or cfg.dims:
                fixed = ", ".join(f"{s.name} {list(s.shape)}" for s in self.input_specs)
                raise InputError(f"{self.source} was built for fixed shapes ({fixed}); "
                                 f"--input-shape / --dynamic pick a shape of a build with "
                                 f"dynamic dims")
            return list(self.input_specs)
        sizes = {n: r.optimum for n, r in self.dynamic.items()}
        for name, size in cfg.dims.items():
            if name not in sizes:
                raise InputError(f"--dynamic {name}: not a dynamic dim of {self.source} "
                                 f"({describe_ranges(self.dynamic)})")
            sizes[name] = int(size)
        by_name = {s.name: s for s in self.input_specs}
        for name, dims in cfg.shapes.items():
            spec = by_name.get(name)
            if spec is None:
                raise InputError(f"--input-shape names '{name}', but the inputs are: "
                                 f"{', '.join(by_name)}")
            if len(dims) != len(spec.shape):
                raise InputError(f"--input-shape {name}: {len(dims)} dims given, the input "
                                 f"has {len(spec.shape)} ({list(spec.shape)})")
            for have, size in zip(spec.shape, dims):
                if isinstance(have, str):
                    sizes[have] = int(size)
                elif have != size:
                    raise InputError(f"--input-shape {name}: {list(dims)} conflicts with the "
                                     f"fixed dims of {list(spec.shape)}")
        outside = [f"{n}={sizes[n]}" for n, r in self.dynamic.items() if sizes[n] not in r]
        if outside:
            raise InputError(f"{', '.join(outside)}: outside the ranges {self.source} was "
                             f"built for ({describe_ranges(self.dynamic)})")
        return [s.at(sizes) for s in self.input_specs]


def find_source(source: str, outdir: Path) -> str | None:
    if not Path(source).exists() and is_factory_spec(source):
        return source  # pkg.module:factory
    for cand in (Path(source), outdir / source, outdir.parent / source):
        if cand.is_file():
            return str(cand)
    return None


def load_feeds(cfg: BenchConfig, specs) -> dict[str, np.ndarray]:
    if cfg.inputs:
        return load_inputs(cfg.inputs, specs)
    return random_inputs(specs, cfg.seed)


def batch_of(specs) -> int:
    if specs and specs[0].shape:
        return int(specs[0].shape[0])
    return 1
