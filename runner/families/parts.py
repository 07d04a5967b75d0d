"""Building blocks several families share: published configs, in-memory tokenizers, T5, SD VAEs,
schedulers. Random/tiny builds only; `pretrained` loads through diffusers (`runner.serve.models`).

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


# The most denoising steps a family's pipeline runs with its scheduler (`Family.max_steps`): a row
# asking for more fails on the worker, after the model loaded and compiled, or, worse, makes NaN
# outputs. From the scheduler config the random and tiny builds use (the hub checkpoints' own);
# tests/test_models.py runs every family's pipeline at its bound and one step past it.

def train_timesteps(config: dict) -> int:
    """Schedulers that would run more steps than the model has training timesteps (UniPC in
    WanPipeline, which sets the begin index; FLUX's FlowMatchEuler): held to
    `num_train_timesteps`. Past it Wan's integer timesteps repeat, and a row asking for more is a
    typo costing hours of GPU time, not a setting."""
    return config["num_train_timesteps"]


def ddim_leading(config: dict) -> int:
    """DDIM (Latte-1, SD 2.1) raises in `set_timesteps` past `num_train_timesteps` (T). With
    "leading" spacing n steps sample timesteps k * (T // n) + steps_offset, so with steps_offset 1
    (SD 2.1) T steps reach timestep T, one past the table (an IndexError at the first step):
    T - steps_offset steps stay inside it."""
    return config["num_train_timesteps"] - config.get("steps_offset", 0)


def dpm_solver_linspace(config: dict) -> int:
    """DPM-Solver++ (PixArt) with "linspace" spacing: n + 1 points from 0 to T - 1 rounded to
    integers repeat one once n >= T; the repeated timestep's step has length 0, which the
    second-order update divides by: NaN outputs, no error. T - 1 steps keep them distinct."""
    return config["num_train_timesteps"] - 1


def unipc_flow_first_step(config: dict) -> int:
    """UniPC with flow sigmas in a pipeline that does not set the scheduler's begin index
    (diffusers' WanImageToVideoPipeline: Wan 2.1 I2V, TI2V-5B's image rows): the first step looks
    its timestep up in the schedule and takes the second of two equal ones, so once the shift
    squeezes the first two sigmas into one integer timestep (shift 3.0: from 334 steps; 5.0: from
    201) the call runs one step short and fails at its end (`assert self.this_order > 0`). The
    most steps whose first two timesteps differ, as `set_timesteps` computes them (sigma 1 less
    1e-6 for the first; integer timesteps truncated)."""
    t, shift = config["num_train_timesteps"], config["flow_shift"]

    def second(n: int) -> int:     # the second timestep of an n-step schedule
        s = 1 - (1 - 1 / t) / n    # np.linspace(1, 1 / t, n + 1)[1]
        return int(shift * s / (1 + (shift - 1) * s) * t)

    first = int((1 - 1e-6) * t)
    # `second` grows with n: the bound is one below the first n whose two timesteps meet
    return next((n - 1 for n in range(2, t + 1) if second(n) >= first), t)
