"""Tensor and node names an exporter may write (``onnx::/model.9/Concat_output_0``, ``a.b`` next
to ``a/b``, ``9relu``, unicode, 200 characters): amp keeps the user's names for everything the
user sees (``--exclude-node``, ``--input-shape``, ``.npz`` inputs, ONNX Runtime, reports) and
``frontend/names.py`` turns them into unique C identifiers only where code is generated.
(The CUDA source itself: tests/backends/cuda/test_cuda_safe_names.py.)
"""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("onnx")

from fixtures.hostile_names import (CONCAT, CONV, DIGIT, INPUT, LONG, MUL, NODES,  # noqa: E402
                                    OUTPUT, SHAPE, SIGMOID, hostile_model)

import amp_cli  # noqa: E402
from amp_cli import tvm_compat  # noqa: E402
from amp_cli.frontend.names import (MAX_LENGTH, NameTable, is_identifier,  # noqa: E402
                                    make_identifiers, to_identifier)
from amp_cli.ir_attrs import ONNX_NODE_PREFIX  # noqa: E402

TOL_FP16 = 1e-2  # rel L2 vs ONNX Runtime fp32, fp16 with fp32 accumulation


@pytest.fixture(scope="module")
def hostile_path(tmp_path_factory):
    import onnx

    path = tmp_path_factory.mktemp("names") / "hostile.onnx"
    onnx.save(hostile_model(), str(path))
    return path


@pytest.fixture(scope="module")
def loaded(hostile_path):
    return amp_cli.load(hostile_path)


# --------------------------------------------------------------------------- the name rules
@pytest.mark.parametrize("name,expected", [
    ("onnx::/model.9/Concat_output_0", "onnx_model_9_Concat_output_0"),
    ("onnx:/model.9/Conv", "onnx_model_9_Conv"),
    ("a.b", "a_b"), ("a/b", "a_b"), ("a-b", "a_b"),
    ("9relu", "v9relu"), ("/0", "v0"),
    ("模型/Pad", "Pad"), ("模型", "v"), ("", "v"), ("___", "v"),
    ("x__y", "x_y"),  # '__' is reserved to the C++ implementation
    ("input", "input"),
])
def test_to_identifier(name, expected):
    assert to_identifier(name) == expected
    assert is_identifier(to_identifier(name))


def test_long_names_keep_head_and_tail():
    out = to_identifier("onnx:" + LONG)
    assert len(LONG) == 200 and len(out) <= MAX_LENGTH
    assert out.startswith("onnx_model_24") and out.endswith("_Conv")
    assert is_identifier(out) and not is_identifier(LONG)


def test_is_identifier():
    assert is_identifier("lv12") and is_identifier("T_concat") and is_identifier("_x")
    for bad in ("onnx:x", "a.b", "a/b", "9x", "", "模型", "a__b", "x" * (MAX_LENGTH + 1)):
        assert not is_identifier(bad), bad


def test_collisions_stay_apart_and_map_back():
    table = NameTable(taken=["onnx_a_b"])
    names = [table.allocate(n) for n in ("onnx:a.b", "onnx:a/b", "onnx:a.b", "onnx:" + LONG,
                                         "onnx:" + LONG)]
    assert len(set(names)) == len(names) and "onnx_a_b" not in names
    assert all(is_identifier(n) for n in names)
    assert [table.original(n) for n in names] == ["onnx:a.b", "onnx:a/b", "onnx:a.b",
                                                   "onnx:" + LONG, "onnx:" + LONG]
    assert table.original("lv") == "lv"


# --------------------------------------------------------------------------- import
def test_import_keeps_the_users_names(loaded):
    assert [i.name for i in loaded.inputs] == [INPUT] and loaded.outputs == [OUTPUT]
    assert loaded.node_types == NODES
    bound = {b.var.name[len(ONNX_NODE_PREFIX):] for block in loaded.mod["main"].body.blocks
             for b in block.bindings if b.var.name.startswith(ONNX_NODE_PREFIX)}
    # exactly the ONNX names ('.' kept: BlockBuilder's name hints turned it into '_'), the
    # reflect Pad too (a call_tir its converter binds itself)
    assert bound == set(NODES), bound


