"""The corpus's models: how to build each one at a scale, and how to make valid inputs for it.

Every builder takes the scale ("tiny" or "full") and the batch size and returns a `Built`: an
eval-mode `nn.Module` with random weights and the specs of its inputs, in `forward()` order.
Libraries (torchvision, transformers) are imported inside the builders, so a missing one only
skips its family (`MissingLibrary`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

TINY, FULL = "tiny", "full"


class MissingLibrary(Exception):
    """A family's library (torchvision, transformers) is not installed."""


@dataclass
class InputSpec:
    """One model input and how to draw valid random data for it.

    kind: "normal" (float ~ N(0, 1)), "tokens" (int ids in [0, high)), or "mask" (a padding
    mask: per row, 1 for a random prefix of at least one position, then 0).
    """
    name: str
    shape: tuple
    dtype: str = "float32"
    kind: str = "normal"
    high: int = 0

    def describe(self) -> str:
        """How the data is drawn, for the manifest."""
        return {"normal": f"{self.dtype} ~ N(0, 1)",
                "tokens": f"{self.dtype} token ids in [0, {self.high})",
                "mask": f"{self.dtype} padding mask: 1 on a random prefix (>= 1 position), "
                        "then 0"}[self.kind]


def make_inputs(specs: list[InputSpec], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Draw one set of inputs for `specs` (see `InputSpec`)."""
    feeds = {}
    for s in specs:
        if s.kind == "normal":
            arr = rng.standard_normal(s.shape)
        elif s.kind == "tokens":
            arr = rng.integers(0, s.high, s.shape)
        else:
            lengths = rng.integers(1, s.shape[-1] + 1, s.shape[:-1])
            arr = np.arange(s.shape[-1]) < lengths[..., None]
        feeds[s.name] = arr.astype(s.dtype)
    return feeds


def image_input(batch: int, size: int, name: str = "input") -> list[InputSpec]:
    """A float NCHW image input with 3 channels."""
    return [InputSpec(name, (batch, 3, size, size))]


@dataclass
class Built:
    """A model ready to export: the module and its inputs in `forward()` order."""
    module: object
    inputs: list[InputSpec]


@dataclass
class Entry:
    """A corpus model: name, family, the failure class it stands for, and its builder."""
    name: str
    family: str
    tag: str
    build: Callable[[str, int], Built] = field(repr=False)


# ---- torchvision ---------------------------------------------------------------------------

# name -> (tiny resolution, full resolution, failure class it represents)
TORCHVISION = {
    "resnet50": (64, 224, "baseline CNN (converts per issue 20)"),
    "mobilenet_v3_large": (64, 224, "hardswish/hardsigmoid, squeeze-excite (needs BN calibration)"),
    "efficientnet_b0": (64, 224, "SiLU, squeeze-excite (needs BN calibration)"),
    "convnext_tiny": (64, 224, "layer norm + GELU CNN (converts per issue 20)"),
    "vit_b_16": (64, 224, "class token Concat: fp32/fp16 Concat dtype mix"),
    "densenet121": (64, 224, "dense Concat chains"),
    "shufflenet_v2_x1_0": (64, 224, "channel shuffle, chunk/Split + Concat"),
    "squeezenet1_0": (64, 224, "fire modules Concat, large activations"),
    "regnet_y_400mf": (64, 224, "grouped convs, squeeze-excite"),
    "inception_v3": (96, 299, "four-branch Concat, odd spatial sizes"),
    "resnext50_32x4d": (64, 224, "grouped 3x3 convs (32 groups) in a ResNet"),
    "swin_t": (64, 224, "shifted-window attention: roll, window partition, relative bias"),
}


def build_torchvision(name: str) -> Callable[[str, int], Built]:
    """A builder for torchvision's `name`, weights=None (tiny: smaller images; ViT 2 layers)."""
    def build(scale: str, batch: int) -> Built:
        try:
            import torchvision
        except ImportError as exc:
            raise MissingLibrary("torchvision") from exc
        from torchvision.models.vision_transformer import VisionTransformer
        size = TORCHVISION[name][0 if scale == TINY else 1]
        if name == "vit_b_16" and scale == TINY:  # vit_b_16's class, 2 layers of width 64
            module = VisionTransformer(image_size=size, patch_size=16, num_layers=2,
                                       num_heads=4, hidden_dim=64, mlp_dim=128)
        else:
            kwargs = {"inception_v3": {"aux_logits": False, "init_weights": True},
                      "vit_b_16": {"image_size": size}}.get(name, {})
            module = getattr(torchvision.models, name)(weights=None, **kwargs)
        return Built(module, image_input(batch, size))
    return build


# ---- Hugging Face transformers -------------------------------------------------------------

TINY_TEXT = dict(layers=2, hidden=64, heads=4, ffn=128, vocab=1000, seq=16)
FULL_TEXT = dict(layers=12, hidden=768, heads=12, ffn=3072, vocab=30522, seq=128)


def wrap_last_hidden(model, names: list[str]):
    """An nn.Module whose forward(*tensors) calls model(**{name: tensor}).last_hidden_state, so
    the exporters see positional tensors and one plain output."""
    import torch

    class LastHidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *tensors):
            return self.model(**dict(zip(names, tensors))).last_hidden_state
    return LastHidden()


