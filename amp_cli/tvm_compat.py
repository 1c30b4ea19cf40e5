"""Every TVM-version-sensitive import and call lives here.

amp is written against apache-tvm 0.27 (Relax + s_tir: MetaSchedule and dlight moved under
``tvm.s_tir``; targets are dicts). A TVM upgrade should touch this file only. Imports are lazy
so ``amp --help`` never pays for TVM.

Long because every version-bound TVM name amp uses is spelled here, by design: one file to
change on an upgrade.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import os

from .errors import AmpError
from .ir_attrs import ONNX_NODE_PREFIX
from .ir_module import replace_functions

TVM_VERSION = "0.27.0.post1"
# apache-tvm 0.27.0.post1 only asks for apache-tvm-ffi>=0.1.14.post0, but 0.1.15.x changed the
# PrimType hash/equal hook ABI: anything that serializes TIR (sch.tensorize, save_json) segfaults.
TVM_FFI_VERSION = "0.1.14.post1"
# a PrimFunc attribute CUDA codegen writes as __launch_bounds__(threads, N): ptxas then keeps
# the registers a thread within the share N resident CTAs an SM leave it
LAUNCH_MIN_BLOCKS_ATTR = "tirx.launch_bounds_min_blocks_per_sm"


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check_versions() -> None:
    """Raise a clear AmpError when the TVM / tvm-ffi pair is not the pinned, known-good one."""
    if os.environ.get("AMP_SKIP_VERSION_CHECK"):
        return
    ffi = _dist_version("apache-tvm-ffi")
    if ffi is not None and ffi != TVM_FFI_VERSION:
        raise AmpError(
            f"apache-tvm-ffi {ffi} is installed but amp needs {TVM_FFI_VERSION} "
            f"(newer ffi releases crash apache-tvm {TVM_VERSION} when compiling tensor-core "
            f"kernels); run: pip install apache-tvm-ffi=={TVM_FFI_VERSION}"
        )


@functools.lru_cache(maxsize=None)
def tvm():
    check_versions()
    try:
        import tvm as _tvm
    except ImportError as exc:  # pragma: no cover - install problem
        raise AmpError(f"cannot import TVM ({exc}); run: pip install apache-tvm=={TVM_VERSION}")
    return _tvm


def relax():
    return tvm().relax


def dlight():
    tvm()
    from tvm.s_tir import dlight as dl

    return dl


def meta_schedule():
    tvm()
    from tvm.s_tir import meta_schedule as ms

    return ms


def _module(name: str):
    """A TVM submodule by its (version-bound) dotted name, TVM imported and checked first."""
    tvm()
    return importlib.import_module(name)


# --- TVM submodules amp reaches into, by their 0.27 names ------------------------------------
def dlight_analysis():
    """dlight's analysis helpers (normalize_prim_func, get_root_block, ...)."""
    return _module("tvm.s_tir.dlight.analysis")


def dlight_base():
    """dlight's base module (try_inline, transform._apply_rules, ...)."""
    return _module("tvm.s_tir.dlight.base")


def dlight_transform():
    """dlight's ApplyDefaultSchedule module (its per-function ``_apply_rules``)."""
    return _module("tvm.s_tir.dlight.base.transform")


def dlight_matmul():
    """dlight's GPU matmul rules and analysis (Matmul, MatmulTensorization, get_index_map)."""
    return _module("tvm.s_tir.dlight.gpu.matmul")


@contextlib.contextmanager
def fast_tvmscript_parsing():
    """While active, ``inspect.stack()`` skips ``inspect.getmodule``. TVMScript's
    ``@T.prim_func`` calls ``inspect.stack()`` for every function it parses, and getmodule scans
    all of ``sys.modules`` for every frame: importing TVM's 248 tensor intrinsics took 41 s of
    CPU (86-313 s on a loaded 2-core machine) in that alone, 5.8 s with this. The frames, line
    numbers and source lines TVMScript reads are the same."""
    import inspect
    import linecache
    import sys

    def stack(context=1):  # noqa: ARG001 - inspect.stack's signature
        frame, out = sys._getframe(1), []
        while frame is not None:
            code = frame.f_code
            line = linecache.getline(code.co_filename, frame.f_lineno)
            out.append(inspect.FrameInfo(frame, code.co_filename, frame.f_lineno, code.co_name,
                                         [line] if line else None, 0))
            frame = frame.f_back
        return out

    original = inspect.stack
    inspect.stack = stack
    try:
        yield
    finally:
        inspect.stack = original


