"""CPU benchmark: amp llvm fp32 (amp's untuned CPU schedules) vs stock TVM vs ONNX Runtime.

Models are built in code with random weights (onnx.helper; nothing is downloaded):
  * resnet50: a ResNet-50 v1.5-shaped graph (Conv+BatchNormalization+Relu, bottlenecks
    [3, 4, 6, 3], MaxPool, GlobalAveragePool, Gemm 2048->1000) at 1x3x224x224.
  * bert: a BERT-base-shaped encoder (hidden 768, 12 heads, FFN 3072, GELU via Erf,
    LayerNormalization) at 1x128 taking the embedding output [1, 128, 768] as input
    (no embedding gather / attention mask).

Usage:
  python benchmarks/cpu_bench.py [--models resnet50,bert] [--bert-layers 12] [--threads N]
                                 [--stock-tvm] [--repeat 20] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


# --------------------------------------------------------------------------------------------
# Model builders
# --------------------------------------------------------------------------------------------
class _Graph:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits = [], []
        self.n = 0

    def name(self, hint: str) -> str:
        self.n += 1
        return f"{hint}_{self.n}"

    def const(self, arr: np.ndarray, hint: str = "w") -> str:
        from onnx import numpy_helper

        nm = self.name(hint)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), nm))
        return nm

    def op(self, op_type: str, inputs: list, hint: str | None = None, **attrs) -> str:
        from onnx import helper

        out = self.name(hint or op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], **attrs))
        return out

    def model(self, inp, out, name: str, opset: int = 17):
        from onnx import TensorProto, helper

        (iname, ishape), (oname, oshape) = inp, out
        graph = helper.make_graph(
            self.nodes, name,
            [helper.make_tensor_value_info(iname, TensorProto.FLOAT, ishape)],
            [helper.make_tensor_value_info(oname, TensorProto.FLOAT, oshape)],
            initializer=self.inits)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        m.ir_version = 8
        return m


def _conv_bn(g: _Graph, x: str, cin: int, cout: int, k: int, stride: int, relu: bool) -> str:
    r = g.rng
    w = (r.standard_normal((cout, cin, k, k)) * math.sqrt(2.0 / (cin * k * k))).astype("float32")
    pad = k // 2
    y = g.op("Conv", [x, g.const(w)], kernel_shape=[k, k], strides=[stride, stride],
             pads=[pad] * 4)
    gamma = r.uniform(0.5, 1.0, cout).astype("float32")
    beta = r.uniform(-0.1, 0.1, cout).astype("float32")
    mean = r.uniform(-0.1, 0.1, cout).astype("float32")
    var = r.uniform(0.5, 1.5, cout).astype("float32")
    y = g.op("BatchNormalization", [y, g.const(gamma), g.const(beta), g.const(mean),
                                    g.const(var)], epsilon=1e-5)
    return g.op("Relu", [y]) if relu else y


def build_resnet50(seed: int = 0, blocks=(3, 4, 6, 3), num_classes: int = 1000,
                   image: int = 224):
    """ResNet-50 v1.5 topology (stride on the 3x3 conv) with random weights, NCHW."""
    g = _Graph(seed)
    x = _conv_bn(g, "input", 3, 64, 7, 2, True)
    x = g.op("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for stage, nblk in enumerate(blocks):
        width = 64 * 2 ** stage
        for b in range(nblk):
            stride = 2 if (b == 0 and stage > 0) else 1
            y = _conv_bn(g, x, cin, width, 1, 1, True)
            y = _conv_bn(g, y, width, width, 3, stride, True)
            y = _conv_bn(g, y, width, width * 4, 1, 1, False)
            sc = _conv_bn(g, x, cin, width * 4, 1, stride, False) if b == 0 else x
            x = g.op("Relu", [g.op("Add", [y, sc])])
            cin = width * 4
    x = g.op("GlobalAveragePool", [x])
    x = g.op("Flatten", [x], axis=1)
    fw = (g.rng.standard_normal((num_classes, cin)) / math.sqrt(cin)).astype("float32")
    fb = g.rng.uniform(-0.1, 0.1, num_classes).astype("float32")
    x = g.op("Gemm", [x, g.const(fw), g.const(fb)], "logits", transB=1)
    return g.model(("input", [1, 3, image, image]), (x, [1, num_classes]), "resnet50")


def _layernorm(g: _Graph, x: str, hidden: int) -> str:
    gamma = g.rng.uniform(0.8, 1.2, hidden).astype("float32")
    beta = g.rng.uniform(-0.1, 0.1, hidden).astype("float32")
    return g.op("LayerNormalization", [x, g.const(gamma), g.const(beta)], axis=-1,
                epsilon=1e-12)


def _dense(g: _Graph, x: str, din: int, dout: int) -> str:
    w = (g.rng.standard_normal((din, dout)) * 0.02 * math.sqrt(768 / din)).astype("float32")
    b = g.rng.uniform(-0.02, 0.02, dout).astype("float32")
    return g.op("Add", [g.op("MatMul", [x, g.const(w)]), g.const(b)])


def build_bert(seed: int = 0, layers: int = 12, seq: int = 128, hidden: int = 768,
               heads: int = 12, ffn: int = 3072):
    """BERT-base encoder stack (post-LN) on the embedding output [1, seq, hidden]."""
    g = _Graph(seed)
    dh = hidden // heads
    x = "hidden_states"
    split = g.const(np.array([1, seq, heads, dh], "int64"), "shape")
    merge = g.const(np.array([1, seq, hidden], "int64"), "shape")
    scale = g.const(np.array(1.0 / math.sqrt(dh), "float32"), "scale")
    half = g.const(np.array(0.5, "float32"), "c")
    one = g.const(np.array(1.0, "float32"), "c")
    rsqrt2 = g.const(np.array(1.0 / math.sqrt(2.0), "float32"), "c")
    for _ in range(layers):
        q = g.op("Transpose", [g.op("Reshape", [_dense(g, x, hidden, hidden), split])],
                 perm=[0, 2, 1, 3])
        k = g.op("Transpose", [g.op("Reshape", [_dense(g, x, hidden, hidden), split])],
                 perm=[0, 2, 3, 1])
        v = g.op("Transpose", [g.op("Reshape", [_dense(g, x, hidden, hidden), split])],
                 perm=[0, 2, 1, 3])
        s = g.op("Mul", [g.op("MatMul", [q, k]), scale])
        p = g.op("Softmax", [s], axis=-1)
        ctx = g.op("Transpose", [g.op("MatMul", [p, v])], perm=[0, 2, 1, 3])
        ctx = g.op("Reshape", [ctx, merge])
        x = _layernorm(g, g.op("Add", [x, _dense(g, ctx, hidden, hidden)]), hidden)
        h = _dense(g, x, hidden, ffn)
        h = g.op("Mul", [g.op("Mul", [h, half]),
                         g.op("Add", [g.op("Erf", [g.op("Mul", [h, rsqrt2])]), one])])
        x = _layernorm(g, g.op("Add", [x, _dense(g, h, ffn, hidden)]), hidden)
    x = g.op("Identity", [x], "last_hidden_state")
    return g.model(("hidden_states", [1, seq, hidden]), (x, [1, seq, hidden]), "bert")


# --------------------------------------------------------------------------------------------
# Runners
# --------------------------------------------------------------------------------------------
def _time(fn, warmup: int, repeat: int) -> dict:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    ts.sort()
    return {"median_ms": ts[len(ts) // 2], "min_ms": ts[0], "runs": repeat}


def run_ort(model, x, threads, warmup, repeat):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    out = sess.run(None, {name: x})[0]
    return out, _time(lambda: sess.run(None, {name: x}), warmup, repeat)


def build_tvm(model, stock: bool, fast_math: bool = False):
    from amp_cli import tvm_compat
    from amp_cli.schedule import cpu as sched

    tvm = tvm_compat.tvm()
    mod = tvm_compat.from_onnx(model)
    target = tvm.target.Target(sched.host_llvm_target())
    t0 = time.perf_counter()
    if stock:
        from tvm.relax.backend.cpu_generic import get_default_pipeline

        ex = tvm_compat.compile_relax(mod, target, get_default_pipeline(target))
        stats = {}
    else:
        ex = tvm_compat.compile_relax(mod, target,
                                      sched.cpu_relax_pipeline(target, fast_math=fast_math))
        stats = dict(sched.LAST_STATS)
    return ex, time.perf_counter() - t0, stats, str(target)


def run_tvm(ex, x, warmup, repeat):
    from amp_cli import tvm_compat

    tvm = tvm_compat.tvm()
    vm = tvm.relax.VirtualMachine(ex, tvm.cpu())
    xt = tvm.runtime.tensor(x)
    out = vm["main"](xt).numpy()
    return out, _time(lambda: vm["main"](xt), warmup, repeat)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="resnet50,bert")
    ap.add_argument("--bert-layers", type=int, default=12)
    ap.add_argument("--threads", type=int, default=None,
                    help="threads for TVM and ORT (default: TVM_NUM_THREADS or all cores)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--stock-tvm", action="store_true",
                    help="also time TVM's stock cpu_generic pipeline (slow: a 1-layer BERT only)")
    ap.add_argument("--fast-math", action="store_true",
                    help="also time amp with fast_math=True (approximate exp/erf/tanh)")
    ap.add_argument("--json", default="benchmarks/cpu_bench.json")
    args = ap.parse_args(argv)

    from amp_cli import tvm_compat
    from amp_cli.schedule import cpu as sched

    tvm = tvm_compat.tvm()
    threads = args.threads or sched.effective_num_threads(default_only=True)
    sched.set_num_threads(threads)
    rng = np.random.default_rng(0)
    cpu_model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                      if ln.startswith("model name")), platform.processor())
    import onnxruntime

    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpu": cpu_model,
              "cores_available": sched.available_cores(), "threads": threads,
              "tvm_threads": sched.effective_num_threads(), "tvm": tvm.__version__,
              "onnxruntime": onnxruntime.__version__, "loadavg_start": os.getloadavg(),
              "argv": sys.argv, "results": []}
    builders = {"resnet50": lambda: build_resnet50(),
                "bert": lambda: build_bert(layers=args.bert_layers)}
    for name in args.models.split(","):
        model = builders[name]()
        label = f"{name}" + (f"-{args.bert_layers}L" if name == "bert" else "")
        shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
        x = rng.uniform(-1, 1, shape).astype("float32")
        ref, t_ort = run_ort(model, x, threads, args.warmup, args.repeat)
        rows = [{"model": label, "engine": "onnxruntime fp32", **t_ort}]
        variants = [("amp llvm fp32 (untuned)", False)]
        if args.fast_math:
            variants.append(("amp llvm fp32 (untuned, fast_math)", True))
        for vname, fm in variants:
            ex, ct, stats, tgt = build_tvm(model, stock=False, fast_math=fm)
            out, t = run_tvm(ex, x, args.warmup, args.repeat)
            err = float(np.abs(out - ref).max() / max(1e-12, np.abs(ref).max()))
            rows.append({"model": label, "engine": vname, **t, "compile_s": ct,
                         "max_rel_err_vs_ort": err, "schedule_stats": stats, "target": tgt})
        # ORT again after TVM, so background load hits both
        _, t_ort2 = run_ort(model, x, threads, 1, args.repeat)
        rows[0]["median_ms_rerun"] = t_ort2["median_ms"]
        if args.stock_tvm and name == "bert":
            small = build_bert(layers=1)
            xs = x
            ex, ct, _, tgt = build_tvm(small, stock=True)
            _, t = run_tvm(ex, xs, 0, 2)
            rows.append({"model": "bert-1L", "engine": "stock TVM cpu_generic (no schedule)",
                         **t, "compile_s": ct})
            ex, ct, stats, tgt = build_tvm(small, stock=False)
            _, t = run_tvm(ex, xs, 1, args.repeat)
            rows.append({"model": "bert-1L", "engine": "amp llvm fp32 (untuned)", **t,
                         "compile_s": ct})
        report["results"] += rows
        for r in rows:
            print(f"{r['model']:10s} {r['engine']:40s} {r['median_ms']:9.2f} ms "
                  f"(min {r['min_ms']:.2f})", flush=True)
    report["loadavg_end"] = os.getloadavg()
    ort_ms = {r["model"]: min(r["median_ms"], r.get("median_ms_rerun", 1e9))
              for r in report["results"] if r["engine"] == "onnxruntime fp32"}
    print("\n| model | engine | median ms | vs ORT |\n|---|---|---|---|")
    for r in report["results"]:
        base = ort_ms.get(r["model"])
        ratio = f"{r['median_ms'] / base:.2f}x" if base else "-"
        print(f"| {r['model']} | {r['engine']} | {r['median_ms']:.2f} | {ratio} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=1, default=str)
        print("wrote", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
