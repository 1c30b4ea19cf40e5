"""The progress bar of `amp tune`.

Its own module, not cli_tune's: on a machine with a GPU the tuning runs in a spawned child and
``TuneBar.update`` is pickled to it; unpickling imports the defining module, and importing
cli_tune first (cli_tune -> cli -> registering cli_tune) is a circular import that killed every
`amp tune` there ("partially initialized module 'amp_cli.cli_tune'", seen on the H200).
"""
from __future__ import annotations

import sys


class TuneBar:
    """tqdm rendering of TuneProgress: trials done/total, tasks done/total, best latency, ETA."""

    def __init__(self):
        from tqdm import tqdm

        self.bar = tqdm(total=1, desc="amp tune", unit="trial", leave=False, file=sys.stderr,
                        disable=None, bar_format="{desc}: {n_fmt}/{total_fmt} {bar} {postfix}")

    def update(self, p) -> None:
        if p.phase != "tune":
            self.bar.set_postfix_str(p.phase + (f" ({p.tasks_total} kernels)"
                                                if p.tasks_total else ""))
            return
        self.bar.total = max(1, p.trials_total)
        self.bar.n = p.trials_done
        parts = [f"tasks {p.tasks_done}/{p.tasks_total}"]
        if p.best_ms is not None:
            parts.append(f"best {p.best_ms:.3f} ms")
        if p.eta_s is not None:
            parts.append(f"ETA {fmt_duration(p.eta_s)}")
        self.bar.set_postfix_str(", ".join(parts))

    def close(self) -> None:
        self.bar.close()


def fmt_duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
