"""What a frontend hands on: a model imported into Relax (fp32) with its inputs and a reference
runner (ONNX Runtime or torch), and the binding of symbolic input dims."""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import DimRange, parse_dim
from ..errors import InputError

ONNX_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 5: "int16", 6: "int32", 7: "int64",
               9: "bool", 10: "float16", 11: "float64", 16: "bfloat16"}


@dataclass
class InputSpec:
    name: str
    shape: list  # ints once bound; str/None for symbolic dims
    dtype: str
    # valid values of an integer input, from the graph (input_values.py): ("index", rows) or
    # ("mask",); None: no constraint known
    values: tuple | None = None

    @property
    def is_static(self) -> bool:
        return all(isinstance(d, int) and d > 0 for d in self.shape)

    def at(self, sizes: dict[str, int]) -> "InputSpec":
        """This input with its dynamic dims (named in ``shape``) set from ``sizes``."""
        missing = [d for d in self.shape if isinstance(d, str) and d not in sizes]
        if missing:
            raise InputError(f"input '{self.name}' has dynamic dims {', '.join(missing)}: "
                             f"give their sizes")
        return InputSpec(self.name, [int(sizes[d]) if isinstance(d, str) else d
                                     for d in self.shape], self.dtype, self.values)

    def to_dict(self):
        d = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}
        if self.values:
            d["values"] = list(self.values)
        return d


