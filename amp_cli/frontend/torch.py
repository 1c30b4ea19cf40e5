"""PyTorch models -> Relax: ``torch.export`` ``.pt2`` files and ``package.module:factory``
specs, through TVM's ExportedProgram importer; torch (fp32) is the reference."""
from __future__ import annotations

import contextlib
import importlib
import io
import re
from pathlib import Path
from typing import Callable

from .. import tvm_compat
from ..errors import InputError, ModelLoadError
from ..sandbox import error_line
from .model import InputSpec, LoadedModel, bind_input_shapes

FACTORY_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")  # package.module:factory


def is_factory_spec(text: str) -> bool:
    """Whether ``text`` names a torch module factory (``package.module:factory``)."""
    return bool(FACTORY_SPEC.match(text))


def _torch():
    try:
        import torch
    except ImportError:
        raise InputError("PyTorch models need torch: pip install -e .[torch]") from None
    return torch


def load_pt2(path: Path, input_shapes) -> LoadedModel:
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


def load_torch_factory(spec: str, input_shapes) -> LoadedModel:
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