def cuda_tensor_intrin():
    """TVM's CUDA tensor intrinsics (importing registers them: wmma, mma, ...)."""
    with fast_tvmscript_parsing():
        _module("tvm.s_tir.tensor_intrin")
    return _module("tvm.s_tir.tensor_intrin.cuda")


def tensor_intrin_class():
    return _module("tvm.s_tir").TensorIntrin


def tvmscript_tir():
    """TVMScript's TIR namespace (``T``): ``tvm.script.tirx`` in 0.27."""
    return _module("tvm.script.tirx")


def relax_cuda_pipeline():
    """TVM's Relax CUDA pipeline pieces (library_dispatch_passes, finalize_passes, ...)."""
    return _module("tvm.relax.backend.cuda.pipeline")


def relax_cpu_pipeline():
    """TVM's Relax generic-CPU pipeline pieces."""
    return _module("tvm.relax.backend.cpu_generic.pipeline")


def llvm_codegen():
    """LLVM target queries (llvm_get_system_cpu, llvm_cpu_has_features, vector width)."""
    return _module("tvm.target.codegen")


def index_map_class():
    return _module("tvm.tirx").IndexMap


def derived_object(cls):
    """TVM's decorator that makes a Python subclass of a TVM object class (PyBuilder, ...)."""
    return _module("tvm.ir.utils").derived_object(cls)


def popen_pool():
    """tvm.support.popen_pool (PopenPoolExecutor, StatusKind)."""
    return _module("tvm.support.popen_pool")


def tar_module():
    return _module("tvm.support.tar")


def remove_weight_layout_rewrite_block(mod):
    return _module("tvm.s_tir.transform").RemoveWeightLayoutRewriteBlock(
        skip_tensor_rewrite=True)(mod)


def structural_hash(obj) -> int:
    tvm()
    import tvm_ffi

    return tvm_ffi.structural_hash(obj)


def registered_mixed_precision_policy(op_name: str) -> int | None:
    """The ``TMixedPrecisionPolicy`` TVM registers for a Relax op (0 always, 1 follow,
    2 never), or None (no such op, or none registered)."""
    try:
        kind = tvm().ir.Op.get(op_name).get_attr("TMixedPrecisionPolicy")
    except Exception:  # noqa: BLE001 - not an op TVM knows
        return None
    return None if kind is None else int(kind)


def symbolic_vars(func) -> list:
    """The TIR variables (symbolic dims) that Relax function ``func`` defines, in the order
    its parameters' shapes name them."""
    found = list(relax().analysis.defined_symbolic_vars(func))
    order = []
    for p in func.params:
        for d in getattr(getattr(p.ty, "shape", None), "values", None) or []:
            match = [v for v in found if v.same_as(d)]
            if match and not any(m.same_as(match[0]) for m in order):
                order.append(match[0])
    return order + [v for v in found if not any(v.same_as(o) for o in order)]


def with_range_check(func, dims: list, bounds: list[tuple[int, int]], message: str):
    """Relax function ``func`` asserting ``lo <= dim <= hi`` for each symbolic ``dim`` (of its
    parameters) before anything else runs. On failure the VM raises Python's AssertionError
    with ``message``, its ``{}`` placeholders filled with the dims' values."""
    t = tvm()
    rx = t.relax
    conds = [c for d, (lo, hi) in zip(dims, bounds) for c in (d >= lo, d <= hi)]
    call = rx.op.assert_op(rx.prim_value(t.tirx.all(*conds)),
                           [rx.prim_value(d) for d in dims], message)
    call = rx.BlockBuilder().normalize(call)
    check = rx.BindingBlock([rx.VarBinding(rx.Var("amp_range_check", call.ty), call)])
    body = rx.SeqExpr([check, *func.body.blocks], func.body.body)
    return rx.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span)