@dataclass
class LoadedModel:
    """A model imported into Relax (fp32), with what amp needs to check it against a reference."""

    source: str
    format: str  # "onnx" | "torch"
    mod: Any  # tvm.IRModule, fp32
    inputs: list[InputSpec]
    outputs: list[str]
    node_types: dict[str, str] = field(default_factory=dict)  # ONNX node name -> op type
    onnx_model: Any = None  # the simplified ModelProto (ONNX Runtime reference)
    torch_module: Any = None  # the torch reference, for torch models
    notes: list[str] = field(default_factory=list)
    # dynamic dims (docs/dynamic-shapes.md): name -> range; the inputs' shapes name them
    dynamic: dict[str, DimRange] = field(default_factory=dict)

    def inputs_at(self, sizes: dict[str, int]) -> list[InputSpec]:
        """The inputs with each dynamic dim at ``sizes[name]`` (static models: as they are)."""
        return [s.at(sizes) for s in self.inputs]

    @property
    def optimum(self) -> dict[str, int]:
        """Each dynamic dim at its optimum: the shape tuning, calibration and the default
        bench run use."""
        return {name: r.optimum for name, r in self.dynamic.items()}

    @property
    def example_inputs(self) -> list[InputSpec]:
        """Concrete inputs: the model's own, with each dynamic dim at its optimum."""
        return self.inputs_at(self.optimum)

    def check_points(self) -> list[dict[str, int]]:
        """Where the accuracy check runs a dynamic model: every dim at its minimum, at its
        optimum, at its maximum ([{}] for a static model)."""
        if not self.dynamic:
            return [{}]
        points = []
        for pick in (lambda r: r.lo, lambda r: r.optimum, lambda r: r.hi):
            point = {name: pick(r) for name, r in self.dynamic.items()}
            if point not in points:
                points.append(point)
        return points

    def summary(self) -> dict:
        ops = Counter(self.node_types.values())
        params, param_bytes = 0, 0
        if self.onnx_model is not None:
            for init in self.onnx_model.graph.initializer:
                n = int(np.prod(init.dims)) if len(init.dims) else 1
                params += n
                param_bytes += n * np.dtype(ONNX_DTYPES.get(init.data_type, "float32")
                                            .replace("bfloat16", "float16")).itemsize
        return {"source": self.source, "format": self.format,
                "inputs": [i.to_dict() for i in self.inputs], "outputs": list(self.outputs),
                "nodes": len(self.node_types), "op_types": dict(sorted(ops.items())),
                "parameters": params, "parameter_bytes": param_bytes, "notes": list(self.notes),
                **({"dynamic": {n: str(r) for n, r in self.dynamic.items()}}
                   if self.dynamic else {})}

    def reference(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """fp32 reference outputs: ONNX Runtime (CPU) for ONNX models, torch for torch models."""
        if self.format == "onnx":
            from .ort_session import inference_session

            sess = inference_session(self.onnx_model)
            return [np.asarray(o) for o in sess.run(None, feeds)]
        import torch

        with torch.no_grad():
            out = self.torch_module(*[torch.from_numpy(feeds[i.name]) for i in self.inputs])
        outs = out if isinstance(out, (tuple, list)) else [out]
        return [o.detach().numpy() for o in outs]


def bind_input_shapes(specs: list[InputSpec], input_shapes: dict[str, list],
                      dims: dict | None = None) -> dict[str, DimRange]:
    """Bind each input's symbolic dims from ``input_shapes`` (input -> dims: ints, or ranges
    ``LO..HI(OPT)`` for dynamic dims) and ``dims`` (the model's dim names -> an int or a
    range). A dim the model names is one size wherever it appears: binding it on one input
    binds it on every input that names it. Dynamic dims stay in ``spec.shape`` as their name
    (the model's, or ``<input>_<axis>`` for an unnamed one). Returns {dim name: range}."""
    names = [s.name for s in specs]
    for name in input_shapes:
        if name not in names:
            raise InputError(f"--input-shape names '{name}', but the model's inputs are: "
                             f"{', '.join(names) or '(none)'}")
    bound: dict[str, tuple] = {}  # dim name -> (int | DimRange, where it was given)

    def bind(key: str, value, where: str) -> None:
        old = bound.get(key)
        if old is not None and old[0] != value:
            raise InputError(f"dim '{key}' is given two sizes: {old[0]} ({old[1]}) and "
                             f"{value} ({where})")
        bound.setdefault(key, (value, where))

    given: dict[tuple, Any] = {}  # (input, axis) -> int | DimRange
    for s in specs:
        if s.name not in input_shapes:
            continue
        want = [parse_dim(d, f"--input-shape {s.name}") for d in input_shapes[s.name]]
        if s.shape and len(want) != len(s.shape):
            raise InputError(f"--input-shape {s.name}: {len(want)} dims given but the input "
                             f"has rank {len(s.shape)} ({format_dims(s.shape)})")
        if not s.shape:
            s.shape = ["?"] * len(want)
        for axis, (value, have) in enumerate(zip(want, s.shape)):
            if isinstance(have, int) and value != have:
                kind = "a range" if isinstance(value, DimRange) else "a size"
                raise InputError(f"--input-shape {s.name}: {kind} {value} for dim {axis}, "
                                 f"which the model fixes at {have} "
                                 f"({format_dims(s.shape)})")
            if not isinstance(have, int):
                given[(s.name, axis)] = value
                if _is_named(have):
                    bind(have, value, f"--input-shape {s.name}")
    model_dims = {d for s in specs for d in s.shape if _is_named(d)}
    for key, value in (dims or {}).items():
        if key not in model_dims:
            raise InputError(f"--dynamic names '{key}', but the model's symbolic dims are: "
                             f"{', '.join(sorted(model_dims)) or '(none)'}")
        bind(key, parse_dim(value, f"--dynamic {key}"), f"--dynamic {key}")
    ranges: dict[str, DimRange] = {}  # IR name -> range
    var_of: dict[str, str] = {}  # the model's dim name (or input_axis) -> IR name
    for s in specs:
        shape = []
        for axis, have in enumerate(s.shape):
            value = given.get((s.name, axis))
            if value is None and _is_named(have) and have in bound:
                value = bound[have][0]
            if value is None or isinstance(value, int):
                shape.append(have if value is None else value)
                continue
            key = have if _is_named(have) else f"{s.name}_{axis}"
            if key not in var_of:
                var_of[key] = dim_var_name(key, set(var_of.values()))
                ranges[var_of[key]] = value
            shape.append(var_of[key])
        s.shape = shape
    unbound = [s for s in specs if not all(isinstance(d, int) or d in ranges for d in s.shape)]
    if unbound:
        listing = "; ".join(f"{s.name} [{format_dims(s.shape)}]" for s in unbound)
        example = " ".join(f"--input-shape {s.name}:" + "x".join(
            str(d) if isinstance(d, int) else "1" for d in s.shape) for s in unbound)
        raise InputError(f"symbolic input dims must be bound: {listing}; e.g. {example} (a "
                         f"range such as 1..8 makes a dim dynamic: docs/dynamic-shapes.md)")
    return ranges


def _is_named(dim) -> bool:
    return isinstance(dim, str) and dim not in ("", "?")


def dim_var_name(key: str, taken: set[str]) -> str:
    """The name a dynamic dim gets in the IR (and in the library's range errors): the model's
    own when it is an identifier, else made one, unique among ``taken``."""
    base = re.sub(r"\W", "_", key) or "dim"
    if not re.match(r"[A-Za-z_]", base):
        base = f"d_{base}"
    name, k = base, 1
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    return name


def format_dims(dims) -> str:
    return "x".join(str(d) for d in dims)
