"""One time step of an ONNX ``LSTM``, ``GRU`` or ``RNN`` as Relax ops (``frontend/rnn.py``
parses the node and unrolls these steps), with the activation functions the ONNX spec lists.

A step reads ``x_t``, its slice of the input projection ``X·W^T + biases`` (computed for every
step at once), and the previous state; it emits one recurrent matmul ``h·R^T`` for all gates
(GRU without ``linear_before_reset``: two) and the pointwise gate math. Gate orders: LSTM
``iofc``, GRU ``zrh``. A step on the zero initial state skips the terms that vanish.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import tvm_compat
from ..errors import UnsupportedOpError

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
# activation (lower case) -> its parameters' defaults (alpha[, beta]). ONNX Runtime hands out
# activation_alpha / activation_beta in order, one value to each activation that takes one.
# None: the ONNX spec and ONNX Runtime disagree on the default (ThresholdedRelu: 1.0 vs 0.01,
# Affine / ScaledTanh: 1, 0 vs 0, 0), so the model has to give the value.
ACTIVATION_PARAMS = {
    "sigmoid": (), "tanh": (), "relu": (), "softsign": (), "softplus": (),
    "leakyrelu": (0.01,), "thresholdedrelu": (None,), "elu": (1.0,),
    "hardsigmoid": (0.2, 0.5), "affine": (None, None), "scaledtanh": (None, None),
}


@dataclass
class Activation:
    name: str  # a key of ACTIVATION_PARAMS
    alpha: float | None = None
    beta: float | None = None


@dataclass
class RnnNode:
    """One ONNX LSTM / GRU / RNN node: attributes parsed, weights as numpy arrays."""

    op: str
    name: str
    seq: int
    batch: int
    hidden: int
    directions: list[str]  # "forward" / "reverse", one per direction
    layout: int
    clip: float | None
    activations: list[list[Activation]]  # per direction: LSTM f, g, h; GRU f, g; RNN f
    w: np.ndarray  # [D, G*H, I]
    r: np.ndarray  # [D, G*H, H]
    b: np.ndarray  # [D, 2*G*H] (zeros when the model has no B)
    p: np.ndarray | None = None  # [D, 3H], LSTM peepholes (iof)
    input_forget: bool = False
    linear_before_reset: bool = False
    np_dtype: object = field(default=np.float32)

    def error(self, what: str) -> UnsupportedOpError:
        return UnsupportedOpError(f"{self.op} node '{self.name}': {what}",
                                  ops=[(self.op, self.name)])


class Emitter:
    """Emits one node's Relax ops, one binding each, into the importer's BlockBuilder."""

    def __init__(self, bb, node: RnnNode, dtype: str):
        self.bb, self.node, self.dtype = bb, node, dtype
        self.relax = tvm_compat.relax()
        self.op = self.relax.op

    def emit(self, expr):
        return self.bb.emit(expr)

    def const(self, value, dtype: str | None = None):
        """A constant in the model's float type, or in ``dtype``."""
        if dtype is None:
            return self.relax.const(np.asarray(value).astype(self.node.np_dtype), self.dtype)
        return self.relax.const(np.asarray(value).astype(dtype), dtype)

    def model_type(self, x):
        """``x`` cast to the model's own type: an identity in the imported graph, but amp's
        precision pass keeps the type of an explicit cast, so the ``follow`` ops reading it stay
        in fp32 after a conversion to fp16/bf16."""
        return self.emit(self.op.astype(x, self.dtype))

    def add(self, a, b):
        """a + b, where None is zero."""
        return b if a is None else a if b is None else self.emit(self.op.add(a, b))

    def mul(self, a, b):
        return self.emit(self.op.multiply(a, b))

    def sub(self, a, b):
        return self.emit(self.op.subtract(a, b))

    def matmul(self, a, b):
        return self.emit(self.op.matmul(a, b))

    def split(self, x, parts: int):
        """``x`` cut into ``parts`` equal pieces along its last axis."""
        tup = self.emit(self.op.split(x, parts, axis=-1))
        return [self.emit(self.relax.TupleGetItem(tup, i)) for i in range(parts)]

    def slice(self, x, axes, begin, end):
        return self.emit(self.op.strided_slice(x, axes, begin, end))

    def activate(self, act: Activation, x, clip: bool = True):
        """``act(x)``, x clipped to ``[-clip, clip]`` first when the node has a clip and
        ``clip`` (the gates' pre-activations; ONNX Runtime leaves LSTM's h(C_t) unclipped)."""
        op, n, a, b, em = self.op, act.name, act.alpha, act.beta, self.emit
        if clip and self.node.clip is not None:
            x = em(op.clip(x, -self.node.clip, self.node.clip))
        simple = {"sigmoid": op.sigmoid, "tanh": op.tanh, "relu": op.nn.relu}
        if n in simple:
            return em(simple[n](x))
        if n == "leakyrelu":
            return em(op.nn.leakyrelu(x, a))
        if n == "thresholdedrelu":
            return em(op.where(em(op.greater(x, self.const(a))), x, self.const(0)))
        if n == "elu":
            neg = self.mul(self.sub(em(op.exp(x)), self.const(1)), self.const(a))
            return em(op.where(em(op.less(x, self.const(0))), neg, x))
        if n == "hardsigmoid":
            return em(op.clip(self.add(self.mul(x, self.const(a)), self.const(b)), 0, 1))
        if n == "affine":
            return self.add(self.mul(x, self.const(a)), self.const(b))
        if n == "scaledtanh":
            return self.mul(em(op.tanh(self.mul(x, self.const(b)))), self.const(a))
        if n == "softsign":
            return em(op.divide(x, self.add(em(op.abs(x)), self.const(1))))
        if n == "softplus":  # max(x, 0) + log(1 + exp(-|x|)): no overflow for large x
            tail = em(op.log(self.add(em(op.exp(em(op.negative(em(op.abs(x)))))),
                                      self.const(1))))
            return self.add(em(op.nn.relu(x)), tail)
        raise self.node.error(f"activation '{n}' is not supported")


