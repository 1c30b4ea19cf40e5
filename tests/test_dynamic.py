"""Dynamic shapes (issue 22, docs/dynamic-shapes.md): ranges on the command line and in YAML,
one library for every shape in the ranges that rejects the others with a Python exception
naming them, accuracy at the min / optimum / max, `amp bench` at a chosen shape, the tuning
tasks at the optimum, and CUDA code generation.

Models: ``models.dynamic_bert`` (token ids + padding mask, dims ``batch`` and ``sequence``) and
``models.tiny_cnn`` (dim ``batch``), both fp16, checked against ONNX Runtime fp32 at
rel L2 <= 5e-3 and max abs <= 2e-2 (measured: BERT-like <= 6.5e-4 / 2.4e-3 over the shapes
below, CNN <= 1e-3 / 1e-3).
"""
from __future__ import annotations

import json
import math

import numpy as np
import onnx
import pytest

import amp_cli
from amp_cli import models, tvm_compat
from amp_cli.accuracy import metrics, random_inputs
from amp_cli.config import ConvertConfig, DimRange, apply_yaml, parse_dim, parse_input_shape
from amp_cli.errors import ConfigError, InputError

REL_L2, MAX_ABS = 5e-3, 2e-2
BERT_SHAPE = "input_ids:1..4(2)x8..48(16)"
BERT_SHAPES = [(1, 8), (2, 16), (3, 29), (4, 48), (1, 48), (4, 8), (2, 33)]  # (batch, sequence)


@pytest.fixture(scope="module")
def bert_onnx(tmp_path_factory):
    path = tmp_path_factory.mktemp("dyn") / "dynamic_bert.onnx"
    onnx.save(models.dynamic_bert(), str(path))
    return path


@pytest.fixture(scope="module")
def bert_llvm(bert_onnx, tmp_path_factory):
    """dynamic_bert converted once for llvm with batch 1..4 (optimum 2) and sequence 8..48
    (optimum 16): (OUTDIR, the loaded model)."""
    model = amp_cli.load(bert_onnx, input_shapes={"input_ids": ["1..4(2)", "8..48(16)"]})
    conv = amp_cli.convert(model, ConvertConfig(target="llvm"))
    out = tmp_path_factory.mktemp("dyn") / "bert_llvm"
    conv.save(out)
    conv.cleanup()
    return out, model


def _vm(outdir):
    from amp_cli import tvm_compat

    dev = tvm_compat.cpu_device()
    return tvm_compat.relax_vm(tvm_compat.load_module(str(outdir / "model.so")), dev), dev


# --- syntax: CLI and YAML ----------------------------------------------------------------------

def test_parse_ranges():
    assert parse_dim("1..32(8)", "d") == DimRange(1, 32, 8)
    assert parse_dim("1..32@8", "d") == DimRange(1, 32, 8)
    assert parse_dim("16..512", "d") == DimRange(16, 512) and DimRange(16, 512).optimum == 512
    assert parse_dim(" 7 ", "d") == 7
    assert str(DimRange(1, 32, 8)) == "1..32(8)" and DimRange(1, 32, 8).points() == [1, 8, 32]
    assert parse_input_shape("ids:1..32(8)x128") == ("ids", [DimRange(1, 32, 8), 128])
    for bad, why in [("0..4", "1 <= LO <= HI"), ("5..4", "1 <= LO <= HI"),
                     ("1..4(5)", "outside the range"), ("1..", "neither"), ("a..b", "neither"),
                     ("1-4", "neither")]:
        with pytest.raises(ConfigError, match=why.replace("(", r"\(")):
            parse_dim(bad, "d")


def test_yaml_ranges_strict(tmp_path):
    cfg = apply_yaml(ConvertConfig(), {"input_shapes": {"ids": ["1..32(8)", 128],
                                                         "mask": "1..32(8)x128"},
                                        "dynamic": {"dims": {"batch": "1..32@8"},
                                                    "specialize_optimum": False}}, "c.yaml")
    assert cfg.input_shapes == {"ids": ["1..32(8)", 128], "mask": ["1..32(8)", 128]}
    assert cfg.dynamic.dims == {"batch": "1..32(8)"} and cfg.dynamic.specialize_optimum is False
    with pytest.raises(ConfigError, match="dynamic.specialize_optimum: expected bool, got str"):
        apply_yaml(ConvertConfig(), {"dynamic": {"specialize_optimum": "yes"}}, "c.yaml")
    with pytest.raises(ConfigError, match=r"c.yaml: input_shapes.ids\[0\]: range 9..2"):
        apply_yaml(ConvertConfig(), {"input_shapes": {"ids": ["9..2", 128]}}, "c.yaml")
    with pytest.raises(ConfigError, match="unknown key 'dynamic.dimz'; did you mean 'dims'"):
        apply_yaml(ConvertConfig(), {"dynamic": {"dimz": {}}}, "c.yaml")


