"""The CPU benchmark suite: amp llvm fp16 and fp32 vs ONNX Runtime fp32 (CPU provider).

Models (benchmarks/models.py, random weights, nothing downloaded): resnet50 at 1x3x224x224
and a BERT-base-shaped encoder (hidden 768, 12 heads, FFN 3072, --bert-layers layers) on
token ids 1x128. Each model goes through the library call ``amp bench`` makes
(``amp_cli.bench.bench`` with compare fp32,ort): amp converts and builds it for llvm (the host
CPU), times it with TVM's time_evaluator after warm-up, and measures every runner against ONNX
Runtime fp32 on the same seeded inputs.

Usage (from the repo root):
  python benchmarks/cpu_suite.py [--models resnet50,bert] [--bert-layers 4] [--threads N]
                                 [--warmup 5] [--repeat 30] [--json cpu_suite.json]
                                 [--markdown]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="resnet50,bert")
    ap.add_argument("--bert-layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--json", default=None, help="default: $OUT/cpu_suite.json or ./")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = ap.parse_args(argv)

    import onnx

    import amp_cli
    from amp_cli.bench import BenchConfig, bench, format_table
    from amp_cli.report import versions, write_json
    from benchmarks import models as bm

    wanted = {m.strip().split("-")[0] for m in args.models.split(",") if m.strip()}
    suite = [m for m in bm.cpu_suite(args.bert_layers) if m.name.split("-")[0] in wanted]
    work = Path(tempfile.mkdtemp(prefix="amp-cpu-suite-"))
    cfg = BenchConfig(warmup=args.warmup, repeat=args.repeat, compare=["fp32", "ort"],
                      threads=args.threads)
    from amp_cli.hardware import effective_num_threads

    out = {"suite": "cpu", "schema_version": 1, "cpu": cpu_model(), "cores": os.cpu_count(),
           "threads": args.threads or effective_num_threads(default_only=True),
           "date": time.strftime("%Y-%m-%d"), "versions": versions(),
           "command": "python benchmarks/cpu_suite.py " + " ".join(argv or sys.argv[1:]),
           "models": {}}
    rows = []
    for m in suite:
        t0 = time.perf_counter()
        path = work / f"{m.name}.onnx"
        onnx.save(m.make_onnx(m.make_weights()), str(path))
        print(f"[cpu_suite] {m.name}: {m.description}", file=sys.stderr, flush=True)
        res = bench(amp_cli.load(path), cfg, amp_cli.ConvertConfig(target="llvm"),
                    progress=lambda s, n=m.name: print(f"[cpu_suite] {n}: {s}",
                                                       file=sys.stderr, flush=True))
        print(format_table(res), file=sys.stderr)
        out["models"][m.name] = {"description": m.description, **res.to_dict(),
                                 "wall_s": time.perf_counter() - t0}
        ort = res.runner("ort")
        for r in res.runners:
            rows.append((m.name, r, ort))
    json_path = Path(args.json or Path(os.environ.get("OUT", ".")) / "cpu_suite.json")
    write_json(json_path, out)
    print(render(out, rows, markdown=args.markdown))
    print(f"wrote {json_path}")
    return 0


def render(out: dict, rows, markdown: bool) -> str:
    head = ["model", "runner", "p50 ms", "mean ms", "p99 ms", "items/s", "vs ORT (p50)",
            "rel L2 vs fp32", "cosine", "build s"]
    body = []
    for name, r, ort in rows:
        if not r.ok:
            body.append([name, r.name, r.error or r.skipped] + [""] * (len(head) - 3))
            continue
        s, a = r.latency, r.accuracy or {}
        vs = f"{s.p50_ms / ort.latency.p50_ms:.2f}x" if ort is not None and ort.ok else "-"
        body.append([name, r.name, f"{s.p50_ms:.2f}", f"{s.mean_ms:.2f}", f"{s.p99_ms:.2f}",
                     f"{s.throughput_per_s:.1f}", vs, f"{a.get('rel_l2', float('nan')):.2e}",
                     f"{a.get('cosine', float('nan')):.6f}",
                     f"{r.build_seconds:.0f}" if r.build_seconds else "-"])
    title = (f"amp CPU suite: {out['cpu']}, {out['cores']} cores, {out['threads']} threads, "
             f"{out['date']}")
    if markdown:
        lines = [title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(head)]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in body]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
