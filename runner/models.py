"""Model presets and pipeline builders.

Contract: `build_pipeline(ModelSpec) -> DiffusionPipeline` on `spec.device` in `spec.dtype`, from one
of three weight sources:

- `pretrained`: `from_pretrained(spec.path)` (hub id or local directory, the real users' path);
- `random`:     the published architecture at full size with random weights, built directly on the
                target device in half precision (benchmarks; the compute is identical);
- `tiny`:       small random configs that run a 2-step call on a CPU in about a second (tests, demo).

`PRESETS` maps a preset name to its family and published facts; `BUILDERS` maps a family to the
function that builds its random pipeline. Tokenizers for `random`/`tiny` are built in memory: no
files, no network.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .config import ModelSection

_PUBLISHED = json.loads((Path(__file__).with_name("published_configs.json")).read_text())
# The hub's json stores -inf as a string; the scheduler needs a float.
_PUBLISHED["pixart_scheduler"]["lambda_min_clipped"] = float("-inf")

# What the rest of the runner needs to know about a model before building it.
# size_factor: height/width must be multiples of it (VAE factor 8 x patch size 2 for the DiTs).
PRESETS: dict[str, dict] = {
    "latte1": dict(family="latte", kind="video", hub_id="maxin-cn/Latte-1", size_factor=16,
                   transformer="latte1_transformer", vae="sd_vae", max_tokens=120),
    "pixart_alpha_1024": dict(family="pixart_alpha", kind="image", size_factor=16,
                              hub_id="PixArt-alpha/PixArt-XL-2-1024-MS",
                              transformer="pixart_alpha_1024", vae="sd_vae", max_tokens=120),
    "pixart_alpha_512": dict(family="pixart_alpha", kind="image", size_factor=16,
                             hub_id="PixArt-alpha/PixArt-XL-2-512x512",
                             transformer="pixart_alpha_512", vae="sd_vae", max_tokens=120),
    "pixart_sigma_1024": dict(family="pixart_sigma", kind="image", size_factor=16,
                              hub_id="PixArt-alpha/PixArt-Sigma-XL-2-1024-MS",
                              transformer="pixart_sigma_1024", vae="sdxl_vae", max_tokens=300),
    "sd21": dict(family="sd21", kind="image", size_factor=8, hub_id="stabilityai/stable-diffusion-2-1",
                 unet="sd21_unet", vae="sd21_vae", max_tokens=77),
}
SOURCES = ("pretrained", "random", "tiny")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

# Frame count the tiny Latte is built with (the published model has video_length 16).
TINY_VIDEO_LENGTH = 4


class ModelLoadError(RuntimeError):
    pass


_D = ModelSection()   # defaults and docs of every field: the config schema's model section


@dataclass(frozen=True)
class ModelSpec:
    preset: str
    source: str = _D.source
    path: str | None = _D.path
    dtype: str = _D.dtype
    device: str = _D.device        # also cuda:N
    local_files_only: bool = _D.local_files_only
    mask_feature: bool = _D.mask_feature

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"unknown model preset {self.preset!r}; valid: {sorted(PRESETS)}")
        if self.source not in SOURCES:
            raise ValueError(f"unknown model.source {self.source!r}; valid: {list(SOURCES)}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"unknown model.dtype {self.dtype!r}; valid: auto, {', '.join(DTYPES)}")
        if self.device != "auto" and self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"unknown model.device {self.device!r}; valid: auto, cpu, cuda, cuda:N")

    def resolved(self) -> "ModelSpec":
        """`auto` device/dtype made concrete for the process this runs in."""
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = self.dtype
        if dtype == "auto":
            dtype = "fp32" if device == "cpu" else "fp16"
        return replace(self, device=device, dtype=dtype)

    @property
    def info(self) -> dict:
        return PRESETS[self.preset]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.resolved().dtype]


def video_length(spec: ModelSpec) -> int | None:
    """Frames the model's temporal embedding is built for (Latte), None for image models."""
    if spec.info["kind"] != "video":
        return None
    if spec.source == "tiny":
        return TINY_VIDEO_LENGTH
    if spec.source == "random":
        return _PUBLISHED[spec.info["transformer"]].get("video_length", 16)
    cfg = _pretrained_file(spec, "transformer/config.json")
    return json.loads(Path(cfg).read_text()).get("video_length", 16) if cfg else 16