def test_optimum_copy_only_where_the_symbolic_kernels_need_it():
    """Unset, the static copy at the optimum is built for llvm (its symbolic GEMMs and
    attention lag a static build's) and for tuning records (they apply to static kernels), not
    for CUDA, whose symbolic kernels take the static build's tiles at the optimum; set, it is
    what the config says."""
    from amp_cli.config import DynamicConfig

    auto = DynamicConfig()
    assert auto.specialize_optimum is None
    assert auto.optimum_copy(cuda_target=False, tuning_db=None)
    assert not auto.optimum_copy(cuda_target=True, tuning_db=None)
    assert auto.optimum_copy(cuda_target=True, tuning_db="db")
    for value in (True, False):
        cfg = DynamicConfig(specialize_optimum=value)
        assert {cfg.optimum_copy(c, t) for c in (True, False) for t in (None, "db")} == {value}


def test_cli_bad_range_is_a_usage_error(cli, bert_onnx, tmp_path):
    for args in (["--input-shape", "input_ids:1..4(9)x8"], ["--dynamic", "batch"],
                 ["--dynamic", "batch=3..1"]):
        res = cli("convert", bert_onnx, "-o", tmp_path / "o", "--target", "llvm", *args)
        assert res.exit_code == 2, res.output
        assert res.stderr.startswith("amp: error: ") and "e.g." in res.stderr


def test_binding_errors(bert_onnx, tiny_onnx):
    with pytest.raises(InputError, match="dim 'batch' is given two sizes: 1..4 .* and 1..8"):
        amp_cli.load(bert_onnx, input_shapes={"input_ids": ["1..4", "8..48"],
                                              "attention_mask": ["1..8", "8..48"]})
    with pytest.raises(InputError, match="--dynamic names 'btch'.* batch, sequence"):
        amp_cli.load(bert_onnx, dims={"btch": "1..4"})
    with pytest.raises(InputError, match="a range 1..4 for dim 1, which the model fixes at 3"):
        amp_cli.load(tiny_onnx, input_shapes={"input": ["1..4", "1..4", 32, 32]})
    with pytest.raises(InputError, match="symbolic input dims must be bound: .*sequence"):
        amp_cli.load(bert_onnx, dims={"batch": "1..4"})


def test_named_dims_bind_every_input(bert_onnx):
    m = amp_cli.load(bert_onnx, dims={"batch": "1..4(2)", "sequence": 16})
    assert [s.shape for s in m.inputs] == [["batch", 16], ["batch", 16]]
    assert m.dynamic == {"batch": DimRange(1, 4, 2)}
    static = amp_cli.load(bert_onnx, input_shapes={"input_ids": [2, 16]})  # propagates by name
    assert [s.shape for s in static.inputs] == [[2, 16], [2, 16]] and not static.dynamic


# --- one library for every shape in the ranges ----------------------------------------------

def test_bert_llvm_runs_every_shape_in_range(bert_llvm):
    out, model = bert_llvm
    report = json.loads((out / "report.json").read_text())
    points = report["accuracy"]["points"]
    assert [p["dims"] for p in points] == [{"batch": 1, "sequence": 8},
                                           {"batch": 2, "sequence": 16},
                                           {"batch": 4, "sequence": 48}]
    assert all(p["worst"]["rel_l2"] <= REL_L2 for p in points)
    assert report["model"]["dynamic"] == {"batch": "1..4(2)", "sequence": "8..48(16)"}
    variants = report["build"]["variants"]  # the optimum copy's kernels are static ones
    assert variants["main_optimum"] and variants["main_dynamic"]
    assert not set(variants["main_optimum"]) & set(variants["main_dynamic"])
    assert "`main_optimum` (every dim at its optimum" in (out / "report.md").read_text()
    vm, dev = _vm(out)
    from amp_cli import tvm_compat

    assert json.loads(str(vm["amp_input_ranges"]())) == {
        "batch": {"min": 1, "max": 4, "opt": 2}, "sequence": {"min": 8, "max": 48, "opt": 16}}
    for k, (batch, seq) in enumerate(BERT_SHAPES):
        feeds = random_inputs(model.inputs_at({"batch": batch, "sequence": seq}), seed=k)
        ref = model.reference(feeds)[0]
        got = vm["main"](*[tvm_compat.to_tvm_tensor(feeds[s.name], dev)
                           for s in model.inputs]).numpy()
        m = metrics(ref, got)
        assert got.shape == (batch, seq, 64)
        assert m["rel_l2"] <= REL_L2 and m["max_abs"] <= MAX_ABS, (batch, seq, m)


