"""Every bad input gets one clear line on stderr, a documented exit code, no traceback, and no
half-written OUTDIR; TVM crashes in the sandboxed build become that one line too.

docs/reliability.md has the table of these cases. Most run `amp` in-process (CliRunner, stdout
and stderr apart: click >= 8.2); Ctrl-C and SIGTERM need a real process.
"""
from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import AMP, amp_env
from onnx import TensorProto, helper

SHAPE = ["--input-shape", "input:1x3x32x32"]


def assert_error(res, code: int, *fragments: str) -> str:
    """Exit `code`, stderr exactly one line 'amp: error: ...' containing `fragments`."""
    stderr = res.stderr if hasattr(res, "stderr") else ""
    assert res.exit_code == code, (res.exit_code, res.output, res.exception)
    assert "Traceback" not in res.output, res.output
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("amp: error: "), lines[0]
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


def amp_temp_files(tmp: Path) -> list:
    """amp's temp files and dirs (staging, sandbox) in `tmp`; tools amp runs (nvcc) may leave
    their own there."""
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("amp-"))


def assert_no_debris(out: Path):
    """OUTDIR not created, and none of save()'s temp dirs beside it."""
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.*")), list(out.parent.iterdir())


# --- the model file ------------------------------------------------------------------------


def test_missing_file(cli, tmp_path):
    out = tmp_path / "out"
    assert_error(cli("convert", tmp_path / "nope.onnx", "-o", out, "--target", "llvm"), 1,
                 "model file not found", "nope.onnx")
    assert_no_debris(out)


def test_directory_as_model(cli, tmp_path):
    out = tmp_path / "out"
    assert_error(cli("convert", tmp_path, "-o", out, "--target", "llvm"), 1, "is a directory")
    assert_no_debris(out)


def test_empty_file(cli, tmp_path):
    (tmp_path / "empty.onnx").write_bytes(b"")
    out = tmp_path / "out"
    assert_error(cli("convert", tmp_path / "empty.onnx", "-o", out, "--target", "llvm"), 1,
                 "empty.onnx is empty")
    assert_no_debris(out)


@pytest.mark.parametrize("kind", ["truncated", "garbage", "text"])
def test_corrupt_onnx(cli, tiny_onnx, tmp_path, kind):
    data = tiny_onnx.read_bytes()
    bad = tmp_path / "bad.onnx"
    bad.write_bytes({"truncated": data[: len(data) // 3],
                     "garbage": np.random.default_rng(0).bytes(4000),
                     "text": b"this is not a model\n"}[kind])
    out = tmp_path / "out"
    assert_error(cli("convert", bad, "-o", out, "--target", "llvm"), 1, "bad.onnx",
                 "not a valid ONNX")
    assert_no_debris(out)


def test_op_tvm_cannot_import_names_op_and_node(cli, tmp_path):
    # Celu is standard ONNX (opset 12) that TVM's Relax importer has no converter for.
    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"], name="first_relu"),
         helper.make_node("Celu", ["r"], ["y"], name="my_celu", alpha=0.5)],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 7])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 7])])
    path = tmp_path / "celu.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    out = tmp_path / "out"
    assert_error(cli("convert", path, "-o", out, "--target", "llvm"), 1,
                 "does not support", "Celu", "my_celu")
    assert_no_debris(out)


# --- shapes ----------------------------------------------------------------------------------


def test_symbolic_dims_listed(cli, tiny_onnx, tmp_path):
    out = tmp_path / "out"
    assert_error(cli("convert", tiny_onnx, "-o", out, "--target", "llvm"), 1,
                 "symbolic input dims", "input [batchx3x32x32]",
                 "--input-shape input:1x3x32x32")
    assert_no_debris(out)


@pytest.mark.parametrize("text", ["input", "input:", "input:1xax3x3", "input:0x3x32x32",
                                  ":1x3", "input:1x-3x32x32", "input:4..2x3x32x32",
                                  "input:1..8(9)x3x32x32", "input:1..x3x32x32"])
def test_malformed_input_shape(cli, tiny_onnx, tmp_path, text):
    # a malformed option value is a usage error: exit 2, in amp's one-line form
    out = tmp_path / "out"
    assert_error(cli("convert", tiny_onnx, "-o", out, "--target", "llvm", "--input-shape", text),
                 2, "--input-shape", "e.g.")
    assert_no_debris(out)


