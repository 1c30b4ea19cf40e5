"""One schema for amp's settings: a dataclass per concern.

Precedence: dataclass defaults < the shipped policy YAML for the target/precision
(``precision/policies/``) < the user's ``--config`` YAML < command-line flags. Unknown YAML keys are an error naming the closest
valid key; the resolved config goes into every report.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .dtypes import PRECISION_DTYPES
from .errors import ConfigError

PRECISIONS = ("fp16", "bf16", "fp32")
ACCUMULATE = ("fp32", "fp16")


@dataclass
class PolicyConfig:
    """Which ops run in the low-precision type.

    always: compute-bound ops (matmul, conv) that run in fp16/bf16 with ``accumulate`` output.
    follow: ops that run in low precision when all their float inputs already are.
    never:  ops that always run in fp32 (reductions, normalizations, exp/pow ...).
    Ops in no list get TVM's registered policy for them (unregistered ops: never).
    Names are Relax op names without the ``relax.`` prefix (``nn.conv2d``) or ONNX op types
    (``Conv``) for ``exclude_ops``.
    """

    always: list[str] = field(default_factory=list)
    follow: list[str] = field(default_factory=list)
    never: list[str] = field(default_factory=list)
    exclude_ops: list[str] = field(default_factory=list)
    exclude_nodes: list[str] = field(default_factory=list)


@dataclass
class PrecisionConfig:
    precision: str = "fp16"  # fp16 | bf16 | fp32
    accumulate: str = "fp32"  # fp32 | fp16 (matmul/conv accumulation and output type)
    keep_io_types: bool = True  # model inputs/outputs stay in their original (fp32) types
    policy: PolicyConfig = field(default_factory=PolicyConfig)

    @property
    def dtype(self) -> str:
        return PRECISION_DTYPES[self.precision]

    @property
    def accumulate_dtype(self) -> str:
        return PRECISION_DTYPES[self.accumulate] if self.precision != "fp32" else "float32"


@dataclass
class AccuracyConfig:
    seed: int = 0
    samples: int = 1  # random input sets checked against the fp32 reference
    # the gate: a conversion above it (or with inf/NaN outputs) runs the accuracy-guided search
    # on its own; if it still misses, convert fails (exit 4) and writes nothing
    rel_l2_tolerance: float = 0.05
    enforce: bool = True  # False (--allow-inaccurate): write it anyway, marked in the report


@dataclass
class AutoPrecisionConfig:
    """Accuracy-guided precision (``--auto-precision``; see docs/auto-precision.md).

    Nodes whose fp32 values leave the low type's range (or underflow it badly) are kept in
    ``fallback``; then the fewest extra nodes are kept there until the model meets
    ``metric <= tolerance`` (``cosine >= tolerance``) on held-out calibration inputs.
    """

    enabled: bool = False  # always run the search
    # run it when the plain conversion misses the accuracy check (inf/NaN or above
    # accuracy.rel_l2_tolerance), with that tolerance
    when_inaccurate: bool = True
    metric: str = "rel_l2"  # rel_l2 | max_abs | cosine
    tolerance: float = 1e-2
    fallback: str = "fp32"  # fp32 | bf16: the type kept nodes run in
    calibration: str | None = None  # .npz of inputs (optionally with a leading sample axis)
    samples: int = 4  # random calibration input sets when no .npz is given
    input_range: str | None = None  # "LO,HI": random float inputs ~ U(LO, HI), else N(0, 1)
    underflow_share: float = 1e-3  # keep a node when this share of its L2 norm is subnormal
    # keep a node when its largest calibration |value| x this leaves the type's range: a few
    # calibration inputs are a sample (ONNX's AlexNet reached 26552 on them, 65504+ on others)
    range_headroom: float = 4.0
    seed: int = 1000  # calibration inputs differ from the accuracy check's seeds


@dataclass
class CudaConfig:
    """Graph-level choices of amp's CUDA pipeline (docs/gpu-performance.md)."""

    cuda_graph: bool = True  # capture the static middle of the model into one CUDA graph
    conv_as_gemm: bool = True  # fp16/bf16 convolutions as NHWC tensor-core GEMMs
    # 1-D convolutions (speech front ends) as 2-D ones over a height of 1, so they become GEMMs
    conv1d_as_conv2d: bool = True
    sink_reshapes: bool = True  # flattening reshapes moved past GEMM epilogues (they fuse)
    # transposes moved down through elementwise ops until they cancel (ConvNeXt's permutes)
    sink_permutes: bool = True
    mean_as_sum: bool = True  # fp32 means as sum * (1/n): the cast feeding them fuses in (SE blocks)
    # a GEMM kernel whose fused epilogue would broadcast its result to a larger tensor (an SE
    # gate's multiply) is split in two, so the GEMM keeps its tensor-core schedule
    split_expanding_epilogues: bool = True
    combine_gemms: bool = True  # parallel matmuls on one input (Q/K/V) as one wider GEMM
    split_k: bool = True  # long-K GEMMs too small to fill the GPU: K-split partials + a sum
    fused_attention: bool = True  # softmax(Q K^T [+ mask]) V as one kernel (fp16/bf16, any S)
    # without mma_attention: S <= 256 on the row kernel (whole score rows on chip) where two
    # CTAs fit an SM; false: the wmma online-softmax kernel for every length
    attention_rows: bool = True
    # attention as mma.sync with scores and output in registers (FlashAttention-2's
    # structure), every length, head dims <= 128 (docs/gpu-performance.md)
    mma_attention: bool = True
    # the mma kernel with 32 query rows a warp (FlashAttention-2's tiling: half the
    # shared-memory reads per mma), head dims <= 64; off: slower where timed (H100 2026-12-07,
    # whisper_encoder 9.79 -> 13.37 ms: no register prefetch of the next K / V tile)
    mma_attention_wide: bool = False
    fused_norm_cast: bool = True  # fp32 layer norm + its fp16/bf16 cast as one two-output kernel
    small_gemm: bool = True  # GEMMs of 2..16 rows (classifier heads): K split across a warp's lanes
    # GEMMs with N <= 32 (16/32-channel convs): tiles as narrow as N (yolo_head 1.24 -> 0.94 ms
    # on the H100, docs/gpu-performance.md)
    narrow_gemm: bool = True
    # amp's wmma tiles: no tile that pads the output over 1.25x the least-padded one (a 7x7
    # image's 49 rows in 128-row tiles, N = 64 in 128-wide ones); H100 2026-12-07: resnet50
    # 0.767 -> 0.741 ms, efficientnet_b0 0.672 -> 0.657, dynamic ResNet-50 at batch 32 0.89x
    padding_aware_tiles: bool = True
    # GEMMs over a symbolic size: wmma tile variants over its whole range (one kernel per tile
    # a static build would pick at each size); false: only up to the optimum, whose tile serves
    # every size above it (fewer kernels: a shorter dynamic build; H100 2026-12-07: the
    # dynamic ResNet-50 at batch 32 1.10x -> 1.21x its static build, so it stays opt-in)
    tile_variants_above_optimum: bool = True
    unroll_injective: bool = True  # large gathers/layout changes: 4 elements per thread, unrolled
    implicit_gemm: bool = True  # convs (C % 8 == 0) read the image in the GEMM: no im2col
    # image stems (C < 8, overlapping windows) read their input padded to 8 channels likewise
    pad_stem_channels: bool = True
    # depthwise/grouped convs as amp's NHWC kernel: channel vectors per thread, rows in registers
    depthwise_conv: bool = True
    # sm_90: NT GEMMs as wgmma + TMA kernels (TIRx), epilogue fused; builds compile for sm_90a
    hopper_gemm: bool = True
    # the shortest K (a multiple of 64) a GEMM needs to take the Hopper kernel; shorter ones
    # keep amp's wmma tiles (512: the range measured on bert-large; 128 timed on the H100
    # 2026-12-07: convnext_tiny 1.066 -> 1.049 ms, resnet50 0.745 -> 0.749, efficientnet_b0
    # 0.662 -> 0.669, within noise either way)
    hopper_min_k: int = 512
    # Hopper GEMMs planned for two CTAs an SM (tiles <= 128 wide, 3 stages), so one CTA's
    # epilogue runs under the other's main loop; opt-in until timed (docs/gpu-performance.md,
    # "The Hopper GEMM's epilogue is exposed")
    hopper_two_per_sm: bool = False
    # Hopper GEMMs as persistent kernels: one CTA an SM walks its tiles, its producer loading
    # the next tile's stages while the consumers run the epilogue; opt-in until timed
    hopper_persistent: bool = False
    # GEMMs with symbolic rows (dynamic batch / sequence) on the Hopper kernels too, one kernel
    # for every M (H100 2026-12-07: dynamic BERT 0.73x / 0.96x / 0.61x at batch 1 / 8 / 32;
    # docs/dynamic-shapes.md)
    hopper_symbolic_m: bool = True
    # kernels over symbolic extents compute their indices in int32 where the ranges' maxima keep
    # every buffer under 2**30 elements (int64 division is emulated on the GPU; backends/cuda/
    # tir/index32.py; H200 2026-12-07: dynamic ResNet-50 1.34x / 1.46x -> 1.08x / 1.22x its
    # static builds at batch 1 / 32)
    index32: bool = True
    # ... with one kernel per tile width for the rows below the optimum, chosen on the host
    # from M (batch 1 gets the narrow tile its static build gets; H200 2026-12-07: dynamic
    # BERT at batch 1 1.26x -> 1.06x its static build)
    hopper_m_variants: bool = True
    # pointwise convs over a symbolic batch, C >= hopper_min_k: one GEMM over the N*H*W rows on
    # those Hopper kernels instead of a batched wmma GEMM per image (H200 2026-12-07: dynamic
    # ResNet-50 1.11x / 1.02x / 1.20x -> 1.02x / 1.03x / 1.12x its static builds at batch
    # 1 / 8 / 32)
    pointwise_flat_rows: bool = True