@pytest.mark.parametrize("batch,seq", [(5, 8), (1, 7), (4, 49), (1, 1000)])
def test_out_of_range_is_a_python_exception_naming_the_ranges(bert_llvm, batch, seq):
    from amp_cli import tvm_compat

    vm, dev = _vm(bert_llvm[0])
    ids = tvm_compat.to_tvm_tensor(np.zeros((batch, seq), "int64"), dev)
    with pytest.raises(AssertionError, match=r"batch=\d+, sequence=\d+; allowed: batch 1..4, "
                                             r"sequence 8..48"):
        vm["main"](ids, ids)


def test_inputs_that_disagree_are_an_exception(bert_llvm):
    from amp_cli import tvm_compat

    vm, dev = _vm(bert_llvm[0])
    a = tvm_compat.to_tvm_tensor(np.zeros((2, 8), "int64"), dev)
    b = tvm_compat.to_tvm_tensor(np.zeros((3, 8), "int64"), dev)
    with pytest.raises(Exception, match="attention_mask"):
        vm["main"](a, b)


def test_cnn_dynamic_batch_cli(cli, tiny_onnx, tmp_path):
    out = tmp_path / "cnn"
    res = cli("convert", tiny_onnx, "-o", out, "--target", "llvm", "--dynamic", "batch=1..8@4")
    assert res.exit_code == 0, res.output
    report = json.loads((out / "report.json").read_text())
    assert [p["dims"]["batch"] for p in report["accuracy"]["points"]] == [1, 4, 8]
    assert "batch=1 | input 1x3x32x32" in (out / "report.md").read_text()
    model = amp_cli.load(tiny_onnx, dims={"batch": "1..8(4)"})
    vm, dev = _vm(out)
    from amp_cli import tvm_compat

    for batch in (1, 2, 3, 4, 5, 8):
        x = random_inputs(model.inputs_at({"batch": batch}), seed=batch)
        got = vm["main"](tvm_compat.to_tvm_tensor(x["input"], dev)).numpy()
        m = metrics(model.reference(x)[0], got)
        assert m["rel_l2"] <= REL_L2 and m["max_abs"] <= MAX_ABS, (batch, m)
    with pytest.raises(AssertionError, match="allowed: batch 1..8"):
        vm["main"](tvm_compat.to_tvm_tensor(np.zeros((9, 3, 32, 32), "float32"), dev))
    assert report["build"]["variants"]["main_optimum"]  # llvm: the optimum copy by default


def test_cnn_dynamic_batch_cuda_build_has_no_optimum_copy_by_default(cli, tiny_onnx, tmp_path):
    """``amp convert --target cuda:sm_90`` of a dynamic batch: one symbolic copy of the model
    (the default), its values checked at the range's min / optimum / max through the CPU build
    of the same module; ``dynamic.specialize_optimum: true`` in a config adds the copy."""
    out = tmp_path / "cnn"
    res = cli("convert", tiny_onnx, "-o", out, "--target", "cuda:sm_90", "--dynamic",
              "batch=1..8@4")
    assert res.exit_code == 0, res.output
    report = json.loads((out / "report.json").read_text())
    assert [p["dims"]["batch"] for p in report["accuracy"]["points"]] == [1, 4, 8]
    assert all(p["worst"]["rel_l2"] <= REL_L2 for p in report["accuracy"]["points"])
    assert set(report["build"]["variants"]) == {"main_dynamic"}
    assert "no static copy at the optimum" in (out / "report.md").read_text()
    cfg = tmp_path / "copy.yaml"
    cfg.write_text("dynamic:\n  specialize_optimum: true\n")
    res = cli("convert", tiny_onnx, "-o", tmp_path / "copy", "--target", "cuda:sm_90",
              "--dynamic", "batch=1..8@4", "--config", cfg, "--no-accuracy")
    assert res.exit_code == 0, res.output
    variants = json.loads((tmp_path / "copy" / "report.json").read_text())["build"]["variants"]
    assert set(variants) == {"main_optimum", "main_dynamic"}


