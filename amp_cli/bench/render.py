"""``amp bench``'s output as text and a chart (pure functions: strings and files, no
printing)."""
from __future__ import annotations

import math
from pathlib import Path

from ..errors import AmpError, InputError
from .results import BenchResult


def _f(v, spec=".3g") -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return format(v, spec)


def format_table(result: BenchResult) -> str:
    """The human-readable table printed by ``amp bench``."""
    where = result.target.get("arch") or result.target.get("mcpu") or ""
    lines = [f"amp bench: {result.source} on {result.device}" + (f" ({where})" if where else ""),
             f"  inputs: {result.inputs['source']}, batch {result.inputs['batch']}; "
             f"warmup {result.config.warmup}, repeat {result.config.repeat}, number "
             f"{result.config.number}; accuracy vs {result.reference}"]
    head = ("runner", "mean ms", "std", "min", "p50", "p90", "p99", "items/s", "rel L2",
            "max abs", "cosine", "non-fin")
    rows = []
    fast = {}
    for r in result.runners:
        if not r.ok:
            rows.append((r.name, f"{'skipped' if r.skipped else 'error'}: {r.skipped or r.error}"))
            continue
        s, a = r.latency, r.accuracy or {}
        fast[r.name] = s.p50_ms
        rows.append((r.name, _f(s.mean_ms, ".4g"), _f(s.std_ms), _f(s.min_ms, ".4g"),
                     _f(s.p50_ms, ".4g"), _f(s.p90_ms, ".4g"), _f(s.p99_ms, ".4g"),
                     _f(s.throughput_per_s, ".4g"), _f(a.get("rel_l2")), _f(a.get("max_abs")),
                     _f(a.get("cosine"), ".6f") if a else "-", _f(a.get("nonfinite_share"))))
    widths = [max(len(head[i]), *(len(r[i]) for r in rows if len(r) > 2)) if
              any(len(r) > 2 for r in rows) else len(head[i]) for i in range(len(head))]
    lines.append("  " + "  ".join(h.ljust(w) if i == 0 else h.rjust(w)
                                  for i, (h, w) in enumerate(zip(head, widths))))
    for r in rows:
        if len(r) == 2:
            lines.append("  " + r[0].ljust(widths[0]) + "  " + r[1])
        else:
            lines.append("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                          for i, (c, w) in enumerate(zip(r, widths))))
    amp = result.primary
    if amp.ok and len(fast) > 1:
        rel = ", ".join(f"{n} {amp.latency.p50_ms / v:.2f}x" for n, v in fast.items()
                        if n != amp.name and v > 0)
        lines.append(f"  {amp.name} p50 latency relative to: {rel}")
    for g in result.gates:
        lines.append(f"  gate {g.name}: {'pass' if g.passed else 'FAIL'}: {g.reason}")
    for r in result.runners:
        for n in r.notes:
            lines.append(f"  note ({r.name}): {n}")
    for n in result.notes:
        lines.append(f"  note: {n}")
    return "\n".join(lines)


def require_matplotlib() -> None:
    """Raise a clear AmpError when matplotlib (the ``bench`` extra) is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise AmpError("--plot needs matplotlib, which is not installed: pip install matplotlib "
                       "(or pip install -e .[bench])") from None


def write_plot(result: BenchResult, path: str | Path) -> Path:
    """A bar chart of p50 latency per runner (error bars: p90 and min) as an image file."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in result.runners if r.ok]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(ok) + 2), 3.5))
    names = [r.name for r in ok]
    p50 = [r.latency.p50_ms for r in ok]
    lo = [r.latency.p50_ms - r.latency.min_ms for r in ok]
    hi = [r.latency.p90_ms - r.latency.p50_ms for r in ok]
    ax.bar(names, p50, yerr=[lo, hi], capsize=4,
           color=["tab:green" if r is result.primary else "tab:gray" for r in ok])
    ax.set_ylabel("latency ms (p50; bars min..p90)")
    ax.set_title(f"{Path(result.source).name} on {result.device}, batch "
                 f"{result.inputs['batch']}")
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    out = Path(path)
    try:
        fig.savefig(out, dpi=120)
    except OSError as exc:
        raise InputError(f"cannot write {out}: {exc.strerror}") from None
    finally:
        plt.close(fig)
    return out