@dataclass
class DynamicConfig:
    """Builds with dynamic dims: one library for every shape in the ranges
    (docs/dynamic-shapes.md). The ranges themselves are ``input_shapes`` entries or ``dims``."""

    # the model's own dim names -> an int or a range "LO..HI(OPT)" (--dynamic batch=1..32)
    dims: dict[str, int | str] = field(default_factory=dict)
    # also compile the model at the optimum shape exactly (static kernels, every static-shape
    # rewrite); main runs that copy for inputs of exactly that shape. None (default): only
    # where the symbolic kernels do not already serve the optimum at static speed -- on llvm,
    # or with tuning records (they apply to the copy's static kernels); CUDA's symbolic
    # kernels take the static build's tiles at the optimum, and the copy, one static build
    # more, put the dynamic CNN's build over 2x a static one (docs/dynamic-shapes.md)
    specialize_optimum: bool | None = None

    def optimum_copy(self, cuda_target: bool, tuning_db: str | None) -> bool:
        """Whether a build for a CUDA (else llvm) target compiles the optimum copy."""
        if self.specialize_optimum is not None:
            return self.specialize_optimum
        return tuning_db is not None or not cuda_target


@dataclass
class ConvertConfig:
    target: str = "cuda"
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    accuracy: AccuracyConfig = field(default_factory=AccuracyConfig)
    # input name -> dims: an int (fixed) or a range "LO..HI" / "LO..HI(OPT)" (a dynamic dim,
    # docs/dynamic-shapes.md); a whole shape may be one string, "1..32(8)x128"
    input_shapes: dict[str, list[int | str]] = field(default_factory=dict)
    dynamic: DynamicConfig = field(default_factory=DynamicConfig)
    tuning_db: str | None = None
    simplify: bool = True  # onnx shape inference + onnxslim before import
    check_accuracy: bool = True
    threads: int | None = None  # CPU threads for the llvm runs (TVM_NUM_THREADS)
    auto_precision: AutoPrecisionConfig = field(default_factory=AutoPrecisionConfig)
    cuda: CudaConfig = field(default_factory=CudaConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------
# YAML loading with strict keys


def _closest(key: str, valid: list[str]) -> str:
    match = difflib.get_close_matches(key, valid, n=1)
    return f"; did you mean '{match[0]}'?" if match else f"; valid keys: {', '.join(valid)}"


def _expect(value: Any, types, where: str):
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in
                                        (types if isinstance(types, tuple) else (types,))):
        names = types.__name__ if isinstance(types, type) else "/".join(t.__name__ for t in types)
        raise ConfigError(f"{where}: expected {names}, got {type(value).__name__} ({value!r})")
    return value


