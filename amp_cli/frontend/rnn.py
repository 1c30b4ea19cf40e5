"""ONNX ``LSTM``, ``GRU`` and ``RNN``, which TVM's ONNX importer lacks, as Relax ops:
``CONVERTERS`` maps each op type to ``fn(bb, inputs, attrs, opset) -> Relax expr``, registered
with the importer by ``tvm_compat.onnx_extra_converters`` (``frontend/onnx.py``).

The recurrence is unrolled over the static sequence length (a symbolic one is refused until
dynamic shapes land); ``rnn_cells.py`` emits each step. ONNX semantics, checked against ONNX
Runtime (tests/frontend/test_rnn.py): directions forward / reverse / bidirectional, ``layout`` 0
and 1, the optional inputs ``B``, ``sequence_lens``, ``initial_h``, ``initial_c`` and ``P``
(peepholes), ``clip``, ``input_forget``, ``linear_before_reset``, the spec's activations with
``activation_alpha`` / ``activation_beta``, and the outputs Y, Y_h, Y_c. The weights must be
constants (they are folded into the matmul operands at import time).

Precision. The input projection ``X·W^T + Wb + Rb`` of every step and direction is one matmul
before the loop; each step adds one recurrent matmul ``h·R^T`` for all gates. Both run in
fp16/bf16 with fp32 accumulation under amp's default policy. Each step reads its slice of the
projection through an explicit cast to the model's type (an identity in the imported graph),
which the precision pass keeps, so the step's pointwise math -- gates, cell and hidden state --
runs in fp32, as in cuDNN's half-precision RNNs. Rounding the gates and the state to the low
type at every step makes long-memory recurrences drift: an LSTM of hidden size 64 whose forget
gate sits near 1 (bias +5), 300 steps, vs ONNX Runtime fp32 (llvm): rel L2 7.5e-3 in fp16 and
1.9e-2 in bf16 with low-precision pointwise math (last step 1.5e-2 / 3.0e-2), 2.0e-3 / 8.0e-3
with it in fp32 (last step 2.3e-3 / 1.2e-2); short sequences gain less (2-layer bidirectional
LSTM, 5 steps: fp16 1.2e-3 -> 3e-4).

``sequence_lens``: past a sequence's length Y is zero and the state stays, so Y_h / Y_c hold the
state at its last valid step (zero for an empty sequence, as in ONNX Runtime); the reverse
direction starts at each sequence's own end: its projection is reversed within each length by a
gather before the loop and its Y is gathered back after it.
"""
from __future__ import annotations

import numpy as np

from .. import tvm_compat
from ..errors import UnsupportedOpError
from .rnn_cells import (ACTIVATION_PARAMS, GATES, STEPS, Activation, Emitter, RnnNode,
                        recurrent_constants)

DEFAULT_ACTIVATIONS = {"LSTM": ("Sigmoid", "Tanh", "Tanh"), "GRU": ("Sigmoid", "Tanh"),
                       "RNN": ("Tanh",)}
DIRECTIONS = {"forward": ["forward"], "reverse": ["reverse"],
              "bidirectional": ["forward", "reverse"]}


# --- the node's attributes and constants ------------------------------------------------
def refuse(op: str, name: str, what: str) -> UnsupportedOpError:
    return UnsupportedOpError(f"{op} node '{name}': {what}", ops=[(op, name)])


def _text(value, default: str) -> str:
    if value is None:
        return default
    return value.decode() if isinstance(value, bytes) else str(value)


def _constant(op: str, name: str, what: str, expr, shape: tuple | None = None):
    if expr is None:
        return None
    value = tvm_compat.constant_value(expr)
    if value is None:
        raise refuse(op, name, f"input {what} must be a constant (an initializer): amp folds "
                               f"the weights into the matmuls at import time")
    if shape is not None and value.shape != shape:
        raise refuse(op, name, f"input {what} has shape {list(value.shape)}, expected "
                               f"{list(shape)}")
    return value