def test_make_identifiers_renames_every_unsafe_name(loaded):
    mod, originals = make_identifiers(loaded.mod)
    names = tvm_compat.var_names(mod)
    assert all(is_identifier(n) for n in names), [n for n in names if not is_identifier(n)]
    assert set(originals) <= set(names)
    # a.b and a/b were two tensors and stay two; every original comes back
    back = sorted(originals.values())
    for node in (CONV, SIGMOID, MUL, DIGIT, CONCAT, LONG):
        assert ONNX_NODE_PREFIX + node in back, node
    assert len({originals[k] for k in originals if originals[k] in
                (ONNX_NODE_PREFIX + SIGMOID, ONNX_NODE_PREFIX + MUL)}) == 2
    # renaming is all it did
    tvm_compat.tvm().ir.assert_structural_equal(mod, loaded.mod, map_free_vars=True)
    again, none = make_identifiers(mod)
    assert again is mod and none == {}


def test_npz_inputs_use_the_onnx_name(tmp_path, loaded):
    from amp_cli.accuracy import load_inputs

    x = np.random.default_rng(0).standard_normal(SHAPE).astype("float32")
    np.savez(tmp_path / "in.npz", **{INPUT: x})
    feeds = load_inputs(str(tmp_path / "in.npz"), loaded.inputs)
    assert list(feeds) == [INPUT] and np.array_equal(feeds[INPUT], x)


# --------------------------------------------------------------------------- the CLI
def test_convert_with_hostile_names(cli, tmp_path):
    """llvm, fp16: ``--input-shape`` binds the hostile input's symbolic batch, ``--exclude-node``
    takes the original names (one with '.', the 200-character one), the build matches ONNX
    Runtime fp32 on random non-zero inputs and the report lists the original names."""
    import onnx

    path = tmp_path / "dynamic.onnx"
    onnx.save(hostile_model(batch="batch.size"), str(path))
    out = tmp_path / "out"
    res = cli("convert", path, "-o", out, "--target", "llvm",
              "--input-shape", f"{INPUT}:2x{SHAPE[1]}x{SHAPE[2]}x{SHAPE[3]}",
              "--exclude-node", SIGMOID, "--exclude-node", LONG)
    assert res.exit_code == 0, res.output
    report = json.loads((out / "report.json").read_text())
    assert report["model"]["inputs"] == [{"name": INPUT, "shape": [2, *SHAPE[1:]],
                                          "dtype": "float32"}]
    kept = {(k["node"], k["reason"]) for k in report["precision"]["kept_fp32"]}
    assert (SIGMOID, "excluded-node") in kept and (LONG, "excluded-node") in kept, kept
    assert {k["node"] for k in report["precision"]["kept_fp32"]} <= set(NODES)
    assert not any("names no node" in n for n in report.get("notes", [])), report.get("notes")
    worst = report["accuracy"]["worst"]
    assert worst["nonfinite_share"] == 0 and worst["rel_l2"] < TOL_FP16, worst
    assert report["accuracy"]["outputs"][0]["output"] == OUTPUT
    md = (out / "report.md").read_text()
    assert SIGMOID in md and LONG in md


def test_torch_export_names(tmp_path):
    """torch.export names placeholders and nodes as ASCII Python identifiers itself (a unicode
    argument becomes '__'); whatever reaches Relax, make_identifiers leaves only identifiers."""
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, 图像, x_1):  # a non-ASCII name on purpose
            return torch.relu(self.conv(图像)) + x_1

    args = (torch.randn(1, 8, 6, 6), torch.randn(1, 8, 6, 6))
    torch.export.save(torch.export.export(Net(), args), str(tmp_path / "net.pt2"))
    loaded = amp_cli.load(tmp_path / "net.pt2")
    assert [i.name for i in loaded.inputs] == ["__", "x_1"]  # torch.export's own names
    mod, originals = make_identifiers(loaded.mod)
    assert all(is_identifier(n) for n in tvm_compat.var_names(mod))
    assert set(originals.values()) == {"__"}