def apply_section(obj, data: dict, where: str, source: str):
    """Set the fields of dataclass ``obj`` from the mapping ``data`` (the YAML section at
    ``where`` of ``source``), strictly: unknown keys and wrong types are ConfigErrors."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {where or 'top level'} must be a mapping, got "
                          f"{type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in fields:
            raise ConfigError(f"{source}: unknown key '{path}'{_closest(str(key), list(fields))}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            apply_section(current, value, path, source)
        elif isinstance(current, list):
            _expect(value, list, f"{source}: {path}")
            for item in value:
                _expect(item, str, f"{source}: {path}[]")
            setattr(obj, key, list(value))
        elif isinstance(current, dict):
            _expect(value, dict, f"{source}: {path}")
            setattr(obj, key, dict(value))
        elif isinstance(current, bool):
            setattr(obj, key, _expect(value, bool, f"{source}: {path}"))
        elif isinstance(current, int) and not isinstance(current, bool):
            setattr(obj, key, _expect(value, int, f"{source}: {path}"))
        elif isinstance(current, float):
            setattr(obj, key, float(_expect(value, (int, float), f"{source}: {path}")))
        else:  # str, or an optional field (None default): its annotation gives the type
            if value is not None:
                ann = str(fields[key].type)
                want = (int if ann.startswith("int") else float if ann.startswith("float")
                        else bool if ann.startswith("bool") else str) if current is None else str
                _expect(value, (int, float) if want is float else want, f"{source}: {path}")
            setattr(obj, key, value)


def read_yaml(path: str | Path) -> dict:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        text = p.read_text()
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not a text (UTF-8) YAML file") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {p}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or "syntax error"
        raise ConfigError(f"{p}: YAML syntax error{where}: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping of keys, got {type(data).__name__}")
    return data


def apply_yaml(cfg: ConvertConfig, data: dict, source: str) -> ConvertConfig:
    apply_section(cfg, data, "", source)
    try:
        validate(cfg)
    except ConfigError as exc:  # say which file the bad value came from
        raise ConfigError(f"{source}: {exc}") from None
    return cfg


def validate(cfg: ConvertConfig) -> None:
    p = cfg.precision
    if p.precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got '{p.precision}'")
    if p.accumulate not in ACCUMULATE:
        raise ConfigError(f"accumulate must be one of {', '.join(ACCUMULATE)}, got "
                          f"'{p.accumulate}'")
    validate_auto_precision(cfg.auto_precision)
    # canonical forms (ints and "LO..HI(OPT)" strings), so the report shows one spelling
    cfg.input_shapes = {name: canonical_shape(dims, f"input_shapes.{name}")
                        for name, dims in cfg.input_shapes.items()}
    cfg.dynamic.dims = {name: canonical_dim(parse_dim(value, f"dynamic.dims.{name}"))
                        for name, value in cfg.dynamic.dims.items()}


# ---------------------------------------------------------------------------------------------
# Shapes: fixed dims and ranges (docs/dynamic-shapes.md)

_RANGE = re.compile(r"^(\d+)\.\.(\d+)(?:\((\d+)\)|@(\d+))?$")


@dataclass(frozen=True)
class DimRange:
    """The sizes a dynamic dim accepts, ``lo..hi`` inclusive, and the size to optimize for
    (``opt``; unset: ``hi``). Written ``LO..HI`` or ``LO..HI(OPT)`` (``LO..HI@OPT`` too: no
    shell quoting needed)."""

    lo: int
    hi: int
    opt: int | None = None

    @property
    def optimum(self) -> int:
        return self.hi if self.opt is None else self.opt

    def points(self) -> list[int]:
        """The sizes the accuracy check runs at: min, optimum, max (distinct, ascending)."""
        return sorted({self.lo, self.optimum, self.hi})

    def __contains__(self, size) -> bool:
        return self.lo <= int(size) <= self.hi

    def __str__(self) -> str:
        return f"{self.lo}..{self.hi}" + (f"({self.opt})" if self.opt is not None else "")


def parse_dim(value, where: str) -> int | DimRange:
    """An int (a fixed dim) or a range: ``8``, ``"1..32"``, ``"1..32(8)"``, ``"1..32@8"``."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a positive int or a range LO..HI(OPT), got "
                          f"{value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ConfigError(f"{where}: dims must be positive, got {value}")
        return value
    if isinstance(value, DimRange):
        return value
    text = str(value).strip() if isinstance(value, str) else None
    if text is not None and text.isdigit():
        return parse_dim(int(text), where)
    m = _RANGE.match(text or "")
    if not m:
        raise ConfigError(f"{where}: '{value}' is neither a positive int nor a range LO..HI or "
                          f"LO..HI(OPT) (such as 1..32(8))")
    lo, hi = int(m.group(1)), int(m.group(2))
    opt = m.group(3) or m.group(4)
    opt = int(opt) if opt is not None else None
    if lo < 1 or lo > hi:
        raise ConfigError(f"{where}: range {text} must have 1 <= LO <= HI")
    if opt is not None and not lo <= opt <= hi:
        raise ConfigError(f"{where}: the optimum {opt} of {lo}..{hi} is outside the range")
    return DimRange(lo, hi, opt)


