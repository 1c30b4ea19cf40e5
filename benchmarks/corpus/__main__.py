"""Command line of the real-model corpus: `python benchmarks/corpus {export,run} ...`.

Also runs as `python -m benchmarks.corpus` from the repository root.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if not __package__:  # `python benchmarks/corpus`: rerun this file as the package's __main__
    import runpy
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repo root, not this folder
    runpy.run_module("benchmarks.corpus", run_name="__main__", alter_sys=True)
    sys.exit()

from . import export, run  # noqa: E402

EPILOG = """\
examples:
  python benchmarks/corpus export /tmp/corpus --scale tiny            # 53 entries, both exporters
  python benchmarks/corpus export /tmp/corpus --only gpt2,lstm --exporter legacy
  python benchmarks/corpus run /tmp/corpus --target llvm --precision fp16,bf16 --json res.json
  python benchmarks/corpus run /tmp/corpus --target cuda --only vit_b_16   # on a GPU machine

The corpus: torchvision (resnet50, mobilenet_v3_large, efficientnet_b0, convnext_tiny, vit_b_16,
densenet121, shufflenet_v2_x1_0, squeezenet1_0, regnet_y_400mf, inception_v3, resnext50_32x4d,
swin_t), transformers built from configs in code (bert, distilbert, gpt2, t5_encoder, vit_hf,
whisper_encoder, wav2vec2),
lstm, gru_bidirectional, yolo_head, and every onnx/backend/test/data/light/ model.
See docs/corpus.md.
"""


def parse_names(text: str | None) -> set[str] | None:
    """'a,b' -> {'a', 'b'}; None stays None (all models)."""
    return {n.strip() for n in text.split(",") if n.strip()} if text else None


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree: export and run."""
    p = argparse.ArgumentParser(
        prog="corpus", description="Export real models to ONNX at a fixed seed, then run "
        "`amp convert` on each and print one row per model.", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    e = sub.add_parser("export", help="write OUTDIR/*.onnx, their inputs and manifest.json",
                       description="Export each model with each exporter into OUTDIR, with "
                       "NAME.EXPORTER.inputs.npz (valid seeded inputs), NAME.EXPORTER."
                       "reference.npz (ONNX Runtime fp32 outputs on them) and manifest.json. "
                       "BatchNorm statistics are calibrated on random inputs first; a model "
                       "whose reference is constant, ~0 or non-finite is marked degenerate.")
    e.add_argument("outdir", type=Path)
    e.add_argument("--only", help="comma-separated model names (light models: light_vgg19, ...)")
    e.add_argument("--scale", choices=["tiny", "full"], default="tiny",
                   help="tiny: 2-layer transformers with hidden 64, images 64 px (inception "
                   "96): the whole corpus converts on 2 cores; full: real configs and "
                   "resolutions [default: tiny]")
    e.add_argument("--batch", type=int, default=1, help="batch size [default: 1]")
    e.add_argument("--exporter", choices=["dynamo", "legacy", "both"], default="both",
                   help="torch.onnx.export(dynamo=True) (torch's default), dynamo=False "
                   "(TorchScript), or both [default: both]")
    e.add_argument("--seed", type=int, default=0, help="seed of weights and inputs [default: 0]")

    r = sub.add_parser("run", help="amp convert every exported model, one row each",
                       description="Run `AMP convert FILE -o TMP --target T --precision P "
                       "--force` per model and precision in a subprocess with a timeout, read "
                       "TMP/report.json, then run the library on the saved inputs against the "
                       "saved ORT reference (saved_rel_l2; CPU targets, or CUDA on a GPU). "
                       "Columns: rc (124 = timeout, -11 = segfault), wall_s, build_s, rel_l2 "
                       "and nonfin (amp's own check, on amp's random inputs), saved_rel_l2, "
                       "torch (torch fp16/bf16 vs fp32 on the same inputs: the error a "
                       "framework gets), error (amp's one-line error).")
    r.add_argument("outdir", type=Path, help="a folder written by `export`")
    r.add_argument("--target", default="llvm", help="amp's --target [default: llvm]")
    r.add_argument("--precision", default="fp16", help="comma-separated, e.g. fp16,bf16 "
                   "[default: fp16]")
    r.add_argument("--only", help="comma-separated model names, or NAME.EXPORTER for one "
                   "exporter's file (gpt2.dynamo, vit_b_16.legacy)")
    r.add_argument("--timeout", type=float, default=900, help="seconds per conversion "
                   "[default: 900]")
    r.add_argument("--json", type=Path, help="write all rows here (updated after each row)")
    r.add_argument("--amp", help="the amp command [default: this Python's -m amp_cli]")
    r.add_argument("--jobs", type=int, default=1, help="conversions at a time [default: 1]")

    return p


def build_check_parser() -> argparse.ArgumentParser:
    """`check LIBRARY INPUTS REFERENCE`: what `run` starts in a subprocess (not in --help)."""
    c = argparse.ArgumentParser(prog="corpus check")
    c.add_argument("library")
    c.add_argument("inputs")
    c.add_argument("reference")
    c.add_argument("--device", default="cpu")
    return c


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["check"]:
        args = build_check_parser().parse_args(argv[1:])
        print(json.dumps(run.check_library(args.library, args.inputs, args.reference,
                                           args.device)))
        return 0
    args = build_parser().parse_args(argv)
    if args.command == "export":
        exporters = list(export.EXPORTERS) if args.exporter == "both" else [args.exporter]
        manifest = export.export_corpus(args.outdir, parse_names(args.only), args.scale,
                                        args.batch, exporters, args.seed)
        bad = [m for m in manifest["models"] if not m.get("file")]
        print(f"{len(manifest['models'])} entries in {args.outdir / 'manifest.json'}, "
              f"{len(bad)} failed to export, "
              f"{sum(bool(m.get('degenerate')) for m in manifest['models'])} degenerate")
    else:
        rows = run.run_corpus(args.outdir, args.target, args.precision.split(","),
                              parse_names(args.only), args.timeout, args.amp, args.json,
                              jobs=args.jobs)
        ok = sum(r.get("rc") == 0 for r in rows)
        print(f"{ok}/{len(rows)} conversions exited 0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
