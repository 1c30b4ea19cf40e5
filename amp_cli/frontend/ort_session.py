"""ONNX Runtime sessions for amp's fp32 reference, also when onnx is newer than onnxruntime.

Symptom: on a machine with a newer ``onnx`` than its ``onnxruntime`` (the GPU machine of
2026-12-05: onnx writes IR version 14, onnxruntime reads up to 13), every model saved there
failed amp's accuracy check with ``Unsupported model IR version: 14, max supported IR version:
13``: the reference could not be computed, so nothing converted.

The IR version is a file-format version; which operators a model may use is fixed by its opset
imports, which ONNX Runtime checks separately. So when ONNX Runtime names the highest IR
version it reads, the session is made again from a copy that declares that version (the
caller's model is left alone). A model that really uses a newer format feature still fails, with
ONNX Runtime's own error about that feature. Nothing is retried for any other error.
"""
from __future__ import annotations

import re

_IR_REFUSED = re.compile(r"Unsupported model IR version: (\d+), max supported IR version: (\d+)")


def supported_ir_version(error: str) -> int | None:
    """The highest IR version ONNX Runtime says it reads, when ``error`` is its refusal of a
    newer one; else None."""
    m = _IR_REFUSED.search(error)
    if m and int(m.group(2)) < int(m.group(1)):
        return int(m.group(2))
    return None


def inference_session(model, options=None, providers=("CPUExecutionProvider",)):
    """``onnxruntime.InferenceSession`` over ``model`` (a ModelProto, its bytes, or a path);
    a model whose IR version is newer than this onnxruntime reads is opened as that version."""
    import onnx
    import onnxruntime as ort

    if options is None:
        options = ort.SessionOptions()
        options.log_severity_level = 3
    blob = model.SerializeToString() if hasattr(model, "SerializeToString") else model
    try:
        return ort.InferenceSession(blob, options, providers=list(providers))
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own Fail type
        version = supported_ir_version(str(exc))
        if version is None:
            raise
    proto = onnx.load(blob) if isinstance(blob, str) else onnx.load_from_string(blob)
    proto.ir_version = version
    return ort.InferenceSession(proto.SerializeToString(), options, providers=list(providers))