def canonical_dim(dim: int | DimRange) -> int | str:
    return dim if isinstance(dim, int) else str(dim)


def canonical_shape(dims, where: str) -> list[int | str]:
    """A shape (a list of ints / range strings, or one string ``"1..32(8)x128"``) in canonical
    form: ints for fixed dims, ``"LO..HI(OPT)"`` strings for ranges."""
    if isinstance(dims, str):
        dims = split_dims(dims)
    if not isinstance(dims, (list, tuple)) or not dims:
        raise ConfigError(f"{where}: expected a list of dims (positive ints or ranges "
                          f"LO..HI(OPT)), got {dims!r}")
    return [canonical_dim(parse_dim(d, f"{where}[{i}]")) for i, d in enumerate(dims)]


def split_dims(text: str) -> list[str]:
    return text.lower().replace(",", "x").split("x") if text else []


def parse_input_shape(text: str) -> tuple[str, list[int | DimRange]]:
    """'x:1x3x224x224' -> ('x', [1, 3, 224, 224]); a dim may be a range: 'ids:1..32(8)x128' ->
    ('ids', [DimRange(1, 32, 8), 128]). Names may contain ':' (the last one splits)."""
    name, sep, dims = text.rpartition(":")
    example = f"{name or 'input'}:1x3x224x224 or {name or 'input'}:1..32(8)x3x224x224"
    if not sep or not name:
        raise ConfigError(f"--input-shape '{text}': expected NAME:DxDxD, e.g. {example}")
    parts = split_dims(dims)
    if not parts:
        raise ConfigError(f"--input-shape '{text}': no dims; e.g. {example}")
    shape = []
    for axis, part in enumerate(parts):
        try:
            shape.append(parse_dim(part, f"dim {axis}"))
        except ConfigError as exc:
            raise ConfigError(f"--input-shape '{text}': {exc}; dims are positive integers or "
                              f"ranges separated by 'x', e.g. {example}") from None
    return name, shape