def test_range_over_a_dynamic_dim(tmp_path):
    """``torch.arange(x.shape[1])`` as transformers exports it: Range(0, Gather(Shape(x), 1), 1)
    stays a function of the dim (TVM's own converter made it data-dependent: the build failed)."""
    b = models.GraphBuilder(seed=1)
    n = b.op("Gather", [b.op("Shape", ["x"]), b.const(np.array(1, "int64"), "i")], axis=0)
    pos = b.op("Range", [b.const(np.array(0, "int64"), "z"), n, b.const(np.array(1, "int64"), "o")])
    y = b.op("Add", ["x", b.op("Cast", [pos], to=1)])
    path = tmp_path / "range.onnx"
    onnx.save(b.model([("x", ["batch", "sequence"], "float32")],
                      [(y, ["batch", "sequence"], "float32")]), str(path))
    model = amp_cli.load(path, dims={"batch": "1..4", "sequence": "2..64(8)"})
    conv = amp_cli.convert(model, ConvertConfig(target="llvm"))
    try:
        assert len(conv.accuracy["points"]) == 3
        assert all(p["worst"]["rel_l2"] <= REL_L2 for p in conv.accuracy["points"])
    finally:
        conv.cleanup()


def test_bench_times_a_chosen_shape(cli, bert_llvm, tmp_path):
    out = bert_llvm[0]
    res = cli("bench", out, "--input-shape", "input_ids:3x40", "--repeat", "3", "--warmup", "1",
              "--json", tmp_path / "b.json")
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "b.json").read_text())
    assert [t["shape"] for t in data["inputs"]["tensors"]] == [[3, 40], [3, 40]]
    res = cli("bench", out, "--dynamic", "batch=9", "--repeat", "1")
    assert res.exit_code == 1 and "batch=9: outside the ranges" in res.stderr
    assert "batch 1..4, sequence 8..48" in res.stderr
    res = cli("bench", out, "--input-shape", "input_ids:1..3x40")
    assert res.exit_code == 2 and "one shape" in res.stderr


def test_tuning_tasks_are_the_optimum_kernels(bert_onnx):
    from amp_cli import tvm_compat
    from amp_cli.target import resolve_target
    from amp_cli.tuning.tasks import fused_module

    model = amp_cli.load(bert_onnx, input_shapes={"input_ids": ["1..4(2)", "8..48(16)"]})
    fused = fused_module(model, ConvertConfig(target="llvm"), resolve_target("llvm"))
    kernels = [f for _, f in fused.functions_items()
               if isinstance(f, tvm_compat.prim_func_class())]
    dims = [d for f in kernels for p in f.params for d in (getattr(p, "shape", None) or [])]
    assert kernels and dims and all(hasattr(d, "value") for d in dims)  # static shapes only


def test_cuda_codegen(bert_onnx):
    """sm_90 code generation of the dynamic model (static copy at the optimum included); the
    values of the same converted module are checked by the CPU build in convert."""
    from amp_cli.compile import build
    from amp_cli.config import PrecisionConfig
    from amp_cli.precision import convert_precision
    from amp_cli.target import resolve_target

    model = amp_cli.load(bert_onnx, input_shapes={"input_ids": ["1..4(2)", "8..48(16)"]})
    mod, _ = convert_precision(model.mod, PrecisionConfig(), model.node_types)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        res = build(mod, resolve_target("cuda:sm_90"), f"{d}/m.so", specialize=True)
    assert res.tensor_core_kernels > 0 and res.cuda_source_bytes > 0
    # main_optimum takes amp's static-shape rewrites (Q/K/V combined, NT GEMMs)
    assert res.graph_rewrites["combined_matmuls"] and res.graph_rewrites["matmuls_nt"]
    # the attention core fuses in both copies: main_dynamic's over symbolic batch / sequence
    assert res.graph_rewrites["attention_fused"] == 2
    assert res.graph_rewrites["attention_unfused"] == 0


