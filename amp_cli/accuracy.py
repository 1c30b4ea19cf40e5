"""Accuracy of a built library against the fp32 reference (ONNX Runtime or torch)."""
from __future__ import annotations

import numpy as np

from . import tvm_compat
from .errors import InputError
from .frontend import InputSpec

INT_INPUT_RANGE = (0, 16)  # ints whose use is unknown: small, valid for any vocabulary >= 16


def random_inputs(specs: list[InputSpec], seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random inputs: floats ~ N(0, 1) (never all zero), bools random, ints as the
    graph uses them (``InputSpec.values``): indices in [0, rows), masks as padding masks (each
    row ones, then zeros, at least one one), else in [0, 16)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for s in specs:
        shape = tuple(int(d) for d in s.shape)
        if s.dtype.startswith("float") or s.dtype == "bfloat16":
            arr = rng.standard_normal(shape).astype("float32")
            feeds[s.name] = arr.astype(s.dtype) if s.dtype != "bfloat16" else arr
        elif s.dtype == "bool":
            feeds[s.name] = rng.integers(0, 2, shape).astype(bool)
        elif s.values and s.values[0] == "mask":
            feeds[s.name] = padding_mask(rng, shape).astype(s.dtype)
        elif s.values and s.values[0] == "index":
            feeds[s.name] = rng.integers(0, max(1, int(s.values[1])), shape).astype(s.dtype)
        else:
            feeds[s.name] = rng.integers(*INT_INPUT_RANGE, shape).astype(s.dtype)
    return feeds


def padding_mask(rng, shape: tuple) -> np.ndarray:
    """0/1 of ``shape``: along the last axis each row is ones then zeros, with a random number
    (at least one) of ones, as a tokenizer pads a batch."""
    if len(shape) < 2:
        return np.ones(shape, np.int64)
    rows = int(np.prod(shape[:-1]))
    keep = rng.integers(1, shape[-1] + 1, rows)
    mask = np.arange(shape[-1])[None, :] < keep[:, None]
    return mask.reshape(shape).astype(np.int64)


def load_inputs(path: str, specs: list[InputSpec]) -> dict[str, np.ndarray]:
    """Inputs from an .npz, checked against the model's input names, shapes and dtypes."""
    try:
        data = np.load(path)
    except Exception as exc:  # noqa: BLE001
        raise InputError(f"{path}: cannot read as .npz ({type(exc).__name__})") from None
    want = {s.name: s for s in specs}
    missing = [n for n in want if n not in data.files]
    extra = [n for n in data.files if n not in want]
    if missing:
        raise InputError(f"{path}: missing input(s) {', '.join(missing)}"
                         + (f"; found {', '.join(extra)}" if extra else ""))
    feeds = {}
    for name, s in want.items():
        arr = data[name]
        if list(arr.shape) != [int(d) for d in s.shape]:
            raise InputError(f"{path}: input '{name}' has shape {list(arr.shape)}, the model "
                             f"expects {list(s.shape)}")
        if str(arr.dtype) != s.dtype:
            raise InputError(f"{path}: input '{name}' has dtype {arr.dtype}, the model expects "
                             f"{s.dtype}")
        feeds[name] = arr
    return feeds


# A reference output measures nothing when it is ~0 everywhere or constant (random-init models:
# MobileViT's hidden state is exactly 0, torchvision MobileNet logits before BN calibration)
ZERO_ABS = 1e-6        # max |x| below this: all ~0
CONSTANT_STD = 1e-3    # std across elements below this share of the mean |x|: constant


def degeneracy(ref) -> str:
    """Why an fp32 reference output cannot judge a conversion ('' when it can): all ~0, or
    constant (every element the same up to ``CONSTANT_STD``)."""
    x = np.asarray(ref, dtype=np.float64)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return ""
    top = float(np.abs(x).max())
    if top < ZERO_ABS:
        return f"all ~0 (max |x| {top:.1e})"
    scale = float(np.abs(x).mean())
    if x.size > 1 and float(x.std()) < CONSTANT_STD * scale:
        return f"constant (std {x.std():.1e} against mean |x| {scale:.1e})"
    return ""


def metrics(ref: np.ndarray, got: np.ndarray) -> dict:
    """max abs, relative L2, cosine and the non-finite share of ``got`` against ``ref``.
    Where ``ref`` itself is inf/NaN (a degenerate fp32 reference) those positions are left out
    and their share is reported as ``reference_nonfinite_share``."""
    ref = np.asarray(ref, dtype=np.float64)
    got = np.asarray(got, dtype=np.float64)
    out = _compare(ref, got)
    flat = degeneracy(ref)
    return {**out, "reference_degenerate": flat} if flat else out


def _compare(ref: np.ndarray, got: np.ndarray) -> dict:
    """:func:`metrics` of float64 arrays, without the degeneracy check."""
    finite = np.isfinite(got)
    nonfinite = float(1.0 - finite.mean()) if got.size else 0.0
    if ref.shape != got.shape:
        return {"shape_mismatch": [list(ref.shape), list(got.shape)], "max_abs": float("inf"),
                "rel_l2": float("inf"), "cosine": 0.0, "nonfinite_share": nonfinite}
    ref_ok = np.isfinite(ref)
    out = {}
    if not ref_ok.all():
        out["reference_nonfinite_share"] = float(1.0 - ref_ok.mean())
        ref, got, finite = ref[ref_ok], got[ref_ok], finite[ref_ok]
    if not finite.all():
        return {"max_abs": float("inf"), "rel_l2": float("inf"), "cosine": 0.0,
                "nonfinite_share": nonfinite, **out}
    diff = got - ref
    denom = np.linalg.norm(ref)
    rel = float(np.linalg.norm(diff) / denom) if denom > 0 else float(np.linalg.norm(diff))
    nr, ng = np.linalg.norm(ref), np.linalg.norm(got)
    cos = float(np.dot(ref.ravel(), got.ravel()) / (nr * ng)) if nr > 0 and ng > 0 else \
        float(nr == ng)
    return {"max_abs": float(np.max(np.abs(diff))) if diff.size else 0.0, "rel_l2": rel,
            "cosine": cos, "nonfinite_share": nonfinite, **out}


def summarize(per_output: list[dict]) -> dict:
    """Worst case over outputs."""
    if not per_output:
        return {}
    worst = {"max_abs": max(m["max_abs"] for m in per_output),
             "rel_l2": max(m["rel_l2"] for m in per_output),
             "cosine": min(m["cosine"] for m in per_output),
             "nonfinite_share": max(m["nonfinite_share"] for m in per_output)}
    ref_bad = max(m.get("reference_nonfinite_share", 0.0) for m in per_output)
    if ref_bad:
        worst["reference_nonfinite_share"] = ref_bad
    return worst


def degenerate_outputs(per_output: list[dict]) -> str:
    """The outputs whose fp32 reference is degenerate, with why ('' when none is)."""
    return "; ".join(f"{m.get('output', f'output {i}')}: {m['reference_degenerate']}"
                     for i, m in enumerate(per_output) if m.get("reference_degenerate"))


class LibraryRunner:
    """Runs an exported Relax VM library on a device."""

    def __init__(self, library: str, device: str = "cpu"):
        self.device = tvm_compat.cuda_device() if device == "cuda" else tvm_compat.cpu_device()
        self.lib = tvm_compat.load_module(library)
        self.vm = tvm_compat.relax_vm(self.lib, self.device)

    def __call__(self, feeds: dict[str, np.ndarray], order: list[str]) -> list[np.ndarray]:
        args = [tvm_compat.to_tvm_tensor(feeds[n], self.device) for n in order]
        out = self.vm["main"](*args)
        return [np.asarray(o.numpy()) for o in flatten_outputs(out)]


def first_nonfinite_call(library: str, device: str, feeds: dict[str, np.ndarray],
                         order: list[str]) -> dict | None:
    """The first kernel call of one run whose arguments hold inf/NaN once it ran -- the kernel
    that produced them, as the calls before it were all finite -- as {kernel, call}; None when
    every call is finite. Needs a library without CUDA graphs (a captured graph runs its kernels
    in one builtin call, out of the instrument's sight)."""
    runner = LibraryRunner(library, device)
    args = [tvm_compat.to_tvm_tensor(feeds[n], runner.device) for n in order]
    found: dict = {}
    calls = [0]

    def instrument(_func, symbol, before_run, _ret, *call_args):
        name = str(symbol)
        if before_run or found or name.startswith("vm.builtin."):
            return 0  # VMInstrumentReturnKind.NO_OP
        calls[0] += 1
        for a in call_args:
            if hasattr(a, "numpy") and str(getattr(a, "dtype", "")).startswith(("float", "bfl")):
                values = np.asarray(a.numpy(), dtype=np.float32)
                if not np.isfinite(values).all():
                    found.update(kernel=name, call=calls[0],
                                 nonfinite_share=float(1 - np.isfinite(values).mean()))
                    break
        return 0

    runner.vm.set_instrument(instrument)
    try:
        runner.vm["main"](*args)
    finally:
        runner.vm.set_instrument(None)
    return found or None


def flatten_outputs(out):
    if hasattr(out, "numpy"):
        return [out]
    items = []
    for o in out:
        items.extend(flatten_outputs(o))
    return items


def check_accuracy(model, library: str, device: str, seed: int, samples: int = 1) -> dict:
    """Run the library and the fp32 reference on seeded random inputs; metrics per output.
    A model with dynamic dims is checked at each of ``model.check_points()`` (every dim at its
    minimum, optimum, maximum): ``points`` has the worst case of each, the rest is the worst
    over all of them."""
    runner = LibraryRunner(library, device)
    order = [s.name for s in model.inputs]
    per_output: list[dict] = []
    points = []
    for sizes in model.check_points():
        specs = model.inputs_at(sizes)
        at_point: list[dict] = []
        for k in range(samples):
            feeds = random_inputs(specs, seed + k)
            ref = model.reference(feeds)
            got = runner(feeds, order)
            if len(ref) != len(got):
                raise InputError(f"reference has {len(ref)} outputs, the build {len(got)}")
            merge_metrics(at_point, [metrics(r, g) for r, g in zip(ref, got)], model.outputs)
        merge_metrics(per_output, at_point, model.outputs)
        if model.dynamic:
            points.append({"dims": dict(sizes), "inputs": {s.name: list(s.shape) for s in specs},
                           "worst": summarize(at_point)})
    result = {"device": device, "samples": samples, "seed": seed, "outputs": per_output,
              "worst": summarize(per_output)}
    flat = degenerate_outputs(per_output)
    if flat:
        result["reference_degenerate"] = flat
    if points:
        result["points"] = points
    return result


def merge_metrics(into: list[dict], new: list[dict], names: list[str]) -> None:
    """Fold per-output metrics ``new`` into ``into`` (worst case: the largest errors, the
    smallest cosine); an empty ``into`` takes them, named after ``names``."""
    for i, m in enumerate(new):
        if i >= len(into):
            into.append({"output": names[i] if i < len(names) else f"output{i}",
                         **{k: v for k, v in m.items() if k != "output"}})
            continue
        for key in ("max_abs", "rel_l2", "nonfinite_share", "reference_nonfinite_share"):
            if key in m:
                into[i][key] = max(into[i].get(key, 0.0), m[key])
        into[i]["cosine"] = min(into[i]["cosine"], m["cosine"])
        if m.get("reference_degenerate"):
            into[i].setdefault("reference_degenerate", m["reference_degenerate"])


def compare_outputs(reference, outputs, model=None) -> dict | None:
    """Worst-case and per-output metrics of ``outputs`` against ``reference`` (None when there
    is no reference); outputs are named after ``model.outputs`` where known."""
    if reference is None:
        return None
    if len(reference) != len(outputs):
        return {"max_abs": float("inf"), "rel_l2": float("inf"), "cosine": 0.0,
                "nonfinite_share": 0.0, "outputs": [],
                "error": f"{len(outputs)} outputs, the reference has {len(reference)}"}
    names = list(getattr(model, "outputs", []) or [])
    per = []
    for i, (r, g) in enumerate(zip(reference, outputs)):
        per.append({"output": names[i] if i < len(names) else f"output{i}",
                    **metrics(r, np.asarray(g, dtype=np.float32)
                              if np.asarray(g).dtype.kind == "f" else g)})
    out = {**summarize(per), "outputs": per}
    flat = degenerate_outputs(per)
    if flat:
        out["reference_degenerate"] = flat
    return out
