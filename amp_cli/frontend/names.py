"""The names a model brings, and the names generated CUDA source can take.

Exporters name tensors and nodes freely: ``onnx::/model.9/Concat_output_0``, ``9conv``,
unicode, hundreds of characters. amp keeps them in its Relax IR as they are -- precision
decisions, ``--exclude-node``, ``--input-shape``, ``.npz`` inputs and reports all speak the
user's names, and each ONNX node's last binding is named ``onnx:<node name>`` (``ir_attrs``).
But TVM turns Relax variable names into TIR buffer names (``emit_te`` at import, LegalizeOps,
FuseOps/FuseTIR) and CUDA codegen prints those with only ``:``, ``-`` and ``.`` replaced
(``CodeGenSourceBase::AllocVarID``), so ``/`` reached the source as ``onnx_/model_9/Concat_ptr``:
a division, and NVRTC's ``identifier "model_9" is undefined``. Replacing after de-duplicating
also lets ``a:b`` and ``a_b`` become one identifier, two tensors under one name.

:func:`make_identifiers` gives every variable of a module whose name is not a C identifier of
at most :data:`MAX_LENGTH` characters a name that is one, unique in the module, and returns the
map back to the original names. The CUDA pipeline runs it first (``backends/cuda/pipeline.py``).
Not at import: the precision pass, auto-precision and the reports find each node through its
``onnx:<node name>`` binding, so renaming there would need a translation in each of them. Not
as a last TIR pass either: every name a kernel prints comes from a Relax variable or a buffer
that exists when the pipeline starts (importer PrimFuncs included), from one named after such a
variable (FuseOps, FuseTIR, LegalizeOps, ``emit_te`` in amp's rewrites), or from TVM's and amp's
own literal names (``T_add``, ``conv_gemm``); ``tests/backends/cuda/test_cuda_safe_names.py``
checks every kernel parameter of a hostile-name model and compiles its source.

>>> to_identifier("onnx::/model.9/Concat_output_0")
'onnx_model_9_Concat_output_0'
>>> to_identifier("9conv"), to_identifier("模型")
('v9conv', 'v')
"""
from __future__ import annotations

import re

from .. import tvm_compat

MAX_LENGTH = 64  # longer names are cut in the middle: readable kernels, any compiler's limits
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NOT_IDENTIFIER_CHARS = re.compile(r"[^A-Za-z0-9_]+")
_UNDERSCORES = re.compile(r"_{2,}")  # '__' anywhere is reserved to the C++ implementation


def is_identifier(name: str, max_length: int = MAX_LENGTH) -> bool:
    """Whether ``name`` can be printed into C/CUDA source as it is."""
    return (len(name) <= max_length and IDENTIFIER.fullmatch(name) is not None
            and "__" not in name)


def to_identifier(name: str, max_length: int = MAX_LENGTH) -> str:
    """``name`` as a C identifier: runs of other characters become one '_', a leading digit (or
    nothing left) gets a 'v' in front, and a name over ``max_length`` keeps its head and its
    tail (where exporters put the op: ``/model.24/.../Conv``). Not unique: see :class:`NameTable`.
    """
    text = _UNDERSCORES.sub("_", _NOT_IDENTIFIER_CHARS.sub("_", name)).strip("_")
    if not text or text[0].isdigit():
        text = "v" + text
    if len(text) > max_length:
        head = max_length // 4
        text = (text[:head] + "_" + text[-(max_length - head - 1):]).replace("__", "_")
    return text


class NameTable:
    """Unique identifiers for original names, with the map back.

    >>> t = NameTable(taken=["a_b"])
    >>> t.allocate("a:b"), t.allocate("a/b"), t.allocate("a:b")
    ('a_b_1', 'a_b_2', 'a_b_3')
    >>> t.original("a_b_2")
    'a/b'
    """

    def __init__(self, taken=(), max_length: int = MAX_LENGTH):
        self.max_length = max_length
        self.taken = set(taken)
        self.originals: dict[str, str] = {}  # identifier -> the name it stands for

    def allocate(self, name: str) -> str:
        """A fresh identifier for ``name`` (each call is a new one: two variables that share a
        name stay two variables)."""
        base = to_identifier(name, self.max_length)
        candidate, n = base, 0
        while candidate in self.taken:
            n += 1
            suffix = f"_{n}"
            candidate = base[:self.max_length - len(suffix)].rstrip("_") + suffix
        self.taken.add(candidate)
        self.originals[candidate] = name
        return candidate

    def original(self, identifier: str) -> str:
        return self.originals.get(identifier, identifier)


def make_identifiers(mod, max_length: int = MAX_LENGTH):
    """``mod`` (an IRModule) with every Relax variable, TIR variable and TIR buffer whose name is
    not an identifier (:func:`is_identifier`) renamed to a unique one; names that already are
    identifiers are kept (and never handed out again). Returns ``(module, {identifier: original
    name})``; the module is ``mod`` itself when nothing needed renaming."""
    names = tvm_compat.var_names(mod)
    if all(is_identifier(n, max_length) for n in names):
        return mod, {}
    table = NameTable((n for n in names if is_identifier(n, max_length)), max_length)

    def new_name(var):
        name = str(var.name)
        return None if is_identifier(name, max_length) else table.allocate(name)

    return tvm_compat.rename_vars(mod, new_name), dict(table.originals)