@pytest.mark.parametrize("ranges,per_shape", [
    (["1..4(2)", "8..48(16)"], True),        # 164 shapes: symbolic regions captured per shape
    (["1..32(2)", "8..480(16)"], False)])    # 15104 shapes: on main_dynamic_graphs' grid only
def test_cuda_graphs_capture_per_shape_only_for_few_shapes(bert_onnx, ranges, per_shape):
    """With CUDA graphs on (the default) a dynamic build captures main_optimum's kernels; it
    captures main_dynamic's symbolic regions too (TVM keeps one graph per shape seen) only when
    the ranges hold at most MAX_CAPTURED_SHAPES shapes (docs/dynamic-shapes.md); wider ranges
    capture them in main_dynamic_graphs, the copy main runs for the shapes of the capture grid
    (at most MAX_CAPTURED_SHAPES of them), with the same kernels."""
    from amp_cli.compile.build import compile_target
    from amp_cli.compile.dynamic import MAX_CAPTURED_SHAPES, shape_count
    from amp_cli.compile.pipeline import relax_pipeline
    from amp_cli.config import PrecisionConfig
    from amp_cli.precision import convert_precision
    from amp_cli.target import resolve_target

    model = amp_cli.load(bert_onnx, input_shapes={"input_ids": ranges})
    assert (shape_count(model.dynamic) <= MAX_CAPTURED_SHAPES) == per_shape
    mod, _ = convert_precision(model.mod, PrecisionConfig(), model.node_types)
    target = resolve_target("cuda:sm_90")
    with compile_target(target, None):
        low = relax_pipeline(target, specialize=True)(mod)
    relax = tvm_compat.relax()
    captures = {gv.name_hint: f for gv, f in low.functions.items()
                if isinstance(f, relax.Function) and "cuda_graph_capture" in gv.name_hint}
    assert any(n.startswith("main_optimum_cuda_graph_capture") for n in captures)
    symbolic = {n for n, f in captures.items() if list(relax.analysis.defined_symbolic_vars(f))}
    assert symbolic, sorted(captures)
    prefix = "main_dynamic_cuda_graph" if per_shape else "main_dynamic_graphs_cuda_graph"
    assert all(n.startswith(prefix) for n in symbolic), sorted(symbolic)
    functions = {gv.name_hint for gv in low.get_global_vars()}
    assert ("main_dynamic_graphs" in functions) != per_shape
    if not per_shape:  # the copy calls the kernels main_dynamic calls: nothing compiled twice
        from amp_cli.compile.dynamic import kernels_by_function
        copies = tuple(n for n in functions if n.startswith("main_dynamic_graphs"))
        used = kernels_by_function(low, ("main_dynamic",) + copies)
        def device(names):  # the VM's host shape functions are each function's own
            return {k for k in names if not k.startswith(("shape_func", "compute_symbolic"))}

        assert device(k for n in copies for k in used[n]) == device(used["main_dynamic"])


