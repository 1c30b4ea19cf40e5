"""Dynamic shapes on the GPU (issue 22): one dynamic library vs static builds of each shape.

One invocation, in this order (~8 minutes on the H200 with the defaults):

1. exports, with seeded random weights and no downloads: HF ``BertModel`` with the bert-large
   config (hidden 1024, 16 heads, FFN 4096, vocab 30522; ``--bert-layers`` of its 24 layers,
   default 12 to fit the time: the dynamic/static ratio is per layer) on ``input_ids`` +
   a padding ``attention_mask``, dims ``batch`` and ``sequence``; and torchvision's
   ``--cnn`` (default resnet50, BatchNorm statistics calibrated) with dim ``batch`` (ONNX,
   torch.onnx's TorchScript exporter with ``dynamic_axes``);
2. builds, in parallel ``amp convert`` child processes (``--jobs``), per model: a static
   library for each of ``--batches`` (default 1, 8, 32; BERT at ``--seq`` 128), the dynamic
   library (BERT batch 1..32(8) x sequence 16..512(128); CNN batch 1..32(8)) as amp builds it
   by default (CUDA: symbolic kernels only; llvm: + a static copy at the optimum,
   ``main_optimum``), and the same with that choice flipped (``dynamic.specialize_optimum``,
   build kind ``dynamic + copy`` on CUDA, ``dynamic symbolic-only`` on llvm);
3. times every library at every batch (TVM time_evaluator, the device's timer, after warm-up;
   the GPU otherwise idle), each against the ONNX Runtime fp32 reference of the same inputs;
4. prints one table (latency per batch, dynamic / static ratios, build seconds) and writes
   everything as JSON to --json (default $OUT/dynamic_bench.json, else ./dynamic_bench.json).

The issue's bar: dynamic latency within 1.15x of static at batch 1, 8 and 32, and the dynamic
build within 2x of one static build.

Usage (on the GPU machine, from the repo root; needs torch, transformers, torchvision):
  python benchmarks/dynamic_bench.py                      # cuda, arch of the local GPU
  python benchmarks/dynamic_bench.py --bert-layers 24     # the whole bert-large (longer)
  python benchmarks/dynamic_bench.py --target llvm --tiny --batches 1,2,4   # CPU smoke test
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

T0 = time.perf_counter()
BERT_LARGE = dict(hidden=1024, heads=16, ffn=4096, vocab=30522)
BERT_TINY = dict(hidden=64, heads=4, ffn=128, vocab=1000)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="cuda", help="cuda (local GPU's arch), cuda:sm_90, llvm")
    ap.add_argument("--models", default="bert,cnn", help="comma-separated subset of bert,cnn")
    ap.add_argument("--bert-layers", type=int, default=12,
                    help="encoder layers of the bert-large config (24: the whole model)")
    ap.add_argument("--cnn", default="resnet50", help="a torchvision classification model")
    ap.add_argument("--batches", default="1,8,32", help="static builds and timed batches")
    ap.add_argument("--seq", type=int, default=128, help="BERT sequence length timed")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--opt-batch", type=int, default=8, help="the ranges' optimum batch")
    ap.add_argument("--seq-range", default="16..512", help="BERT's dynamic sequence range")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny models (BERT hidden 64, 2 layers; resnet18 at 64 px): a smoke test")
    ap.add_argument("--no-copy-ab", action="store_true",
                    help="skip the dynamic build with the optimum copy flipped (one build less)")
    ap.add_argument("--jobs", type=int, default=None,
                    help="parallel builds [default: cores // 4, at least 1]")
    ap.add_argument("--build-only", action="store_true",
                    help="only build and compare build times (no GPU needed: --target "
                         "cuda:sm_90 generates the CUDA code on the CPU)")
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--json", default=None,
                    help="where the results go [default: $OUT or the work folder]")
    ap.add_argument("--variant", action="append", default=[],
                    metavar="[MODEL:]NAME=CONFIG.yaml",
                    help="also build the dynamic library with this config and time it beside "
                         "the default (an A/B in one run; repeatable; MODEL: bert or cnn only)")
    ap.add_argument("--workdir", default=None, help="keep the ONNX files and builds here")
    return ap.parse_args(argv)


# --- models ------------------------------------------------------------------------------------

def export_bert(path: Path, layers: int, sizes: dict) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=sizes["vocab"], hidden_size=sizes["hidden"],
                                     num_hidden_layers=layers,
                                     num_attention_heads=sizes["heads"],
                                     intermediate_size=sizes["ffn"])
    model = transformers.BertModel(config).eval()

    class LastHidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids,
                              attention_mask=attention_mask).last_hidden_state

    ids = torch.randint(0, sizes["vocab"], (2, 16))
    mask = torch.ones(2, 16, dtype=torch.int64)
    dims = {0: "batch", 1: "sequence"}
    torch.onnx.export(LastHidden().eval(), (ids, mask), str(path), dynamo=False,
                      input_names=["input_ids", "attention_mask"], output_names=["hidden"],
                      dynamic_axes={"input_ids": dims, "attention_mask": dims,
                                    "hidden": dims}, opset_version=17)


def export_cnn(path: Path, name: str, size: int, tiny: bool) -> str:
    """torchvision's ``name`` (BatchNorm statistics calibrated on random inputs) exported with
    a dynamic batch; without a working torchvision, benchmarks/models.py's ResNet-50 v1.5 (the
    same network, written out; tiny: one block per stage). Returns what was exported."""
    import torch

    torch.manual_seed(0)
    try:
        import torchvision

        model = getattr(torchvision.models, name)(weights=None)
        source = f"torchvision {name}"
    except (ImportError, RuntimeError) as exc:  # RuntimeError: a wheel built for another torch
        from benchmarks.models import resnet50_torch, resnet50_weights

        blocks = (1, 1, 1, 1) if tiny else (3, 4, 6, 3)
        model = resnet50_torch(resnet50_weights(0, blocks), blocks)
        source = f"benchmarks/models.py resnet50 blocks {blocks} (torchvision: {exc})"
        log(f"no working torchvision ({type(exc).__name__}): exporting {source}")
    else:
        model.train()  # BatchNorm statistics from random inputs: random-init ones blow up
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.reset_running_stats()
                m.momentum = None
        with torch.no_grad():
            for _ in range(4):
                model(torch.randn(4, 3, size, size))
    model.eval()
    torch.onnx.export(model, (torch.randn(1, 3, size, size),), str(path), dynamo=False,
                      input_names=["input"], output_names=["logits"],
                      dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
                      opset_version=17)
    return source


# --- builds ------------------------------------------------------------------------------------

def convert(onnx_path: Path, out: Path, target: str, shapes: list[str], config: Path | None):
    """``amp convert`` in a child process (no accuracy check: timed below); (seconds, report)."""
    cmd = [sys.executable, "-m", "amp_cli", "convert", str(onnx_path), "-o", str(out),
           "--target", target, "--no-accuracy", "--force"]
    for s in shapes:
        cmd += ["--input-shape", s]
    if config:
        cmd += ["--config", str(config)]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if res.returncode:
        return wall, {"error": (res.stderr.strip().splitlines() or ["?"])[-1]}
    return wall, json.loads((out / "report.json").read_text())


def flipped_copy_kind(cuda: bool) -> tuple[str, bool]:
    """(build kind, ``dynamic.specialize_optimum``) of the A/B build: the default dynamic build
    with its optimum copy flipped (amp builds one by default on llvm, not on CUDA)."""
    from amp_cli.config import DynamicConfig

    copy = not DynamicConfig().optimum_copy(cuda, None)
    return ("dynamic + copy" if copy else "dynamic symbolic-only"), copy


def plan_builds(args, work: Path, models: dict, cuda: bool = True) -> list[dict]:
    batches = [int(b) for b in args.batches.split(",")]
    flip_kind, flip = flipped_copy_kind(cuda)
    flipped = work / "flipped_copy.yaml"
    flipped.write_text(f"dynamic:\n  specialize_optimum: {str(flip).lower()}\n")
    builds = []
    for name, m in models.items():
        for b in batches:
            builds.append(dict(model=name, kind=f"static b{b}", shapes=m["static"](b),
                               config=None))
        builds.append(dict(model=name, kind="dynamic", shapes=m["dynamic"], config=None))
        if not args.no_copy_ab:
            builds.append(dict(model=name, kind=flip_kind, shapes=m["dynamic"],
                               config=flipped))
        for spec in args.variant:
            vname, _, cfg = spec.partition("=")
            only, _, vname = vname.rpartition(":")
            if not vname or not cfg:
                raise SystemExit(f"--variant {spec!r}: expected [MODEL:]NAME=CONFIG.yaml")
            if only and only != name:
                continue
            builds.append(dict(model=name, kind=f"dynamic {vname}", shapes=m["dynamic"],
                               config=Path(cfg).resolve()))
    for k, b in enumerate(builds):
        b["out"] = work / f"{b['model']}_{k}"
    return builds


# --- timing ------------------------------------------------------------------------------------

def time_builds(args, builds, models, device) -> list[dict]:
    """Every library at every batch, against ONNX Runtime fp32 of the same inputs."""
    import amp_cli
    from amp_cli.accuracy import random_inputs
    from amp_cli.bench.results import BenchConfig
    from amp_cli.bench.runners import bench_library

    cfg = BenchConfig(warmup=args.warmup, repeat=args.repeat)
    rows = []
    for name, m in models.items():
        loaded = amp_cli.load(m["onnx"], input_shapes=m["load_shapes"])
        for b in [int(x) for x in args.batches.split(",")]:
            sizes = {"batch": b, "sequence": args.seq} if name == "bert" else {"batch": b}
            specs = loaded.inputs_at({k: v for k, v in sizes.items() if k in loaded.dynamic})
            feeds = random_inputs(specs, seed=b)
            log(f"{name} b{b}: ONNX Runtime fp32 reference")
            reference = loaded.reference(feeds)
            order = [s.name for s in specs]
            for build in builds:
                if build["model"] != name or "error" in build["report"]:
                    continue
                if build["kind"].startswith("static") and build["kind"] != f"static b{b}":
                    continue
                log(f"{name} b{b}: time {build['kind']}")
                try:
                    r = bench_library(build["kind"], "amp", str(build["out"] / "model.so"),
                                      device, "float16", feeds, order, b, cfg, reference, loaded)
                except Exception as exc:  # noqa: BLE001 - recorded in the table
                    rows.append(dict(model=name, batch=b, build=build["kind"], error=str(exc)))
                    continue
                rows.append(dict(model=name, batch=b, build=build["kind"],
                                 p50_ms=r.latency.p50_ms, mean_ms=r.latency.mean_ms,
                                 min_ms=r.latency.min_ms, rel_l2=r.accuracy.get("rel_l2"),
                                 max_abs=r.accuracy.get("max_abs")))
    return rows


def build_table(builds) -> list[str]:
    """Build seconds per library (amp's own build time and the child process' wall time) and
    each dynamic build against the mean of the model's static builds (issue 22: <= 2x)."""
    lines = [f"{'model':8} {'build':24} {'amp s':>7} {'wall s':>7} {'vs static':>9}"]
    for model in dict.fromkeys(b["model"] for b in builds):
        mine = [b for b in builds if b["model"] == model]
        secs = {b["kind"]: (b["report"].get("build") or {}).get("seconds") for b in mine}
        static = [v for k, v in secs.items() if k.startswith("static") and v]
        base = sum(static) / len(static) if static else None
        for b in mine:
            v = secs[b["kind"]]
            ratio = f"{v / base:.2f}x" if v and base and not b["kind"].startswith("static") \
                else ""
            lines.append(f"{model:8} {b['kind']:24} {v or float('nan'):7.1f} "
                         f"{b['wall_s']:7.1f} {ratio:>9}"
                         + (f"  {b['report']['error']}" if "error" in b["report"] else ""))
    return lines


