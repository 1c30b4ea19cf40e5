"""amp tune: records written, kill -9 + resume, convert with the records, RPC tracker runs.

Everything runs on the llvm target with a tiny MatMul+Add+Relu model (3 kernels after the fp16
conversion) and a handful of trials.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from amp_cli.cli import main
from amp_cli.compile.records import RECORD_FILE, SUMMARY_FILE, WORKLOAD_FILE, repair_database
from amp_cli.tuning import compact_database, parse_duration

FAST = ["--target", "llvm", "--trials-per-iter", "3", "--workers", "2", "--cost-model",
        "random", "--seed", "0"]


def _tiny_onnx(path: Path, n: int | str = 32, k=48, m=40) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((k, m)) * 0.1).astype("float32"), "w")
    b = numpy_helper.from_array((rng.standard_normal(m) * 0.1).astype("float32"), "b")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
             helper.make_node("Add", ["y", "b"], ["z"], name="add"),
             helper.make_node("Relu", ["z"], ["out"], name="relu")]
    g = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                        [n, k])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [n, m])],
                          [w, b])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # MetaSchedule's TuneContext imports the tensor intrinsics (~30 s of CPU); importing them here
    # once lets every forked tuning child of this test process skip that.
    import tvm.s_tir.tensor_intrin  # noqa: F401

    return _tiny_onnx(tmp_path_factory.mktemp("tune") / "tiny.onnx")


def _valid_lines(path: Path) -> int:
    n = 0
    for line in path.read_text().splitlines():
        if line.strip():
            json.loads(line)  # must parse
            n += 1
    return n


def _run(args):
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    return res


# ---------------------------------------------------------------------------------------------
def test_parse_duration_and_help():
    assert parse_duration("30m") == 1800
    assert parse_duration("1h30m") == 5400
    assert parse_duration("90s") == 90
    assert parse_duration("45") == 45
    res = CliRunner().invoke(main, ["tune", "--help"])
    assert res.exit_code == 0
    for word in ("ansor", "autotvm", "ReplayTrace", "EvolutionarySearch", "--rpc-tracker",
                 "--time-budget"):
        assert word in res.output


def test_repair_drops_truncated_last_line(tmp_path):
    (tmp_path / WORKLOAD_FILE).write_text('["1","abc"]\n')
    (tmp_path / RECORD_FILE).write_text('[0,[[],[],[1e-6]]]\n[0,[[],[],[2e-6]]]\n[0,[[["Get')
    notes = repair_database(tmp_path)
    assert notes and "dropped 1" in notes[0]
    assert _valid_lines(tmp_path / RECORD_FILE) == 2
    assert (tmp_path / RECORD_FILE).read_text().endswith("\n")


def test_tune_writes_records_and_convert_uses_them(tiny, tmp_path):
    db = tmp_path / "db"
    res = _run(["tune", str(tiny), "--db", str(db), "--trials", "6", *FAST])
    assert res.exit_code == 0, res.output
    assert "records in all" in res.output
    n = _valid_lines(db / RECORD_FILE)
    assert n >= 6
    summary = json.loads((db / SUMMARY_FILE).read_text())
    assert summary["records"] == n and len(summary["tasks"]) == 3
    assert all(t["default_us"] for t in summary["tasks"])  # amp's default schedule was timed

    # rerun with the budget spent: nothing is measured again
    res = _run(["tune", str(tiny), "--db", str(db), "--trials", "6", *FAST])
    assert res.exit_code == 0, res.output
    assert "already tuned" in res.output
    assert _valid_lines(db / RECORD_FILE) == n

    # convert with the records: the report says per kernel tuned/default
    out = tmp_path / "out"
    res = _run(["convert", str(tiny), "-o", str(out), "--target", "llvm", "--tuning-db",
                str(db), "--no-accuracy"])
    assert res.exit_code == 0, res.output
    report = json.loads((out / "report.json").read_text())
    sched = report["build"]["schedule"]
    assert sched["tuned"] + sched["default"] == 3
    assert sched["tuned"] >= 1, sched  # the matmul's tuned record beats amp's default
    assert {k["schedule"] for k in sched["kernels"]} <= {"tuned", "default"}
    assert "tuned" in (out / "report.md").read_text()

    # the compacted copy (what one commits) keeps the best record per kernel and applies the
    # same schedules
    small = tmp_path / "small"
    kept = compact_database(db, small)
    best = {}
    for line in (db / RECORD_FILE).read_text().splitlines():
        wl, (_trace, secs, *_rest) = json.loads(line)
        if secs:
            best[wl] = min(best.get(wl, 1e9), sum(secs) / len(secs))
    assert kept == _valid_lines(small / RECORD_FILE) == len(best)
    secs = [json.loads(line)[1][1] for line in (small / RECORD_FILE).read_text().splitlines()]
    assert sorted(sum(s) / len(s) for s in secs) == pytest.approx(sorted(best.values()))
    assert json.loads((small / SUMMARY_FILE).read_text())["compacted"]["records"] == kept
    out2 = tmp_path / "out2"
    res = _run(["convert", str(tiny), "-o", str(out2), "--target", "llvm", "--tuning-db",
                str(small), "--no-accuracy"])
    assert res.exit_code == 0, res.output
    sched2 = json.loads((out2 / "report.json").read_text())["build"]["schedule"]
    assert [(k["kernel"], k["schedule"]) for k in sched2["kernels"]] == \
        [(k["kernel"], k["schedule"]) for k in sched["kernels"]]

    base = tmp_path / "base"
    res = _run(["convert", str(tiny), "-o", str(base), "--target", "llvm", "--no-accuracy"])
    assert res.exit_code == 0, res.output
    t_tuned, t_default = _latency(out / "model.so"), _latency(base / "model.so")
    ratio = t_tuned / t_default
    print(f"\ntuned {t_tuned * 1e6:.1f} us vs default {t_default * 1e6:.1f} us: "
          f"ratio tuned/default {ratio:.3f}")
    assert ratio < 2.0  # generous: 2 shared cores make timing noisy


def test_tuned_dynamic_build_applies_the_records_to_its_optimum_copy(tmp_path):
    """``amp tune`` of a model with a dynamic batch tunes the optimum's kernels; ``amp convert
    --tuning-db`` with the same range builds the optimum copy (unset ``specialize_optimum``
    turns it on for tuning records) and applies the records there; every shape in the range
    still runs, checked against ORT fp32 at the range's min / optimum / max."""
    model = _tiny_onnx(tmp_path / "dyn.onnx", n="batch")
    db = tmp_path / "db"
    res = _run(["tune", str(model), "--db", str(db), "--trials", "6", "--dynamic",
                "batch=1..64@32", *FAST])
    assert res.exit_code == 0, res.output
    out = tmp_path / "out"
    res = _run(["convert", str(model), "-o", str(out), "--target", "llvm", "--tuning-db",
                str(db), "--dynamic", "batch=1..64@32"])
    assert res.exit_code == 0, res.output
    report = json.loads((out / "report.json").read_text())
    assert set(report["build"]["variants"]) == {"main_optimum", "main_dynamic"}
    tuned = {k["kernel"] for k in report["build"]["schedule"]["kernels"]
             if k["schedule"] == "tuned"}
    assert tuned and tuned <= set(report["build"]["variants"]["main_optimum"])
    assert [p["dims"]["batch"] for p in report["accuracy"]["points"]] == [1, 32, 64]
    assert report["accuracy"]["within_tolerance"]


