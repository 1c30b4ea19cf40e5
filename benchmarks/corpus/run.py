"""`run`: convert every corpus model with `amp convert` in a subprocess and tabulate the results.

amp's own accuracy check draws its inputs itself (`amp convert` takes no input file for it), so
after a successful build this also runs the library on the model's saved inputs (`check`, in a
subprocess too: TVM can crash) and compares it with the saved ONNX Runtime fp32 reference.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

PACKAGE_DIR = Path(__file__).resolve().parent
COLUMNS = [("name", 22), ("exporter", 11), ("prec", 5), ("rc", 4), ("wall_s", 7),
           ("build_s", 8), ("rel_l2", 9), ("nonfin", 7), ("saved_rel_l2", 13), ("torch", 8),
           ("error", 0)]


def run_command(cmd: list[str], timeout: float) -> tuple[int, str, str, float]:
    """Run `cmd` in its own process group; on timeout kill that group. (rc, out, err, secs);
    rc is 124 on timeout, -N when killed by signal N."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            errors="replace", start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        rc = 124
    return rc, out, err, time.monotonic() - start


def pick_error_line(stderr: str) -> str:
    """The line that says what went wrong: amp's `amp: error: ...` line, else the first line
    naming an error, else the last line (progress bars' carriage returns split lines too)."""
    lines = [ln.strip() for ln in re.split(r"[\r\n]+", stderr) if ln.strip()]
    for pattern in (r"^amp: ", r"(Error|error|Segmentation|Aborted|Killed)"):
        hits = [ln for ln in lines if re.search(pattern, ln)]
        if hits:
            return re.sub(r"^amp: (error: )?", "", hits[0])[:1000]
    return lines[-1][:1000] if lines else ""


def as_number(value):
    """A report value as a float: amp writes non-finite numbers as the strings "inf", "nan"."""
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def read_report(path: Path) -> dict:
    """The fields of amp's report.json that the table shows."""
    r = json.loads(path.read_text())
    worst = (r.get("accuracy") or {}).get("worst") or {}
    return {"rel_l2": as_number(worst.get("rel_l2")),
            "nonfinite_share": as_number(worst.get("nonfinite_share")),
            "accuracy_device": (r.get("accuracy") or {}).get("device"),
            "build_s": (r.get("build") or {}).get("seconds"), "timings": r.get("timings"),
            "notes": r.get("notes")}


def check_saved_inputs(library: Path, entry: dict, outdir: Path, device: str,
                       timeout: float) -> dict:
    """Run the built library on the entry's saved inputs (subprocess) and compare it with the
    saved ORT fp32 reference."""
    if not entry.get("reference_file"):
        return {"saved_error": "no reference"}
    cmd = [sys.executable, str(PACKAGE_DIR), "check", str(library),
           str(outdir / entry["inputs_file"]), str(outdir / entry["reference_file"]),
           "--device", device]
    rc, out, err, _ = run_command(cmd, timeout)
    lines = out.strip().splitlines()
    if rc != 0 or not lines:
        return {"saved_error": f"check exit {rc}: {pick_error_line(err)}"}
    return json.loads(lines[-1])


def check_library(library: str, inputs: str, reference: str, device: str) -> dict:
    """Run a Relax VM library on an .npz of inputs (in file order) vs an .npz reference."""
    import tvm
    from tvm import relax
    from .export import rel_l2
    dev = tvm.cuda(0) if device == "cuda" else tvm.cpu(0)
    if not dev.exist:
        return {"saved_skipped": f"no {device} device"}
    vm = relax.VirtualMachine(tvm.runtime.load_module(library), dev)
    feeds = np.load(inputs)
    out = vm["main"](*(tvm.runtime.tensor(feeds[k], dev) for k in feeds.files))
    got = flatten_outputs(out)
    ref = [v for _, v in sorted(np.load(reference).items(), key=lambda kv: int(kv[0][4:]))]
    if len(got) != len(ref):
        return {"saved_error": f"{len(got)} outputs, reference has {len(ref)}"}
    nonfinite = max(float(1 - np.isfinite(g).mean()) for g in got)
    return {"saved_rel_l2": max(rel_l2(r, g) for r, g in zip(ref, got)),
            "saved_nonfinite_share": nonfinite}


def flatten_outputs(out) -> list[np.ndarray]:
    """A VM result (a tensor or nested tuples of them) as a flat list of numpy arrays."""
    if hasattr(out, "numpy"):
        return [out.numpy()]
    return [a for o in out for a in flatten_outputs(o)]


DEFAULT_TOLERANCE = 0.05  # amp's accuracy.rel_l2_tolerance


