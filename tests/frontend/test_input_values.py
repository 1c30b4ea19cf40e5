"""Integer inputs get valid random values (amp_cli/frontend/input_values.py): token ids below
the embedding table's rows, attention masks as 0/1 padding masks -- read off the graph, never
off the input's name."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

import amp_cli
from amp_cli.accuracy import random_inputs
from amp_cli.models import GraphBuilder


def bert_like_inputs():
    b = GraphBuilder(seed=0)
    emb = b.op("Gather", [b.weight(50, 8), "ids"], axis=0)              # [2, 6, 8]
    typ = b.op("Gather", [b.weight(2, 8), b.op("Unsqueeze", ["types", b.const(
        np.array([0], np.int64), "ax")])], axis=0)                      # [1, 2, 6, 8]
    keep = b.op("Cast", [b.op("Unsqueeze", ["keep", b.const(np.array([1], np.int64), "ax")])],
                to=TensorProto.FLOAT)                                   # [2, 1, 6]
    bias = b.op("Mul", [b.op("Sub", [b.const(np.float32(1), "one"), keep]),
                        b.const(np.float32(-1e4), "neg")])
    scores = b.op("MatMul", [emb, b.op("Transpose", [emb], perm=[0, 2, 1])])  # [2, 6, 6]
    y = b.op("Add", [b.op("Softmax", [b.op("Add", [scores, bias])], axis=-1),
                     b.op("ReduceMean", [typ], keepdims=0, axes=[0, 1, 3])])
    # an int input of unknown use (added to a float after a float cast of a Shape-like value)
    z = b.op("Cast", [b.op("Add", ["count", b.const(np.int64(1), "one_i")])], to=TensorProto.INT32)
    return b.model([("ids", [2, 6], "int64"), ("types", [2, 6], "int64"),
                    ("keep", [2, 6], "int64"), ("count", [2], "int64")],
                   [(y, [2, 6, 6], "float32"), (z, [2], "int32")])


def test_int_inputs_get_their_graph_ranges(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(bert_like_inputs(), str(path))
    model = amp_cli.load(path)
    values = {s.name: s.values for s in model.inputs}
    assert values == {"ids": ("index", 50), "types": ("index", 2), "keep": ("mask",),
                      "count": None}
    for seed in range(3):
        feeds = random_inputs(model.inputs, seed)
        assert feeds["ids"].min() >= 0 and feeds["ids"].max() < 50
        assert set(np.unique(feeds["types"])) <= {0, 1}
        keep = feeds["keep"]
        assert set(np.unique(keep)) <= {0, 1} and (keep[:, 0] == 1).all()
        assert (np.diff(keep, axis=-1) <= 0).all()  # ones, then zeros
        ref = model.reference(feeds)
        assert np.isfinite(ref[0]).all()
