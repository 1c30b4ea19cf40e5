"""Model loading (frontends): ONNX files, torch.export ``.pt2`` files and ``package.module:factory`` specs.

ONNX models go through shape binding (``--input-shape``), onnx shape inference and onnxslim
before TVM's importer sees them: real exported models (dynamic dims, shape subgraphs) import
only after that.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import InputError
from .model import InputSpec, LoadedModel, bind_input_shapes
from .onnx import load_onnx
from .torch import is_factory_spec, load_pt2, load_torch_factory

__all__ = ["InputSpec", "LoadedModel", "bind_input_shapes", "is_factory_spec", "load"]


def load(model: str | Path, input_shapes: dict[str, list] | None = None,
         simplify: bool = True, dims: dict | None = None) -> LoadedModel:
    """Load an ONNX file, a ``.pt2`` export or a ``pkg.module:factory`` spec into Relax.

    ``input_shapes``: input name -> dims, each an int or, for a dynamic dim, a range
    (``"1..32(8)"``, :class:`~amp_cli.config.DimRange`); ``dims``: the model's own dim names
    -> an int or a range (docs/dynamic-shapes.md). ONNX models only take ranges.

    >>> m = load("examples/generated/tiny_cnn.onnx")          # doctest: +SKIP
    >>> [i.shape for i in m.inputs]                            # doctest: +SKIP
    [[1, 3, 32, 32]]
    """
    input_shapes = dict(input_shapes or {})
    text = str(model)
    ranged = dims or any(not isinstance(d, int) and not str(d).isdigit()
                         for shape in input_shapes.values() for d in shape)
    path = Path(text)
    if ranged and (path.suffix == ".pt2" or not path.exists() and is_factory_spec(text)):
        raise InputError(f"{text}: dynamic dims (ranges, --dynamic) need an ONNX model; export "
                         f"it with torch.onnx.export(..., dynamic_shapes=...) and convert the "
                         f".onnx file")
    if not path.exists() and is_factory_spec(text):
        return load_torch_factory(text, input_shapes)
    if not path.exists():
        raise InputError(f"model file not found: {path}")
    if path.is_dir():
        raise InputError(f"{path} is a directory, expected an .onnx or .pt2 file")
    if path.stat().st_size == 0:
        raise InputError(f"{path} is empty")
    if path.suffix == ".pt2":
        return load_pt2(path, input_shapes)
    return load_onnx(path, input_shapes, simplify, dims)