def text_inputs(batch: int, seq: int, vocab: int, mask: bool = True) -> list[InputSpec]:
    """input_ids in [0, vocab) and, with `mask`, a padding attention_mask."""
    specs = [InputSpec("input_ids", (batch, seq), "int64", "tokens", vocab)]
    if mask:
        specs.append(InputSpec("attention_mask", (batch, seq), "int64", "mask"))
    return specs


def hf_config(name: str, p: dict):
    """A transformers config for `name` with sizes `p` (TINY_TEXT or FULL_TEXT); no downloads."""
    import transformers as tf
    L, H, A, F, V = p["layers"], p["hidden"], p["heads"], p["ffn"], p["vocab"]
    return {
        "bert": lambda: tf.BertConfig(vocab_size=V, hidden_size=H, num_hidden_layers=L,
                                      num_attention_heads=A, intermediate_size=F),
        "distilbert": lambda: tf.DistilBertConfig(vocab_size=V, dim=H, n_layers=L, n_heads=A,
                                                  hidden_dim=F),
        "gpt2": lambda: tf.GPT2Config(vocab_size=V, n_embd=H, n_layer=L, n_head=A,
                                      n_inner=F, n_positions=max(p["seq"], 128)),
        "t5_encoder": lambda: tf.T5Config(vocab_size=V, d_model=H, d_kv=H // A, d_ff=F,
                                          num_layers=L, num_heads=A),
        "vit_hf": lambda: tf.ViTConfig(hidden_size=H, num_hidden_layers=L,
                                       num_attention_heads=A, intermediate_size=F,
                                       image_size=32 if H < 768 else 224,
                                       patch_size=8 if H < 768 else 16),
        "whisper_encoder": lambda: tf.WhisperConfig(
            vocab_size=V, d_model=H, encoder_layers=L, encoder_attention_heads=A,
            encoder_ffn_dim=F, decoder_layers=1, decoder_attention_heads=A,
            max_source_positions=50 if H < 768 else 1500),
        "llama": lambda: tf.LlamaConfig(
            vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=A,
            num_key_value_heads=max(1, A // 2), intermediate_size=F,
            max_position_embeddings=max(p["seq"], 128)),
        "deberta_v2": lambda: tf.DebertaV2Config(
            vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=A,
            intermediate_size=F, max_position_embeddings=max(p["seq"], 128),
            relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=64),
        "segformer": lambda: tf.SegformerConfig(
            **(dict(hidden_sizes=[16, 32, 64, 128], num_attention_heads=[1, 2, 4, 8],
                    depths=[1, 1, 1, 1], decoder_hidden_size=64) if H < 768 else {})),
        "wav2vec2": lambda: tf.Wav2Vec2Config(
            hidden_size=H, num_hidden_layers=L, num_attention_heads=A, intermediate_size=F,
            **({} if H >= 768 else dict(conv_dim=(32, 32, 32), conv_stride=(5, 2, 2),
                                        conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16,
                                        num_conv_pos_embedding_groups=4))),
    }[name]()


# name -> (model class, inputs(config, p, batch), failure class)
HF = {
    "bert": ("BertModel", lambda c, p, b: text_inputs(b, p["seq"], c.vocab_size),
             "padding mask from finfo(float32).min (converts per issue 20)"),
    "distilbert": ("DistilBertModel", lambda c, p, b: text_inputs(b, p["seq"], c.vocab_size),
                   "padding mask via masked_fill"),
    "gpt2": ("GPT2Model", lambda c, p, b: text_inputs(b, p["seq"], c.vocab_size, mask=False),
             "causal mask from finfo(float32).min: inf/NaN in fp16"),
    "t5_encoder": ("T5EncoderModel", lambda c, p, b: text_inputs(b, p["seq"], c.vocab_size),
                   "relative position bias, RMS norm, fp16 overflow in FFN"),
    "vit_hf": ("ViTModel", lambda c, p, b: image_input(b, c.image_size, "pixel_values"),
               "class token Concat, HF attention"),
    "llama": ("LlamaModel", lambda c, p, b: text_inputs(b, p["seq"], c.vocab_size),
              "RoPE, RMSNorm, grouped-query attention, SiLU-gated MLP, causal + padding mask"),
    "deberta_v2": ("DebertaV2Model", lambda c, p, b: text_inputs(b, p["seq"], c.vocab_size),
                   "disentangled relative-position attention (gathers of position scores)"),
    "segformer": ("SegformerModel", lambda c, p, b: image_input(b, 64 if p["hidden"] < 768
                                                                else 512, "pixel_values"),
                  "spatial-reduction attention, overlapping patch convs, depthwise conv MLP"),
    "whisper_encoder": ("WhisperEncoder", lambda c, p, b: [InputSpec(
        "input_features", (b, c.num_mel_bins, 2 * c.max_source_positions))],
        "conv1d front end + encoder layers (speech)"),
    "wav2vec2": ("Wav2Vec2Model", lambda c, p, b: [InputSpec(
        "input_values", (b, 1600 if p["hidden"] < 768 else 16000))],
        "raw-audio conv encoder, GroupNorm, grouped positional conv (speech)"),
}


def build_hf(name: str) -> Callable[[str, int], Built]:
    """A builder for the transformers model `name` from a config built in code."""
    def build(scale: str, batch: int) -> Built:
        try:
            import transformers
        except ImportError as exc:
            raise MissingLibrary("transformers") from exc
        p = TINY_TEXT if scale == TINY else FULL_TEXT
        config = hf_config(name, p)
        cls_name, make_specs, _ = HF[name]
        if cls_name == "WhisperEncoder":
            from transformers.models.whisper.modeling_whisper import WhisperEncoder as cls
        else:
            cls = getattr(transformers, cls_name)
        specs = make_specs(config, p, batch)
        return Built(wrap_last_hidden(cls(config), [s.name for s in specs]), specs)
    return build


# ---- recurrent nets ------------------------------------------------------------------------

def build_rnn(cell: str, bidirectional: bool, layers: int) -> Callable[[str, int], Built]:
    """A speech-like recurrent net: torch.nn.LSTM/GRU (batch_first) and a linear head."""
    def build(scale: str, batch: int) -> Built:
        import torch
        feat, hidden, seq = (16, 32, 16) if scale == TINY else (80, 256, 100)

        class RecurrentNet(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.rnn = getattr(torch.nn, cell)(feat, hidden, num_layers=layers,
                                                   batch_first=True, bidirectional=bidirectional)
                self.head = torch.nn.Linear(hidden * (2 if bidirectional else 1), 10)

            def forward(self, x):
                return self.head(self.rnn(x)[0])
        return Built(RecurrentNet(), [InputSpec("features", (batch, seq, feat))])
    return build


# ---- a YOLO-style detector -----------------------------------------------------------------

def build_detector(scale: str, batch: int) -> Built:
    """A YOLOv8-like net whose layers live in `self.model` (nn.ModuleList), so exported tensor
    names read like `/model.9/Concat_output_0`: Conv-BN-SiLU, chunk (Split) + Concat blocks,
    nn.Upsample (Resize), and a head with Sigmoid class scores."""
    import torch
    from torch import nn
    w, size = (8, 64) if scale == TINY else (16, 640)

    def conv(c1, c2, k=3, s=1):
        return nn.Sequential(nn.Conv2d(c1, c2, k, s, k // 2, bias=False), nn.BatchNorm2d(c2),
                             nn.SiLU())

    class C2f(nn.Module):
        """Split in two, run a bottleneck on one half, concatenate all three."""
        def __init__(self, c1, c2):
            super().__init__()
            self.cv1, self.cv2 = conv(c1, c2, 1), conv(3 * (c2 // 2), c2, 1)
            self.m = nn.Sequential(conv(c2 // 2, c2 // 2), conv(c2 // 2, c2 // 2))

        def forward(self, x):
            a, b = self.cv1(x).chunk(2, 1)
            return self.cv2(torch.cat([a, b, self.m(b)], 1))

    class Concat(nn.Module):
        def forward(self, xs):
            return torch.cat(xs, 1)

    class Detect(nn.Module):
        """Per level: 4 box coordinates and `nc` sigmoid class scores, all levels concatenated."""
        def __init__(self, chans, nc=8):
            super().__init__()
            self.nc = nc
            self.cv = nn.ModuleList(nn.Sequential(conv(c, c), nn.Conv2d(c, 4 + nc, 1))
                                    for c in chans)

        def forward(self, xs):
            ys = [m(x).flatten(2) for m, x in zip(self.cv, xs)]
            box, cls = torch.cat(ys, 2).split([4, self.nc], 1)
            return torch.cat([box, cls.sigmoid()], 1)

    # (module, index of its input(s)); -1 is the previous layer
    layers = [(conv(3, w, 3, 2), -1), (conv(w, 2 * w, 3, 2), -1), (C2f(2 * w, 2 * w), -1),
              (conv(2 * w, 4 * w, 3, 2), -1), (C2f(4 * w, 4 * w), -1),
              (conv(4 * w, 8 * w, 3, 2), -1), (C2f(8 * w, 8 * w), -1),
              (nn.Upsample(scale_factor=2, mode="nearest"), -1), (Concat(), [-1, 4]),
              (C2f(12 * w, 4 * w), -1), (Detect([4 * w, 8 * w]), [9, 6])]

    class Detector(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.ModuleList(m for m, _ in layers)
            self.sources = [f for _, f in layers]

        def forward(self, x):
            outs = []
            for m, f in zip(self.model, self.sources):
                x = [outs[i] for i in f] if isinstance(f, list) else x
                x = m(x)
                outs.append(x)
            return x
    return Built(Detector(), image_input(batch, size, "images"))


# ---- the catalogue -------------------------------------------------------------------------

def list_entries() -> list[Entry]:
    """Every torch-built corpus model (the ONNX light models are listed by export.py)."""
    entries = [Entry(n, "torchvision", tag, build_torchvision(n))
               for n, (_, _, tag) in TORCHVISION.items()]
    entries += [Entry(n, "hf", tag, build_hf(n)) for n, (_, _, tag) in HF.items()]
    entries += [Entry("lstm", "rnn", "ONNX LSTM (2 layers, unidirectional)",
                      build_rnn("LSTM", False, 2)),
                Entry("gru_bidirectional", "rnn", "ONNX GRU (bidirectional)",
                      build_rnn("GRU", True, 1)),
                Entry("yolo_head", "detector", "names with / and . (model.9), Concat/Split/"
                      "Resize/Sigmoid", build_detector)]
    return entries
