"""Per-node range and fp16/bf16 sensitivity analysis of an ONNX model, without a TVM build.

Two ONNX Runtime sessions, each run once per calibration input set:

1. **Ranges (fp32).** The model with every intermediate value added as a graph output: each
   ONNX node's max |x| and the share of its L2 norm that is subnormal in the low type. ORT
   gives per-ONNX-node values directly (the names ``exclude_nodes`` takes), and costs one run.
2. **Low-precision emulation.** One graph holding, next to the fp32 original:
   - a *naive* copy where every float32 value is rounded to the low type after every node (what
     "convert everything" computes: storage rounding, fp32 arithmetic is exact emulation of
     correctly rounded fp16 elementwise ops and of fp16-input/fp32-accumulate matmuls);
   - per node, a *local* copy fed with the fp32 values rounded to the low type;
   - per edge (value ``u`` into node ``j``), a copy of ``j`` where only ``u`` is rounded: the
     error ``u``'s low-precision storage causes one node downstream. Attributed to ``u``'s
     producer, or to ``j`` when ``j`` casts its own inputs (matmul/conv/gemm: ``always`` ops)
     or ``u`` is a model input or constant. This one-hop propagation is what ranks the ``+1024``
     before a cancelling ``-1024`` (harmless alone, ruinous one node later) above its consumer.

Graph optimizations are disabled for the emulation session, so ORT cannot drop the
round-trip casts. The error numbers are estimates; amp's search confirms every decision with
real builds (``amp_cli.precision.auto``).

>>> from amp_cli.sensitivity import analyze, calibration_inputs           # doctest: +SKIP
>>> a = analyze(model, "float16", calibration_inputs(model, cfg.auto_precision)[:2])
>>> a.first_nonfinite                                                   # doctest: +SKIP
'square'
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import numpy as np

from ..accuracy import random_inputs
from ..config import parse_input_range
from ..dtypes import round_to, type_range
from ..errors import AmpError, InputError
from ..frontend.ort_session import inference_session

# ONNX ops that amp's policy runs as "always": they cast their float inputs to the low type
# themselves, whatever precision the producer ran in.
ALWAYS_ONNX_OPS = {"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "Attention"}
_FLOAT32 = 1  # onnx.TensorProto.FLOAT
_ONNX_LOW = {"float16": 10, "bfloat16": 16}
_SEP = "::amp"  # suffix separator of the emulation graph's helper values


@dataclass
class NodeSensitivity:
    node: str
    op_type: str
    max_abs: float  # fp32 max |x| over the node's float outputs and the calibration inputs
    limit: float  # largest finite value of the low type
    underflow_share: float  # share of the output's L2 norm below the low type's smallest normal
    storage_error: float  # rel L2 of rounding the fp32 output to the low type
    local_error: float  # rel L2 of the node run on rounded fp32 inputs (output rounded)
    naive_error: float  # rel L2 of the node's output when every node runs in the low type
    naive_nonfinite: bool  # inf/NaN there where fp32 is finite
    edge_errors: dict = field(default_factory=dict)  # consumer node -> rel L2 one hop later
    score: float = 0.0  # error contribution used to rank the node (see module docstring)
    overflow: bool = False  # max_abs x headroom > limit

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class SensitivityAnalysis:
    dtype: str
    limit: float
    smallest_normal: float
    nodes: list  # NodeSensitivity, topological order
    first_nonfinite: str | None  # first node with inf/NaN under naive conversion
    naive_output_error: float  # worst rel L2 of the model outputs under naive conversion
    samples: int
    seconds: float
    emulated: bool = True  # False: only ranges (model with control flow)
    notes: list = field(default_factory=list)
    method: str = ("ONNX Runtime: fp32 run with every intermediate as an output (ranges) and "
                   "one emulation graph (naive, per-node and per-edge rounding to the low type)")

    def by_node(self) -> dict:
        return {n.node: n for n in self.nodes}

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["nodes"] = [n.to_dict() for n in self.nodes]
        return d


# ---------------------------------------------------------------------------------------------
# Calibration inputs


def calibration_inputs(model, ap_cfg) -> list[dict]:
    """The calibration input sets: from ``ap_cfg.calibration`` (.npz; arrays of the input's
    shape, or with one extra leading axis of samples), else ``ap_cfg.samples`` seeded random
    sets (floats ~ N(0, 1), or U(LO, HI) with ``input_range``). Dynamic dims at their
    optimum."""
    if ap_cfg.calibration:
        return load_calibration(ap_cfg.calibration, model.example_inputs)
    sets = []
    for k in range(ap_cfg.samples):
        feeds = random_inputs(model.example_inputs, ap_cfg.seed + k)
        if ap_cfg.input_range:
            lo, hi = parse_input_range(ap_cfg.input_range)
            rng = np.random.default_rng(ap_cfg.seed + k)
            for s in model.inputs:
                if s.dtype.startswith("float"):
                    feeds[s.name] = rng.uniform(lo, hi, feeds[s.name].shape).astype(s.dtype)
        sets.append(feeds)
    return sets


def load_calibration(path: str, specs) -> list[dict]:
    try:
        data = np.load(path)
    except Exception as exc:  # noqa: BLE001
        raise InputError(f"{path}: cannot read as .npz ({type(exc).__name__})") from None
    missing = [s.name for s in specs if s.name not in data.files]
    if missing:
        raise InputError(f"{path}: missing calibration input(s) {', '.join(missing)}; found "
                         f"{', '.join(data.files) or 'nothing'}")
    counts = set()
    arrays = {}
    for s in specs:
        arr = data[s.name]
        want = [int(d) for d in s.shape]
        if list(arr.shape) == want:
            arr = arr[None]
        elif list(arr.shape[1:]) != want:
            raise InputError(f"{path}: input '{s.name}' has shape {list(arr.shape)}; expected "
                             f"{want} or [N, {', '.join(map(str, want))}]")
        if str(arr.dtype) != s.dtype:
            raise InputError(f"{path}: input '{s.name}' has dtype {arr.dtype}, the model "
                             f"expects {s.dtype}")
        arrays[s.name] = arr
        counts.add(arr.shape[0])
    if len(counts) != 1:
        raise InputError(f"{path}: inputs have different sample counts {sorted(counts)}")
    n = counts.pop()
    return [{name: np.ascontiguousarray(a[k]) for name, a in arrays.items()} for k in range(n)]


# ---------------------------------------------------------------------------------------------
# Analysis


def _session(model_proto, optimize: bool):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = 1
    if not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return inference_session(model_proto, opts)


class _Err:
    """Accumulates a relative L2 error over calibration samples."""

    __slots__ = ("diff", "ref", "nonfinite")

    def __init__(self):
        self.diff, self.ref, self.nonfinite = 0.0, 0.0, False

    def add(self, ref: np.ndarray, got: np.ndarray) -> None:
        ref = np.asarray(ref, np.float64)
        got = np.asarray(got, np.float64)
        fin = np.isfinite(ref)
        if not np.isfinite(got[fin]).all():
            self.nonfinite = True
            return
        self.diff += float(np.sum((got[fin] - ref[fin]) ** 2))
        self.ref += float(np.sum(ref[fin] ** 2))

    @property
    def value(self) -> float:
        if self.nonfinite:
            return math.inf
        return math.sqrt(self.diff / self.ref) if self.ref > 0 else math.sqrt(self.diff)


def analyze(model, dtype: str, feeds_list: list[dict], headroom: float = 1.0
            ) -> SensitivityAnalysis:
    """Ranges and low-precision error estimates per ONNX node of ``model`` (an ONNX
    :class:`~amp_cli.frontend.LoadedModel`) on the calibration inputs ``feeds_list``. A node
    counts as overflowing when its largest |value| times ``headroom`` leaves the type's range
    (calibration inputs are a sample: other inputs go higher)."""
    import onnx

    if model.onnx_model is None:
        raise AmpError("auto-precision analyses ONNX models; export the torch model to ONNX "
                       "(torch.onnx.export) and convert that")
    start = time.perf_counter()
    limit, tiny = type_range(dtype).max, type_range(dtype).smallest_normal
    src = model.onnx_model
    graph = src.graph
    nodes = list(graph.node)
    inits = {i.name for i in graph.initializer}
    notes = []

    # Pass 1: fp32 with every node output as a graph output.
    probe = onnx.ModelProto()
    probe.CopyFrom(src)
    have = {o.name for o in probe.graph.output}
    for n in nodes:
        for o in n.output:
            if o and o not in have:
                probe.graph.output.append(onnx.ValueInfoProto(name=o))
                have.add(o)
    sess = _session(probe, optimize=False)
    out_names = [o.name for o in sess.get_outputs()]
    out_types = {o.name: o.type for o in sess.get_outputs()}
    in_types = {i.name: i.type for i in sess.get_inputs()}
    is_f32 = {**{k: t == "tensor(float)" for k, t in out_types.items()},
              **{k: t == "tensor(float)" for k, t in in_types.items()}}
    for init in graph.initializer:
        is_f32[init.name] = init.data_type == _FLOAT32
    ref_runs = []
    for feeds in feeds_list:
        ref_runs.append(dict(zip(out_names, sess.run(None, feeds))))
    del sess

    stats = {}
    for n in nodes:
        outs = [o for o in n.output if o and is_f32.get(o)]
        max_abs, under_sq, tot_sq = 0.0, 0.0, 0.0
        store = _Err()
        for run in ref_runs:
            for o in outs:
                v = np.asarray(run[o], np.float32)
                fin = v[np.isfinite(v)]
                if fin.size:
                    a = np.abs(fin.astype(np.float64))
                    max_abs = max(max_abs, float(a.max()))
                    under_sq += float(np.sum(a[a < tiny] ** 2))
                    tot_sq += float(np.sum(a ** 2))
                store.add(v, round_to(v, dtype))
        stats[n.name] = NodeSensitivity(
            node=n.name, op_type=n.op_type, max_abs=max_abs, limit=limit,
            underflow_share=math.sqrt(under_sq / tot_sq) if tot_sq > 0 else 0.0,
            storage_error=store.value, local_error=0.0, naive_error=0.0, naive_nonfinite=False,
            overflow=max_abs * headroom > limit)

    has_subgraph = any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                       for n in nodes for a in n.attribute)
    first_nonfinite, naive_out = None, math.nan
    emulated = not has_subgraph
    if has_subgraph:
        notes.append("the model has control flow (If/Loop/Scan): only ranges were measured, "
                     "nodes are ranked by range")
        for s in stats.values():
            s.score = s.storage_error
    else:
        emu, plan = _emulation_graph(src, nodes, is_f32, inits, dtype)
        sess = _session(emu, optimize=False)
        names = [o.name for o in sess.get_outputs()]
        errs = {key: _Err() for key in plan}
        for feeds, run in zip(feeds_list, ref_runs):
            got = dict(zip(names, sess.run(names, feeds)))
            for key, (ref_name, got_name, rnd) in plan.items():
                g = got[got_name]
                errs[key].add(run[ref_name], round_to(g, dtype) if rnd else g)
        del sess
        producer = {o: n for n in nodes for o in n.output if o}
        for key, e in errs.items():
            kind, node, other = key
            s = stats[node]
            v = e.value
            if kind == "naive":
                s.naive_error = max(s.naive_error, v)
                s.naive_nonfinite = s.naive_nonfinite or e.nonfinite
            elif kind == "local":
                s.local_error = max(s.local_error, v)
            else:  # ("edge", consumer, value)
                p = producer.get(other)
                owner = node if (p is None or stats[node].op_type in ALWAYS_ONNX_OPS) \
                    else p.name
                so = stats[owner]
                label = node if owner != node else f"(input {other})"
                so.edge_errors[label] = max(so.edge_errors.get(label, 0.0), v)
        for s in stats.values():
            s.score = max([s.storage_error, *s.edge_errors.values()])
            if s.naive_nonfinite and first_nonfinite is None:
                first_nonfinite = s.node
        outs = [o.name for o in graph.output]
        naive_out = max((stats[producer[o].name].naive_error for o in outs if o in producer),
                        default=math.nan)
    return SensitivityAnalysis(
        dtype=dtype, limit=limit, smallest_normal=tiny, nodes=[stats[n.name] for n in nodes],
        first_nonfinite=first_nonfinite, naive_output_error=naive_out, samples=len(feeds_list),
        seconds=time.perf_counter() - start, emulated=emulated, notes=notes)


def _emulation_graph(src, nodes, is_f32, inits, dtype):
    """The emulation model and its plan: (kind, node, value) -> (reference value name,
    emulated value name, round the emulated value to the low type before comparing)."""
    import onnx
    from onnx import helper

    low = _ONNX_LOW[dtype]
    extra, plan, outputs = [], {}, []
    rounded = {}

    def rnd(v: str) -> str:
        if v not in rounded:
            mid, out = f"{v}{_SEP}r16", f"{v}{_SEP}r"
            extra.append(helper.make_node("Cast", [v], [mid], to=low, name=f"{mid}{_SEP}c"))
            extra.append(helper.make_node("Cast", [mid], [out], to=_FLOAT32, name=f"{out}{_SEP}c"))
            rounded[v] = out
        return rounded[v]

    def copy(n, inputs, tag):
        outs = [f"{o}{_SEP}{tag}" if o else "" for o in n.output]
        c = onnx.NodeProto()
        c.CopyFrom(n)
        c.name = f"{n.name}{_SEP}{tag}"
        del c.input[:]
        c.input.extend(inputs)
        del c.output[:]
        c.output.extend(outs)
        extra.append(c)
        return outs

    naive = {}
    graph_inputs = [i.name for i in src.graph.input] + list(inits)
    for v in graph_inputs:
        naive[v] = rnd(v) if is_f32.get(v) else v
    for k, n in enumerate(nodes):
        floats = [o for o in n.output if o and is_f32.get(o)]
        # naive chain: every float32 value rounded after every node
        outs = copy(n, [naive.get(i, i) if i else "" for i in n.input], "naive")
        for o, c in zip(n.output, outs):
            if o:
                naive[o] = rnd(c) if is_f32.get(o) else c
        for o in floats:
            plan[("naive", n.name, o)] = (o, naive[o], False)
            outputs.append(naive[o])
        fin = [i for i in dict.fromkeys(n.input) if i and is_f32.get(i)]
        if not floats or not fin:
            continue
        # local: all float inputs rounded
        outs = copy(n, [rnd(i) if i in fin else i for i in n.input], "local")
        keep_out = n.op_type in ALWAYS_ONNX_OPS  # fp32 output (accumulate type)
        for o, c in zip(n.output, outs):
            if o in floats:
                plan[("local", n.name, o)] = (o, c, not keep_out)
                outputs.append(c)
        # edges: one float input rounded at a time
        for j, u in enumerate(fin):
            outs = copy(n, [rnd(i) if i == u else i for i in n.input], f"e{j}")
            for o, c in zip(n.output, outs):
                if o in floats:
                    plan[("edge", n.name, u)] = (o, c, False)
                    outputs.append(c)
                    break  # first float output is enough for the ranking
    emu = onnx.ModelProto()
    emu.CopyFrom(src)
    emu.graph.node.extend(extra)
    del emu.graph.output[:]
    emu.graph.output.extend(onnx.ValueInfoProto(name=o) for o in dict.fromkeys(outputs))
    return emu, plan


# ---------------------------------------------------------------------------------------------
# Rendering (report.md section, chart)


def _g(v) -> str:
    if isinstance(v, str):
        return v
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isinf(v):
            return "inf"
        if math.isnan(v):
            return "-"
        return f"{v:.3g}"
    return str(v)


def render_markdown_section(ap: dict, max_rows: int = 60) -> list[str]:
    """report.md lines for report['auto_precision']."""
    a, s = ap.get("analysis") or {}, ap.get("search") or {}
    lines = ["## Auto precision", ""]
    tol = ap.get("tolerance", {})
    cal = ap.get("calibration", {})
    lines.append(f"- tolerance: {tol.get('metric')} {'>=' if tol.get('metric') == 'cosine' else '<='}"
                 f" {_g(tol.get('value'))} on {cal.get('heldout')} held-out calibration input "
                 f"set(s) ({cal.get('source')}); analysis on {cal.get('analysis')} set(s)")
    lines.append(f"- kept nodes run in: {ap.get('fallback')}")
    if a:
        lines.append(f"- naive conversion (every node in {a.get('dtype')}): output rel L2 "
                     f"{_g(a.get('naive_output_error'))}; first node producing inf/NaN: "
                     f"{('`' + a['first_nonfinite'] + '`') if a.get('first_nonfinite') else 'none'}")
        lines.append(f"- analysis: {_g(a.get('seconds'))} s ({a.get('method')})")
    if s:
        lines.append(f"- search: {s.get('variants_evaluated')} variants evaluated "
                     f"({s.get('builds')} builds) over {s.get('candidates')} candidate nodes; "
                     f"bound {s.get('bound')} = {s.get('bound_value')}; "
                     f"{'tolerance met' if s.get('met') else 'tolerance NOT met'} "
                     f"({s.get('metric_name')} {_g(s.get('final_metric'))}); "
                     f"{_g(s.get('seconds'))} s")
    for n in ap.get("notes", []):
        lines.append(f"- {n}")
    kept = ap.get("kept") or []
    if kept:
        lines += ["", f"Kept in {ap.get('fallback')} by auto precision and policy:", "",
                  "| node | op | why | max abs | limit | score |", "|---|---|---|---|---|---|"]
        for k in kept:
            lines.append(f"| {k['node']} | {k['op_type']} | {k['why']} | {_g(k.get('max_abs'))} "
                         f"| {_g(k.get('limit'))} | {_g(k.get('score'))} |")
    trials = s.get("trials") or []
    if trials:
        lines += ["", "Variants evaluated:", "", "| # | phase | extra nodes kept | metric | pass |"
                  " build |", "|---|---|---|---|---|---|"]
        for i, t in enumerate(trials, 1):
            lines.append(f"| {i} | {t['phase']} | {t['extra']} | {_g(t['metric'])} | "
                         f"{'yes' if t['passed'] else 'no'} | "
                         f"{'cached' if t.get('cached') else 'yes'} |")
    nodes = a.get("nodes") or []
    if nodes:
        lines += ["", "Per-node sensitivity (fp32 range vs the low type, error contribution):", "",
                  "| node | op | mode | max abs | / limit | underflow | score | local err | naive "
                  "err |", "|---|---|---|---|---|---|---|---|---|"]
        order = sorted(nodes, key=lambda n: -_num(n.get("score")))
        for n in order[:max_rows]:
            ratio = _num(n.get("max_abs")) / _num(n.get("limit")) if _num(n.get("limit")) else 0
            lines.append(f"| {n['node']} | {n['op_type']} | {n.get('mode', '-')} | "
                         f"{_g(n.get('max_abs'))} | {_g(ratio)} | {_g(n.get('underflow_share'))} "
                         f"| {_g(n.get('score'))} | {_g(n.get('local_error'))} | "
                         f"{'inf/NaN' if n.get('naive_nonfinite') else _g(n.get('naive_error'))} |")
        if len(order) > max_rows:
            lines.append(f"| ... {len(order) - max_rows} more (report.json, amp inspect --json) "
                         f"| | | | | | | | |")
    lines.append("")
    return lines


def _num(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return 0.0


def write_chart(ap: dict, path) -> str | None:
    """A PNG of each node's range (max |x| / limit) and error score; None without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    nodes = (ap.get("analysis") or {}).get("nodes") or []
    if not nodes:
        return None
    names = [n["node"] for n in nodes]
    ratio = [max(_num(n.get("max_abs")) / max(_num(n.get("limit")), 1e-30), 1e-12) for n in nodes]
    score = [min(max(_num(n.get("score")), 1e-12), 1e6) for n in nodes]
    kept = {k["node"] for k in ap.get("kept") or []}
    colors = ["tab:red" if n in kept else "tab:blue" for n in names]
    try:
        _plot(plt, path, names, ratio, score, colors)
    except Exception:  # noqa: BLE001 - a chart never costs the conversion
        return None
    return str(path)


def _plot(plt, path, names, ratio, score, colors):
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(6, 0.18 * len(names)), 6), sharex=True)
    x = range(len(names))
    ax1.bar(x, ratio, color=colors)
    ax1.axhline(1.0, color="k", lw=0.8)
    ax1.set_yscale("log")
    ax1.set_ylabel("max |x| / limit")
    ax2.bar(x, score, color=colors)
    ax2.set_yscale("log")
    ax2.set_ylabel("error score (rel L2)")
    ax2.set_xticks(list(x))
    ax2.set_xticklabels(names, rotation=90, fontsize=6)
    ax1.set_title("amp auto precision: red = kept in higher precision")
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)
