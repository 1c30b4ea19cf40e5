"""Tune a BERT-base encoder layer (fp16, batch 8 x seq 128) on the local GPU, in one invocation.

Builds the layer in code (amp_cli.models.tiny_bert: hidden 768, 12 heads, FFN 3072), converts it
to fp16 with amp, builds the library with amp's default schedules, tunes with `amp tune`'s library call for
--time-budget, rebuilds with the records and times both with the Relax VM's time_evaluator
(median of repeats, after warm-up). Prints a short table last and writes everything to --json.

Usage (on the GPU machine):
  python benchmarks/tune_gpu.py --time-budget 8m --json $OUT/tune_gpu.json [--db $OUT/db]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _time_library(lib_path: str, shape, repeat: int) -> float:
    import tvm
    from tvm import relax

    dev = tvm.cuda(0)
    vm = relax.VirtualMachine(tvm.runtime.load_module(lib_path), dev)
    x = tvm.runtime.tensor(np.random.default_rng(0).standard_normal(shape).astype("float32"),
                           dev)
    vm["main"](x)  # warm-up
    dev.sync()
    f = vm.time_evaluator("main", dev, number=10, repeat=repeat, min_repeat_ms=50)
    return float(np.median(f(x).results)) * 1e3  # ms


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-budget", default="8m", help="tuning budget, e.g. 90s, 8m")
    ap.add_argument("--trials", type=int, default=2000, help="trial cap (the time budget "
                                                             "usually ends the run first)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--db", default=None, help="tuning directory (default: a temp dir)")
    ap.add_argument("--arch", default=None, help="cuda arch (default: the local GPU's)")
    ap.add_argument("--strategy", default="evolutionary")
    ap.add_argument("--cost-model", default="auto")
    ap.add_argument("--trials-per-iter", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--no-tune", action="store_true",
                    help="time default vs tuned with the records already in --db (no tuning)")
    args = ap.parse_args(argv)
    if args.no_tune and not args.db:
        ap.error("--no-tune needs --db")

    import onnx

    import amp_cli
    from amp_cli.convert import convert
    from amp_cli.models import tiny_bert
    from amp_cli.report import versions
    from amp_cli.tuning import TuneConfig, parse_duration, tune

    work = tempfile.mkdtemp(prefix="amp-tune-gpu-")
    db = args.db or os.path.join(work, "db")
    onnx_path = os.path.join(work, "bert_layer.onnx")
    onnx.save(tiny_bert(batch=args.batch, seq=args.seq, hidden=768, heads=12, ffn=3072,
                        layers=1), onnx_path)
    shape = (args.batch, args.seq, 768)
    target = f"cuda:{args.arch}" if args.arch else "cuda"
    model = amp_cli.load(onnx_path)
    cfg = amp_cli.ConvertConfig(target=target)
    cfg.check_accuracy = False

    t0 = time.perf_counter()
    base = convert(model, cfg)
    default_ms = _time_library(base.library, shape, args.repeat)
    default_build_s = time.perf_counter() - t0

    def progress(p):
        if p.phase == "tune":
            best = f"{p.best_ms:.3f} ms" if p.best_ms is not None else "-"
            print(f"  [{p.elapsed_s:6.0f} s] trials {p.trials_done}/{p.trials_total}, tasks "
                  f"{p.tasks_done}/{p.tasks_total}, est. best {best}", file=sys.stderr,
                  flush=True)
        else:
            print(f"  {p.phase}", file=sys.stderr, flush=True)

    tcfg = TuneConfig(db_dir=db, trials=args.trials, strategy=args.strategy,
                      cost_model=args.cost_model, trials_per_iter=args.trials_per_iter,
                      time_budget_s=parse_duration(args.time_budget))
    if args.no_tune:
        from amp_cli.compile.records import read_summary

        res = _summary_result(read_summary(db))
    else:
        res = tune(model, amp_cli.ConvertConfig(target=target), tcfg, progress=progress)

    cfg.tuning_db = db
    tuned = convert(model, cfg)
    tuned_ms = _time_library(tuned.library, shape, args.repeat)
    sched = tuned.build.schedule
    out = {
        "model": f"BERT-base encoder layer fp16, batch {args.batch} x seq {args.seq}",
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "gpu": _gpu_name(), "target": base.target.spec, "versions": versions(),
        "time_budget": args.time_budget, "default_ms": default_ms, "tuned_ms": tuned_ms,
        "speedup": default_ms / tuned_ms if tuned_ms else None,
        "candidates_failed_to_build": res.failed_builds,
        "candidates_failed_to_run": res.failed_runs,
        "trials": res.trials_run, "tuning_seconds": res.seconds, "stopped": res.stopped,
        "cost_model": res.cost_model, "strategy": res.strategy,
        "default_build_s": default_build_s, "kernels_tuned": sched.get("tuned"),
        "kernels_default": sched.get("default"), "tune": res.to_dict(), "schedule": sched,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
    print(f"{'':24}{'latency ms':>12}")
    print(f"{'default (amp rules)':24}{default_ms:12.3f}")
    print(f"{'tuned':24}{tuned_ms:12.3f}   ({out['speedup']:.2f}x)")
    print(f"trials {res.trials_run} in {res.seconds:.0f} s ({res.stopped}), cost model "
          f"{res.cost_model}; candidates failed to build: {res.failed_builds}, to run: "
          f"{res.failed_runs}; kernels tuned {sched.get('tuned')}/"
          f"{(sched.get('tuned') or 0) + (sched.get('default') or 0)}")
    base.cleanup()
    tuned.cleanup()
    return 0


class _summary_result:  # noqa: N801 - stands in for tune()'s result with --no-tune
    """What the report needs from a tuning run, read back from DIR's summary.json."""

    def __init__(self, summary: dict):
        tasks = summary.get("tasks", [])
        self.failed_builds = sum(t.get("failed_builds") or 0 for t in tasks)
        self.failed_runs = sum(t.get("failed_runs") or 0 for t in tasks)
        self.trials_run = summary.get("records", 0)
        self.seconds = 0.0
        self.stopped = "not tuned in this run (--no-tune): records from --db"
        self.cost_model = summary.get("cost_model")
        self.strategy = summary.get("strategy")
        self.summary = summary

    def to_dict(self):
        return {"from_summary": self.summary}


def _gpu_name() -> str | None:
    import subprocess

    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None


if __name__ == "__main__":
    sys.exit(main())