def test_input_shape_for_unknown_input(cli, tiny_onnx, tmp_path):
    out = tmp_path / "out"
    assert_error(cli("convert", tiny_onnx, "-o", out, "--target", "llvm",
                     "--input-shape", "images:1x3x32x32"), 1,
                 "'images'", "the model's inputs are: input")
    assert_no_debris(out)


def test_input_shape_wrong_rank(cli, tiny_onnx, tmp_path):
    out = tmp_path / "out"
    assert_error(cli("convert", tiny_onnx, "-o", out, "--target", "llvm",
                     "--input-shape", "input:1x3x32"), 1, "3 dims given", "rank 4")
    assert_no_debris(out)


# --- YAML config -----------------------------------------------------------------------------


@pytest.mark.parametrize("text,fragments", [
    ("precision:\n  precision: fp16\n   accumulate: [\n", ("YAML syntax error", "line 3")),
    ("precison:\n  precision: bf16\n", ("unknown key 'precison'", "did you mean 'precision'")),
    ("precision:\n  keep_io_tyeps: true\n", ("unknown key 'precision.keep_io_tyeps'",
                                            "did you mean 'keep_io_types'")),
    ("precision:\n  keep_io_types: 3\n", ("precision.keep_io_types", "expected bool", "int")),
    ("accuracy:\n  seed: abc\n", ("accuracy.seed", "expected int", "'abc'")),
    ("threads: two\n", ("threads", "expected int")),
    ("target: 5\n", ("target", "expected str")),
    ("precision: fp16\n", ("precision must be a mapping",)),
    ("precision:\n  policy:\n    never: nn.softmax\n", ("precision.policy.never",
                                                      "expected list")),
    ("precision:\n  precision: fp8\n", ("precision must be one of", "'fp8'")),
    ("- a\n- b\n", ("top level must be a mapping",)),
])
def test_bad_yaml(cli, tiny_onnx, tmp_path, text, fragments):
    cfg = tmp_path / "amp.yaml"
    cfg.write_text(text)
    out = tmp_path / "out"
    assert_error(cli("convert", tiny_onnx, "-o", out, "--target", "llvm", *SHAPE, "--config",
                     cfg), 1, "amp.yaml", *fragments)
    assert_no_debris(out)


def test_yaml_target_used_without_target_flag(cli, tiny_onnx, tmp_path):
    # Regression: --target's default ("cuda") used to override the config file's target.
    cfg = tmp_path / "amp.yaml"
    cfg.write_text("target: tpu\n")
    assert_error(cli("convert", tiny_onnx, "-o", tmp_path / "out", *SHAPE, "--config", cfg), 1,
                 "unknown target kind 'tpu'")


def test_yaml_not_text(cli, tiny_onnx, tmp_path):
    cfg = tmp_path / "amp.yaml"
    cfg.write_bytes(b"\xff\xfe\x00\x81binary")
    assert_error(cli("convert", tiny_onnx, "-o", tmp_path / "out", *SHAPE, "--config", cfg), 1,
                 "amp.yaml", "not a text")


def test_yaml_missing(cli, tiny_onnx, tmp_path):
    assert_error(cli("convert", tiny_onnx, "-o", tmp_path / "out", *SHAPE, "--config",
                     tmp_path / "nope.yaml"), 1, "config file not found")


# --- targets ---------------------------------------------------------------------------------


@pytest.mark.parametrize("target,fragments", [
    ("tpu", ("unknown target kind 'tpu'", "cuda, llvm")),
    ("cuda:sm_91", ("unknown CUDA arch 'sm_91'", "sm_90")),
    ("cuda:90", ("unknown CUDA arch '90'",)),
    ("llvm:skylak", ("unknown llvm CPU 'skylak'", "did you mean skylake")),
    ("llvm:notacpu", ("unknown llvm CPU 'notacpu'",)),
    ("{bad json", ("not valid JSON",)),
    ('{"arch": "sm_90"}', ("must be an object with a 'kind'",)),
    ('{"kind": "llvm", "bogus": 1}', ("TVM rejects target", "bogus")),
])
def test_unknown_target(cli, tiny_onnx, tmp_path, target, fragments):
    out = tmp_path / "out"
    assert_error(cli("convert", tiny_onnx, "-o", out, *SHAPE, "--target", target), 1, *fragments)
    assert_no_debris(out)


