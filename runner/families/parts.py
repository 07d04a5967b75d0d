"""Building blocks several families share: published configs, in-memory tokenizers, T5, SD VAEs,
schedulers. Random/tiny builds only; `pretrained` loads through diffusers (`runner.models`).

Tokenizers are built in memory (transformers 5 accepts vocab lists directly): no files, no network.
"""

from __future__ import annotations

import json
from pathlib import Path

PUBLISHED = json.loads(Path(__file__).with_name("published_configs.json").read_text())
# The hub's json stores -inf as a string; the scheduler needs a float.
PUBLISHED["pixart_scheduler"]["lambda_min_clipped"] = float("-inf")

_WORDS = ("a an the of in on at with and to is cat dog bird fish horse robot city street forest "
          "mountain river ocean sky sun moon night day red blue green yellow white black small big "
          "photo painting video portrait landscape walking running flying sitting beautiful "
          "astronaut car boat tree flower house castle snow rain fire light dark").split()


def t5_tokenizer(max_length: int):
    from transformers import T5Tokenizer
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [("\u2581" + w, -1.0) for w in _WORDS]
    vocab += [(c, -3.0) for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-"]
    return T5Tokenizer(vocab=vocab, extra_ids=100, model_max_length=max_length)


def clip_tokenizer():
    from transformers import CLIPTokenizer
    # GPT-2's byte-to-unicode alphabet: with no merges every word splits into these characters.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = [chr(b) for b in printable] + [chr(256 + i) for i in range(256 - len(printable))]
    vocab = {c: i for i, c in enumerate(chars)}
    for c in chars:
        vocab[c + "</w>"] = len(vocab)
    for w in _WORDS:
        vocab.setdefault(w + "</w>", len(vocab))
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def t5_encoder(max_tokens: int, tiny: bool, published: dict | None = None, config_cls=None,
               model_cls=None):
    """(tokenizer, encoder): T5-XXL's encoder at full size (or `published`: another T5's config,
    e.g. UMT5-XXL, with its config and model classes), or a 2-layer one."""
    from transformers import T5Config, T5EncoderModel
    tok = t5_tokenizer(max_tokens)
    if tiny:
        cfg = dict(vocab_size=len(tok), d_model=32, d_kv=8, d_ff=64, num_layers=2,
                   num_decoder_layers=0, num_heads=4, feed_forward_proj="gated-gelu",
                   is_encoder_decoder=False)
    else:
        cfg = published or PUBLISHED["t5_xxl"]
    return tok, (model_cls or T5EncoderModel)((config_cls or T5Config)(**cfg))


def sd_vae(name: str, tiny: bool):
    from diffusers import AutoencoderKL
    if tiny:  # four levels keep the real 8x spatial factor
        return AutoencoderKL(block_out_channels=[8, 8, 8, 8], layers_per_block=1, norm_num_groups=4,
                             latent_channels=4, down_block_types=["DownEncoderBlock2D"] * 4,
                             up_block_types=["UpDecoderBlock2D"] * 4,
                             scaling_factor=PUBLISHED[name]["scaling_factor"])
    return AutoencoderKL.from_config(PUBLISHED[name])


def scheduler(cls, config: dict):
    # Schedulers keep their tables on the CPU (DPM-Solver calls .numpy() on them), also when the
    # rest is built under `torch.device("cuda")`.
    import torch
    with torch.device("cpu"):
        return cls.from_config(config)


def tokens(pipe, prompts: list[str], max_tokens: int):
    """The tokenizer's ids and attention mask, padded to `max_tokens` (what the pipelines do)."""
    return pipe.tokenizer(prompts, padding="max_length", max_length=max_tokens, truncation=True,
                          return_attention_mask=True, add_special_tokens=True, return_tensors="pt")