def _latency(lib: Path) -> float:
    import tvm
    from tvm import relax

    dev = tvm.cpu(0)
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(lib)), dev)
    x = tvm.runtime.tensor(np.random.default_rng(0).standard_normal((32, 48)).astype("float32"),
                           dev)
    f = vm.time_evaluator("main", dev, number=50, repeat=15, min_repeat_ms=20)
    return float(np.median(f(x).results))


# ---------------------------------------------------------------------------------------------
def test_kill9_then_resume(tiny, tmp_path):
    db = tmp_path / "db"
    cmd = [sys.executable, "-m", "amp_cli", "tune", str(tiny), "--db", str(db), "--trials",
           "200", "--trials-per-iter", "2", "--workers", "2", "--cost-model", "random",
           "--target", "llvm", "--seed", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    records = db / RECORD_FILE
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if records.exists() and records.read_text().count("\n") >= 3:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert records.exists(), "no record written within 300 s"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole run: CLI, sandbox child, workers
        proc.wait()
    # as if the kill hit in the middle of a write
    with open(records, "a") as f:
        f.write('[0,[[["GetSBlock",[],["ro')
    before = records.read_text().count("\n")
    assert before >= 3
    res = _run(["tune", str(tiny), "--db", str(db), "--trials", str(before + 3), *FAST])
    assert res.exit_code == 0, res.output
    after = _valid_lines(records)  # every line parses: the torn one is gone
    assert after >= before + 1, (before, after)
    summary = json.loads((db / SUMMARY_FILE).read_text())
    assert summary["records"] == after
    run = summary["runs"][-1]
    print(f"\nkilled run left {before} records; the rerun measured {run['trials']} more, "
          f"skipped {run['skipped_measured']} already-measured candidates")


# ---------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rpc_tracker_serves_tuning(tiny, tmp_path):
    from tvm import rpc

    port = _free_port()
    key = "amp-test-cpu"
    tracker = subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host",
                                "127.0.0.1", "--port", str(port), "--port-end",
                                str(port + 1)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    server = None
    try:
        deadline = time.time() + 60
        while True:
            try:
                rpc.connect_tracker("127.0.0.1", port).summary()
                break
            except Exception:  # noqa: BLE001 - not up yet
                assert time.time() < deadline, "RPC tracker did not start"
                time.sleep(0.5)
        sport = _free_port()
        server = subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_server", "--host",
                                   "127.0.0.1", "--port", str(sport), "--port-end",
                                   str(sport + 20), "--tracker",
                                   f"127.0.0.1:{port}", "--key", key],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        while True:
            assert server.poll() is None, "RPC server exited"
            queue = rpc.connect_tracker("127.0.0.1", port).summary().get("queue_info", {})
            if queue.get(key, {}).get("free", 0) >= 1:
                break
            assert time.time() < deadline + 60, "RPC server did not register"
            time.sleep(0.5)
        db = tmp_path / "db"
        res = _run(["tune", str(tiny), "--db", str(db), "--trials", "3", *FAST,
                    "--rpc-tracker", f"127.0.0.1:{port}", "--rpc-key", key])
        assert res.exit_code == 0, res.output
        summary = json.loads((db / SUMMARY_FILE).read_text())
        assert summary["records"] >= 3
        assert any(t["valid_records"] for t in summary["tasks"])  # measured over RPC
    finally:
        for p in (server, tracker):
            if p is not None:
                os.killpg(p.pid, signal.SIGKILL)  # with the server's session workers
                p.wait()