def check_pretrained(spec: ModelSpec) -> None:
    """Fail fast, on the driver, when `pretrained` weights cannot be found (no GPU time spent)."""
    if spec.source != "pretrained":
        return
    path = spec.path or spec.info["hub_id"]
    if os.path.isdir(path):
        if not (Path(path) / "model_index.json").is_file():
            raise ModelLoadError(f"model.path {path!r} is a directory without model_index.json: "
                                 f"not a diffusers pipeline (save one with save_pretrained, or "
                                 f"download {spec.info['hub_id']} into it)")
        return
    if _pretrained_file(spec, "model_index.json") is None:
        raise ModelLoadError(
            f"cannot find the pretrained model {path!r} (not a local directory; not reachable on the "
            f"hub or not in the local hub cache). Fix: download it where there is network "
            f"(huggingface-cli download {spec.info['hub_id']} --local-dir DIR) and run with "
            f"model.path=DIR, or use model.source=random|tiny to run without weights.")


def _pretrained_file(spec: ModelSpec, name: str) -> str | None:
    path = spec.path or spec.info["hub_id"]
    if os.path.isdir(path):
        p = Path(path) / name
        return str(p) if p.exists() else None
    try:
        from huggingface_hub import hf_hub_download
        return hf_hub_download(path, name, local_files_only=spec.local_files_only)
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------
# Tokenizers built in memory (transformers 5 accepts vocab lists directly).

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


# ---------------------------------------------------------------------------------------------
# Random pipelines: published configs at full size, or tiny configs.

def _t5_config(tiny: bool, vocab_size: int):
    from transformers import T5Config
    if tiny:
        return T5Config(vocab_size=vocab_size, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                        num_decoder_layers=0, num_heads=4, feed_forward_proj="gated-gelu",
                        is_encoder_decoder=False)
    return T5Config(**_PUBLISHED["t5_xxl"])


def _vae(name: str, tiny: bool):
    from diffusers import AutoencoderKL
    if tiny:  # four levels keep the real 8x spatial factor
        return AutoencoderKL(block_out_channels=[8, 8, 8, 8], layers_per_block=1, norm_num_groups=4,
                             latent_channels=4, down_block_types=["DownEncoderBlock2D"] * 4,
                             up_block_types=["UpDecoderBlock2D"] * 4,
                             scaling_factor=_PUBLISHED[name]["scaling_factor"])
    return AutoencoderKL.from_config(_PUBLISHED[name])


def _scheduler(cls, name: str):
    # Schedulers keep their tables on the CPU (DPM-Solver calls .numpy() on them), also when the
    # rest is built under `torch.device("cuda")`.
    with torch.device("cpu"):
        return cls.from_config(_PUBLISHED[name])


def _dit_config(info: dict, tiny: bool) -> dict:
    cfg = dict(_PUBLISHED[info["transformer"]])
    if tiny:
        # cross_attention_dim must equal heads * head_dim for Latte and PixArt.
        cfg.update(num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
                   caption_channels=32, num_layers=2, sample_size=8)
        if info["family"] == "latte":
            cfg["video_length"] = TINY_VIDEO_LENGTH
    return cfg


def _text_encoder_t5(info: dict, tiny: bool):
    from transformers import T5EncoderModel
    tok = t5_tokenizer(info["max_tokens"])
    return tok, T5EncoderModel(_t5_config(tiny, _PUBLISHED["t5_xxl"]["vocab_size"] if not tiny else len(tok)))


def _build_latte(info: dict, tiny: bool):
    from diffusers import DDIMScheduler, LattePipeline, LatteTransformer3DModel
    tok, te = _text_encoder_t5(info, tiny)
    return LattePipeline(tokenizer=tok, text_encoder=te, vae=_vae(info["vae"], tiny),
                         transformer=LatteTransformer3DModel.from_config(_dit_config(info, tiny)),
                         scheduler=_scheduler(DDIMScheduler, "latte1_scheduler"))


