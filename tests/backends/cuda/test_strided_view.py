"""strided_view: the element strides a chain of permute_dims / reshape / strided_slice / scalar
multiplies reads from its source, checked against numpy (which copies exactly when no single
strided view exists) and against the chain itself compiled and run by TVM on the CPU."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from amp_cli.backends.cuda.rewrites import strided_view as sv  # noqa: E402

relax = tvm.relax


def _numpy_view_strides(base_shape, perm, new_shape):
    """numpy's answer: the element strides of ``transpose(perm).reshape(new_shape)`` when that
    is a view (assigning .shape raises when a copy would be needed), else None."""
    v = np.arange(int(np.prod(base_shape))).reshape(base_shape).transpose(perm)
    r = v.view()
    try:
        r.shape = new_shape
    except AttributeError:
        return None
    return r


@pytest.mark.parametrize("base", [(2, 3, 4, 5), (1, 4, 3, 8), (2, 1, 6, 4), (3, 4, 1, 2)])
def test_reshape_is_a_view_exactly_when_numpy_says_so(base):
    flat = np.arange(int(np.prod(base)))
    for perm in itertools.permutations(range(4)):
        s = [base[p] for p in perm]
        strides = [sv.contiguous_strides(base)[p] for p in perm]
        for new in [(int(np.prod(s)),), (s[0] * s[1], s[2], s[3]), (s[0], s[1] * s[2], s[3]),
                    (s[0], s[1], s[2] * s[3]), (s[0] * s[1], s[2] * s[3]), (1, *s),
                    (*s, 1), (s[0], 1, s[1], s[2], s[3])]:
            got = sv._reshape(s, strides, new)
            want = _numpy_view_strides(base, perm, new)
            assert (got is None) == (want is None), (base, perm, new, got)
            if got is not None:
                idx = np.indices(new).reshape(len(new), -1).T
                np.testing.assert_array_equal(flat[idx @ np.array(got)], want.reshape(-1))


def _chains():
    """(input shape, builder, factor): the layout chains exporters write around attention;
    a builder emits each op through ``e``."""
    def heads(e, x):      # [B, S, H*D] -> [B, H, S, D]
        return e(relax.op.permute_dims(e(relax.op.reshape(x, (2, 8, 3, 16))), [0, 2, 1, 3]))

    def dynamo_kt(e, x):  # [B,S,H,D] -> [B,H,S,D] -> [B*H,S,D] -> [B*H,D,S] -> [B,H,D,S]
        t = e(relax.op.reshape(e(relax.op.permute_dims(x, [0, 2, 1, 3])), (6, 8, 16)))
        return e(relax.op.reshape(e(relax.op.permute_dims(t, [0, 2, 1])), (2, 3, 16, 8)))

    def packed_k(e, x):   # K: columns 48..96 of a combined [B, S, 3*H*D] projection, scaled
        t = e(relax.op.strided_slice(x, [2], [48], [96]))
        t = e(relax.op.permute_dims(e(relax.op.reshape(t, (2, 8, 3, 16))), [0, 2, 3, 1]))
        return e(relax.op.multiply(t, relax.const(0.5, "float32")))

    def split_v(e, x):    # V: the third of split(qkv, 3) (the legacy exporter's c_attn split)
        t = e(relax.TupleGetItem(e(relax.op.split(x, 3, axis=-1)), 2))
        return e(relax.op.permute_dims(e(relax.op.reshape(t, (2, 8, 3, 16))), [0, 2, 1, 3]))

    def split_at(e, x):   # split at indices: [0, 40), [40, 88), [88, 144)
        t = e(relax.TupleGetItem(e(relax.op.split(x, [40, 88], axis=2)), 1))
        return e(relax.op.permute_dims(t, [0, 2, 1]))

    def mha_select(e, x):  # torch MultiheadAttention's packed in-projection [S, B, 3E] -> k
        t = e(relax.op.expand_dims(e(relax.op.reshape(x, (8, 2, 3, 48))), [0]))
        t = e(relax.op.squeeze(e(relax.op.permute_dims(t, [3, 1, 2, 0, 4])), [-2]))
        t = e(relax.op.take(t, relax.const(1, "int64"), axis=0))            # proj[1]
        t = e(relax.op.permute_dims(e(relax.op.reshape(t, (8, 6, 16))), [1, 0, 2]))
        return e(relax.op.reshape(t, (2, 3, 8, 16)))                      # [B, H, S, D]

    def take_keep(e, x):   # a [1] index keeps its axis; squeeze() drops every size-1 axis
        t = e(relax.op.take(x, relax.const(np.array([5], "int64")), axis=1))
        return e(relax.op.squeeze(e(relax.op.expand_dims(t, [-1])), None))

    return [((2, 8, 48), heads, 1.0), ((2, 8, 3, 16), dynamo_kt, 1.0),
            ((2, 8, 144), packed_k, 0.5), ((2, 8, 144), split_v, 1.0),
            ((2, 8, 144), split_at, 1.0), ((8, 2, 144), mha_select, 1.0),
            ((2, 8, 144), take_keep, 1.0)]


@pytest.mark.parametrize("shape,make,factor", _chains(),
                         ids=["heads", "dynamo_kt", "packed_k", "split_v", "split_at",
                              "mha_select", "take_keep"])
def test_views_read_what_the_chain_computes(shape, make, factor):
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            expr = make(bb.emit, x)
            gv = bb.emit_output(expr)
        bb.emit_func_output(gv)
    mod = bb.get()
    bound = {b.var: b.value for blk in mod["main"].body.blocks for b in blk.bindings}
    found = sv.views(expr, bound.get)
    deepest = found[0]
    assert deepest.source.same_as(x), found          # read in place from the input
    assert deepest.factor == factor
    data = np.random.default_rng(0).standard_normal(shape).astype("float32") + 3.0
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    want = vm["main"](tvm.runtime.tensor(data)).numpy()
    idx = np.indices(deepest.shape).reshape(len(deepest.shape), -1).T
    got = data.reshape(-1)[deepest.offset + idx @ np.array(deepest.strides)] * deepest.factor
    np.testing.assert_allclose(got, want.reshape(-1), rtol=1e-6)