def test_rpc_tracker_unreachable_is_one_line_error(tiny, tmp_path):
    res = _run(["tune", str(tiny), "--db", str(tmp_path / "db"), "--trials", "2", *FAST,
                "--rpc-tracker", f"127.0.0.1:{_free_port()}", "--rpc-key", "nobody"])
    assert res.exit_code == 1
    assert "amp: error:" in res.output and "RPC tracker" in res.output


def test_database_with_tensor_core_records_opens_in_a_fresh_process(tmp_path):
    """Records of tensor-core schedules name their tensor intrinsics (``wmma_fill_16x16x16_f32``
    ...), which exist only once ``tvm.s_tir.tensor_intrin`` is imported. The build that applies a
    database runs in a fresh (isolated) process; it must register them before reading, or TVM
    raises "TensorIntrin 'wmma_fill_16x16x16_f32' is not registered" (seen on the H200 after an
    `amp tune` of a BERT layer). The record here is amp's own wmma schedule of a GEMM."""
    import tvm
    from tvm import te

    from amp_cli import tvm_compat
    from amp_cli.backends.cuda.kernels import tc_gemm

    a = te.placeholder((256, 256), "float16", name="A")
    b = te.placeholder((256, 256), "float16", name="B")
    r = te.reduce_axis((0, 256), name="k")
    c = te.compute((256, 256), lambda i, j: te.sum(
        a[i, r].astype("float32") * b[j, r].astype("float32"), axis=r), name="C")
    func = te.create_prim_func([a, b, c]).with_attr("global_symbol", "main")
    sch = tc_gemm.schedule_gemm(func, "float16", "float32", 1, [256, 256, 256], 90)
    assert "wmma_fill" in str(sch.trace)
    ms = tvm_compat.meta_schedule()
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    db = ms.database.JSONDatabase(work_dir=str(tmp_path), allow_missing=True)
    wl = db.commit_workload(tvm.IRModule({"main": func}))
    db.commit_tuning_record(ms.database.TuningRecord(sch.trace, wl, [1e-5], target, None))
    code = ("import sys; from amp_cli.compile.records import open_database; "
            "print('records', len(open_database(sys.argv[1])))")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, timeout=300, cwd=str(Path(__file__).resolve().parents[2]))
    assert proc.returncode == 0, proc.stderr[-1500:]
    assert "records 1" in proc.stdout