def with_fresh_constants(func):
    """Relax function ``func`` with each tensor constant a new node over the same data: graph
    rewrites that key on constant nodes (one weight, one matmul) see two copies of a model as
    two sets of weights (``dedup_constants`` makes them one again before codegen)."""
    rx = relax()

    @rx.expr_functor.mutator
    class _Fresh(rx.PyExprMutator):
        def visit_generic_const_(self, const):  # noqa: N802 - TVM visitor naming
            return rx.const(const.value) if hasattr(const.value, "numpy") else const

    return _Fresh().visit_expr(func)


def private_function(func):
    """Relax function ``func`` without its exported name (callable inside the module only)."""
    return func.without_attr("global_symbol")


def copy_with_new_vars(func):
    """A copy of Relax function ``func`` with fresh variables (two functions of one module may
    not share them)."""
    return relax().utils.copy_with_new_vars(func)


def dedup_constants(mod):
    """``mod`` with its equal Relax constants (dtype, shape and bytes) made one object: the VM
    library stores a constant object once, so weights that two functions fold to the same
    values (main_optimum and main_dynamic) are stored once."""
    import hashlib

    t = tvm()
    rx = t.relax
    canon: dict = {}
    changed = [0]

    @rx.expr_functor.mutator
    class _Dedup(rx.PyExprMutator):
        def visit_generic_const_(self, const):  # noqa: N802 - TVM visitor naming
            if not hasattr(const.value, "numpy"):  # a dtype, a string: not a tensor
                return const
            arr = const.value.numpy()
            key = (str(arr.dtype), arr.shape, hashlib.blake2b(arr.tobytes()).hexdigest())
            first = canon.setdefault(key, const)
            if not first.same_as(const):
                changed[0] += 1
            return first

    dedup = _Dedup(mod)
    funcs = [(gv, f) for gv, f in mod.functions_items() if isinstance(f, rx.Function)]
    new = {gv: dedup.visit_expr(f) for gv, f in funcs}
    return replace_functions(mod, new) if changed[0] else mod


def string_function(name: str, text: str):
    """A public Relax function ``name()`` returning the string ``text`` (0.27:
    ``tvm.ir.StringImm``; ``relax.StringImm`` before)."""
    t = tvm()
    bb = t.relax.BlockBuilder()
    with bb.function(name, []):
        bb.emit_func_output(t.ir.StringImm(text))
    return bb.get()[name]


def substitute_vars(expr, mapping: dict):
    """``expr`` (a Relax expression) with the variables in ``mapping`` replaced."""
    relax = tvm().relax

    @relax.expr_functor.mutator
    class _Substitute(relax.PyExprMutator):
        def visit_var_(self, var):  # noqa: N802 - TVM visitor naming
            return mapping.get(var, var)

        def visit_dataflow_var_(self, var):  # noqa: N802
            return mapping.get(var, var)

    return _Substitute().visit_expr(expr)


def from_onnx(model, shape_dict=None, dtype_dict="float32", opset=None):
    tvm()
    from tvm.relax.frontend.onnx import from_onnx as _from_onnx

    return _from_onnx(model, shape_dict=shape_dict, dtype_dict=dtype_dict, opset=opset,
                      keep_params_in_input=False)


def from_exported_program(exported_program):
    tvm()
    from tvm.relax.frontend.torch import from_exported_program as _fep

    return _fep(exported_program, keep_params_as_input=False)


def make_target(spec: dict):
    """A tvm.target.Target from a dict such as {"kind": "cuda", "arch": "sm_90"}."""
    return tvm().target.Target(spec)


def target_to_dict(target) -> dict:
    """Plain-JSON view of a Target (for reports)."""
    import json

    return json.loads(str(target))


def relax_vm(executable_or_module, device):
    return relax().VirtualMachine(executable_or_module, device)


def load_module(path: str):
    return tvm().runtime.load_module(path)


def cpu_device():
    return tvm().cpu(0)


_CUDA_TOUCHED = []


def cuda_touched() -> bool:
    """Whether this process has initialized CUDA (then a forked child cannot use it)."""
    return bool(_CUDA_TOUCHED)


def cuda_device():
    _CUDA_TOUCHED.append(True)
    return tvm().cuda(0)


_PROBE = ("import tvm; d = tvm.cuda(0); "
          "print(d.compute_version if d.exist else '')")