def _build_pixart(info: dict, tiny: bool):
    from diffusers import (DPMSolverMultistepScheduler, PixArtAlphaPipeline, PixArtSigmaPipeline,
                           PixArtTransformer2DModel)
    tok, te = _text_encoder_t5(info, tiny)
    cls = PixArtSigmaPipeline if info["family"] == "pixart_sigma" else PixArtAlphaPipeline
    return cls(tokenizer=tok, text_encoder=te, vae=_vae(info["vae"], tiny),
               transformer=PixArtTransformer2DModel.from_config(_dit_config(info, tiny)),
               scheduler=_scheduler(DPMSolverMultistepScheduler, "pixart_scheduler"))


def _build_sd21(info: dict, tiny: bool):
    from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel
    tok = clip_tokenizer()
    if tiny:
        unet = UNet2DConditionModel(
            block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4,
            out_channels=4, norm_num_groups=4, cross_attention_dim=16, attention_head_dim=(2, 4),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), use_linear_projection=True)
        clip = CLIPTextConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77,
                              projection_dim=16, bos_token_id=tok.bos_token_id,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    else:
        unet = UNet2DConditionModel.from_config(_PUBLISHED[info["unet"]])
        clip = CLIPTextConfig(**{**_PUBLISHED["sd21_clip"], "bos_token_id": tok.bos_token_id,
                                 "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id})
    return StableDiffusionPipeline(vae=_vae(info["vae"], tiny), text_encoder=CLIPTextModel(clip),
                                   tokenizer=tok, unet=unet,
                                   scheduler=_scheduler(DDIMScheduler, "sd21_scheduler"),
                                   safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)


BUILDERS = {"latte": _build_latte, "pixart_alpha": _build_pixart, "pixart_sigma": _build_pixart,
            "sd21": _build_sd21}

PIPELINE_CLASSES = {"latte": "LattePipeline", "pixart_alpha": "PixArtAlphaPipeline",
                    "pixart_sigma": "PixArtSigmaPipeline", "sd21": "StableDiffusionPipeline"}


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_pipeline(spec: ModelSpec):
    """Build (or load) the pipeline for `spec`, on its device, in its dtype, in eval mode."""
    spec = spec.resolved()
    info = spec.info
    if spec.source == "pretrained":
        pipe = _load_pretrained(spec)
    else:
        tiny = spec.source == "tiny"
        # Seeded so every worker builds identical random weights (same outputs on any worker).
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            if tiny:
                pipe = BUILDERS[info["family"]](info, tiny=True)
            else:
                # Full size: allocate straight on the target device in half precision; building
                # T5-XXL in fp32 on a CPU would take 19 GB and minutes.
                with torch.device(spec.device), _default_dtype(spec.torch_dtype):
                    pipe = BUILDERS[info["family"]](info, tiny=False)
    pipe = pipe.to(spec.device)
    if pipe.dtype != spec.torch_dtype:  # tiny models are built in fp32
        pipe = pipe.to(dtype=spec.torch_dtype)
    pipe.set_progress_bar_config(disable=True)
    for c in pipe.components.values():
        if isinstance(c, torch.nn.Module):
            c.eval().requires_grad_(False)
    return pipe


def _load_pretrained(spec: ModelSpec):
    import diffusers
    path = spec.path or spec.info["hub_id"]
    cls = getattr(diffusers, PIPELINE_CLASSES[spec.info["family"]])
    extra = {"safety_checker": None, "requires_safety_checker": False} if spec.info["family"] == "sd21" else {}
    try:
        return cls.from_pretrained(path, dtype=spec.torch_dtype,
                                   local_files_only=spec.local_files_only, **extra)
    except (OSError, ValueError) as e:
        where = "local directory" if os.path.isdir(path) else "hub id"
        raise ModelLoadError(
            f"could not load {cls.__name__} from {where} {path!r}: {e}\n"
            f"Fix: download the weights once (huggingface-cli download {spec.info['hub_id']} "
            f"--local-dir DIR) and run with model.path=DIR, or set model.source=random/tiny "
            f"for a run without weights.") from e
