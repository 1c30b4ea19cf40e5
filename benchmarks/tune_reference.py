"""Build (or extend) the reference tuning records in examples/tuned/ with `amp tune`.

Writes the suite's two models (benchmarks/models.py: resnet50 at batch 8, and bert-large at
batch 8 x seq 128 with 2 encoder layers -- its kernels are the 24-layer model's, so the records
apply to it) as ONNX into a temporary folder, copies --db into a temporary work database, runs,
for each model,

  amp tune <model>.onnx --db WORK --target TARGET --trials N --time-budget T

one after the other, and writes WORK back into --db compacted (amp_cli.tuning.compact_database:
the best record per kernel, ~1 MB instead of the search history's ~6 MB). Rerunning resumes
from --db, so the records can be built up over several runs of a few minutes each. Apply them
with `amp convert ... --tuning-db examples/tuned` or `benchmarks/gpu_suite.py --tuning-db
examples/tuned`.

Usage (on the GPU machine, from the repo root):
  python benchmarks/tune_reference.py --time-budget 150s            # per model
  python benchmarks/tune_reference.py --models resnet50 --db /tmp/db --time-budget 10m
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def reference_models(names: list[str], batch: int):
    """The gpu suite's models, bert-large with 2 layers (same kernels, a 2-layer build)."""
    import models as bm

    suite = bm.gpu_suite(layers=2, batch=batch)
    known = {m.name.split("-")[0]: m for m in suite}
    unknown = [n for n in names if n.split("-")[0] not in known]
    if unknown:
        raise SystemExit(f"unknown model(s) {', '.join(unknown)}; choose from "
                         f"resnet50, bert-large")
    return [known[n.split("-")[0]] for n in names]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50,bert-large",
                    help="comma-separated subset of resnet50,bert-large")
    ap.add_argument("--db", default=str(ROOT / "examples" / "tuned"), help="tuning directory")
    ap.add_argument("--target", default="cuda:sm_90")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--trials", type=int, default=3000,
                    help="trial cap per model over all runs (the time budget usually ends a "
                         "run first)")
    ap.add_argument("--time-budget", default="150s", help="per model and run, e.g. 150s, 8m")
    ap.add_argument("--workdir", default=None, help="where the ONNX files go (default: temp)")
    args = ap.parse_args(argv)

    import onnx

    from amp_cli.compile.records import WORKLOAD_FILE
    from amp_cli.tuning import compact_database

    suite = reference_models([n for n in args.models.split(",") if n], args.batch)
    db = Path(args.db)
    failed = []
    with tempfile.TemporaryDirectory(prefix="amp-tune-ref-") as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        work_db = Path(tmp) / "db"
        if db.exists():
            shutil.copytree(db, work_db)
        for m in suite:
            path = work / f"{m.name}.onnx"
            onnx.save(m.make_onnx(m.make_weights()), str(path))
            cmd = [sys.executable, "-m", "amp_cli", "tune", str(path), "--db", str(work_db),
                   "--target", args.target, "--trials", str(args.trials),
                   "--time-budget", args.time_budget]
            print(f"== {m.name}: amp tune {path.name} --db {db} ...", flush=True)
            t = time.perf_counter()
            rc = subprocess.call(cmd, cwd=ROOT)
            print(f"== {m.name}: exit {rc} after {time.perf_counter() - t:.0f} s", flush=True)
            if rc:
                failed.append(m.name)
        if (work_db / WORKLOAD_FILE).exists():
            kept = compact_database(work_db, db)
            print(f"== wrote {db}: best record of {kept} kernels", flush=True)
    if failed:
        print(f"amp tune failed for {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