def summarize(rows, builds, cuda: bool = True) -> list[str]:
    flip_kind, copy = flipped_copy_kind(cuda)
    head = "+copy ms" if copy else "symbolic ms"
    lines = [f"{'model':6} {'batch':>5} {'static ms':>10} {'dynamic ms':>11} {'ratio':>6} "
             f"{head:>12} {'ratio':>6}  rel L2 (static / dynamic)"]
    keyed = {(r["model"], r["batch"], r["build"]): r for r in rows}
    for (model, batch) in sorted({(r["model"], r["batch"]) for r in rows}):
        st = keyed.get((model, batch, f"static b{batch}"), {})
        dy = keyed.get((model, batch, "dynamic"), {})
        sy = keyed.get((model, batch, flip_kind), {})

        def ms(r):
            return f"{r['p50_ms']:.3f}" if "p50_ms" in r else "-"

        def ratio(r):
            return f"{r['p50_ms'] / st['p50_ms']:.2f}" if "p50_ms" in r and "p50_ms" in st \
                else "-"

        def err(r):
            return f"{r['rel_l2']:.2g}" if r.get("rel_l2") is not None else "-"

        lines.append(f"{model:6} {batch:>5} {ms(st):>10} {ms(dy):>11} {ratio(dy):>6} "
                     f"{ms(sy):>12} {ratio(sy):>6}  {err(st)} / {err(dy)}")
    variants = [b["kind"] for b in builds if b["kind"].startswith("dynamic ")
                and b["kind"] != flip_kind]
    for kind in dict.fromkeys(variants):
        lines.append(f"{kind} (ms, vs static / vs dynamic):")
        for (model, batch) in sorted({(r["model"], r["batch"]) for r in rows}):
            v = keyed.get((model, batch, kind), {})
            st = keyed.get((model, batch, f"static b{batch}"), {})
            dy = keyed.get((model, batch, "dynamic"), {})
            if "p50_ms" not in v:
                lines.append(f"  {model:6} {batch:>5} {v.get('error', '-')}")
                continue
            vs = [f"{v['p50_ms'] / r['p50_ms']:.2f}" if "p50_ms" in r else "-" for r in (st, dy)]
            rel = f"{v['rel_l2']:.2g}" if v.get("rel_l2") is not None else "-"
            lines.append(f"  {model:6} {batch:>5} {v['p50_ms']:10.3f} {vs[0]:>6} {vs[1]:>6}"
                         f"  rel L2 {rel}")
    lines.append("build seconds (amp's own, wall in parentheses):")
    for b in builds:
        rep = b["report"]
        secs = (rep.get("build") or {}).get("seconds")
        lines.append(f"  {b['model']:5} {b['kind']:22} "
                     + (f"{secs:7.1f} s ({b['wall_s']:.0f} s)" if secs is not None
                        else f"failed: {rep.get('error')}"))
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    from amp_cli import tvm_compat
    from amp_cli.target import resolve_target

    target = resolve_target(args.target, check_toolchain=False)
    device = "cuda" if target.is_cuda else "cpu"
    if device == "cuda" and not args.build_only and not tvm_compat.has_cuda_device():
        print("no GPU here: run with --target llvm (e.g. --tiny) for a CPU smoke test",
              file=sys.stderr)
        return 2
    target_text = args.target if args.target != "cuda" else \
        f"cuda:sm_{tvm_compat.cuda_compute_version().replace('.', '')}"
    work = Path(args.workdir or tempfile.mkdtemp(prefix="dynamic-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    mb, ob = args.max_batch, args.opt_batch
    seq_lo, seq_hi = (int(x) for x in args.seq_range.split(".."))
    models = {}
    wanted = args.models.split(",")
    if "bert" in wanted:
        path = work / "bert.onnx"
        log(f"export BERT ({'tiny' if args.tiny else 'bert-large config'}, "
            f"{2 if args.tiny else args.bert_layers} layers)")
        export_bert(path, 2 if args.tiny else args.bert_layers,
                    BERT_TINY if args.tiny else BERT_LARGE)
        rng = f"1..{mb}({ob})x{seq_lo}..{seq_hi}({args.seq})"
        models["bert"] = dict(onnx=path, dynamic=[f"input_ids:{rng}"],
                              static=lambda b: [f"input_ids:{b}x{args.seq}"],
                              load_shapes={"input_ids": [f"1..{mb}({ob})",
                                                         f"{seq_lo}..{seq_hi}({args.seq})"]})
    if "cnn" in wanted:
        name, size = ("resnet18", 64) if args.tiny else (args.cnn, 224)
        path = work / "cnn.onnx"
        source = export_cnn(path, name, size, args.tiny)
        log(f"exported {source} ({size} px)")
        models["cnn"] = dict(onnx=path, source=source, dynamic=[f"input:1..{mb}({ob})x3x{size}x{size}"],
                             static=lambda b, s=size: [f"input:{b}x3x{s}x{s}"],
                             load_shapes={"input": [f"1..{mb}({ob})", 3, size, size]})
    builds = plan_builds(args, work, models, target.is_cuda)
    jobs = args.jobs or max(1, (os.cpu_count() or 4) // 4)
    log(f"{len(builds)} builds for {target_text}, {jobs} at a time")

    def run(build):
        build["wall_s"], build["report"] = convert(
            models[build["model"]]["onnx"], build["out"], target_text, build["shapes"],
            build["config"])
        log(f"built {build['model']} {build['kind']} in {build['wall_s']:.0f} s"
            + (f": {build['report']['error']}" if "error" in build["report"] else ""))

    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(run, builds))
    rows = [] if args.build_only else time_builds(args, builds, models, device)
    lines = build_table(builds) if args.build_only else summarize(rows, builds, target.is_cuda)
    print("\n".join(lines))
    out = Path(args.json) if args.json else \
        Path(os.environ.get("OUT") or work) / "dynamic_bench.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "target": target_text, "args": vars(args), "rows": rows,
        "models": {n: {"onnx": str(m["onnx"]), "source": m.get("source", "transformers "
                                                                 "BertModel")}
                   for n, m in models.items()},
        "builds": [{k: (str(v) if isinstance(v, Path) else v) for k, v in b.items()
                    if k != "report"} | {"seconds": (b["report"].get("build") or {})
                                         .get("seconds"), "error": b["report"].get("error"),
                                         "kernels": len((b["report"].get("build") or {})
                                                        .get("kernels", []))}
                   for b in builds], "table": lines}, indent=2, default=str) + "\n")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