@dataclass
class Recurrent:
    """One direction's recurrent constants, made once (not once per step)."""

    rt: object = None  # R^T [H, G*H]; GRU without linear_before_reset: its z, r columns
    rt_h: object = None  # GRU without linear_before_reset: R_h^T [H, H]
    rb_h: object = None  # GRU with linear_before_reset: Rb_h [H]; None when zero
    peep: tuple = ()  # LSTM peepholes (P_i, P_o, P_f), [H] each; () when absent or zero


def recurrent_constants(em: Emitter, d: int) -> Recurrent:
    node, hid = em.node, em.node.hidden
    rt = node.r[d].T
    if node.op == "GRU" and not node.linear_before_reset:
        return Recurrent(em.const(rt[:, :2 * hid]), em.const(rt[:, 2 * hid:]))
    rec = Recurrent(em.const(rt))
    if node.op == "GRU" and node.b[d, 5 * hid:].any():
        rec.rb_h = em.const(node.b[d, 5 * hid:])
    if node.p is not None and node.p[d].any():
        rec.peep = tuple(em.const(node.p[d, k * hid:(k + 1) * hid]) for k in range(3))
    return rec


def lstm_step(em: Emitter, d: int, x_t, state, rec: Recurrent, zero: bool):
    """x_t [1,B,4H] = X_t·W^T + Wb + Rb; state (h, c), [1,B,H] each; ``zero``: the state is the
    zero initial one. Returns (h, c)."""
    node = em.node
    h, c = state
    f_act, g_act, h_act = node.activations[d]
    i, o, f, g = em.split(x_t if zero else em.add(x_t, em.matmul(h, rec.rt)), 4)
    if rec.peep and not zero:
        i = em.add(i, em.mul(c, rec.peep[0]))
        f = em.add(f, em.mul(c, rec.peep[2]))
    i = em.activate(f_act, i)
    c_new = em.mul(i, em.activate(g_act, g))
    if not zero:  # f * c vanishes on the zero state
        f = em.sub(em.const(1), i) if node.input_forget else em.activate(f_act, f)
        c_new = em.add(em.mul(f, c), c_new)
    if rec.peep:
        o = em.add(o, em.mul(c_new, rec.peep[1]))
    o = em.activate(f_act, o)
    return em.mul(o, em.activate(h_act, c_new, clip=False)), c_new


def gru_step(em: Emitter, d: int, x_t, state, rec: Recurrent, zero: bool):
    """x_t [1,B,3H] = X_t·W^T + Wb + Rb (with linear_before_reset: without Rb_h, which the
    reset gate scales); state (h,). Returns (h,)."""
    node = em.node
    (h,) = state
    f_act, g_act = node.activations[d]
    xz, xr, xh = em.split(x_t, 3)
    if zero:  # h·R^T vanishes
        z = em.activate(f_act, xz)
        if node.linear_before_reset and rec.rb_h is not None:
            xh = em.add(xh, em.mul(em.activate(f_act, xr), rec.rb_h))
        n = em.activate(g_act, xh)
        return (em.sub(n, em.mul(z, n)),)  # (1 - z) * n
    if node.linear_before_reset:
        hz, hr, hh = em.split(em.matmul(h, rec.rt), 3)
        z, r = em.activate(f_act, em.add(xz, hz)), em.activate(f_act, em.add(xr, hr))
        n = em.activate(g_act, em.add(xh, em.mul(r, em.add(hh, rec.rb_h))))
    else:
        hz, hr = em.split(em.matmul(h, rec.rt), 2)
        z, r = em.activate(f_act, em.add(xz, hz)), em.activate(f_act, em.add(xr, hr))
        n = em.activate(g_act, em.add(xh, em.matmul(em.mul(r, h), rec.rt_h)))
    return (em.add(n, em.mul(z, em.sub(h, n))),)  # (1 - z) * n + z * h


def rnn_step(em: Emitter, d: int, x_t, state, rec: Recurrent, zero: bool):
    """x_t [1,B,H] = X_t·W^T + Wb + Rb; state (h,). Returns (h,)."""
    (h,) = state
    act = em.node.activations[d][0]
    return (em.activate(act, x_t if zero else em.add(x_t, em.matmul(h, rec.rt))),)


STEPS = {"LSTM": lstm_step, "GRU": gru_step, "RNN": rnn_step}