def test_prescheduled_kernels_are_not_tuning_tasks():
    """amp's own kernels carry tirx.is_scheduled on the PrimFunc (not on the task's module):
    extract_tasks still lists them, amp's filter drops them."""
    import tvm
    from tvm import relax, te
    from tvm.s_tir import meta_schedule as ms

    from amp_cli.tuning.tasks import tunable_tasks

    a = te.placeholder((64, 64), name="a")

    def prim(name, scheduled):
        out = te.compute((64, 64), lambda i, j: a[i, j] * (2.0 if scheduled else 3.0), name=name)
        f = te.create_prim_func([a, out])
        return f.with_attr("tirx.is_scheduled", True) if scheduled else f

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((64, 64), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            mine = bb.add_func(prim("mine", True), "amp_own")
            other = bb.add_func(prim("other", False), "plain")
            y = bb.emit(relax.call_tir(mine, (x,), relax.TensorType((64, 64), "float32")))
            z = bb.emit(relax.call_tir(other, (y,), relax.TensorType((64, 64), "float32")))
            out = bb.emit_output(z)
        bb.emit_func_output(out)
    tasks = ms.relax_integration.extract_tasks(bb.get(), tvm.target.Target("llvm"))
    assert len(tasks) == 2
    assert [t.task_name for t in tunable_tasks(tasks)] == ["plain"]


@pytest.mark.parametrize("hopper", [True, False])
def test_hopper_gemms_are_not_tuning_tasks(tmp_path, hopper):
    """On sm_90 the Hopper GEMM pass runs before the tuning capture (and before tuning records
    are applied): the GEMM it takes is scheduled already and drops out of the tasks; with
    ``cuda.hopper_gemm`` off the same GEMM is a task again."""
    from tvm.s_tir import meta_schedule as ms

    from amp_cli.config import ConvertConfig, CudaConfig
    from amp_cli.ir_attrs import TIRX_KERNEL as TIRX_ATTR
    from amp_cli.frontend import load
    from amp_cli.target import resolve_target
    from amp_cli.tuning.tasks import fused_module, tunable_tasks, tuning_target

    model = load(_tiny_onnx(tmp_path / "gemm.onnx", n=256, k=512, m=256))
    cfg = ConvertConfig(target="cuda:sm_90", cuda=CudaConfig(hopper_gemm=hopper))
    target = resolve_target(cfg.target)
    fused = fused_module(model, cfg, target)
    hopper_funcs = [gv.name_hint for gv, f in fused.functions_items()
                    if f.attrs is not None and f.attrs.get(TIRX_ATTR, False)]
    tasks = tunable_tasks(ms.relax_integration.extract_tasks(fused, tuning_target(target)))
    gemm_tasks = [t.task_name for t in tasks if "matmul" in t.task_name]
    if hopper:
        assert len(hopper_funcs) == 1 and not gemm_tasks, (hopper_funcs, gemm_tasks)
    else:
        assert not hopper_funcs and len(gemm_tasks) == 1, (hopper_funcs, gemm_tasks)


def test_progress_callback_unpickles_in_a_fresh_interpreter():
    """On a GPU machine the tuning runs in a spawned child and `amp tune`'s progress callback is
    pickled to it. Unpickling imports the callback's module in a fresh interpreter; when that was
    cli_tune, the import was circular (cli_tune -> cli -> cli_tune) and every `amp tune` on the
    H200 died before tuning."""
    import pickle

    from amp_cli.cli.tune import tune  # noqa: F401 - the CLI as the parent has it loaded
    from amp_cli.cli.progress import TuneBar

    bar = TuneBar()
    try:
        blob = pickle.dumps(bar.update)
    finally:
        bar.close()
    code = "import pickle, sys; f = pickle.loads(sys.stdin.buffer.read()); print(callable(f))"
    proc = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True,
                          timeout=120, cwd=str(Path(__file__).resolve().parents[2]))
    assert proc.returncode == 0, proc.stderr.decode()[-1500:]
    assert proc.stdout.decode().strip() == "True"