@functools.lru_cache(maxsize=None)
def cuda_compute_version() -> str | None:
    """The local GPU's compute capability ("9.0"), or None. Probed in a subprocess, so this
    process does not initialize CUDA: a forked build child could not use it afterwards."""
    import shutil
    import subprocess
    import sys

    if not (shutil.which("nvidia-smi") or os.path.exists("/dev/nvidia0")):
        return None
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                             timeout=120).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out[-1] if out and out[-1] else None


def has_cuda_device() -> bool:
    return cuda_compute_version() is not None


def to_tvm_tensor(array, device):
    return tvm().runtime.tensor(array, device)


def save_json(obj) -> str:
    return tvm().ir.save_json(obj)


def load_json(text: str):
    return tvm().ir.load_json(text)


def compile_relax(mod, target, relax_pipeline, tir_pipeline="default"):
    return tvm().compile(mod, target=target, relax_pipeline=relax_pipeline,
                         tir_pipeline=tir_pipeline)


def onnx_supported_ops() -> set:
    """ONNX op types TVM's Relax importer converts."""
    tvm()
    from tvm.relax.frontend.onnx import onnx_frontend

    return set(onnx_frontend._get_convert_map()) | {"If", "Constant"}


@contextlib.contextmanager
def onnx_node_naming():
    """While importing, name each ONNX node's final Relax binding 'onnx:<node name>' so that
    per-node precision decisions and reports can refer to ONNX node names. Yields a dict holding
    the node being converted (for error messages)."""
    tvm()
    from tvm import relax as _relax
    from tvm.relax.frontend.onnx import onnx_frontend

    cls = onnx_frontend.ONNXGraphImporter
    original = cls._convert_operator
    current: dict = {}
    constant = tvm().ir.expr.Constant

    def convert(self, op_name, inputs, attrs, opset):
        custom = attrs.get("tvm_custom") or {}
        name = custom.get("name") or op_name
        current["node"], current["op"] = name, op_name
        sym = original(self, op_name, inputs, attrs, opset)
        ty = getattr(sym, "ty", None)
        # a node with several outputs (LSTM, Split, TopK) returns a tuple: that is its last
        # binding (a one-output node returning a tuple, e.g. SequenceConstruct, is left alone)
        named = isinstance(ty, _relax.TensorType) or (
            isinstance(ty, _relax.TupleType) and custom.get("num_outputs", 1) > 1)
        # a converter that bound its result itself (call_tir through emit_te: reflect Pad,
        # Clip, Tile) returns that variable: the node's name goes on an alias of it
        own_var = isinstance(sym, _relax.Var) and not any(
            i is not None and sym.same_as(i) for i in inputs)
        if (isinstance(sym, _relax.Expr) and named
                and (own_var or not isinstance(sym, (_relax.Var, constant)))):
            sym = emit_named(self.bb, sym, ONNX_NODE_PREFIX + name)
        return sym

    cls._convert_operator = convert
    try:
        yield current
    finally:
        cls._convert_operator = original


@contextlib.contextmanager
def onnx_extra_converters(converters: dict):
    """While importing, TVM's ONNX importer also converts the op types in ``converters`` (op
    type -> ``fn(bb, inputs, attrs, opset) -> relax.Expr``; ``inputs`` holds None for an absent
    optional input, ``attrs`` the parsed attributes plus TVM's ``tvm_custom`` name and
    ``num_outputs``). They take precedence over TVM's own converter of the same op type, and
    ``onnx_supported_ops()`` lists them while the context is open."""
    tvm()
    from tvm.relax.frontend.onnx import onnx_frontend

    original = onnx_frontend._get_convert_map

    def adapter(op_type, fn):
        # TVM looks converters up as classes with get_converter(opset) -> impl(bb, inputs,
        # attrs, params)
        def get_converter(cls, opset):
            return lambda bb, inputs, attrs, params: fn(bb, inputs, attrs, opset)

        return type(f"Amp{op_type}Converter", (), {"get_converter": classmethod(get_converter)})

    extra = {op_type: adapter(op_type, fn) for op_type, fn in converters.items()}

    def convert_map():
        return {**original(), **extra}

    onnx_frontend._get_convert_map = convert_map
    try:
        yield
    finally:
        onnx_frontend._get_convert_map = original


def prim_value_expr(expr):
    """``expr`` when it is a scalar PrimExpr (0.27: a symbolic dim the importer took from a
    shape is the TIR expression itself), else None."""
    return expr if tvm().ir.is_prim_expr(expr) else None


