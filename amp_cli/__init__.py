"""amp: mixed-precision conversion of ONNX / PyTorch models with Apache TVM.

The package root is the Python API; the ``amp`` CLI is a thin layer over it::

    import amp_cli
    model = amp_cli.load("model.onnx", input_shapes={"x": [1, 3, 224, 224]})
    conv = amp_cli.convert(model, amp_cli.ConvertConfig(target="cuda:sm_90"))
    conv.save("out/")            # model.so, report.json, report.md
"""
__version__ = "0.1.0"

from .config import ConvertConfig, PolicyConfig, PrecisionConfig  # noqa: F401
from .errors import AmpError  # noqa: F401


def load(model, input_shapes=None, simplify=True):
    """Load an ONNX file, a torch.export .pt2 file or a 'pkg.module:factory' spec."""
    from .load import load as _load

    return _load(model, input_shapes=input_shapes, simplify=simplify)


def convert(model, cfg=None, progress=None):
    """Mixed-precision conversion + build + accuracy check; returns a Conversion."""
    from .convert import convert as _convert

    return _convert(model, cfg, progress=progress)


__all__ = ["AmpError", "ConvertConfig", "PolicyConfig", "PrecisionConfig", "convert", "load"]
