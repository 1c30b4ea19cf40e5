"""What ``amp bench`` is told (``BenchConfig``) and what it measured (``BenchResult`` and its
parts, whose ``to_dict()`` is the JSON schema documented in ``bench/__init__.py``), and the gates
evaluated on a result."""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import AmpError, ConfigError, GateError, InputError
from ..report import write_json

SCHEMA_VERSION = 1
COMPARE_CHOICES = ("fp32", "ort", "torch")


@dataclass
class BenchConfig:
    """Settings of one bench run (defaults live here once)."""

    warmup: int = 10  # untimed calls before timing
    repeat: int = 50  # timed samples
    number: int = 1  # calls per sample (a sample is their mean)
    compare: list[str] = field(default_factory=list)  # subset of COMPARE_CHOICES
    inputs: str | None = None  # .npz with the model's inputs; default: seeded random inputs
    seed: int = 0
    max_latency_ratio: float | None = None  # gate: amp p50 / amp fp32 p50
    max_rel_error: float | None = None  # gate: amp worst rel L2 vs the fp32 reference
    threads: int | None = None  # CPU threads (TVM and ONNX Runtime)
    # a build with dynamic dims is timed at one shape: input name -> dims (--input-shape) and
    # dim name -> size (--dynamic); dims not named stay at their optimum
    shapes: dict[str, list[int]] = field(default_factory=dict)
    dims: dict[str, int] = field(default_factory=dict)

    def validate(self) -> None:
        for name in ("warmup", "repeat", "number"):
            v = getattr(self, name)
            low = 0 if name == "warmup" else 1
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ConfigError(f"--{name} must be an integer >= {low}, got {v!r}")
        bad = [c for c in self.compare if c not in COMPARE_CHOICES]
        if bad:
            raise ConfigError(f"--compare: unknown runner(s) {', '.join(bad)}; choose from "
                              f"{', '.join(COMPARE_CHOICES)}")
        for name in ("max_latency_ratio", "max_rel_error"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive number, got "
                                  f"{v!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class LatencyStats:
    """Latency statistics over timed samples (milliseconds) and throughput."""

    mean_ms: float
    std_ms: float
    min_ms: float
    max_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    samples: int
    number: int  # calls averaged into each sample
    batch: int
    throughput_per_s: float  # batch / mean latency

    @classmethod
    def from_seconds(cls, seconds, batch: int, number: int = 1) -> "LatencyStats":
        ms = np.asarray(list(seconds), dtype=np.float64) * 1e3
        if ms.size == 0:
            raise ValueError("no timing samples")
        mean = float(ms.mean())
        return cls(mean_ms=mean, std_ms=float(ms.std()), min_ms=float(ms.min()),
                   max_ms=float(ms.max()), p50_ms=float(np.percentile(ms, 50)),
                   p90_ms=float(np.percentile(ms, 90)), p99_ms=float(np.percentile(ms, 99)),
                   samples=int(ms.size), number=int(number), batch=int(batch),
                   throughput_per_s=batch / (mean / 1e3) if mean > 0 else float("inf"))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class RunnerResult:
    """One runner (the amp build, amp fp32, ONNX Runtime, a PyTorch mode) on the bench inputs."""

    name: str  # "amp fp16", "amp fp32", "onnxruntime cpu", "torch eager fp32" ...
    kind: str  # "amp" | "amp-fp32" | "ort" | "torch"
    device: str
    precision: str
    timer: str = ""
    latency: LatencyStats | None = None
    accuracy: dict | None = None  # worst-case metrics + per output
    build_seconds: float | None = None
    skipped: str | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.latency is not None and not self.skipped and not self.error

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["latency"] = self.latency.to_dict() if self.latency else None
        return d


@dataclass
class GateResult:
    name: str  # "max_latency_ratio" | "max_rel_error"
    threshold: float
    value: float | None
    passed: bool
    reason: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class BenchResult:
    """Everything one bench run measured; ``to_dict()`` is the documented JSON schema."""

    source: str
    model: dict
    target: dict
    device: str
    config: BenchConfig
    convert_config: dict
    inputs: dict
    reference: str
    runners: list[RunnerResult]
    gates: list[GateResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    versions: dict = field(default_factory=dict)
    created: str = ""

    @property
    def primary(self) -> RunnerResult:
        """The amp build being benched."""
        return self.runners[0]

    def runner(self, kind: str) -> RunnerResult | None:
        return next((r for r in self.runners if r.kind == kind), None)

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.gates)

    def to_dict(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, "created": self.created,
                "source": self.source, "model": self.model, "target": self.target,
                "device": self.device, "bench": self.config.to_dict(),
                "convert_config": self.convert_config, "inputs": self.inputs,
                "reference": self.reference, "runners": [r.to_dict() for r in self.runners],
                "gates": [g.to_dict() for g in self.gates], "passed": self.passed,
                "versions": self.versions, "notes": list(self.notes)}

    def write_json(self, path: str | Path) -> Path:
        """Write the JSON atomically (a temp file renamed into place)."""
        out = Path(path)
        if out.parent and not out.parent.exists():
            try:
                out.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise InputError(f"cannot create {out.parent}: {exc.strerror}") from None
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        try:
            write_json(tmp, self.to_dict())
            os.replace(tmp, out)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise InputError(f"cannot write {out}: {exc.strerror}") from None
        return out

    def check_gates(self) -> None:
        """Raise GateError (exit code 3) with a one-line reason when a gate failed; AmpError
        (exit code 1) when a gate could not be evaluated (e.g. the fp32 build failed)."""
        unknown = [g for g in self.gates if g.value is None]
        if unknown:  # a gate that could not be evaluated is a setup problem, not a regression
            raise AmpError("; ".join(g.reason for g in unknown))
        failed = [g for g in self.gates if not g.passed]
        if failed:
            raise GateError("; ".join(g.reason for g in failed))


def evaluate_gates(result: BenchResult) -> list[GateResult]:
    """The --max-latency-ratio / --max-rel-error gates of ``result.config``."""
    cfg, amp, gates = result.config, result.primary, []
    if cfg.max_latency_ratio is not None:
        fp32 = result.runner("amp-fp32")
        r = cfg.max_latency_ratio
        if not amp.ok or fp32 is None or not fp32.ok:
            why = (fp32.error or fp32.skipped) if fp32 is not None and not fp32.ok else \
                (amp.error or "no timing")
            gates.append(GateResult("max_latency_ratio", r, None, False,
                                    f"latency-ratio gate: cannot compare with amp fp32 ({why})"))
        else:
            ratio = amp.latency.p50_ms / fp32.latency.p50_ms
            passed = ratio <= r
            gates.append(GateResult(
                "max_latency_ratio", r, ratio, passed,
                f"latency ratio {ratio:.3g} ({amp.name} p50 "
                f"{amp.latency.p50_ms:.3g} ms / amp fp32 p50 {fp32.latency.p50_ms:.3g} ms) "
                f"{'<=' if passed else 'above'} --max-latency-ratio {r:g}"))
    if cfg.max_rel_error is not None:
        e = cfg.max_rel_error
        if not amp.accuracy:
            gates.append(GateResult("max_rel_error", e, None, False,
                                    "rel-error gate: amp's accuracy was not measured"))
        else:
            rel = float(amp.accuracy["rel_l2"])
            passed = rel <= e
            gates.append(GateResult(
                "max_rel_error", e, rel, passed,
                f"rel L2 error {rel:.3g} of {amp.name} vs the fp32 reference "
                f"{'<=' if passed else 'above'} --max-rel-error {e:g}"))
    return gates
