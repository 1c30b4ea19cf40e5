"""`export`: write the corpus's .onnx files, their seeded inputs and fp32 references, and
manifest.json.

Per model: seed, build, calibrate BatchNorm statistics, draw inputs, run torch fp32 (and fp16
and bf16, as the "what a framework gets" baseline), export with each exporter,
then run ONNX Runtime fp32 on the saved inputs: its outputs are the reference that `run`
compares amp against, and a near-constant or ~0 reference marks the model `degenerate`.
"""
from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import numpy as np

from . import zoo

EXPORTERS = ("dynamo", "legacy")
RNN_OPS = {"LSTM", "GRU", "RNN", "Loop", "Scan"}


def rel_l2(ref: np.ndarray, got: np.ndarray) -> float:
    """||got - ref|| / ||ref|| in float64 (inf when got is non-finite)."""
    ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def find_degeneracy(outputs: list[np.ndarray]) -> str:
    """Why a reference measures nothing ('' when it is fine): non-finite, or what amp's own
    check calls degenerate (``amp_cli.accuracy.degeneracy``: all ~0, or constant)."""
    from amp_cli.accuracy import degeneracy

    for i, out in enumerate(outputs):
        x = np.asarray(out, np.float64)
        if not np.isfinite(x).all():
            return f"output {i}: non-finite values in the fp32 reference"
        reason = degeneracy(x)
        if reason:
            return f"output {i}: {reason}"
    return ""


def calibrate_batchnorm(module, specs: list[zoo.InputSpec], rng, passes: int = 4) -> bool:
    """Set BatchNorm running statistics from random inputs (train-mode passes at batch 4, a
    cumulative average), then eval. Random-init running stats (0 mean, unit var) let
    activations grow or vanish layer by layer, so the logits come out constant or ~0."""
    import torch
    bns = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None
    if bns:
        module.train()
        batch4 = [zoo.InputSpec(s.name, (4,) + tuple(s.shape[1:]), s.dtype, s.kind, s.high)
                  for s in specs]
        with torch.no_grad():
            for _ in range(passes):
                module(*to_tensors(zoo.make_inputs(batch4, rng)).values())
    module.eval()
    return bool(bns)


def reinit_zero_weights(module) -> list[str]:
    """Give zero-initialized weight matrices (torchvision ViT's head) small random values: a
    zero layer makes the output exactly 0, which measures nothing. Returns their names."""
    import torch
    names = []
    for name, p in module.named_parameters():
        if name.endswith("weight") and p.dim() >= 2 and not p.detach().any():
            torch.nn.init.normal_(p, std=0.02)
            names.append(name)
    return names


def to_tensors(feeds: dict[str, np.ndarray], dtype=None) -> dict:
    """numpy -> torch; float arrays cast to `dtype` when given."""
    import torch
    out = {}
    for k, v in feeds.items():
        t = torch.from_numpy(np.ascontiguousarray(v))
        out[k] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out


def run_torch(module, feeds: dict[str, np.ndarray], dtype=None, device: str = "cpu"):
    """The module's outputs (a list of float32 numpy arrays), optionally in `dtype`."""
    import torch
    m = copy.deepcopy(module).to(device=device, dtype=dtype) if dtype else module
    with torch.no_grad():
        out = m(*(t.to(device) for t in to_tensors(feeds, dtype).values()))
    outs = out if isinstance(out, (tuple, list)) else [out]
    return [o.float().cpu().numpy() for o in outs]


def measure_low_precision(module, feeds, ref: list[np.ndarray]) -> dict:
    """torch fp16 and bf16 vs torch fp32 on the GPU if there is one, else the CPU: what a
    framework gets on the same weights, {"fp16": rel L2 or an error line, "bf16": ..., "device"}.
    Random-init deep CNNs with calibrated BatchNorm are sensitive (resnet50: fp16 ~0.07), so
    amp's error is judged against this, not against zero."""
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = {"device": device}
    for key, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        try:
            got = run_torch(module, feeds, dtype, device)
            out[key] = max(rel_l2(r, g) for r, g in zip(ref, got))
        except Exception as exc:  # noqa: BLE001 - recorded, not fatal
            out[key] = first_line(exc)
    return out