def parse_dynamic(text: str) -> tuple[str, int | DimRange]:
    """'batch=1..32(8)' -> ('batch', DimRange(1, 32, 8)): a range for every input dim the model
    names ``batch``."""
    name, sep, value = text.partition("=")
    example = "e.g. batch=1..32(8)"
    if not sep or not name.strip():
        raise ConfigError(f"--dynamic '{text}': expected DIM=LO..HI or DIM=LO..HI(OPT) with "
                          f"DIM a dim name of the model, {example}")
    try:
        return name.strip(), parse_dim(value.strip(), f"--dynamic '{text}'")
    except ConfigError as exc:
        raise ConfigError(f"{exc}; {example}") from None


TOLERANCE_METRICS = ("rel_l2", "max_abs", "cosine")


def validate_auto_precision(a: AutoPrecisionConfig) -> None:
    if a.metric not in TOLERANCE_METRICS:
        raise ConfigError(f"auto_precision.metric must be one of {', '.join(TOLERANCE_METRICS)}, "
                          f"got '{a.metric}'")
    if a.fallback not in ("fp32", "bf16"):
        raise ConfigError(f"auto_precision.fallback must be fp32 or bf16, got '{a.fallback}'")
    if not a.tolerance >= 0:
        raise ConfigError(f"auto_precision.tolerance must be >= 0, got {a.tolerance}")
    if a.samples < 1:
        raise ConfigError(f"auto_precision.samples must be >= 1, got {a.samples}")
    if a.input_range is not None:
        parse_input_range(a.input_range)


def parse_tolerance(text: str) -> tuple[str, float]:
    """'rel_l2=1e-2' -> ('rel_l2', 0.01); a bare number means rel_l2."""
    metric, sep, value = text.partition("=")
    if not sep:
        metric, value = "rel_l2", text
    metric = metric.strip().replace("-", "_")
    if metric not in TOLERANCE_METRICS:
        raise ConfigError(f"--tolerance '{text}': metric must be one of "
                          f"{', '.join(TOLERANCE_METRICS)}, e.g. rel_l2=1e-2")
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"--tolerance '{text}': '{value}' is not a number, e.g. "
                          f"rel_l2=1e-2") from None
    if not number >= 0:
        raise ConfigError(f"--tolerance '{text}': the value must be >= 0")
    return metric, number


def parse_input_range(text: str) -> tuple[float, float]:
    """'LO,HI' -> (LO, HI) with LO < HI."""
    parts = str(text).split(",")
    try:
        lo, hi = (float(v) for v in parts)
    except ValueError:
        raise ConfigError(f"calibration range '{text}': expected LO,HI, e.g. 0,1") from None
    if not lo < hi:
        raise ConfigError(f"calibration range '{text}': LO must be below HI")
    return lo, hi
