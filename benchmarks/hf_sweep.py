"""A generality sweep: many transformers architectures, tiny configs written in code (nothing is
downloaded), exported with both ``torch.onnx.export`` paths and converted by ``amp convert`` with
default options. One row per (model, exporter, target, precision): amp's exit code and its own
accuracy check against ONNX Runtime fp32 (or the error line). The corpus (benchmarks/corpus)
holds the models it keeps measuring; this sweep looks for failure classes it does not have.

Usage (repository root; needs torch, transformers, onnxscript):
  python benchmarks/hf_sweep.py                          # every model, llvm fp16/bf16 + cuda:sm_90
  python benchmarks/hf_sweep.py --only llama,segformer --targets llvm:fp16
Results of 2026-12-07: docs/corpus.md, "Beyond the corpus".
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
B, S, VOCAB = 2, 16, 512
TEXT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            vocab_size=VOCAB)


def configs() -> dict:
    """name -> (a callable building the model, image size or None for text models)."""
    import transformers as tf

    small_lm = dict(TEXT, num_key_value_heads=2, max_position_embeddings=64)
    return {
        "llama": (lambda: tf.LlamaModel(tf.LlamaConfig(**small_lm)), None),
        "mistral": (lambda: tf.MistralModel(tf.MistralConfig(**small_lm)), None),
        "qwen2": (lambda: tf.Qwen2Model(tf.Qwen2Config(**small_lm)), None),
        "phi": (lambda: tf.PhiModel(tf.PhiConfig(**TEXT, max_position_embeddings=64)), None),
        "gpt_neox": (lambda: tf.GPTNeoXModel(tf.GPTNeoXConfig(**TEXT,
                                                              max_position_embeddings=64)), None),
        "roberta": (lambda: tf.RobertaModel(tf.RobertaConfig(**TEXT,
                                                             max_position_embeddings=64)), None),
        "albert": (lambda: tf.AlbertModel(tf.AlbertConfig(**TEXT, embedding_size=32,
                                                          max_position_embeddings=64)), None),
        "deberta_v2": (lambda: tf.DebertaV2Model(tf.DebertaV2Config(
            **TEXT, max_position_embeddings=64)), None),
        "electra": (lambda: tf.ElectraModel(tf.ElectraConfig(**TEXT, embedding_size=32,
                                                             max_position_embeddings=64)), None),
        "bloom": (lambda: tf.BloomModel(tf.BloomConfig(hidden_size=64, n_layer=2, n_head=4,
                                                       vocab_size=VOCAB)), None),
        "opt": (lambda: tf.OPTModel(tf.OPTConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
            vocab_size=VOCAB, max_position_embeddings=64, word_embed_proj_dim=64)), None),
        "falcon": (lambda: tf.FalconModel(tf.FalconConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB)), None),
        "hf_convnext": (lambda: tf.ConvNextModel(tf.ConvNextConfig(
            hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1])), 64),
        "hf_resnet": (lambda: tf.ResNetModel(tf.ResNetConfig(
            hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], embedding_size=16)), 64),
        "hf_swin": (lambda: tf.SwinModel(tf.SwinConfig(
            image_size=64, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
            window_size=4)), 64),
        "mobilevit": (lambda: tf.MobileViTModel(tf.MobileViTConfig(
            image_size=64, hidden_sizes=[32, 48, 64],
            neck_hidden_sizes=[8, 16, 24, 32, 40, 48, 64])), 64),
        "segformer": (lambda: tf.SegformerModel(tf.SegformerConfig(
            hidden_sizes=[16, 32, 64, 128], num_attention_heads=[1, 2, 4, 8],
            depths=[1, 1, 1, 1], decoder_hidden_size=64)), 64),
        "clip_vision": (lambda: tf.CLIPVisionModel(tf.CLIPVisionConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            image_size=32, patch_size=8)), 32),
        "clip_text": (lambda: tf.CLIPTextModel(tf.CLIPTextConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=VOCAB, max_position_embeddings=32)), None),
        "bart_encoder": (lambda: tf.BartModel(tf.BartConfig(
            d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
            vocab_size=VOCAB, max_position_embeddings=64)).get_encoder(), None),
        "dinov2": (lambda: tf.Dinov2Model(tf.Dinov2Config(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            image_size=32, patch_size=8)), 32),
    }


def export(name: str, exporter: str, path: Path) -> None:
    """Export model ``name`` (seeded weights) to ``path``: last_hidden_state of input_ids +
    a padding attention_mask (second row padded after 10 tokens), or of pixel_values."""
    import torch

    torch.manual_seed(0)
    make, image = configs()[name]
    model = make().eval()
    names = ["pixel_values"] if image else ["input_ids", "attention_mask"]

    class LastHidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *tensors):
            out = self.model(**dict(zip(names, tensors)))
            return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    if image:
        args = (torch.randn(B, 3, image, image),)
    else:
        mask = torch.ones(B, S, dtype=torch.int64)
        mask[1, 10:] = 0
        args = (torch.randint(0, VOCAB, (B, S)), mask)
    with torch.no_grad():
        torch.onnx.export(LastHidden().eval(), args, str(path), input_names=names,
                          dynamo=exporter == "dynamo",
                          **({} if exporter == "dynamo" else {"opset_version": 18}))


def convert(path: Path, target: str, precision: str, timeout: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "amp_cli", "convert", str(path), "-o", out, "--target",
                 target, "--precision", precision, "--force"],
                capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
        except subprocess.TimeoutExpired:
            return {"rc": 124, "error": f"timeout after {timeout} s"}
        text = proc.stdout + proc.stderr
        rel = re.search(r"rel L2 ([^,]+),", text)
        err = next((ln for ln in text.splitlines() if ln.startswith("amp: error")), None)
        row = {"rc": proc.returncode, "rel_l2": rel.group(1) if rel else None, "error": err}
        if "reference is degenerate" in text:
            row["note"] = "degenerate reference"
        return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=None, help="comma-separated model names")
    ap.add_argument("--exporters", default="dynamo,legacy")
    ap.add_argument("--targets", default="llvm:fp16,llvm:bf16,cuda:sm_90:fp16",
                    help="comma list of TARGET:PRECISION")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default="hf_sweep.json")
    args = ap.parse_args(argv)
    names = list(configs()) if not args.only else args.only.split(",")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="amp-hf-sweep-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in names:
        for exporter in args.exporters.split(","):
            path = work / f"{name}.{exporter}.onnx"
            try:
                if not path.exists():
                    export(name, exporter, path)
            except Exception as exc:  # noqa: BLE001 - an exporter failure is a row
                rows.append({"model": name, "exporter": exporter, "rc": None,
                             "error": f"export: {type(exc).__name__}: {exc}"[:200]})
                print(f"{name:<14} {exporter:<7} export failed: {rows[-1]['error']}", flush=True)
                continue
            for spec in args.targets.split(","):
                target, _, precision = spec.rpartition(":")
                row = {"model": name, "exporter": exporter, "target": target,
                       "precision": precision, **convert(path, target, precision, args.timeout)}
                rows.append(row)
                print(f"{name:<14} {exporter:<7} {target:<11} {precision:<5} rc={row['rc']} "
                      f"rel L2 {row.get('rel_l2')} {row.get('note') or row.get('error') or ''}",
                      flush=True)
                Path(args.json).write_text(json.dumps(rows, indent=1))
    ok = sum(1 for r in rows if r.get("rc") == 0)
    print(f"{ok}/{len(rows)} conversions exited 0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