def test_search_order_puts_the_largest_share_of_default_time_first():
    from amp_cli.tuning import TaskResult
    from amp_cli.tuning.tasks import search_order

    tasks = [TaskResult(task="cast", workload="a", weight=1, default_us=4.0),
             TaskResult(task="conv_x5", workload="b", weight=5, default_us=17.0),  # 85 us
             TaskResult(task="untimed", workload="c", weight=9, default_us=None),
             TaskResult(task="stem", workload="d", weight=1, default_us=40.0),
             TaskResult(task="cast_x3", workload="e", weight=3, default_us=4.0)]  # 12 us
    assert [tasks[i].task for i in search_order(tasks)] == \
        ["conv_x5", "stem", "cast_x3", "cast", "untimed"]


def test_evolutionary_population_follows_trials_per_iter():
    from amp_cli.tuning import TuneConfig
    from amp_cli.tuning.search import search_strategy

    s = search_strategy("evolutionary", TuneConfig(db_dir="db"))
    assert (s.population_size, s.init_min_unmeasured) == (128, 50)  # 8 x 16, not TVM's 512
    s = search_strategy("evolutionary", TuneConfig(db_dir="db", trials_per_iter=4, population=20))
    assert (s.population_size, s.init_min_unmeasured) == (20, 20)
    assert type(search_strategy("replay-trace", TuneConfig(db_dir="db"))).__name__ == \
        "ReplayTrace"


def test_first_round_goes_to_the_kernel_with_most_default_time(tiny, tmp_path):
    # one round of 3 trials: only the first task in the scheduler's order is measured, and
    # that must be the one with the largest weight x default latency, not the first extracted
    db = tmp_path / "db"
    res = _run(["tune", str(tiny), "--db", str(db), "--trials", "3", "--population", "16",
                *FAST])
    assert res.exit_code == 0, res.output
    tasks = json.loads((db / SUMMARY_FILE).read_text())["tasks"]
    share = {t["task"]: t["weight"] * t["default_us"] for t in tasks}
    tuned = [t["task"] for t in tasks if t["records"]]
    assert tuned == [max(share, key=share.get)], (tuned, share)