def test_cuda_without_nvcc(cli, tiny_onnx, tmp_path, monkeypatch):
    from amp_cli import target

    bin_dir = tmp_path / "bin"  # a PATH with python but no nvcc
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(target, "CUDA_DEFAULT_ROOTS", (str(tmp_path / "no-cuda"),))
    out = tmp_path / "out"
    assert_error(cli("convert", tiny_onnx, "-o", out, *SHAPE, "--target", "cuda:sm_90"), 1,
                 "needs nvcc", "CUDA_HOME")
    assert_no_debris(out)


# --- OUTDIR ----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["proc", "parent-is-file", "grandparent-is-file"])
def test_unwritable_outdir(cli, tiny_onnx, tmp_path, where):
    # Tests run as root, which ignores permission bits: use places that refuse root too.
    out = {"proc": Path("/proc/amp-test-out"),
           "parent-is-file": tiny_onnx / "out",
           "grandparent-is-file": tiny_onnx / "a" / "b"}[where]
    line = assert_error(cli("convert", tiny_onnx, "-o", out, *SHAPE, "--target", "llvm"), 1,
                        f"cannot create {out}")
    assert ("is a file" in line) if "file" in where else ("not writable" in line)
    assert not out.exists()
    assert tiny_onnx.is_file()


def test_outdir_is_a_file_is_a_usage_error(cli, tiny_onnx, tmp_path):
    res = cli("convert", tiny_onnx, "-o", tiny_onnx, *SHAPE, "--target", "llvm", "--force")
    assert res.exit_code == 2 and "is a file" in res.stderr
    assert tiny_onnx.is_file()


