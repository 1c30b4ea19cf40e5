"""Accuracy-guided precision: the fewest nodes in fp32 (or bf16) that make a model meet a
tolerance. See docs/auto-precision.md.

Steps (each variant is amp's precision pass with ``exclude_nodes``, built for the CPU and run
on held-out calibration inputs against the fp32 reference):

1. **Range.** :func:`amp_cli.sensitivity.analyze` gives each ONNX node's fp32 range. A node
   whose values leave the low type's range (or whose L2 norm is mostly subnormal there) is kept,
   and so is every node that would still cast such a value to the low type (a matmul reading
   it). These need no trial: the low type cannot hold the values.
2. **Base variant.** Range set + policy. Meets the tolerance: done (one build).
3. **Galloping + bisection over the ranked candidates.** Candidates are the nodes still in the
   low type, ranked by their error score (the analysis' per-edge error estimate). Try keeping
   the top 1, 2, 4, ... candidates until one passes, then bisect between the last failing and
   the first passing k: the smallest passing top-k in <= 2*ceil(log2 k) + 1 trials (at most
   2*ceil(log2 n) + 1 with the final check when only every candidate works). The top-k of a
   ranking is an arbitrary node set of the graph, not a prefix/suffix of layers.
4. **Pruning.** Group testing on the chosen set: give back groups of the lower-ranked chosen
   nodes to the low type, halving a group when that fails, with what is left of the bound.

Evaluations <= 2 * ceil(log2 n) + 3, n = candidate nodes (the bound is enforced). Variants whose converted module is
structurally identical to one already built are not built again (counted as ``cached``).
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from .. import tvm_compat
from ..accuracy import LibraryRunner, metrics
from ..compile import build
from ..config import ConvertConfig, PrecisionConfig
from ..errors import AmpError
from ..ir_attrs import ONNX_NODE_PREFIX
from ..ir_module import replace_main
from ..target import cpu_target, resolve_target
from .convert import Converter, convert_precision, prepare_module, tensor_dtype
from .fallback import to_bf16_fallback
from .policy import resolve_config
from .sensitivity import SensitivityAnalysis, analyze, calibration_inputs

Progress = Callable[[str], None]

WHY = {
    "range": "values leave the {dtype} range",
    "range-input": "reads a value outside the {dtype} range",
    "underflow": "values underflow {dtype}",
    "tolerance": "needed to meet the tolerance",
    "user": "--exclude-node",
    "policy": "policy (op kept in fp32)",
    "fp32-input": "follows an fp32 input",
    "constant-range": "a constant leaves the {dtype} range",
    "excluded-op": "--exclude-op",
    "unknown-op": "op without a policy",
}


def search_bound(n: int) -> int:
    """Most variants the search evaluates over ``n`` candidate nodes."""
    return 2 * math.ceil(math.log2(n)) + 3 if n > 1 else 1 + n


@dataclass
class Trial:
    phase: str  # base | gallop | bisect | verify | prune
    extra: int  # candidate nodes kept beyond the range set
    nodes: list  # those nodes
    metric: float
    passed: bool
    cached: bool
    seconds: float

    def to_dict(self):
        return dataclasses.asdict(self)


@dataclass
class AutoPrecisionResult:
    """What the search chose; :meth:`convert` produces the final module."""

    precision: PrecisionConfig  # the chosen variant (exclude_nodes = user + range + search)
    fallback: str
    dtype: str
    metric_name: str
    tolerance: float
    analysis: SensitivityAnalysis | None
    reasons: dict  # node -> range | range-input | underflow | tolerance
    kept: list = field(default_factory=list)  # dicts: node, op_type, why, max_abs, limit, score
    modes: dict = field(default_factory=dict)  # node -> mode in the base variant
    trials: list = field(default_factory=list)  # Trial
    candidates: int = 0
    builds: int = 0
    met: bool | None = None
    final_metric: float | None = None
    calibration: dict = field(default_factory=dict)
    seconds: float = 0.0
    notes: list = field(default_factory=list)

    @property
    def exclude_nodes(self) -> list:
        return list(self.reasons)

    def convert(self, model):
        """(IRModule, PrecisionReport) of the chosen variant."""
        mod, rep = convert_precision(model.mod, self.precision, model.node_types)
        if self.fallback == "bf16":
            mod = to_bf16_fallback(mod, set(self.reasons))
        return mod, rep

    def to_dict(self) -> dict:
        by = self.analysis.by_node() if self.analysis else {}
        nodes = []
        if self.analysis:
            for n in self.analysis.to_dict()["nodes"]:
                n["mode"] = self.modes.get(n["node"], "-")
                n["kept"] = next((k["why"] for k in self.kept if k["node"] == n["node"]), None)
                nodes.append(n)
        del by
        analysis = self.analysis.to_dict() if self.analysis else {}
        if analysis:
            analysis["nodes"] = nodes
        n = self.candidates
        return {
            "enabled": True, "dtype": self.dtype, "fallback": self.fallback,
            "tolerance": {"metric": self.metric_name, "value": self.tolerance},
            "calibration": self.calibration,
            "kept": self.kept,
            "exclude_nodes": self.exclude_nodes,
            "analysis": analysis,
            "candidates": n,
            "search": None if self.met is None else {
                "candidates": n, "variants_evaluated": len(self.trials), "builds": self.builds,
                "bound": "2*ceil(log2(n))+3", "bound_value": search_bound(n),
                "met": self.met, "metric_name": self.metric_name,
                "final_metric": self.final_metric, "seconds": self.seconds,
                "trials": [t.to_dict() for t in self.trials]},
            "notes": list(self.notes),
        }


def node_modes(mod, low: str) -> dict:
    """ONNX node -> 'low' when any of its (non-cast) ops reads or writes the low type, else
    'fp32'; nodes the importer folded away are absent."""
    tvm = tvm_compat.tvm()
    relax = tvm.relax
    modes = {}
    for block in mod["main"].body.blocks:
        pending_low = False
        for b in block.bindings:
            v = b.value
            if isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op) and \
                    v.op.name != "relax.astype":
                if tensor_dtype(b.var) == low or any(tensor_dtype(a) == low for a in v.args):
                    pending_low = True
            name = b.var.name
            if name.startswith(ONNX_NODE_PREFIX):
                node = name[len(ONNX_NODE_PREFIX):]
                modes[node] = "low" if pending_low else "fp32"
                pending_low = False
    return modes


def _worst(model, runner, feeds_list, refs, metric: str) -> float:
    order = [s.name for s in model.inputs]
    worst = -math.inf if metric != "cosine" else math.inf
    for feeds, ref in zip(feeds_list, refs):
        got = runner(feeds, order)
        for r, g in zip(ref, got):
            m = metrics(r, g)
            if m["nonfinite_share"] > 0:
                return math.inf if metric != "cosine" else -math.inf
            worst = max(worst, m[metric]) if metric != "cosine" else min(worst, m[metric])
    return worst


class _Evaluator:
    """Builds and measures variants; a variant whose bindings stay fp32 exactly as in one
    already built is the same module, and is not built again."""

    def __init__(self, model, prec: PrecisionConfig, base_exclude: list, feeds, refs,
                 metric: str, tolerance: float, fallback: str, isolate: bool):
        self.model, self.prec, self.base = model, prec, list(base_exclude)
        self.feeds, self.refs = feeds, refs
        self.metric, self.tol, self.fallback = metric, tolerance, fallback
        self.isolate = isolate
        self.target = cpu_target()
        self.workdir = tempfile.mkdtemp(prefix="amp-auto-")
        self.cache = {}  # structural hash -> metric
        self.trials: list[Trial] = []
        self.builds = 0

    def passes(self, value: float) -> bool:
        if self.metric == "cosine":
            return value >= self.tol
        return value <= self.tol

    def variant(self, extra) -> PrecisionConfig:
        p = copy.deepcopy(self.prec)
        p.policy.exclude_nodes = list(dict.fromkeys(self.base + list(extra)))
        return p

    def __call__(self, extra: list, phase: str) -> bool:
        start = time.perf_counter()
        variant = self.variant(extra)
        _, rep = _quick_convert(self.model, variant)
        # The pass is deterministic in which bindings stay fp32: equal sets, equal modules.
        kept = tuple(sorted((k.node, k.op) for k in rep.kept_fp32))
        key = kept
        excluded = set(self.base) | set(extra)
        if self.fallback == "bf16":
            key = (kept, tuple(sorted(excluded & {k.node for k in rep.kept_fp32})))
        cached = key in self.cache
        if not cached:
            mod, _ = convert_precision(self.model.mod, variant, self.model.node_types)
            if self.fallback == "bf16":
                mod = to_bf16_fallback(mod, excluded)
            path = os.path.join(self.workdir, f"variant{self.builds}.so")
            build(mod, self.target, path, isolate=self.isolate)
            self.builds += 1
            runner = LibraryRunner(path, "cpu")
            self.cache[key] = _worst(self.model, runner, self.feeds, self.refs, self.metric)
        value = self.cache[key]
        ok = self.passes(value)
        self.trials.append(Trial(phase, len(extra), list(extra), value, ok, cached,
                                 time.perf_counter() - start))
        return ok

    def cleanup(self):
        shutil.rmtree(self.workdir, ignore_errors=True)


def _consumers(onnx_model) -> dict:
    out = {}
    for n in onnx_model.graph.node:
        for i in n.input:
            if i:
                out.setdefault(i, []).append(n.name)
    return out


def auto_precision(model, cfg: ConvertConfig, progress: Progress | None = None,
                   isolate: bool = True, search: bool = True) -> AutoPrecisionResult:
    """Choose the nodes of ``model`` to keep in ``cfg.auto_precision.fallback``.

    ``cfg`` is the resolved config (``policy.resolve_config``: the target's default policy
    merged in). ``search=False`` stops after the range analysis (no builds).

    >>> res = auto_precision(model, resolve_config(cfg, "llvm"))  # doctest: +SKIP
    >>> res.kept[0]["node"], res.kept[0]["why"]                                 # doctest: +SKIP
    ('square', 'values leave the float16 range')
    """
    step = progress or (lambda _s: None)
    start = time.perf_counter()
    ap = cfg.auto_precision
    prec = copy.deepcopy(cfg.precision)
    notes = []
    fallback = ap.fallback
    if prec.precision == "fp32":
        raise AmpError("--auto-precision chooses nodes to keep out of fp16/bf16; it needs "
                       "--precision fp16 or bf16")
    if fallback == "bf16" and prec.precision == "bf16":
        notes.append("--fallback bf16 with --precision bf16: kept nodes run in fp32")
        fallback = "fp32"
    low = prec.dtype
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        notes.append("sensitivity chart skipped: matplotlib is not installed "
                     "(pip install -e .[bench])")
    sets = calibration_inputs(model, ap)
    if len(sets) >= 2:
        half = (len(sets) + 1) // 2
        analysis_sets, heldout = sets[:half], sets[half:]
    else:
        analysis_sets = heldout = sets
        notes.append("one calibration input set: analysis and tolerance check share it")
    calibration = {"source": ap.calibration or (f"random U({ap.input_range})" if ap.input_range
                                                else "random N(0, 1)") +
                   ("" if ap.calibration else f", seed {ap.seed}"),
                   "samples": len(sets), "analysis": len(analysis_sets),
                   "heldout": len(heldout)}
    step("sensitivity analysis")
    analysis = analyze(model, low, analysis_sets, ap.range_headroom)
    notes.extend(analysis.notes)
    stats = analysis.by_node()
    user = list(prec.policy.exclude_nodes)
    base_modes = node_modes(_variant_mod(model, prec, user), low)

    # 1. range: nodes whose values the low type cannot hold, and the nodes casting them to it.
    reasons: dict = {}
    bad_values = set()
    for s in analysis.nodes:
        if s.overflow:
            bad_values.update(o for n in model.onnx_model.graph.node if n.name == s.node
                              for o in n.output if o)
        if s.node in user or base_modes.get(s.node) != "low":
            continue
        if s.overflow:
            reasons[s.node] = "range"
        elif s.underflow_share > ap.underflow_share:
            reasons[s.node] = "underflow"
    import numpy as np

    for spec in model.inputs:
        if spec.dtype.startswith("float") and any(
                float(np.max(np.abs(f[spec.name]))) * ap.range_headroom > analysis.limit
                for f in sets):
            bad_values.add(spec.name)
    consumers = _consumers(model.onnx_model)
    for _ in range(4):  # a kept producer can turn a follow-op consumer fp32; re-check
        modes = node_modes(_variant_mod(model, prec, user + list(reasons)), low)
        added = False
        for v in bad_values:
            for c in consumers.get(v, []):
                if modes.get(c) == "low" and c not in reasons and c not in user:
                    reasons[c] = "range-input"
                    added = True
        if not added:
            break
    modes = node_modes(_variant_mod(model, prec, user + list(reasons)), low)
    order = {s.node: i for i, s in enumerate(analysis.nodes)}
    cands = [n for n, m in modes.items() if m == "low" and n in stats]
    cands.sort(key=lambda n: (-stats[n].score, -stats[n].naive_error, order[n]))
    result = AutoPrecisionResult(
        precision=prec, fallback=fallback, dtype=low, metric_name=ap.metric,
        tolerance=ap.tolerance, analysis=analysis, reasons=reasons,
        modes={n: ("fp16" if low == "float16" else "bf16") if m == "low" else "fp32"
               for n, m in base_modes.items()},
        candidates=len(cands), calibration=calibration, notes=notes)
    if search:
        step("precision search")
        refs = [model.reference(f) for f in heldout]
        ev = _Evaluator(model, prec, user + list(reasons), heldout, refs, ap.metric,
                        ap.tolerance, fallback, isolate)
        try:
            chosen = _search(ev, cands)
        finally:
            ev.cleanup()
        for n in chosen:
            reasons[n] = "tolerance"
        result.trials, result.builds = ev.trials, ev.builds
        final = [t for t in ev.trials if set(t.nodes) == set(chosen) and t.passed]
        result.met = bool(final)
        result.final_metric = final[-1].metric if final else ev.trials[-1].metric
        if not final:
            notes.append(f"the tolerance {ap.metric} {ap.tolerance:g} is not met even with "
                         f"every candidate node in {fallback}; kept them all")
    result.precision = copy.deepcopy(prec)
    result.precision.policy.exclude_nodes = list(dict.fromkeys(user + list(reasons)))
    result.reasons = reasons
    result.kept = _kept(model, result, user)
    result.seconds = time.perf_counter() - start
    return result


_PREPARED: dict = {}  # id(model.mod) -> (model.mod, prepare_module(model.mod))


def _quick_convert(model, prec: PrecisionConfig, exclude=None):
    """amp's precision pass without its closing DeadCodeElimination/FoldConstant (FoldConstant
    compiles a kernel per folded constant: seconds): enough to see each node's mode and the
    PrecisionReport, at a tenth of the cost."""
    p = copy.deepcopy(prec)
    if exclude is not None:
        p.policy.exclude_nodes = list(dict.fromkeys(exclude))
    key = id(model.mod)
    if key not in _PREPARED:  # one FoldConstant per model, not one per variant
        _PREPARED.clear()
        _PREPARED[key] = (model.mod, prepare_module(model.mod))  # holding mod keeps id stable
    conv = Converter(p, model.node_types)
    prepared = _PREPARED[key][1]
    return replace_main(prepared, conv.convert_function(prepared["main"])), conv.report


def _variant_mod(model, prec, exclude):
    return _quick_convert(model, prec, exclude)[0]


def _search(ev: _Evaluator, cands: list) -> list:
    """The chosen extra nodes among the ranked candidates (see the module docstring).

    Galloping (k = 1, 2, 4, ...) then bisection finds the smallest passing top-k in
    <= 2*ceil(log2 k) + 1 trials, so a model that needs one or two nodes costs two or three;
    pruning gets whatever is left of the bound."""
    n = len(cands)
    budget = search_bound(n)
    if ev([], "base") or n == 0:
        return []
    lo, hi, k = 0, n, 1  # top-lo fails; top-hi passes (top-n assumed: every candidate kept)
    while k < n:
        if ev(cands[:k], "gallop"):
            hi = k
            break
        lo, k = k, 2 * k
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ev(cands[:mid], "bisect"):
            hi = mid
        else:
            lo = mid
    if hi == n and not ev(cands, "verify"):
        return list(cands)
    chosen = list(cands[:hi])
    # Give back groups of chosen nodes, the lower-ranked half first, halving a group that
    # fails; the last one is needed (top-(k-1) failed), so it is never offered.
    rest = list(reversed(chosen[:-1]))
    queue = [g for g in (rest[:(len(rest) + 1) // 2], rest[(len(rest) + 1) // 2:]) if g]
    while queue and len(ev.trials) < budget:
        group = queue.pop(0)
        trial = [c for c in chosen if c not in group]
        if ev(trial, "prune"):
            chosen = trial
        elif len(group) > 1:
            half = len(group) // 2
            queue[:0] = [group[:half], group[half:]]
    return chosen


def _kept(model, result: AutoPrecisionResult, user: list) -> list:
    _, rep = _quick_convert(model, result.precision)
    stats = result.analysis.by_node() if result.analysis else {}
    out, seen = [], set()
    for k in rep.kept_fp32:
        if k.node in seen or k.node not in model.node_types:
            continue
        seen.add(k.node)
        why = k.reason
        if why == "excluded-node":
            why = result.reasons.get(k.node, "user") if k.node not in user else "user"
        s = stats.get(k.node)
        out.append({"node": k.node, "op_type": model.node_types.get(k.node, k.op),
                    "reason": why, "why": WHY.get(why, why).format(dtype=result.dtype),
                    "max_abs": s.max_abs if s else None, "limit": s.limit if s else None,
                    "score": s.score if s else None})
    return out


# ---------------------------------------------------------------------------------------------
# bf16 fallback


def summary_text(ap: dict) -> str:
    """One line for the CLI: what was kept and why, and what the search cost."""
    why = Counter(k["reason"] for k in ap.get("kept", []))
    s = ap.get("search") or {}
    kept = ", ".join(f"{c} {r}" for r, c in why.items()) or "none"
    text = f"auto precision: kept in {ap.get('fallback')}: {kept}"
    if s:
        tol = ap.get("tolerance", {})
        text += (f"; {s.get('variants_evaluated')} variants ({s.get('builds')} builds, bound "
                 f"{s.get('bound_value')} for {s.get('candidates')} candidates); "
                 f"{tol.get('metric')} {_fmt(s.get('final_metric'))} "
                 f"{'within' if s.get('met') else 'NOT within'} {_fmt(tol.get('value'))}")
    return text


def _fmt(v) -> str:
    try:
        return f"{float(v):.3g}"
    except (TypeError, ValueError):
        return str(v)


def inspect_model(model, cfg: ConvertConfig, search: bool = True,
                  progress: Progress | None = None) -> AutoPrecisionResult:
    """The analysis (and, with ``search``, the search) ``amp inspect`` prints; builds only
    temporary CPU variants.

    >>> res = inspect_model(amp_cli.load("m.onnx"), ConvertConfig(target="llvm"))  # doctest: +SKIP
    >>> res.analysis.first_nonfinite                                              # doctest: +SKIP
    """
    resolved = resolve_config(cfg, resolve_target(cfg.target).kind)
    return auto_precision(model, resolved, progress=progress, search=search)