def test_capture_grid_bounds_the_graphs_and_keeps_common_sizes():
    from amp_cli.compile.dynamic import MAX_CAPTURED_SHAPES, capture_grid
    from amp_cli.config import DimRange

    def grid_shapes(ranges, steps):
        return math.prod(r.hi // steps[n] - (r.lo - 1) // steps[n] for n, r in ranges.items())

    bert = {"batch": DimRange(1, 32, 8), "sequence": DimRange(16, 512, 128)}
    assert capture_grid(bert) == {"batch": 1, "sequence": 16}  # every batch; seq % 16 == 0
    assert capture_grid({"batch": DimRange(1, 32, 8)}) is None  # 32 shapes: all captured
    for ranges in (bert, {"b": DimRange(1, 4096)}, {"b": DimRange(3, 1000), "s": DimRange(7, 999),
                                                      "h": DimRange(1, 5)}):
        steps = capture_grid(ranges)
        assert steps is not None and all(s & (s - 1) == 0 for s in steps.values())
        assert 0 < grid_shapes(ranges, steps) <= MAX_CAPTURED_SHAPES
        # one step less on any dim would not fit: the grid is as fine as the bound allows
        # (or that dim is already every size)
        for n, s in steps.items():
            if s > 1:
                assert grid_shapes(ranges, {**steps, n: s // 2}) > MAX_CAPTURED_SHAPES


def test_three_way_dispatch_keeps_the_values_on_llvm(bert_onnx):
    """main -> main_optimum (the optimum shape), main_dynamic_graphs (shapes on the capture
    grid), main_dynamic (the rest): the guarded module built for llvm (where the capture is
    not applied, so the dispatch alone is checked) matches ONNX Runtime fp32 at shapes of each
    kind (an fp32 module: the same maths as the reference, up to summation order)."""
    from amp_cli.compile.dynamic import capture_grid, guard_dynamic

    model = amp_cli.load(bert_onnx, input_shapes={"input_ids": ["1..32(2)", "8..480(16)"]})
    assert capture_grid(model.dynamic) == {"batch": 1, "sequence": 16}
    guarded = guard_dynamic(model.mod, specialize=True, graphs=True)
    assert "main_dynamic_graphs" in {gv.name_hint for gv in guarded.get_global_vars()}
    tvm = tvm_compat.tvm()
    vm = tvm_compat.relax_vm(tvm.compile(guarded, target="llvm"), tvm.cpu())
    # (2, 16): the optimum; (3, 32) and (1, 16): on the grid; (3, 29), (2, 17): off it
    for k, (batch, seq) in enumerate([(2, 16), (3, 32), (3, 29), (1, 16), (2, 17)]):
        feeds = random_inputs(model.inputs_at({"batch": batch, "sequence": seq}), seed=k)
        ref = model.reference(feeds)[0]
        got = vm["main"](*[tvm_compat.to_tvm_tensor(feeds[s.name], tvm.cpu())
                           for s in model.inputs]).numpy()
        assert got.shape == ref.shape
        assert metrics(ref, got)["rel_l2"] < 1e-5, (batch, seq)  # fp32 module: same maths


def _bert_on_gpu_twice(bert_onnx, tmp_path, ranges, shapes, copy=None):
    """dynamic_bert with ``ranges`` converted for the local GPU (``copy``: the config's
    ``dynamic.specialize_optimum``, None the default: no copy on CUDA), run at every shape of
    ``shapes`` twice, in two orders (a CUDA graph captured for one shape must never be
    replayed for another), within the module's tolerances of ONNX Runtime fp32."""
    if not tvm_compat.has_cuda_device():
        pytest.skip("no CUDA device")
    model = amp_cli.load(bert_onnx, input_shapes={"input_ids": ranges})
    cfg = ConvertConfig(target="cuda")
    cfg.dynamic.specialize_optimum = copy
    conv = amp_cli.convert(model, cfg, isolate=False)
    conv.save(tmp_path / "out")
    conv.cleanup()
    dev = tvm_compat.cuda_device()
    vm = tvm_compat.relax_vm(tvm_compat.load_module(str(tmp_path / "out" / "model.so")), dev)
    for k, (batch, seq) in enumerate(shapes + shapes[::-1]):
        feeds = random_inputs(model.inputs_at({"batch": batch, "sequence": seq}), seed=k)
        ref = model.reference(feeds)[0]
        got = vm["main"](*[tvm_compat.to_tvm_tensor(feeds[s.name], dev)
                           for s in model.inputs]).numpy()
        m = metrics(ref, got)
        assert got.shape == (batch, seq, 64)
        assert m["rel_l2"] <= REL_L2 and m["max_abs"] <= MAX_ABS, (batch, seq, m)


@pytest.mark.gpu
def test_bert_on_gpu_at_every_shape_with_graphs_per_shape(bert_onnx, tmp_path):
    """Ranges of 164 shapes: every shape's symbolic regions captured (main_dynamic), with the
    optimum copy (main_optimum's graph) beside them."""
    _bert_on_gpu_twice(bert_onnx, tmp_path, ["1..4(2)", "8..48(16)"], BERT_SHAPES, copy=True)


@pytest.mark.gpu
def test_bert_on_gpu_with_graphs_on_the_capture_grid(bert_onnx, tmp_path):
    """Ranges too wide to capture every shape (batch 1..32 x sequence 8..480): shapes on the
    capture grid (sequence % 16 == 0) replay main_dynamic_graphs' per-shape graphs, the others
    launch main_dynamic's kernels."""
    _bert_on_gpu_twice(bert_onnx, tmp_path, ["1..32(2)", "8..480(16)"],
                       [(1, 16), (3, 32), (32, 480), (3, 29), (2, 16), (7, 48), (1, 8), (5, 100)])


def test_symbolic_graph_rewrites_keep_the_values(bert_onnx, monkeypatch):
    """The CUDA graph rewrites that now apply under symbolic batch / sequence (Q/K/V combined,
    NT constant weights, layer norm + cast over flattened rows) checked by values: the
    converted dynamic model with and without them, both on llvm (the norm kernel before its GPU
    schedule), at several shapes. Only the summation order may differ."""
    from amp_cli.backends.cuda.rewrites import norm_cast as nc
    from amp_cli.backends.cuda.rewrites.combine_gemm import combine_parallel_gemms
    from amp_cli.backends.cuda.rewrites.matmul_nt import matmul_to_nt
    from amp_cli.config import PrecisionConfig
    from amp_cli.precision import convert_precision

    monkeypatch.setattr(nc, "norm_cast_func", lambda *key: nc.norm_cast_compute(*key)
                        .with_attr("op_pattern", nc.OPAQUE))
    model = amp_cli.load(bert_onnx, input_shapes={"input_ids": ["1..4(2)", "8..48(16)"]})
    mod, _ = convert_precision(model.mod, PrecisionConfig(), model.node_types)
    new, combined = combine_parallel_gemms(mod)
    new, counts = matmul_to_nt(new)
    new, fused, _ = nc.fuse_norm_casts(new)
    assert combined == 3 and counts["constant"] >= 3 and fused >= 1
    tvm = tvm_compat.tvm()

    def vm(m):
        return tvm_compat.relax_vm(tvm.compile(m, target="llvm"), tvm.cpu())

    ref_vm, got_vm = vm(mod), vm(new)
    for b, s in [(1, 8), (3, 29), (4, 48)]:
        specs = model.inputs_at({"batch": b, "sequence": s})
        feeds = random_inputs(specs, seed=b * 100 + s)
        args = [tvm.runtime.tensor(feeds[i.name]) for i in specs]
        ref = ref_vm["main"](*args).numpy().astype(np.float64)
        got = got_vm["main"](*args).numpy().astype(np.float64)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-3, (b, s)


def test_report_note_says_which_shapes_replay_graphs():
    from amp_cli.compile.dynamic import capture_note

    wide = {"batch": DimRange(1, 32, 8), "sequence": DimRange(16, 512, 128)}
    note = capture_note(wide, specialize=True)
    assert "sequence a multiple of 16" in note and "at most 1024 graphs" in note
    assert "every other shape" in capture_note({"batch": DimRange(1, 32, 8)}, True)
    note = capture_note(wide, specialize=False)
    assert note.startswith("CUDA graphs: every shape with") and "multiple of 16" in note


@pytest.mark.parametrize("model_name", ["cnn", "bert"])
def test_symbolic_only_cuda_build_captures_every_shape(model_name, tiny_onnx, bert_onnx):
    """Without the optimum copy (``dynamic.specialize_optimum: false``) a CUDA build still
    captures per shape: main runs ``main_dynamic``, whose symbolic regions are captured (in
    main itself, beside the range check, TVM 0.27's VM codegen failed on a CNN: "Var storage
    is not defined")."""
    from amp_cli.compile import build
    from amp_cli.compile.build import compile_target
    from amp_cli.compile.pipeline import relax_pipeline
    from amp_cli.config import PrecisionConfig
    from amp_cli.precision import convert_precision
    from amp_cli.target import resolve_target

    if model_name == "cnn":
        model = amp_cli.load(tiny_onnx, dims={"batch": "1..8(4)"})
    else:
        model = amp_cli.load(bert_onnx, input_shapes={"input_ids": ["1..4(2)", "8..48(16)"]})
    mod, _ = convert_precision(model.mod, PrecisionConfig(), model.node_types)
    target = resolve_target("cuda:sm_90")
    with compile_target(target, None):
        low = relax_pipeline(target, specialize=False)(mod)
    relax = tvm_compat.relax()
    symbolic = {gv.name_hint for gv, f in low.functions.items()
                if isinstance(f, relax.Function) and "cuda_graph_capture" in gv.name_hint
                and list(relax.analysis.defined_symbolic_vars(f))}
    assert symbolic and all(n.startswith("main_dynamic_cuda_graph") for n in symbolic)
    assert "main_optimum" not in {gv.name_hint for gv in low.get_global_vars()}
    import tempfile

    with tempfile.TemporaryDirectory() as d:  # the VM codegen of that module
        res = build(mod, target, f"{d}/m.so", specialize=False)
    assert res.cuda_source_bytes > 0
    assert set(res.variants) == {"main_dynamic"} and res.variants["main_dynamic"]