def scalar_dtype(expr) -> str | None:
    """The dtype of a Relax scalar (a tensor constant or a PrimValue), or None."""
    ty = getattr(expr, "ty", None)
    dtype = getattr(ty, "dtype", None)
    return None if dtype is None else str(dtype)


def onnx_default_converter(op_type: str, opset: int):
    """TVM's own converter of ONNX ``op_type``: ``fn(bb, inputs, attrs, params)`` (for amp's
    converters that handle some cases and hand the rest back)."""
    tvm()
    from tvm.relax.frontend.onnx import onnx_frontend

    return getattr(onnx_frontend, op_type).get_converter(opset)


def dtype_bits(dtype: str) -> int:
    """Bits of one element of ``dtype`` (all lanes of a vector type)."""
    d = tvm().DataType(str(dtype))
    return int(d.bits) * int(d.lanes)


def constant_value(expr):
    """The numpy value of a Relax constant, or None when ``expr`` is not one."""
    if isinstance(expr, tvm().ir.expr.Constant):
        return expr.value.numpy()
    return None


def emit_named(bb, expr, name: str):
    """Bind ``expr`` in ``bb`` to a new variable named exactly ``name`` and return the variable.
    (``bb.emit(expr, name_hint)`` passes the hint through a NameSupply that turns '.' into '_'
    and numbers repeats, so an ONNX node '/model.9/Conv' came out as 'onnx:/model_9/Conv' and
    ``--exclude-node /model.9/Conv`` matched nothing.)"""
    relax = tvm().relax
    expr = bb.normalize(expr)
    var_class = relax.DataflowVar if bb.current_block_is_dataflow() else relax.Var
    var = var_class(name, expr.ty)
    bb.emit_normalized(relax.VarBinding(var, expr))
    return var


def var_names(root) -> list[str]:
    """The name of every variable in ``root`` (an IRModule or function): Relax variables, TIR
    variables and TIR buffers (0.27: one ``Var`` class, a buffer is a buffer-typed Var)."""
    tvm()
    import tvm_ffi

    names: list[str] = []
    tvm_ffi.structural_walk(root, (tvm().ir.expr.Var, lambda v: names.append(str(v.name))))
    return names


def rename_vars(root, new_name):
    """``root`` (an IRModule or function) with each variable ``v`` for which ``new_name(v)``
    returns a string replaced, at its definition and at every use, by a variable of that name
    and the same type (a Relax DataflowVar stays one). ``new_name`` is asked once per variable
    (two variables of one name are two questions) and returns None to keep a variable."""
    t = tvm()
    import tvm_ffi

    var_class, dataflow_var = t.ir.expr.Var, t.relax.DataflowVar
    made: dict = {}  # by handle: a TIR Var's == builds an expression, so no Var dict keys

    def swap(var):
        key = var.__chandle__()
        if key not in made:
            name = new_name(var)
            made[key] = var if name is None else (
                dataflow_var if isinstance(var, dataflow_var) else var_class)(name, var.ty)
        return made[key]

    return tvm_ffi.structural_map(root, (var_class, swap))


def prim_func_class():
    """TIR's PrimFunc class (``tvm.tirx`` in 0.27, ``tvm.tir`` before)."""
    t = tvm()
    return (t.tirx if hasattr(t, "tirx") else t.tir).PrimFunc


# --- lane legalizer / CUDA pipeline support (amp_cli.legalize) --------------------------------
# 0.27 renamed tvm.tir -> tvm.tirx and tvm.arith -> tvm.sym, lowered TIR uses Bind statements and
# ir.TensorLoad, and tvm.tirx.build only accepts a *registered pipeline name* as tir_pipeline
# (it asserts isinstance(pipeline, str)), so a custom pipeline is registered under a name.

def tirx():
    tvm()
    import tvm.tirx as _tirx

    return _tirx


def s_tir():
    tvm()
    import tvm.s_tir as _s_tir

    return _s_tir


def analyzer():
    tvm()
    from tvm.sym import Analyzer

    return Analyzer()


def size_value(x):
    """A size of a shape as a Python int when it is a constant, else the PrimExpr itself."""
    if isinstance(x, int):
        return x
    value = getattr(x, "value", None)
    return int(value) if isinstance(value, int) else x


