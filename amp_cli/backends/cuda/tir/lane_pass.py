"""The lane legalizer: split vector TIR whose (dtype, lanes) CUDA codegen rejects.

Works on lowered, flattened TIR after ``VectorizeLoop`` (one-dimensional buffer indices, vector
lanes expressed as ``Ramp``/``Broadcast``). The unit of rewriting is a statement:

* ``BufferStore`` with a vector value, and
* ``Bind`` (the 0.27 let-statement) of a vector variable.

If any vector sub-expression of the statement has an illegal (dtype, lanes) pair, the statement's
lanes ``[0, L)`` are partitioned into pieces and the statement is emitted once per piece, every
vector sub-expression restricted to that piece's lanes. All vector sub-expressions of one
statement share the statement's lane count L (that is what VectorizeLoop produces), so the lane
restriction is a structural map: ``Ramp(b, s, L)[lo:lo+n] = Ramp(b + lo*s, s, n)``,
``Broadcast(v, L)[..] = Broadcast(v, n)``, ``op(a, b)[..] = op(a[..], b[..])`` for lane-wise ops,
``A[idx][..] = A[idx[..]]``. Lanes are independent, so the pieces compute exactly what the
original did: no arithmetic is reordered or re-associated.

The partition is greedy, widest first, over widths 16/8/4/2/1 such that at every piece:

* every vector dtype in the statement is legal at the piece width (table.LEGAL_LANES);
* every contiguous (stride-1 Ramp) load/store piece is at most 16 bytes and provably aligned to
  its own size: ``base + lo`` is a multiple of ``n`` for all values of the variables
  (``modular_set``, the same test CodeGenC uses to decide on a vector access), the buffer's
  ``data_alignment`` is a multiple of the piece's byte size, and a symbolic ``elem_offset``
  is covered by ``offset_factor``. A piece that fails this is made narrower, down to scalars;
* a piece that reads a vector variable split earlier either is exactly one of the variable's
  pieces or is scalar (then the lane is extracted with a one-index Shuffle).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .... import tvm_compat
from .table import MAX_ACCESS_BYTES, PIECE_WIDTHS, element_bytes, lane_legal


class _Unsupported(Exception):
    """The statement has a vector node the legalizer does not know how to split."""


def _lanes(expr) -> int:
    ty = getattr(expr, "ty", None)
    dt = getattr(ty, "dtype", None)
    if dt is None:
        return 1
    try:
        return int(dt.lanes)
    except (TypeError, ValueError):  # scalable vectors: not ours
        raise _Unsupported(f"scalable vector {dt}")


def _dtype(expr) -> str:
    return str(expr.ty.dtype)


def _elem(dtype_str: str) -> str:
    if "x" in dtype_str and dtype_str.rsplit("x", 1)[1].isdigit():
        return dtype_str.rsplit("x", 1)[0]
    return dtype_str


def _with_lanes(dtype_str: str, n: int) -> str:
    base = _elem(dtype_str)
    return base if n == 1 else f"{base}x{n}"


def _int_value(expr):
    value = getattr(expr, "value", None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass
class _Access:
    buffer: object
    base: object          # element index of lane 0 (scalar PrimExpr)
    dtype: str            # element dtype


@dataclass
class _Info:
    lanes: int
    dtypes: set = field(default_factory=set)       # vector dtypes (with L lanes) printed
    accesses: list = field(default_factory=list)   # contiguous loads/stores
    split_vars: list = field(default_factory=list)  # vars split earlier that are read


class LaneLegalizer:
    """Rewrites one PrimFunc body. ``rewrites`` collects human-readable records."""

    def __init__(self):
        self.T = tvm_compat.tirx()
        self.ir = tvm_compat.tvm().ir
        self.analyzer = tvm_compat.analyzer()
        self.rewrites: list[str] = []
        self.skipped: list[str] = []
        # Bind var -> list of (lo, n, piece var)
        self.var_pieces: dict = {}
        self._binary = tuple(
            getattr(self.T, name)
            for name in ("Add", "Sub", "Mul", "Div", "Mod", "FloorDiv", "FloorMod", "Min",
                         "Max", "EQ", "NE", "LT", "LE", "GT", "GE", "And", "Or", "BitwiseAnd",
                         "BitwiseOr", "BitwiseXor", "LShift", "RShift")
            if hasattr(self.T, name)
        )
        self._unary = tuple(getattr(self.T, n) for n in ("Not", "BitwiseNot") if hasattr(self.T, n))

    # ---------------------------------------------------------------- analysis
    def _is_contiguous(self, index, lanes) -> bool:
        return (isinstance(index, self.T.Ramp) and _int_value(index.stride) == 1
                and _lanes(index) == lanes)

    def _collect(self, expr, info: _Info, as_index=False):
        T = self.T
        lanes = _lanes(expr)
        if lanes == 1:
            # Scalars are lane-invariant; they may still hide vectors only inside a Let/Call
            # argument, which CUDA codegen handles as scalars, so nothing to do.
            return
        if lanes != info.lanes:
            raise _Unsupported(f"mixed lane counts {lanes} vs {info.lanes} in {type(expr).__name__}")
        if not as_index:
            info.dtypes.add(_dtype(expr))
        if isinstance(expr, T.Ramp):
            if as_index:
                return
            return
        if isinstance(expr, T.Broadcast):
            return
        if isinstance(expr, self.ir.TensorLoad):
            if len(expr.indices) != 1:
                raise _Unsupported("multi-dimensional load (run after FlattenBuffer)")
            index = expr.indices[0]
            if self._is_contiguous(index, lanes):
                info.accesses.append(_Access(expr.source, index.base, _elem(_dtype(expr))))
            else:
                self._collect(index, info)
            return
        if isinstance(expr, T.Cast):
            self._collect(expr.value, info)
            return
        if isinstance(expr, self._binary):
            self._collect(expr.a, info)
            self._collect(expr.b, info)
            return
        if isinstance(expr, self._unary):
            self._collect(expr.a, info)
            return
        if isinstance(expr, T.Select):
            for sub in (expr.condition, expr.true_value, expr.false_value):
                self._collect(sub, info)
            return
        if isinstance(expr, T.Let):
            self._collect(expr.value, info)
            self._collect(expr.body, info)
            return
        if isinstance(expr, self.ir.Call):
            for arg in expr.args:
                if _lanes(arg) not in (1, lanes):
                    raise _Unsupported(f"call {expr.op} mixes lane counts")
                self._collect(arg, info)
            return
        if isinstance(expr, T.Var):
            if expr in self.var_pieces:
                info.split_vars.append(expr)
            return
        if isinstance(expr, T.Shuffle):
            if len(expr.vectors) == 1 and all(_int_value(i) is not None for i in expr.indices) \
                    and _lanes(expr.vectors[0]) != lanes:
                return
            raise _Unsupported("shuffle")
        raise _Unsupported(type(expr).__name__)

    def _needs_rewrite(self, info: _Info) -> bool:
        return any(not lane_legal(dt) for dt in info.dtypes)

    def _piece_ok(self, info: _Info, lo: int, n: int) -> bool:
        if n == 1:
            return True
        for dt in info.dtypes:
            if not lane_legal(_elem(dt), n):
                return False
        for acc in info.accesses:
            nbytes = n * element_bytes(acc.dtype)
            if nbytes > MAX_ACCESS_BYTES:
                return False
            buf = acc.buffer
            align = int(getattr(buf, "data_alignment", 0) or 0)
            if align <= 0 or align % nbytes != 0:
                return False
            offset = getattr(buf, "elem_offset", None)
            base = acc.base + lo if lo else acc.base
            off_value = _int_value(offset) if offset is not None else 0
            if off_value is None:
                factor = int(getattr(buf, "offset_factor", 0) or 0)
                if factor <= 0 or factor % n != 0:
                    return False
            elif off_value:
                base = base + off_value
            ms = self.analyzer.modular_set(base)
            if int(ms.coeff) % n != 0 or int(ms.base) % n != 0:
                return False
        for var in info.split_vars:
            if not any(plo == lo and pn == n for plo, pn, _ in self.var_pieces[var]):
                return False
        return True

    def _partition(self, info: _Info) -> list[tuple[int, int]]:
        pieces, lo, total = [], 0, info.lanes
        while lo < total:
            for n in PIECE_WIDTHS:
                if n <= total - lo and self._piece_ok(info, lo, n):
                    pieces.append((lo, n))
                    lo += n
                    break
        return pieces

    # ---------------------------------------------------------------- splitting
    def _split(self, expr, lo: int, n: int, L: int, env: dict):
        T = self.T
        lanes = _lanes(expr)
        if lanes == 1:
            if isinstance(expr, T.Var) and expr in env:
                return env[expr]
            return expr
        if isinstance(expr, T.Ramp):
            base = expr.base + expr.stride * lo if lo else expr.base
            base = self.analyzer.simplify(base)
            return base if n == 1 else T.Ramp(base, expr.stride, n)
        if isinstance(expr, T.Broadcast):
            return expr.value if n == 1 else T.Broadcast(expr.value, n)
        if isinstance(expr, self.ir.TensorLoad):
            return T.BufferLoad(expr.source, [self._split(expr.indices[0], lo, n, L, env)])
        if isinstance(expr, T.Cast):
            return T.Cast(_with_lanes(_dtype(expr), n), self._split(expr.value, lo, n, L, env))
        if isinstance(expr, self._binary):
            return type(expr)(self._split(expr.a, lo, n, L, env), self._split(expr.b, lo, n, L, env))
        if isinstance(expr, self._unary):
            return type(expr)(self._split(expr.a, lo, n, L, env))
        if isinstance(expr, T.Select):
            return T.Select(self._split(expr.condition, lo, n, L, env),
                            self._split(expr.true_value, lo, n, L, env),
                            self._split(expr.false_value, lo, n, L, env))
        if isinstance(expr, T.Let):
            var = expr.var
            new_var = T.Var(f"{var.name}_l{lo}", _with_lanes(_dtype(var), n) if _lanes(var) == L
                            else _dtype(var))
            value = self._split(expr.value, lo, n, L, env)
            inner = dict(env)
            inner[var] = new_var
            return T.Let(new_var, value, self._split(expr.body, lo, n, L, inner))
        if isinstance(expr, self.ir.Call):
            args = [self._split(a, lo, n, L, env) for a in expr.args]
            return self.ir.Call(expr.op, args, expr.attrs, list(expr.ty_args), None,
                                self.ir.PrimType(_with_lanes(_dtype(expr), n)))
        if isinstance(expr, T.Var):
            if expr in env:
                return env[expr]
            for plo, pn, pvar in self.var_pieces[expr]:
                if plo == lo and pn == n:
                    return pvar
                if n == 1 and plo <= lo < plo + pn:
                    return pvar if pn == 1 else T.Shuffle([pvar], [lo - plo])
            raise _Unsupported(f"piece {lo}+{n} of split variable {expr.name}")
        if isinstance(expr, T.Shuffle):
            return T.Shuffle(list(expr.vectors), list(expr.indices)[lo:lo + n])
        raise _Unsupported(type(expr).__name__)

    # ---------------------------------------------------------------- statements
    @staticmethod
    def _fmt(pieces) -> str:
        return "+".join(str(n) for _, n in pieces)

    def rewrite_store(self, store):
        """None when unchanged, else a list of statements."""
        T = self.T
        value = store.value
        L = _lanes(value)
        if L == 1 or len(store.indices) != 1:
            return None
        index = store.indices[0]
        info = _Info(L)
        try:
            self._collect(value, info)
            if self._is_contiguous(index, L):
                info.accesses.append(_Access(store.buffer, index.base, _elem(_dtype(value))))
            else:
                self._collect(index, info)
            if not self._needs_rewrite(info):
                return None
            pieces = self._partition(info)
            new = [T.BufferStore(store.buffer, self._split(value, lo, n, L, {}),
                                 [self._split(index, lo, n, L, {})]) for lo, n in pieces]
        except _Unsupported as exc:
            self.skipped.append(f"store {_dtype(value)}: not legalized ({exc})")
            return None
        self.rewrites.append(f"store {_dtype(value)} -> {self._fmt(pieces)}")
        return new

    def rewrite_bind(self, bind):
        T = self.T
        var, value = bind.var, bind.value
        L = _lanes(value)
        if L == 1:
            return None
        info = _Info(L)
        try:
            self._collect(value, info)
            info.dtypes.add(_dtype(var))
            if not self._needs_rewrite(info):
                return None
            pieces = self._partition(info)
            new, record = [], []
            for lo, n in pieces:
                pvar = T.Var(f"{var.name}_l{lo}", _with_lanes(_dtype(var), n))
                new.append(T.Bind(pvar, self._split(value, lo, n, L, {})))
                record.append((lo, n, pvar))
        except _Unsupported as exc:
            self.skipped.append(f"bind {_dtype(value)}: not legalized ({exc})")
            return None
        self.var_pieces[var] = record
        self.rewrites.append(f"bind {_dtype(value)} -> {self._fmt(pieces)}")
        return new

    def rewrite_body(self, body):
        T = self.T

        def on_seq(seq, mutator):
            out, changed = [], False
            for stmt in seq.seq:
                new = mutator.mutate(stmt)
                if not new.same_as(stmt):
                    changed = True
                if isinstance(new, T.SeqStmt):
                    out.extend(new.seq)
                else:
                    out.append(new)
            return T.SeqStmt(out) if changed else seq

        def on_store(store, _mutator):
            new = self.rewrite_store(store)
            if new is None:
                return store
            return new[0] if len(new) == 1 else T.SeqStmt(new)

        def on_bind(bind, _mutator):
            new = self.rewrite_bind(bind)
            if new is None:
                return bind
            return new[0] if len(new) == 1 else T.SeqStmt(new)

        return tvm_compat.structural_mutate(
            body, [(T.SeqStmt, on_seq), (T.BufferStore, on_store), (T.Bind, on_bind)])
