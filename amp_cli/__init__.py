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


# Stage functions, imported eagerly so that they (not their modules, which share the names)
# are the package attributes. Heavy imports (tvm, torch, onnxruntime) stay inside functions.
from .convert import Conversion, convert  # noqa: E402,F401
from .frontend import LoadedModel, load  # noqa: E402,F401

__all__ = ["AmpError", "Conversion", "ConvertConfig", "LoadedModel", "PolicyConfig",
           "PrecisionConfig", "convert", "load"]