def first_line(exc: BaseException) -> str:
    """`Type: first line of the message`, then the same for its cause (the exporters wrap the
    real error in a generic one)."""
    lines = []
    while exc is not None and len(lines) < 3:
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip().splitlines()
        lines.append(f"{type(exc).__name__}: {text[0] if text else ''}")
        exc = exc.__cause__
    return " <- ".join(lines)[:600]


def export_onnx(module, feeds: dict, path: Path, exporter: str) -> None:
    """torch.onnx.export with the dynamo or the legacy (TorchScript) exporter, one file."""
    import warnings
    import torch
    args = tuple(to_tensors(feeds).values())
    kwargs = dict(input_names=list(feeds), dynamo=exporter == "dynamo")
    if exporter == "dynamo":
        kwargs.update(external_data=False, verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), **kwargs)


def describe_graph(path: Path) -> tuple[list[dict], list[str]]:
    """The graph inputs (initializers excluded) as dicts and the sorted op types."""
    import onnx
    from onnx import helper
    model = onnx.load(str(path), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    inputs = []
    for i in model.graph.input:
        if i.name in inits:
            continue
        t = i.type.tensor_type
        inputs.append({"name": i.name, "dtype": helper.tensor_dtype_to_np_dtype(t.elem_type).name,
                       "shape": [d.dim_value if d.HasField("dim_value") else d.dim_param
                                 for d in t.shape.dim]})
    ops = {n.op_type for n in model.graph.node}
    for f in model.functions:
        ops |= {n.op_type for n in f.node}
    return inputs, sorted(ops)


def run_ort(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """ONNX Runtime fp32 on the CPU, all optimizations off (the reference)."""
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3  # the light models' unused-initializer warnings
    from amp_cli.frontend.ort_session import inference_session

    return inference_session(str(path), opts).run(None, feeds)


def finish_entry(entry: dict, path: Path, feeds: dict[str, np.ndarray],
                 torch_ref: list[np.ndarray] | None) -> None:
    """Describe an exported file, save its inputs and ORT reference, judge degeneracy."""
    inputs, ops = describe_graph(path)
    feeds = {i["name"]: feeds[i["name"]] for i in inputs}
    np.savez(path.with_suffix(".inputs.npz"), **feeds)
    entry.update(file=path.name, inputs_file=path.with_suffix(".inputs.npz").name, op_types=ops,
                 rnn_ops=sorted(RNN_OPS & set(ops)))
    gen = {i["name"]: i.get("generate") for i in entry.get("inputs", [])}
    entry["inputs"] = [dict(i, generate=gen.get(i["name"])) for i in inputs]
    try:
        ref = run_ort(path, feeds)
    except Exception as exc:  # noqa: BLE001
        entry.update(degenerate=True, degenerate_reason=f"ORT cannot run it: {first_line(exc)}")
        return
    np.savez(path.with_suffix(".reference.npz"), *ref)
    entry["reference_file"] = path.with_suffix(".reference.npz").name
    if torch_ref is not None:
        entry["ort_vs_torch_rel_l2"] = max(rel_l2(r, o) for r, o in zip(torch_ref, ref))
    reason = find_degeneracy(ref)
    entry.update(degenerate=bool(reason), degenerate_reason=reason)


def export_torch_entry(e: zoo.Entry, outdir: Path, scale: str, batch: int, seed: int,
                       exporters: list[str], log) -> list[dict]:
    """Build, calibrate, baseline and export one torch model; one manifest entry per exporter."""
    import torch
    torch.manual_seed(seed)
    built = e.build(scale, batch)
    module = built.module
    reinitialized = reinit_zero_weights(module)
    calibrated = calibrate_batchnorm(module, built.inputs, np.random.default_rng(seed))
    feeds = zoo.make_inputs(built.inputs, np.random.default_rng(seed))
    torch_ref = run_torch(module, feeds)
    base = {"name": e.name, "family": e.family, "failure_class": e.tag,
            "bn_calibrated": calibrated, "reinitialized_zero_weights": reinitialized,
            "torch_rel_l2": measure_low_precision(module, feeds, torch_ref),
            "inputs": [{"name": s.name, "generate": s.describe()} for s in built.inputs]}
    entries = []
    for exporter in exporters:
        entry = dict(base, exporter=exporter)
        path = outdir / f"{e.name}.{exporter}.onnx"
        try:
            export_onnx(module, feeds, path, exporter)
        except Exception as exc:  # noqa: BLE001 - one exporter failing keeps the other
            entry.update(file=None, export_error=first_line(exc))
            log(f"  {e.name} [{exporter}] export failed: {entry['export_error']}")
            entries.append(entry)
            continue
        finish_entry(entry, path, feeds, torch_ref)
        entries.append(entry)
        log(f"  {e.name} [{exporter}] ops {len(entry['op_types'])}"
            + (f" rnn {entry['rnn_ops']}" if entry["rnn_ops"] else "")
            + (f" DEGENERATE: {entry['degenerate_reason']}" if entry["degenerate"] else ""))
    return entries


def list_light_models() -> list[Path]:
    """The models of the installed onnx wheel's backend/test/data/light/ folder."""
    import onnx
    return sorted((Path(onnx.__file__).parent / "backend/test/data/light").glob("*.onnx"))


def export_light_model(src: Path, outdir: Path, seed: int, log) -> dict:
    """Copy an ONNX light model and give it seeded inputs from its input shapes."""
    path = outdir / src.name
    shutil.copyfile(src, path)
    inputs, _ = describe_graph(path)
    specs = [zoo.InputSpec(i["name"], tuple(i["shape"]), i["dtype"]) for i in inputs]
    feeds = zoo.make_inputs(specs, np.random.default_rng(seed))
    entry = {"name": src.stem, "family": "onnx-light", "exporter": "onnx-light",
             "failure_class": "ONNX backend-test model (old opset, initializers as inputs)",
             "inputs": [{"name": s.name, "generate": s.describe()} for s in specs]}
    finish_entry(entry, path, feeds, None)
    log(f"  {src.stem}" + (f" DEGENERATE: {entry['degenerate_reason']}"
                           if entry["degenerate"] else ""))
    return entry


def collect_versions() -> dict:
    """Versions of the libraries that shape the exported graphs."""
    import importlib.metadata as md
    out = {}
    for pkg in ("torch", "torchvision", "transformers", "onnx", "onnxscript", "onnxruntime"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def merge_entries(old: list[dict], new: list[dict]) -> list[dict]:
    """`old` with each re-exported model's entries replaced by `new`'s, in place; models new
    to the manifest go last (re-exporting a few models keeps the others' entries)."""
    fresh: dict[str, list[dict]] = {}
    for m in new:
        fresh.setdefault(m["name"], []).append(m)
    renewed = {m["name"] for m in new}
    merged = []
    for m in old:
        if m["name"] in fresh:
            merged += fresh.pop(m["name"])
        elif m["name"] not in renewed:
            merged.append(m)
    return merged + [m for ms in fresh.values() for m in ms]


def export_corpus(outdir: Path, only: set[str] | None, scale: str, batch: int,
                  exporters: list[str], seed: int, log=print) -> dict:
    """Export every selected model into `outdir` and write `outdir/manifest.json`."""
    outdir.mkdir(parents=True, exist_ok=True)
    models, skipped = [], []
    for e in zoo.list_entries():
        if only and e.name not in only:
            continue
        log(f"{e.name} ({e.family})")
        try:
            models += export_torch_entry(e, outdir, scale, batch, seed, exporters, log)
        except zoo.MissingLibrary as exc:
            skipped.append({"name": e.name, "reason": f"{exc} is not installed"})
            log(f"  skipped: {exc} is not installed")
        except Exception as exc:  # noqa: BLE001 - a model that cannot even be built
            models.append({"name": e.name, "family": e.family, "failure_class": e.tag,
                           "exporter": None, "file": None, "export_error": first_line(exc)})
            log(f"  failed: {first_line(exc)}")
    for src in list_light_models():
        if not only or src.stem in only:
            models.append(export_light_model(src, outdir, seed, log))
    manifest = {"seed": seed, "scale": scale, "batch": batch, "versions": collect_versions(),
                "models": models, "skipped": skipped}
    path = outdir / "manifest.json"
    old = json.loads(path.read_text()) if only and path.is_file() else {}
    if all(old.get(k) == manifest[k] for k in ("seed", "scale", "batch")):
        manifest["models"] = merge_entries(old["models"], models)
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest
