"""amp: mixed-precision conversion of ONNX / PyTorch models with Apache TVM.

The package root is the Python API; the ``amp`` CLI is a thin layer over it::

    import amp_cli
    model = amp_cli.load("model.onnx", input_shapes={"x": (1, 3, 224, 224)})
    result = amp_cli.convert(model, amp_cli.ConvertConfig(target="llvm"))
    result.save("out/")            # model.so, report.json, report.md
"""
__version__ = "0.1.0"

from .errors import AmpError  # noqa: F401