def _static_shape(op: str, name: str, expr) -> list[int]:
    dims = []
    for i, d in enumerate(expr.ty.shape):
        try:
            dims.append(int(d))
        except TypeError:
            raise refuse(op, name, f"dim {i} of X ('{d}') is symbolic; amp unrolls recurrences "
                                   f"over static shapes until dynamic shapes land: bind it with "
                                   f"--input-shape") from None
    return dims


def _activations(op: str, name: str, attrs: dict, ndir: int) -> list[list[Activation]]:
    per_dir = len(DEFAULT_ACTIVATIONS[op])
    names = [_text(a, "") for a in attrs.get("activations", ())] or \
        list(DEFAULT_ACTIVATIONS[op]) * ndir
    if len(names) != per_dir * ndir:
        raise refuse(op, name, f"{len(names)} activations given, expected {per_dir * ndir} "
                               f"({per_dir} per direction)")
    given = [list(attrs.get("activation_alpha", ())), list(attrs.get("activation_beta", ()))]
    acts = []
    for raw in names:
        key = raw.lower()
        if key not in ACTIVATION_PARAMS:
            raise refuse(op, name, f"activation '{raw}' is not supported (amp supports "
                                   f"{', '.join(sorted(ACTIVATION_PARAMS))})")
        values = []
        for k, default in enumerate(ACTIVATION_PARAMS[key]):
            value = float(given[k].pop(0)) if given[k] else default
            if value is None:
                which = ("activation_alpha", "activation_beta")[k]
                raise refuse(op, name, f"activation '{raw}' needs an explicit {which} (ONNX "
                                       f"Runtime's default differs from the ONNX spec's)")
            values.append(value)
        acts.append(Activation(key, *values))
    return [acts[d * per_dir:(d + 1) * per_dir] for d in range(ndir)]


def parse_node(op: str, inputs, attrs: dict) -> RnnNode:
    name = (attrs.get("tvm_custom") or {}).get("name") or op
    direction = _text(attrs.get("direction"), "forward")
    if direction not in DIRECTIONS:
        raise refuse(op, name, f"unknown direction '{direction}'")
    layout = int(attrs.get("layout", 0))
    if layout not in (0, 1):
        raise refuse(op, name, f"layout {layout} is neither 0 nor 1")
    shape = _static_shape(op, name, inputs[0])
    seq, batch = (shape[0], shape[1]) if layout == 0 else (shape[1], shape[0])
    dirs = DIRECTIONS[direction]
    ndir, gates = len(dirs), GATES[op]
    r = _constant(op, name, "R", inputs[2])
    hidden = int(attrs.get("hidden_size", r.shape[-1]))
    gh = gates * hidden
    if r.shape != (ndir, gh, hidden):
        raise refuse(op, name, f"input R has shape {list(r.shape)}, expected "
                               f"{[ndir, gh, hidden]}")
    w = _constant(op, name, "W", inputs[1], (ndir, gh, shape[2]))
    b = _constant(op, name, "B", inputs[3], (ndir, 2 * gh))
    p = _constant(op, name, "P", inputs[7], (ndir, 3 * hidden)) if op == "LSTM" else None
    clip = attrs.get("clip")
    return RnnNode(op, name, seq, batch, hidden, dirs, layout,
                   None if clip is None else float(clip), _activations(op, name, attrs, ndir),
                   w, r, np.zeros((ndir, 2 * gh), w.dtype) if b is None else b, p,
                   input_forget=bool(attrs.get("input_forget", 0)),
                   linear_before_reset=bool(attrs.get("linear_before_reset", 0)),
                   np_dtype=w.dtype)


