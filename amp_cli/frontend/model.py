"""What a frontend hands on: a model imported into Relax (fp32) with its inputs and a reference
runner (ONNX Runtime or torch), and the binding of symbolic input dims."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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
                "parameters": params, "parameter_bytes": param_bytes, "notes": list(self.notes)}

    def reference(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """fp32 reference outputs: ONNX Runtime (CPU) for ONNX models, torch for torch models."""
        if self.format == "onnx":
            import onnxruntime as ort

            opts = ort.SessionOptions()
            opts.log_severity_level = 3
            sess = ort.InferenceSession(self.onnx_model.SerializeToString(), opts,
                                        providers=["CPUExecutionProvider"])
            return [np.asarray(o) for o in sess.run(None, feeds)]
        import torch

        with torch.no_grad():
            out = self.torch_module(*[torch.from_numpy(feeds[i.name]) for i in self.inputs])
        outs = out if isinstance(out, (tuple, list)) else [out]
        return [o.detach().numpy() for o in outs]


def bind_input_shapes(specs: list[InputSpec], input_shapes: dict[str, list[int]]) -> None:
    names = [s.name for s in specs]
    for name in input_shapes:
        if name not in names:
            raise InputError(f"--input-shape names '{name}', but the model's inputs are: "
                             f"{', '.join(names) or '(none)'}")
    for s in specs:
        if s.name in input_shapes:
            dims = list(input_shapes[s.name])
            if s.shape and len(dims) != len(s.shape):
                raise InputError(f"--input-shape {s.name}: {len(dims)} dims given but the input "
                                 f"has rank {len(s.shape)} ({format_dims(s.shape)})")
            for given, have in zip(dims, s.shape):
                if isinstance(have, int) and have != given:
                    raise InputError(f"--input-shape {s.name}: {format_dims(dims)} conflicts with "
                                     f"the model's fixed shape {format_dims(s.shape)}")
            s.shape = dims
    dynamic = [s for s in specs if not s.is_static]
    if dynamic:
        listing = "; ".join(f"{s.name} [{format_dims(s.shape)}]" for s in dynamic)
        example = " ".join(f"--input-shape {s.name}:" + "x".join(
            str(d) if isinstance(d, int) else "1" for d in s.shape) for s in dynamic)
        raise InputError(f"symbolic input dims must be bound: {listing}; e.g. {example}")


def format_dims(dims) -> str:
    return "x".join(str(d) for d in dims)
