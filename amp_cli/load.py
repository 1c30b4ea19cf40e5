"""Model loading: ONNX files, torch.export ``.pt2`` files and ``package.module:factory`` specs.

ONNX models go through shape binding (``--input-shape``), onnx shape inference and onnxslim
before TVM's importer sees them: real exported models (dynamic dims, shape subgraphs) import
only after that.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from . import tvm_compat
from .errors import InputError, ModelLoadError, UnsupportedOpError
from .sandbox import error_line

ONNX_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 5: "int16", 6: "int32", 7: "int64",
               9: "bool", 10: "float16", 11: "float64", 16: "bfloat16"}
_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass
class InputSpec:
    name: str
    shape: list  # ints once bound; str/None for symbolic dims
    dtype: str

    @property
    def is_static(self) -> bool:
        return all(isinstance(d, int) and d > 0 for d in self.shape)

    def to_dict(self):
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


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


def load(model: str | Path, input_shapes: dict[str, list[int]] | None = None,
         simplify: bool = True) -> LoadedModel:
    """Load an ONNX file, a ``.pt2`` export or a ``pkg.module:factory`` spec into Relax.

    >>> m = load("examples/generated/tiny_cnn.onnx")          # doctest: +SKIP
    >>> [i.shape for i in m.inputs]                            # doctest: +SKIP
    [[1, 3, 32, 32]]
    """
    input_shapes = dict(input_shapes or {})
    text = str(model)
    path = Path(text)
    if not path.exists() and _SPEC.match(text):
        return _load_torch_factory(text, input_shapes)
    if not path.exists():
        raise InputError(f"model file not found: {path}")
    if path.is_dir():
        raise InputError(f"{path} is a directory, expected an .onnx or .pt2 file")
    if path.stat().st_size == 0:
        raise InputError(f"{path} is empty")
    if path.suffix == ".pt2":
        return _load_pt2(path, input_shapes)
    return _load_onnx(path, input_shapes, simplify)


# ---------------------------------------------------------------------------------------------
# ONNX


def _onnx_inputs(graph) -> list[InputSpec]:
    inits = {i.name for i in graph.initializer}
    specs = []
    for vi in graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dims = []
        for d in tt.shape.dim:
            if d.HasField("dim_value") and d.dim_value > 0:
                dims.append(int(d.dim_value))
            else:
                dims.append(d.dim_param or "?")
        specs.append(InputSpec(vi.name, dims, ONNX_DTYPES.get(tt.elem_type, "float32")))
    return specs


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
                                 f"has rank {len(s.shape)} ({_fmt_dims(s.shape)})")
            for given, have in zip(dims, s.shape):
                if isinstance(have, int) and have != given:
                    raise InputError(f"--input-shape {s.name}: {_fmt_dims(dims)} conflicts with "
                                     f"the model's fixed shape {_fmt_dims(s.shape)}")
            s.shape = dims
    dynamic = [s for s in specs if not s.is_static]
    if dynamic:
        listing = "; ".join(f"{s.name} [{_fmt_dims(s.shape)}]" for s in dynamic)
        example = " ".join(f"--input-shape {s.name}:" + "x".join(
            str(d) if isinstance(d, int) else "1" for d in s.shape) for s in dynamic)
        raise InputError(f"symbolic input dims must be bound: {listing}; e.g. {example}")


def _fmt_dims(dims) -> str:
    return "x".join(str(d) for d in dims)


def _load_onnx(path: Path, input_shapes, simplify: bool) -> LoadedModel:
    import onnx

    try:
        model = onnx.load(str(path))
    except Exception as exc:  # noqa: BLE001 - protobuf raises several types
        raise InputError(f"{path}: not a valid ONNX file (truncated or corrupt?): "
                         f"{type(exc).__name__}") from None
    if not model.graph.node and not model.graph.output:
        raise InputError(f"{path}: not a valid ONNX model (no graph)")
    specs = _onnx_inputs(model.graph)
    bind_input_shapes(specs, input_shapes)
    notes = []
    _fix_input_dims(model, specs)
    model = _prepare_onnx(model, simplify, notes)
    node_types = {}
    for i, n in enumerate(model.graph.node):
        if not n.name:
            n.name = f"{n.op_type}_{i}"
        node_types[n.name] = n.op_type
    unsupported = [(n.op_type, n.name) for n in model.graph.node
                   if n.op_type not in tvm_compat.onnx_supported_ops() and n.op_type != "Constant"]
    if unsupported:
        listing = ", ".join(f"{t} (node '{nm}')" for t, nm in unsupported[:8])
        more = f" and {len(unsupported) - 8} more" if len(unsupported) > 8 else ""
        raise UnsupportedOpError(f"{path}: TVM's ONNX importer does not support: "
                                 f"{listing}{more}", ops=unsupported)
    shape_dict = {s.name: list(s.shape) for s in specs}
    dtype_dict = {s.name: s.dtype for s in specs}
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), tvm_compat.onnx_node_naming() as current:
            mod = tvm_compat.from_onnx(model, shape_dict=shape_dict, dtype_dict=dtype_dict)
    except Exception as exc:  # noqa: BLE001 - the importer raises anything
        node = current.get("node")
        where = f" at node '{node}' ({current.get('op')})" if node else ""
        msg = error_line(str(exc)) if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"{path}: TVM's ONNX importer failed{where}: {msg[:300]}") from exc
    outputs = [o.name for o in model.graph.output]
    return LoadedModel(str(path), "onnx", mod, specs, outputs, node_types, onnx_model=model,
                       notes=notes)


def _fix_input_dims(model, specs):
    by_name = {s.name: s for s in specs}
    for vi in model.graph.input:
        s = by_name.get(vi.name)
        if s is None:
            continue
        dims = vi.type.tensor_type.shape.dim
        for d, v in zip(dims, s.shape):
            d.ClearField("dim_param")
            d.dim_value = int(v)


def _prepare_onnx(model, simplify: bool, notes: list[str]):
    import onnx

    try:
        model = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception as exc:  # noqa: BLE001
        notes.append(f"onnx shape inference failed ({type(exc).__name__}); continued without")
    if not simplify:
        return model
    try:
        import onnxslim

        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            slimmed = onnxslim.slim(model)
        if slimmed is not None:
            before, after = len(model.graph.node), len(slimmed.graph.node)
            notes.append(f"onnxslim: {before} -> {after} nodes")
            model = slimmed
    except Exception as exc:  # noqa: BLE001 - the simplifier is best-effort
        notes.append(f"onnxslim failed ({type(exc).__name__}: {str(exc)[:100]}); "
                     f"imported the unsimplified graph")
    return model


# ---------------------------------------------------------------------------------------------
# PyTorch


def _torch():
    try:
        import torch
    except ImportError:
        raise InputError("PyTorch models need torch: pip install -e .[torch]") from None
    return torch


def _load_pt2(path: Path, input_shapes) -> LoadedModel:
    torch = _torch()
    try:
        ep = torch.export.load(str(path))
    except Exception as exc:  # noqa: BLE001
        raise InputError(f"{path}: not a valid torch.export .pt2 file: {str(exc)[:200]}") from None
    specs = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind.name != "USER_INPUT":
            continue
        meta = ep.graph.find_nodes(op="placeholder", target=spec.arg.name)[0].meta["val"]
        specs.append(InputSpec(spec.arg.name, [int(d) for d in meta.shape],
                               str(meta.dtype).replace("torch.", "")))
    if input_shapes:
        bind_input_shapes(specs, input_shapes)
    return _import_exported(ep, specs, str(path), ep.module())


def _load_torch_factory(spec: str, input_shapes) -> LoadedModel:
    torch = _torch()
    mod_name, _, attr = spec.partition(":")
    import sys

    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # like `python -m`: specs resolve from the cwd
    try:
        factory: Callable = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as exc:
        raise InputError(f"cannot import '{spec}': {exc}") from None
    module = factory()
    if not isinstance(module, torch.nn.Module):
        raise InputError(f"'{spec}' returned {type(module).__name__}, expected a torch.nn.Module")
    if not input_shapes:
        raise InputError(f"'{spec}': a torch module needs its input shapes, e.g. "
                         f"--input-shape x:1x3x224x224 (one per forward() argument)")
    module.eval()
    specs = [InputSpec(n, list(s), "float32") for n, s in input_shapes.items()]
    args = tuple(torch.randn(*s.shape) for s in specs)
    try:
        ep = torch.export.export(module, args)
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"torch.export failed for '{spec}': {str(exc)[:300]}") from None
    return _import_exported(ep, specs, spec, module)


def _import_exported(ep, specs, source, reference) -> LoadedModel:
    torch = _torch()
    try:
        ep = ep.run_decompositions()
        with contextlib.redirect_stdout(io.StringIO()):
            mod = tvm_compat.from_exported_program(ep)
    except Exception as exc:  # noqa: BLE001
        msg = error_line(str(exc)) if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"{source}: TVM's torch importer failed: {msg[:300]}") from exc
    node_types = {n.name: str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    outputs = [f"output{i}" for i, _ in enumerate(ep.graph_signature.output_specs)]
    del torch
    return LoadedModel(source, "torch", mod, specs, outputs, node_types, torch_module=reference)