# --- sequence lengths -------------------------------------------------------------------
class Lengths:
    """``sequence_lens``: absent or all full (no masking), a constant, or a runtime tensor (then
    its values are clamped to [0, seq]). Gives the per-step mask and the reverse direction's
    within-length reversal."""

    def __init__(self, em: Emitter, expr):
        node, op = em.node, em.op
        self.em, self.masked, self.values, self.index = em, False, None, None
        if expr is None:
            return
        seq, batch = node.seq, node.batch
        value = tvm_compat.constant_value(expr)
        if value is not None:
            value = value.astype(np.int64).reshape(-1)
            if value.shape != (batch,) or (value < 0).any() or (value > seq).any():
                raise node.error(f"sequence_lens {value.tolist()} does not fit batch {batch} "
                                 f"and sequence length {seq}")
            self.masked, self.values = bool((value != seq).any()), value
            return
        self.masked = True
        i64 = "int64"
        lens = em.emit(op.reshape(em.emit(op.astype(expr, i64)), (1, batch)))
        lens = em.emit(op.minimum(em.emit(op.maximum(lens, em.const(0, i64))),
                                  em.const(seq, i64)))
        steps = em.const(np.arange(seq).reshape(seq, 1), i64)
        running = em.emit(op.less(steps, lens))  # [T, B]
        self.running = em.emit(op.reshape(running, (seq, batch, 1)))
        self.runtime = (steps, lens, running)

    def mask(self, k: int):
        """[1, B, 1] bool: the sequences still running at processing step k."""
        if self.values is not None:
            return self.em.const((k < self.values).reshape(1, -1, 1), "bool")
        return self.em.slice(self.running, [0], [k], [k + 1])

    def any_empty(self) -> bool:
        return self.masked and (self.values is None or not self.values.all())

    def reverse_index(self):
        """[T*B] int64: row t*B+b of the sequences reversed within their lengths (steps past a
        length stay in place). An involution: the same gather maps the outputs back."""
        if self.index is not None:
            return self.index
        em, op = self.em, self.em.op
        seq, batch = em.node.seq, em.node.batch
        if self.values is not None:
            t = np.arange(seq).reshape(seq, 1)
            rows = np.where(t < self.values, self.values - 1 - t, t)
            self.index = em.const((rows * batch + np.arange(batch)).reshape(-1), "int64")
            return self.index
        steps, lens, running = self.runtime
        back = em.sub(em.sub(lens, em.const(1, "int64")), steps)
        rows = em.emit(op.where(running, back, steps))
        rows = em.add(em.mul(rows, em.const(batch, "int64")),
                      em.const(np.arange(batch).reshape(1, batch), "int64"))
        self.index = em.emit(op.reshape(rows, (seq * batch,)))
        return self.index


# --- unrolling ----------------------------------------------------------------------------
def input_bias(node: RnnNode) -> np.ndarray:
    """[D, G*H]: the biases added to X·W^T (all but Rb_h of a linear_before_reset GRU)."""
    gh = GATES[node.op] * node.hidden
    bias = node.b[:, :gh] + node.b[:, gh:]
    if node.op == "GRU" and node.linear_before_reset:
        bias[:, 2 * node.hidden:] = node.b[:, 2 * node.hidden:gh]
    return bias


def initial_states(em: Emitter, d: int, inputs) -> tuple[list, bool]:
    """Direction d's initial states, [1,B,H] each, and whether they are all zero."""
    node = em.node
    shape = (1, node.batch, node.hidden)
    given = [inputs[5]] + ([inputs[6]] if node.op == "LSTM" else [])
    states, zero = [], True
    for expr in given:
        value = tvm_compat.constant_value(expr) if expr is not None else None
        if expr is None or (value is not None and not value.any()):
            states.append(em.const(np.zeros(shape)))
            continue
        zero = False
        s = em.slice(expr, [node.layout], [d], [d + 1])
        states.append(s if node.layout == 0 else em.emit(em.op.permute_dims(s, [1, 0, 2])))
    return states, zero


def gather_rows(em: Emitter, x, index, width: int):
    """[T, B, width] with its T*B rows permuted by ``index``."""
    seq, batch = em.node.seq, em.node.batch
    flat = em.emit(em.op.reshape(x, (seq * batch, width)))
    return em.emit(em.op.reshape(em.emit(em.op.take(flat, index, axis=0)), (seq, batch, width)))


