"""report.json (machine-readable, stable keys) and report.md (for a person)."""
from __future__ import annotations

import datetime as _dt
import json
import math
import platform
import re
import subprocess
from importlib import metadata
from pathlib import Path

from .precision.sensitivity import render_markdown_section
from .target import find_nvcc

REPORT_VERSION = 1
# a kernel on the generic fallback schedule whose outputs each take this many multiply-adds is
# named in report.md (a reduction of a few elements there -- a softmax row, a pool -- is fine)
FALLBACK_HEAVY = 64


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name, dist in (("amp", "amp-cli"),) + tuple((d, d) for d in (
            "apache-tvm", "apache-tvm-ffi", "onnx", "onnxruntime", "onnxslim", "numpy",
            "torch")):
        try:
            out[name] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["cuda"] = cuda_version()
    return out


def cuda_version() -> str | None:
    nvcc = find_nvcc()
    if not nvcc:
        return None
    try:
        text = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                              timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"release ([\d.]+)", text)
    return m.group(1) if m else None


def clean_json(obj):
    """JSON-safe: inf/nan as strings, numpy scalars as Python numbers."""
    if isinstance(obj, dict):
        return {str(k): clean_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean_json(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):
        try:
            obj = obj.item()
        except (ValueError, AttributeError):
            return str(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def write_json(path: str | Path, data: dict) -> None:
    Path(path).write_text(json.dumps(clean_json(data), indent=2, sort_keys=False) + "\n")


def build_report(model, cfg, target, prec, build, accuracy, notes, timings,
                 auto_precision=None) -> dict:
    extra = {"auto_precision": auto_precision} if auto_precision else {}
    return clean_json({
        "report_version": REPORT_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config": cfg.to_dict(),
        "target": target.spec,
        "versions": versions(),
        # source_path: the absolute path, so `amp bench OUTDIR` finds the model from any cwd
        "model": {**model.summary(), "source_path": _source_path(model.source)},
        "precision": prec.to_dict(),
        "build": {k: v for k, v in build.to_dict().items() if k != "library"},
        "accuracy": accuracy,
        "timings": timings,
        "notes": list(notes),
        **extra,
    })


def _source_path(source: str) -> str | None:
    p = Path(source)
    return str(p.resolve()) if p.is_file() else None


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def render_markdown(r: dict) -> str:
    m, p, b, a = r["model"], r["precision"], r["build"], r.get("accuracy") or {}
    tgt = r["target"]
    lines = [f"# amp conversion report: {Path(m['source']).name}", ""]
    lines += [f"- target: `{json.dumps(tgt)}`",
              f"- precision: {p['dtype']} (accumulate {p['accumulate']}), keep-io-types "
              f"{r['config']['precision']['keep_io_types']}",
              f"- created: {r['created']}",
              "- versions: " + ", ".join(f"{k} {v}" for k, v in r["versions"].items() if v), ""]
    if r.get("notes"):
        lines += ["## Notes", ""] + [f"- {n}" for n in r["notes"]] + [""]
    lines += ["## Model", "",
              f"- format: {m['format']}; nodes: {m['nodes']}; parameters: {m['parameters']:,}",
              "- inputs: " + ", ".join(f"`{i['name']}` {i['dtype']}"
                                       f"[{'x'.join(map(str, i['shape']))}]"
                                       for i in m["inputs"])]
    if m.get("dynamic"):
        lines.append("- dynamic dims (one library for every shape in the ranges; the library "
                     "rejects others, and `amp_input_ranges()` returns them): " + ", ".join(
                         f"`{n}` {rng}" for n, rng in m["dynamic"].items()))
    lines += [f"- {n}" for n in m.get("notes", [])] + [""]
    lines += ["## Precision", "",
              f"- ops converted to {p['dtype']}: {p['converted_ops']} of {p['total_ops']}; "
              f"casts inserted: {p['casts_inserted']}; tiny constants flushed to zero: "
              f"{p['underflow_flushed']}"]
    if p.get("note"):
        lines.append(f"- {p['note']}")
    lines += ["", "| op | input dtypes | output dtype | count |", "|---|---|---|---|"]
    for row in p.get("op_dtypes") or []:
        lines.append(f"| {row['op']} | {row['inputs']} | {row['output']} | {row['count']} |")
    if p["kept_fp32"]:
        lines += ["", "Kept in fp32:", "", "| node | op | ops | why |", "|---|---|---|---|"]
        for k in p["kept_fp32"]:
            lines.append(f"| {k['node']} | {k['op']} | {k.get('count', 1)} | {k['reason']} |")
    if p["constants"]:
        lines += ["", "Constants outside the target type's range (kept-fp32: the op stays in "
                      "fp32; saturated-mask: a masking sentinel, now the type's largest finite "
                      "value):", "", "| node | op | max abs | limit | action |",
                  "|---|---|---|---|---|"]
        for c in p["constants"]:
            lines.append(f"| {c['node']} | {c['op']} | {_fmt(c['max_abs'])} | "
                         f"{_fmt(c['limit'])} | {c['action']} |")
    lines += ["", "## Build", "",
              f"- {len(b['kernels'])} kernels, {_fmt(b['seconds'])} s, library "
              f"{b['size_bytes']:,} bytes"]
    if tgt.get("kind") == "cuda":
        cuda = r["config"].get("cuda") or {}
        onoff = {True: "on", False: "off"}
        lines.append(f"- tensor-core kernels: {b['tensor_core_kernels']}; CUDA graphs "
                     f"{onoff.get(cuda.get('cuda_graph'), '?')}, convolutions as GEMMs "
                     f"{onoff.get(cuda.get('conv_as_gemm'), '?')}")
        if b["legalized"]:
            lines += ["- CUDA legalization (lane legalizer, strided cp.async guard) rewrote:"]
            for rec in b["legalized"]:
                guard = "InjectPTXAsyncCopy" in str(rec.get("stage", ""))
                lines.append(f"  - `{rec.get('kernel')}`: {', '.join(rec.get('rewrites', []))}"
                             + (" (TVM's cp.async ignores a copy's stride)" if guard else ""))
        else:
            lines.append("- CUDA legalization: no kernel needed a rewrite")
    variants = b.get("variants") or {}
    if "main_optimum" in variants:
        lines.append(f"- dynamic dims: `main_optimum` (every dim at its optimum, static kernels) "
                     f"calls {len(variants['main_optimum'])} kernels, "
                     f"`main_dynamic` (every other shape, symbolic kernels) "
                     f"{len(variants.get('main_dynamic', []))}")
    elif variants:
        lines.append(f"- dynamic dims: every shape runs `main_dynamic` (symbolic kernels, "
                     f"{len(variants.get('main_dynamic', []))} kernels); no static copy at the "
                     f"optimum (`dynamic.specialize_optimum: true` adds one)")
    rewrites = {k: v for k, v in (b.get("graph_rewrites") or {}).items() if v}
    if rewrites:
        labels = b.get("graph_rewrite_labels") or {}
        lines.append("- graph rewrites: " + ", ".join(
            f"{n} {labels.get(k, k)}" for k, n in rewrites.items()))
    if b.get("rule_failures"):
        lines.append("- schedule rules that raised on a kernel (the next rule scheduled it):")
        for f in b["rule_failures"]:
            lines.append(f"  - `{f['kernel']}`: {f['rule']}: {f['error']}")
    ruled = b.get("kernel_schedules") or []
    if ruled:
        counts: dict = {}
        for f in ruled:
            counts[f["rule"]] = counts.get(f["rule"], 0) + 1
        lines.append("- schedule rules: " + ", ".join(f"{r} {n}" for r, n in counts.items()))
    heavy = [f for f in ruled if f["rule"] == "Fallback" and f["reduction"] >= FALLBACK_HEAVY]
    if heavy:
        lines.append("- compute kernels on dlight's generic fallback schedule (one thread per "
                     "output, no tiling or tensor cores; slow when large):")
        for f in heavy:
            lines.append(f"  - `{f['kernel']}`: {f['reduction']} multiply-adds per output")
    sched = b.get("schedule") or {}
    if sched:
        lines.append(f"- schedules: {sched.get('tuned', 0)} tuned, {sched.get('default', 0)} "
                     f"default")
        for k in sched.get("kernels", []):
            lines.append(f"  - `{k['kernel']}`: {k['schedule']}"
                         + (f", expected speedup {k['expected_speedup']:.2f}x"
                            if k.get("expected_speedup") else ""))
    lines.append("")
    if a:
        w = a.get("worst", {})
        lines += ["## Accuracy vs fp32 reference", "",
                  f"Measured on **{a['device']}**, {a['samples']} seeded random input set(s) "
                  f"(seed {a['seed']}); tolerance rel L2 {a.get('tolerance_rel_l2')}: "
                  f"{'within' if a.get('within_tolerance') else 'NOT within'}.", "",
                  "| output | max abs | rel L2 | cosine | non-finite |", "|---|---|---|---|---|"]
        for o in a.get("outputs", []):
            lines.append(f"| {o['output']} | {_fmt(o['max_abs'])} | {_fmt(o['rel_l2'])} | "
                         f"{_fmt(o['cosine'])} | {_fmt(o['nonfinite_share'])} |")
        if w:
            lines.append(f"| **worst** | {_fmt(w['max_abs'])} | {_fmt(w['rel_l2'])} | "
                         f"{_fmt(w['cosine'])} | {_fmt(w['nonfinite_share'])} |")
        if a.get("points"):
            lines += ["", "Per shape (dynamic dims at their minimum, optimum, maximum):", "",
                      "| dims | inputs | max abs | rel L2 | cosine | non-finite |",
                      "|---|---|---|---|---|---|"]
            for pt in a["points"]:
                pw = pt["worst"]
                lines.append(
                    "| " + ", ".join(f"{k}={v}" for k, v in pt["dims"].items()) + " | "
                    + ", ".join(f"{k} {'x'.join(map(str, v))}" for k, v in pt["inputs"].items())
                    + f" | {_fmt(pw['max_abs'])} | {_fmt(pw['rel_l2'])} | {_fmt(pw['cosine'])}"
                    f" | {_fmt(pw['nonfinite_share'])} |")
        lines.append("")
    if r.get("auto_precision"):
        lines += render_markdown_section(r["auto_precision"])
    return "\n".join(lines)