def test_existing_outdir_without_force_is_untouched(cli, tiny_onnx, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_error(cli("convert", tiny_onnx, "-o", out, *SHAPE, "--target", "llvm"), 1,
                 "exists", "--force")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "mine"


def test_interrupted_save_leaves_old_outdir(tmp_path, monkeypatch):
    """Conversion.save is atomic: an interrupt while writing keeps the old OUTDIR as it was."""
    from types import SimpleNamespace

    convert_mod = importlib.import_module("amp_cli.convert")

    lib = tmp_path / "model.so"
    lib.write_bytes(b"\0" * 64)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    conv = convert_mod.Conversion(None, None, None, None, None, SimpleNamespace(library=str(lib)),
                                  {}, {"config": {}}, str(tmp_path / "staging"))

    def interrupted(_report):
        raise KeyboardInterrupt

    monkeypatch.setattr(convert_mod, "render_markdown", interrupted)
    with pytest.raises(KeyboardInterrupt):
        conv.save(out, force=True)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert not list(tmp_path.glob(".out.*"))
    with pytest.raises(KeyboardInterrupt):
        conv.save(tmp_path / "new")
    assert_no_debris(tmp_path / "new")


# --- .npz inputs (amp bench --inputs, amp convert --calibration) -----------------------------


@pytest.fixture
def bad_npz(tmp_path):
    def make(kind):
        p = tmp_path / f"{kind}.npz"
        if kind == "not-npz":
            p.write_text("hello")
        else:
            name, shape, dtype = {"names": ("x", (1, 3, 32, 32), "float32"),
                                  "shape": ("input", (1, 3, 31, 32), "float32"),
                                  "dtype": ("input", (1, 3, 32, 32), "float64")}[kind]
            np.savez(p, **{name: np.zeros(shape, dtype)})
        return p
    return make


NPZ_CASES = [("names", ("missing", "input", "found x")),
             ("shape", ("shape [1, 3, 31, 32]", "[1, 3, 32, 32]")),
             ("dtype", ("dtype float64", "float32")),
             ("not-npz", ("cannot read as .npz",))]


@pytest.mark.parametrize("kind,fragments", NPZ_CASES)
def test_bad_npz_load_inputs(tiny_onnx, bad_npz, kind, fragments):
    from amp_cli.accuracy import load_inputs
    from amp_cli.errors import InputError
    from amp_cli.frontend import InputSpec

    with pytest.raises(InputError) as e:
        load_inputs(str(bad_npz(kind)), [InputSpec("input", [1, 3, 32, 32], "float32")])
    for f in fragments:
        assert f in str(e.value)


@pytest.mark.parametrize("kind,fragments", NPZ_CASES)
def test_bad_npz_bench_inputs(cli, tiny_onnx, bad_npz, kind, fragments):
    assert_error(cli("bench", tiny_onnx, "--target", "llvm", *SHAPE, "--inputs", bad_npz(kind)),
                 1, f"{kind}.npz", *fragments)


@pytest.mark.parametrize("kind,fragments", NPZ_CASES)
def test_bad_npz_calibration(cli, tiny_onnx, bad_npz, tmp_path, kind, fragments):
    out = tmp_path / "out"
    assert_error(cli("convert", tiny_onnx, "-o", out, "--target", "llvm", *SHAPE,
                     "--auto-precision", "--calibration", bad_npz(kind)),
                 1, f"{kind}.npz", *fragments)
    assert_no_debris(out)


# --- unexpected errors and interrupts inside the library ------------------------------------


def test_unexpected_exception_is_one_line(cli, tiny_onnx, tmp_path, monkeypatch):
    convert_mod = importlib.import_module("amp_cli.convert")

    def broken(*_a, **_k):
        raise RuntimeError("something inside TVM\nwith a second line")

    monkeypatch.setattr(convert_mod, "convert_precision", broken)
    out = tmp_path / "out"
    assert_error(cli("convert", tiny_onnx, "-o", out, "--target", "llvm", *SHAPE), 1,
                 "internal error: RuntimeError: with a second line", "--debug")
    assert_no_debris(out)


def test_interrupt_swallowed_by_tvm_still_exits_130(cli, tiny_onnx, tmp_path, monkeypatch):
    """TVM turns a KeyboardInterrupt inside its Python callbacks into RuntimeError; after a
    SIGINT any error is the interrupt."""
    convert_mod = importlib.import_module("amp_cli.convert")

    def like_tvm(*_a, **_k):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        except KeyboardInterrupt:
            raise RuntimeError("") from None

    monkeypatch.setattr(convert_mod, "convert_precision", like_tvm)
    out = tmp_path / "out"
    # as in an interactive shell, whatever this test process inherited (a background job of a
    # non-interactive shell starts with SIGINT ignored, and then so would amp)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        res = cli("convert", tiny_onnx, "-o", out, "--target", "llvm", *SHAPE)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert res.exit_code == 130 and res.stderr.strip() == "amp: interrupted", res.output
    assert_no_debris(out)


# --- crash containment -----------------------------------------------------------------------


@pytest.mark.parametrize("target,crash,signame,stage", [
    ("cuda:sm_90", "codegen", "SIGSEGV", "build cuda sm_90"),
    ("llvm", "relax pipeline:abort", "SIGABRT", "build llvm"),
    ("cuda:sm_90", "export:SIGBUS", "SIGBUS", "build cuda sm_90"),
])
def test_crash_in_build_is_one_line(cli, tiny_onnx, tmp_path, clean_tmp, monkeypatch, target,
                                    crash, signame, stage):
    monkeypatch.setenv("AMP_TEST_CRASH", crash)
    out = tmp_path / "out"
    line = assert_error(cli("convert", tiny_onnx, "-o", out, "--target", target, *SHAPE), 1,
                        f"stage '{stage}", f"crashed with {signame}",
                        f"during {crash.partition(':')[0]}")
    assert "Segfault" not in line
    assert_no_debris(out)
    assert amp_temp_files(clean_tmp) == []  # staging and sandbox files removed


def test_crash_while_scheduling_names_the_kernel(cli, tiny_onnx, tmp_path, clean_tmp,
                                                 monkeypatch):
    monkeypatch.setenv("AMP_TEST_CRASH", "softmax*")  # tiny_cnn's last kernel
    out = tmp_path / "out"
    assert_error(cli("convert", tiny_onnx, "-o", out, "--target", "cuda:sm_90", *SHAPE), 1,
                 "stage 'build cuda sm_90'", "crashed with SIGSEGV while compiling kernel "
                 "'softmax")
    assert_no_debris(out)
    assert amp_temp_files(clean_tmp) == []


def test_crash_names_the_kernel(clean_tmp, monkeypatch):
    """Work that notes the kernel it is on (tuning measures kernel by kernel) gets it named."""
    from amp_cli.errors import BuildError
    from amp_cli.sandbox import note_kernel, run_isolated

    def compile_kernels(names):
        for n in names:
            note_kernel(n)
        return len(names)

    assert run_isolated(compile_kernels, ["fused_matmul_add", "softmax"], stage="tune") == 2
    monkeypatch.setenv("AMP_TEST_CRASH", "softmax*")
    with pytest.raises(BuildError) as e:
        run_isolated(compile_kernels, ["fused_matmul_add", "softmax_13"], stage="tune")
    assert e.value.kernel == "softmax_13" and e.value.stage == "tune"
    assert "crashed with SIGSEGV while compiling kernel 'softmax_13'" in str(e.value)
    assert "Fatal Python error" in e.value.child_traceback  # faulthandler's stack, for --debug
    assert amp_temp_files(clean_tmp) == []


def test_crash_with_debug_shows_child_stack(cli, tiny_onnx, tmp_path, monkeypatch):
    monkeypatch.setenv("AMP_TEST_CRASH", "codegen")
    res = cli("convert", tiny_onnx, "-o", tmp_path / "out", "--target", "llvm", *SHAPE, "--debug")
    assert res.exit_code == 1
    assert "Fatal Python error" in res.stderr
    assert res.stderr.rstrip().splitlines()[-1].startswith("amp: error: stage 'build llvm")


def test_python_error_in_child_is_build_error(clean_tmp):
    from amp_cli.errors import BuildError
    from amp_cli.sandbox import run_isolated

    def boom():
        raise ValueError("bad schedule")

    with pytest.raises(BuildError, match="stage 'build x' failed: ValueError: bad schedule"):
        run_isolated(boom, stage="build x")
    assert amp_temp_files(clean_tmp) == []


# --- real signals ----------------------------------------------------------------------------


def _gone(pid: int, wait: float = 5.0) -> bool:
    """The process has exited (a zombie waiting for its reaper counts as exited)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def _sandbox_child(pid: int) -> int | None:
    """The forked build child of `pid` (same command line), if one is running."""
    try:
        kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                              text=True).stdout.split()
        mine = Path(f"/proc/{pid}/cmdline").read_bytes()
        for k in kids:
            if Path(f"/proc/{k}/cmdline").read_bytes() == mine:
                return int(k)
    except OSError:
        pass
    return None


def _default_signals():
    """In the child: SIGINT and SIGTERM as in an interactive shell (the test may run where they
    are ignored, e.g. as a background job of a non-interactive shell)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@pytest.mark.parametrize("sig,code,message", [(signal.SIGINT, 130, "amp: interrupted"),
                                              (signal.SIGTERM, 143, "amp: terminated (SIGTERM)")])
def test_signal_during_build(tmp_path, clean_tmp, sig, code, message):
    """Ctrl-C (or a CI timeout's SIGTERM) while the sandboxed child compiles: exit 128+signal,
    the child dies, nothing is half-written, no temp dirs remain."""
    from amp_cli import models

    model = tmp_path / "bert.onnx"
    onnx.save(models.tiny_bert(), str(model))
    out = tmp_path / "out"
    proc = subprocess.Popen([AMP, "convert", str(model), "-o", str(out), "--target", "cuda:sm_90"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=amp_env(TMPDIR=clean_tmp), preexec_fn=_default_signals)
    child, deadline = None, time.monotonic() + 120
    while child is None and proc.poll() is None and time.monotonic() < deadline:
        child = _sandbox_child(proc.pid)
        time.sleep(0.02)
    assert child is not None, "never saw the sandboxed build child"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert err.strip() == message, err
    assert _gone(child)
    assert_no_debris(out)
    assert amp_temp_files(clean_tmp) == []


def test_sandbox_child_dies_with_its_parent(tmp_path, clean_tmp):
    """A CLI killed outright (SIGKILL: no cleanup runs) takes its compile child with it."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import time\n"
        "from amp_cli.sandbox import run_isolated\n"
        "run_isolated(time.sleep, 60, stage='sleep')\n")
    proc = subprocess.Popen([sys.executable, str(script)], env=amp_env(TMPDIR=clean_tmp))
    deadline = time.monotonic() + 60
    child = None
    while child is None and time.monotonic() < deadline:
        kids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                              text=True).stdout.split()
        child = int(kids[0]) if kids else None
        time.sleep(0.05)
    assert child is not None
    proc.kill()
    proc.wait()
    assert _gone(child)


@pytest.mark.slow  # ~1.5 min on 2 loaded cores: MetaSchedule's builder and runner start-up
def test_crash_while_tuning_keeps_records(tiny_onnx, tmp_path, clean_tmp):
    """A crash in the sandboxed tuning child (here: on purpose, from the progress callback,
    which runs in the child after a measured batch was recorded) is one TuneError, and the
    records written before it survive, readable."""
    import json

    tune_mod = pytest.importorskip("amp_cli.tuning")
    import amp_cli
    from amp_cli.errors import AmpError

    model = amp_cli.load(tiny_onnx, input_shapes={"input": [1, 3, 32, 32]})
    db = tmp_path / "db"

    def crash_after_first_batch(p):
        if p.phase == "tune" and p.trials_done > 0:
            os.kill(os.getpid(), signal.SIGSEGV)

    tcfg = tune_mod.TuneConfig(db_dir=str(db), trials=4, trials_per_iter=2, workers=1,
                               strategy="replay-trace", cost_model="random",
                               measure_default=False, repeat=1, min_repeat_ms=1, seed=0)
    with pytest.raises(AmpError) as e:
        tune_mod.tune(model, amp_cli.ConvertConfig(target="llvm"), tcfg,
                      progress=crash_after_first_batch)
    msg = str(e.value)
    assert "stage 'tune llvm" in msg and "crashed with SIGSEGV" in msg, msg
    assert str(db) in msg and "\n" not in msg
    from amp_cli.compile import records
    lines = (db / records.RECORD_FILE).read_text().splitlines()
    assert lines and all(json.loads(ln) for ln in lines)
    records.open_database(db)  # still a valid database
    # amp-cand-*: candidate libraries of the killed run (tune.py's builder workers); reported
    assert [f for f in amp_temp_files(clean_tmp) if not f.startswith("amp-cand-")] == []


def test_summary_with_non_finite_reference(cli, tmp_path):
    """Regression (found by tests/test_fuzz.py): an output that overflows in the fp32 reference
    too made the CLI's summary line crash on the report's 'inf' strings. The positions where
    the reference itself is inf are not compared: a degenerate reference, not a conversion
    error (the summary and report say so)."""
    g = helper.make_graph(
        [helper.make_node("Exp", ["x"], ["e1"]), helper.make_node("Exp", ["e1"], ["e2"]),
         helper.make_node("Exp", ["e2"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 11])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, 11])])
    path = tmp_path / "exp3.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    out = tmp_path / "out"
    res = cli("convert", path, "-o", out, "--target", "llvm")
    assert res.exit_code == 0, res.output
    assert "degenerate reference" in res.stdout
    worst = json.loads((out / "report.json").read_text())["accuracy"]["worst"]
    assert 0 < worst["reference_nonfinite_share"] < 1


def test_summary_with_constant_reference(cli, tmp_path):
    """A model whose fp32 output is the same on every input (random-init MobileViT's hidden
    state is all 0) gives rel L2 0 whatever the conversion does: the summary and the report
    say the reference is degenerate instead of letting 0 read as 'exact'."""
    g = helper.make_graph(
        [helper.make_node("Mul", ["x", "zero"], ["z"]), helper.make_node("Add", ["z", "one"],
                                                                         ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 6])],
        initializer=[helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]),
                     helper.make_tensor("one", TensorProto.FLOAT, [1], [1.5])])
    path = tmp_path / "const.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    out = tmp_path / "out"
    res = cli("convert", path, "-o", out, "--target", "llvm")
    assert res.exit_code == 0, res.output
    assert "reference is degenerate" in res.stdout and "constant" in res.stdout
    acc = json.loads((out / "report.json").read_text())["accuracy"]
    assert acc["reference_degenerate"].startswith("y: constant") and acc["worst"]["rel_l2"] == 0


def test_degeneracy_of_references():
    from amp_cli.accuracy import degeneracy

    rng = np.random.default_rng(0)
    assert degeneracy(rng.standard_normal(100)) == ""
    assert degeneracy(np.zeros(50)).startswith("all ~0")
    assert degeneracy(np.full(50, 3.0) + 1e-6 * rng.standard_normal(50)).startswith("constant")
    assert degeneracy(np.array([np.inf, 1.0, -2.0])) == ""  # non-finite: reported elsewhere


def test_error_line_picks_the_message_not_the_dump():
    from amp_cli.sandbox import error_line

    tvm_like = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n"
                "ValueError: Check failed: a == b : cross-thread reduction needs ...\n"
                "    for i in range(3):\n    ^^^^^^^^^^^^^^^^^^\n")
    assert error_line(tvm_like).startswith("ValueError: Check failed: a == b")
    assert error_line("something odd\n   ^^^^\n") == "something odd"
    assert error_line("") == "unknown error"
