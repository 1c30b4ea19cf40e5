"""ONNX files -> Relax: shape binding (``--input-shape``), onnx shape inference and onnxslim
(real exported models import only after them), then TVM's importer with each ONNX node's last
binding named after the node."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

from .. import tvm_compat
from ..dims import attach_ranges
from ..errors import InputError, ModelLoadError, UnsupportedOpError
from ..sandbox import error_line
from .input_values import infer_input_values
from .model import ONNX_DTYPES, InputSpec, LoadedModel, bind_input_shapes
from .rnn import CONVERTERS as RNN_CONVERTERS  # ops TVM's importer lacks, converted by amp
from .shape_ops import CONVERTERS as SHAPE_CONVERTERS  # keep dynamic dims symbolic


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


def load_onnx(path: Path, input_shapes, simplify: bool, dims=None) -> LoadedModel:
    import onnx

    try:
        model = onnx.load(str(path))
    except Exception as exc:  # noqa: BLE001 - protobuf raises several types
        raise InputError(f"{path}: not a valid ONNX file (truncated or corrupt?): "
                         f"{type(exc).__name__}") from None
    if not model.graph.node and not model.graph.output:
        raise InputError(f"{path}: not a valid ONNX model (no graph)")
    specs = _onnx_inputs(model.graph)
    dynamic = bind_input_shapes(specs, input_shapes, dims)
    notes = []
    _fix_input_dims(model, specs)
    model = _prepare_onnx(model, simplify, notes)
    node_types = {}
    for i, n in enumerate(model.graph.node):
        if not n.name:
            n.name = f"{n.op_type}_{i}"
        node_types[n.name] = n.op_type
    supported = tvm_compat.onnx_supported_ops() | set(RNN_CONVERTERS)
    unsupported = [(n.op_type, n.name) for n in model.graph.node
                   if n.op_type not in supported and n.op_type != "Constant"]
    if unsupported:
        listing = ", ".join(f"{t} (node '{nm}')" for t, nm in unsupported[:8])
        more = f" and {len(unsupported) - 8} more" if len(unsupported) > 8 else ""
        raise UnsupportedOpError(f"{path}: TVM's ONNX importer does not support: "
                                 f"{listing}{more}", ops=unsupported)
    # dynamic inputs: the importer makes one symbolic var per dim name of the graph's inputs
    shape_dict = {s.name: list(s.shape) for s in specs if s.is_static}
    dtype_dict = {s.name: s.dtype for s in specs}
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), tvm_compat.onnx_node_naming() as current, \
                tvm_compat.onnx_extra_converters({**RNN_CONVERTERS, **SHAPE_CONVERTERS}):
            mod = tvm_compat.from_onnx(model, shape_dict=shape_dict, dtype_dict=dtype_dict)
    except UnsupportedOpError as exc:  # amp's own converters name the node and the reason
        raise UnsupportedOpError(f"{path}: {exc}", ops=exc.ops) from exc
    except Exception as exc:  # noqa: BLE001 - the importer raises anything
        node = current.get("node")
        where = f" at node '{node}' ({current.get('op')})" if node else ""
        msg = error_line(str(exc)) if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"{path}: TVM's ONNX importer failed{where}: {msg[:300]}") from exc
    try:
        mod = attach_ranges(mod, dynamic)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: TVM's ONNX importer lost a dynamic dim: {exc}") from None
    outputs = [o.name for o in model.graph.output]
    ints = [s.name for s in specs if s.dtype.startswith(("int", "uint"))]
    for name, values in infer_input_values(model, ints).items():
        next(s for s in specs if s.name == name).values = values
    return LoadedModel(str(path), "onnx", mod, specs, outputs, node_types, onnx_model=model,
                       notes=notes, dynamic=dynamic)


def _fix_input_dims(model, specs):
    by_name = {s.name: s for s in specs}
    for vi in model.graph.input:
        s = by_name.get(vi.name)
        if s is None:
            continue
        dims = vi.type.tensor_type.shape.dim
        for d, v in zip(dims, s.shape):
            if isinstance(v, str):  # a dynamic dim, under its IR name
                d.ClearField("dim_value")
                d.dim_param = v
            else:
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