def unroll_direction(em: Emitter, d: int, proj, lengths: Lengths, inputs):
    """Y_d [T,B,H] and the final states of direction d; ``proj``: [T,B,D*G*H]."""
    node, op = em.node, em.op
    seq, gh = node.seq, GATES[node.op] * node.hidden
    reverse = node.directions[d] == "reverse"
    gather = reverse and lengths.masked
    src, lo = proj, d * gh
    if gather:  # run the sequences reversed within their own lengths, forwards
        if len(node.directions) > 1:
            src = em.slice(proj, [2], [lo], [lo + gh])
        src, lo = gather_rows(em, src, lengths.reverse_index(), gh), 0
    order = list(range(seq))[::-1] if reverse and not gather else list(range(seq))
    whole = src is proj and len(node.directions) == 1  # no slicing along the gates
    rec = recurrent_constants(em, d)
    state, zero = initial_states(em, d, inputs)
    step = STEPS[node.op]
    outs = {}
    for k, t in enumerate(order):
        x_t = em.slice(src, [0], [t], [t + 1]) if whole or gather else \
            em.slice(src, [0, 2], [t, lo], [t + 1, lo + gh])
        # The step's pointwise math reads x_t through a cast to the model's type, so it stays
        # in fp32 after amp's precision pass and only the matmuls run low (module docstring).
        new = step(em, d, em.model_type(x_t), state, rec, zero)
        if lengths.masked:  # finished sequences: zeros in Y, the state kept
            running = lengths.mask(k)
            outs[t] = em.emit(op.where(running, new[0], em.const(0)))
            new = tuple(em.emit(op.where(running, n, s)) for n, s in zip(new, state))
        else:
            outs[t] = new[0]
        state, zero = tuple(new), False
    y = em.emit(op.concat([outs[t] for t in range(seq)], axis=0))
    if gather:
        y = gather_rows(em, y, lengths.reverse_index(), node.hidden)
    if lengths.any_empty():  # an empty sequence ends in zero states, as in ONNX Runtime
        running = lengths.mask(0)
        state = tuple(em.emit(op.where(running, s, em.const(0))) for s in state)
    return y, state


def convert_node(op_type: str, bb, inputs, attrs: dict):
    """The node's outputs (Y, Y_h[, Y_c], as many as it names) as a Relax tuple, or Y alone."""
    node = parse_node(op_type, inputs, attrs)
    x = inputs[0]
    em = Emitter(bb, node, str(x.ty.dtype))
    op = em.op
    if node.layout == 1:
        x = em.emit(op.permute_dims(x, [1, 0, 2]))
    lengths = Lengths(em, inputs[4])
    ndir = len(node.directions)
    wt = np.concatenate([node.w[d].T for d in range(ndir)], axis=1)  # [I, D*G*H]
    proj = em.add(em.matmul(x, em.const(wt)), em.const(input_bias(node).reshape(-1)))
    ys, finals = [], []
    for d in range(ndir):
        y, state = unroll_direction(em, d, proj, lengths, inputs)
        ys.append(y)
        finals.append(state)
    shape = (node.seq, 1, node.batch, node.hidden)
    y = op.stack(ys, axis=1) if ndir > 1 else op.reshape(ys[0], shape)
    if node.layout == 1:
        y = op.permute_dims(em.emit(y), [2, 0, 1, 3])
    wanted = int((attrs.get("tvm_custom") or {}).get("num_outputs", 1))
    if wanted <= 1:  # returned unbound: the importer binds it, named after the node
        return y
    outputs = [em.emit(y)]
    for k in range(len(finals[0])):
        states = [s[k] for s in finals]
        state = em.emit(op.concat(states, axis=0)) if ndir > 1 else states[0]
        outputs.append(em.emit(op.permute_dims(state, [1, 0, 2])) if node.layout == 1 else state)
    return em.relax.Tuple(outputs[:wanted])


def convert_lstm(bb, inputs, attrs: dict, opset: int):
    return convert_node("LSTM", bb, inputs, attrs)


def convert_gru(bb, inputs, attrs: dict, opset: int):
    return convert_node("GRU", bb, inputs, attrs)


def convert_rnn(bb, inputs, attrs: dict, opset: int):
    return convert_node("RNN", bb, inputs, attrs)


CONVERTERS = {"LSTM": convert_lstm, "GRU": convert_gru, "RNN": convert_rnn}