def index32(x):
    """A size as kernels compute addresses with it: a Python int as is, a symbolic size (int64,
    as Relax's shape variables are) as an int32 expression (callers check that their tensors
    have fewer than 2**31 elements)."""
    x = size_value(x)
    if isinstance(x, int):
        return x
    return x if str(x.ty) == "int32" else tvm().tirx.Cast("int32", x)


def prove_equal(a, b) -> bool:
    """Sizes ``a`` and ``b`` (ints or PrimExprs over shape variables) are equal for every value
    of their variables."""
    a, b = size_value(a), size_value(b)
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return bool(analyzer().can_prove_equal(a, b))


def prove_divisible(n, d) -> bool:
    """Size ``d`` divides size ``n`` for every value of their variables."""
    n, d = size_value(n), size_value(d)
    if isinstance(n, int) and isinstance(d, int):
        return d != 0 and n % d == 0
    t = tvm()
    return bool(analyzer().can_prove_equal(t.tirx.floormod(n, d), 0))


def size_upper_bound(x, upper: dict[str, int]) -> int | None:
    """The largest value of size ``x`` (products and sums of shape variables and positive
    constants, so increasing in each variable) when each variable is at most ``upper[name]``;
    None when a variable has no bound there."""
    x = size_value(x)
    if isinstance(x, int):
        return x
    t = tvm()
    found = list(t.tirx.analysis.undefined_vars(x, []))
    if any(str(v.name) not in upper for v in found):
        return None
    bound = analyzer()
    for v in found:
        bound.bind(v, t.tirx.const(upper[str(v.name)], str(v.ty)))
    return size_value(bound.simplify(x))


def buffer_load_class():
    """The class of TIR buffer loads (0.27: ``tvm.ir.TensorLoad``; ``tirx.BufferLoad`` is only a
    constructor function). Its ``source`` is the buffer (a buffer-typed Var)."""
    return tvm().ir.TensorLoad


def structural_mutate(root, callbacks):
    """tvm_ffi.structural_mutate: typed callbacks (node, mutator) that own their recursion."""
    tvm()
    import tvm_ffi

    return tvm_ffi.structural_mutate(root, callbacks)


def decl_buffer(buffer, data):
    """A ``DeclBuffer`` statement binding ``buffer`` to the storage expression ``data``
    (0.27: flat DeclBuffer without body, data by keyword)."""
    return tirx().DeclBuffer(buffer, data=data)


def prim_func_pass(fn, name: str, opt_level: int = 0):
    return tvm().tirx.transform.prim_func_pass(fn, opt_level=opt_level, name=name)


def register_tir_pipeline(name: str, factory) -> str:
    """Register ``factory() -> (main_pass, finalize_host_fn, finalize_device_fn)`` under
    ``name`` (what tvm.compile(..., tir_pipeline=name) looks up); returns ``name``."""
    tvm()
    from tvm.tirx import compilation_pipeline as _cp

    _cp.register_tir_pipeline(name, factory)
    return name


def unregister_tir_pipeline(name: str) -> None:
    tvm()
    from tvm.tirx import compilation_pipeline as _cp

    _cp.PIPELINE_MAP.pop(name, None)


def tirx_main_pipeline():
    """TVM 0.27's TIRx lowering (``tir_pipeline="tirx"``) as one module pass; its finalize
    passes are the default pipeline's."""
    from tvm.tirx import compilation_pipeline as _cp

    main, _host, _device = _cp.get_tir_pipeline("tirx")
    return main


def default_tir_finalize_passes():
    """(finalize_host_passes, finalize_device_passes) factories of TVM's default pipeline."""
    tvm()
    from tvm.s_tir import pipeline as _sp

    return _sp.finalize_host_passes, _sp.finalize_device_passes


def cuda_module_source(executable) -> str:
    """CUDA C source of a tvm.compile result for a CUDA target (no GPU or nvcc needed:
    without a CUDA driver 0.27 keeps the generated source in the imported device module)."""
    mod = getattr(executable, "mod", executable)
    stack, seen, out = [mod], set(), []
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if m.kind == "cuda":
            out.append(m.inspect_source())
        stack.extend(m.imports)
    return "\n".join(out)


cuda_source = cuda_module_source  # the name amp_cli.build uses
