"""Per-kernel GPU time of an amp library at one input shape, through torch's CUPTI profiler
(it records every kernel of the process, TVM's included). Diagnostic for slow builds:

    python benchmarks/kernel_profile.py OUT/model.so MODEL.onnx --input-shape input:32x3x224x224

prints the kernels by total time per call and writes them as JSON to $OUT/kernel_profile.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("library")
    ap.add_argument("model")
    ap.add_argument("--input-shape", action="append", default=[])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    import amp_cli
    from amp_cli import tvm_compat
    from amp_cli.accuracy import random_inputs
    from amp_cli.config import parse_input_shape

    shapes = dict(parse_input_shape(s) for s in args.input_shape)
    model = amp_cli.load(args.model, input_shapes=shapes)
    dev = tvm_compat.cuda_device()
    vm = tvm_compat.relax_vm(tvm_compat.load_module(args.library), dev)
    feeds = random_inputs(model.inputs, seed=0)
    tensors = [tvm_compat.to_tvm_tensor(feeds[s.name], dev) for s in model.inputs]
    for _ in range(3):
        vm["main"](*tensors)
    dev.sync()
    torch.cuda.init()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.iters):
            vm["main"](*tensors)
        dev.sync()
    per = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            per[ev.name][0] += 1
            per[ev.name][1] += ev.device_time_total if hasattr(ev, "device_time_total") \
                else ev.cuda_time_total
    rows = sorted(({"kernel": k, "calls": c / args.iters, "us": t / args.iters}
                   for k, (c, t) in per.items()), key=lambda r: -r["us"])
    total = sum(r["us"] for r in rows)
    print(f"{total / 1000:.3f} ms of kernels per call, {len(rows)} kernels")
    for r in rows[:args.top]:
        print(f"{r['us']:10.1f} us  {r['calls']:5.1f}x  {r['kernel'][:110]}")
    out = Path(os.environ.get("OUT") or ".") / "kernel_profile.json"
    out.write_text(json.dumps({"library": args.library, "shapes": args.input_shape,
                               "total_us": total, "kernels": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