def gate_tolerance(torch_rel_l2) -> float | None:
    """The accuracy gate for a model with random weights: amp's default, or twice the error
    PyTorch's own fp16/bf16 makes on the same weights when that is larger (random-init deep
    CNNs: torch bf16 misses its fp32 output by 0.3-0.65 -- the type's noise, not a bug, and
    amp should not have to keep most of the model in fp32 to beat it). None: amp's default."""
    if torch_rel_l2 is None or 2 * torch_rel_l2 <= DEFAULT_TOLERANCE:
        return None
    return 2 * float(torch_rel_l2)


def convert_entry(entry: dict, outdir: Path, amp: list[str], target: str, precision: str,
                  timeout: float, results_dir: Path) -> dict:
    """`amp convert` one model at one precision; the row for the table."""
    row = {"name": entry["name"], "exporter": entry["exporter"], "prec": precision,
           "target": target, "degenerate": entry.get("degenerate", False),
           "torch": (entry.get("torch_rel_l2") or {}).get(precision)}
    with tempfile.TemporaryDirectory(prefix="corpus-") as tmp:
        out_dir = Path(tmp) / "out"
        cmd = amp + ["convert", str(outdir / entry["file"]), "-o", str(out_dir),
                     "--target", target, "--precision", precision, "--force"]
        tolerance = gate_tolerance(row["torch"])
        if tolerance is not None:
            row["tolerance"] = tolerance
            config = Path(tmp) / "tolerance.yaml"
            config.write_text(f"accuracy:\n  rel_l2_tolerance: {tolerance:.6g}\n")
            cmd += ["--config", str(config)]
        rc, _, err, secs = run_command(cmd, timeout)
        row.update(rc=rc, wall_s=round(secs, 1))
        if rc != 0:
            row["error"] = "timeout" if rc == 124 else pick_error_line(err) or f"exit {rc}"
        report = out_dir / "report.json"
        if report.is_file():
            row.update(read_report(report))
            stem = f"{Path(entry['file']).stem}.{target.replace(':', '_')}.{precision}"
            (results_dir / f"{stem}.report.json").write_text(report.read_text())
        if rc == 0 and (out_dir / "model.so").is_file():
            device = "cuda" if target.startswith("cuda") or '"cuda"' in target else "cpu"
            row.update(check_saved_inputs(out_dir / "model.so", entry, outdir, device,
                                          timeout))
    return row


def format_cell(value, width: int) -> str:
    """One table cell: floats in 3 significant digits, None as '-'."""
    if value is None:
        text = "-"
    elif isinstance(value, float):
        text = f"{value:.3g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.1e}"
    else:
        text = str(value)
    return text[:width - 1].ljust(width) if width else text


def format_row(row: dict) -> str:
    """One printed line of the table."""
    vals = dict(row, nonfin=row.get("nonfinite_share"), saved_rel_l2=row.get("saved_rel_l2"),
                error=row.get("error") or row.get("saved_error") or
                ("degenerate reference" if row.get("degenerate") else ""))
    return " ".join(format_cell(vals.get(k), w) for k, w in COLUMNS)


def run_corpus(outdir: Path, target: str, precisions: list[str], only: set[str] | None,
               timeout: float, amp: str | None, json_path: Path | None, log=print,
               jobs: int = 1) -> list[dict]:
    """Convert each exported model of `outdir/manifest.json` at each precision, printing rows
    as they finish (`jobs` conversions at a time, each its own `amp convert` process)."""
    from concurrent.futures import ThreadPoolExecutor

    manifest = json.loads((outdir / "manifest.json").read_text())
    amp_cmd = shlex.split(amp) if amp else [sys.executable, "-m", "amp_cli"]
    results_dir = outdir / "results"
    results_dir.mkdir(exist_ok=True)
    log(" ".join(format_cell(k, w) for k, w in COLUMNS))
    rows, lock = [], threading.Lock()

    def add(row: dict) -> None:
        with lock:
            rows.append(row)
            log(format_row(row))
            if json_path:  # rewritten after every row: a long run killed midway keeps its rows
                json_path.write_text(json.dumps({"target": target, "rows": rows}, indent=1))

    work = []
    for entry in manifest["models"]:
        if only and not {entry["name"], f"{entry['name']}.{entry['exporter']}"} & only:
            continue
        if not entry.get("file"):
            add({"name": entry["name"], "exporter": entry["exporter"], "rc": None,
                 "error": f"not exported: {entry.get('export_error')}"})
            continue
        work += [(entry, precision) for precision in precisions]
    def one(entry: dict, precision: str) -> None:
        try:
            add(convert_entry(entry, outdir, amp_cmd, target, precision, timeout, results_dir))
        except Exception as exc:  # noqa: BLE001 - the runner's own failure is a row too
            add({"name": entry["name"], "exporter": entry["exporter"], "prec": precision,
                 "rc": None, "error": f"corpus runner: {type(exc).__name__}: {exc}"[:300]})

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        for entry, precision in work:
            pool.submit(one, entry, precision)
    return rows
