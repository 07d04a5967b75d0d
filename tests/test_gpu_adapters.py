"""LoRA adapters on the full-size Wan 14B denoiser (random weights, fp16, CUDA): the runner's fused
adapter (`runner.adapters.fuse`) against diffusers' unfused PEFT path, for Wan 2.1 T2V 14B and Wan
2.2 A14B's second expert (`load_into_transformer_2`) on one build, and the fused adapters through O3's FP8
linears, whose 16-bit weights must leave the GPU; and the job's own worker for Wan 2.2 A14B
Lightning at 720P with an adapter on each expert, its memory peaks within an 80 GB GPU. Run on
the GPU machine:

    pytest -m gpu tests/test_gpu_adapters.py -v

Each check also shows that a broken variant fails it: the base model (the adapter skipped) is
further from diffusers' output than the bound allows, and so would be a fusion that did nothing.
"""
import gc
import time

import pytest
import torch

from conftest import free_pipeline

from runner import adapters
from runner.families.wan import random_adapter
from runner.config import ModelSpec

pytestmark = pytest.mark.gpu

H100_GIB = 79.2      # an H100 80GB HBM3's torch.cuda total_memory, GiB

# 480x832, 9 frames: latents (1, 16, 3, 60, 104), 4,680 tokens; 512 text tokens of width 4096
LATENT, TEXT = (1, 16, 3, 60, 104), (1, 512, 4096)


def _denoiser(preset: str):
    """The preset's 14B denoiser at full size, random weights (seeded), fp16 on the GPU."""
    from diffusers import WanTransformer3DModel
    spec = ModelSpec(preset, source="random")
    cfg = spec.family.denoiser_config(spec.info, False)
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device("cuda"):
            return WanTransformer3DModel.from_config(cfg).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(old)


def _pipe(transformer, transformer_2=None):
    """A WanPipeline holding the denoisers alone: what diffusers' LoRA loader needs."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
    return WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=transformer,
                       scheduler=FlowMatchEulerDiscreteScheduler(), transformer_2=transformer_2,
                       boundary_ratio=0.875 if transformer_2 is not None else None)


def _inputs():
    g = torch.Generator("cuda").manual_seed(1)
    return dict(hidden_states=torch.randn(LATENT, generator=g, device="cuda", dtype=torch.float16),
                encoder_hidden_states=torch.randn(TEXT, generator=g, device="cuda",
                                                  dtype=torch.float16),
                timestep=torch.tensor([500.0], device="cuda"), return_dict=False)


def _forward(model, x) -> torch.Tensor:
    with torch.inference_mode():
        return model(**x)[0].float()


def _err(a, b) -> float:
    return float((a - b).norm() / b.norm())


def _adapter_file(tmp_path, model, seed=0):
    from safetensors.torch import save_file
    f = tmp_path / f"lora{seed}.safetensors"
    save_file(random_adapter(model, "original", rank=64, seed=seed, device="cuda"), str(f))
    return adapters.Adapter(path=str(f))


def _check_fused(pipe, model, a: adapters.Adapter, x) -> tuple:
    """(the base output, diffusers' unfused output, ours fused), asserting ours is within fp16 rounding of diffusers'
    and the adapter's own effect is far past that bound (a skipped fusion fails)."""
    base = _forward(model, x)
    extra = {"load_into_transformer_2": True} if a.expert == "transformer_2" else {}
    pipe.load_lora_weights(a.path, adapter_name="ref", **extra)
    ref = _forward(model, x)
    pipe.unload_lora_weights()
    assert _err(_forward(model, x), base) == 0, "unload_lora_weights left the weights changed"
    n = adapters.fuse(pipe, (a,))
    assert n == 400, f"{n} Linears fused, expected 40 blocks x 10"
    ours = _forward(model, x)
    effect, err = _err(base, ref), _err(ours, ref)
    print(f"adapter effect {effect:.4f}, fused vs unfused {err:.5f}")
    assert err < 0.01, f"fused output {err:.4f} (relative) from diffusers' unfused one"
    assert effect > 10 * err, f"the adapter's effect {effect:.4f} is within 10x the bound"
    return base, ref, ours


def test_full_size_14b_fused_adapters_match_diffusers_unfused_and_survive_fp8(tmp_path):
    """One full-size 14B denoiser (Wan 2.1 T2V 14B's config, which is Wan 2.2 A14B's expert's:
    one build for both checks): an adapter fused as T2V 14B's `transformer`, then a second one
    as A14B's `transformer_2` (diffusers' `load_into_transformer_2`; a tiny first expert), each
    against diffusers' unfused output; then O3's FP8 linears on the fused weights."""
    from compiler.transforms import fuse_qkv, to_fp8
    from diffusers import WanTransformer3DModel
    t = [time.perf_counter()]    # where the test's seconds go, printed (one of the suite's longest)
    model = _denoiser("wan21_t2v_14b")
    x = _inputs()
    t.append(time.perf_counter())
    _check_fused(_pipe(model), model, _adapter_file(tmp_path, model), x)
    t.append(time.perf_counter())
    tiny = ModelSpec("wan22_t2v_a14b", source="tiny")
    with torch.device("cuda"):   # the first expert: only read for its config by the loader
        first = WanTransformer3DModel.from_config(tiny.family.denoiser_config(tiny.info, True))
    a = _adapter_file(tmp_path, model, seed=3)
    base, ref, ours = _check_fused(_pipe(first.half(), model), model,
                                   adapters.Adapter(path=a.path, expert="transformer_2"), x)
    t.append(time.perf_counter())
    # O3's FP8 linears on the fused weights: the adapter's change survives the quantisation
    linears = sum(m.weight.numel() for blk in model.blocks for m in blk.modules()
                  if isinstance(m, torch.nn.Linear))
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    fuse_qkv(model)
    converted = to_fp8(model, (type(model.blocks[0]).__name__,))
    gc.collect()
    torch.cuda.empty_cache()
    saved = before - torch.cuda.memory_allocated()
    print(f"{converted} FP8 linears; {saved / 2**30:.2f} GiB freed of "
          f"{linears / 2**30:.2f} G block-linear values")
    # 2 bytes -> 1 byte a value: ~1 byte a value freed, unless a 16-bit copy stays (the fused
    # QKV/KV weights' views kept 5.2 G values in 16 bits: 3.2 GiB freed instead of 12.7)
    assert saved > 0.9 * linears, f"only {saved / 2**30:.2f} GiB freed: a 16-bit copy stayed"
    fp8 = _forward(model, x)
    err, to_base = _err(fp8, ref), _err(fp8, base)
    print(f"FP8: {err:.4f} from the adapted output, {to_base:.4f} from the base one")
    t.append(time.perf_counter())
    print("seconds: build {:.1f}, T2V adapter {:.1f}, A14B second expert {:.1f}, FP8 {:.1f}".format(
        *(b - a for a, b in zip(t, t[1:]))))
    assert err < 0.1, f"FP8 output {err:.4f} (relative) from the adapted fp16 one"
    # the adapter survives the quantisation: FP8 is nearer the adapted output than the base one
    assert err < 0.5 * to_base


def test_a14b_lightning_720p_with_adapters_fits_one_80gb_gpu(tmp_path):
    """The job's own worker (`runner.job.worker_config` of `wan22_lightning_batch`: O3, FP8
    linears, compiled blocks and step graphs) with a random rank-64 adapter in LightX2V's layout
    fused into each expert, one 720x1280 x 81-frame video in the published 4 steps (2 + 2), no
    CFG: the start-up's peak (both experts' 16-bit weights are on the GPU before FP8) and the
    serving peak (a step + the decode, the first call's compile counted) within an 80 GB GPU, the
    video made."""
    from runner import job
    from runner.bench.lora import main as lora
    from runner.config import load_config, split
    from runner.prompts import Item
    from runner.worker import Worker
    files = [tmp_path / "high.safetensors", tmp_path / "low.safetensors"]
    t0 = time.perf_counter()     # where the test's seconds go, printed (the suite's longest)
    for k, (f, expert) in enumerate(zip(files, ("transformer", "transformer_2"))):
        lora(["preset=wan22_t2v_a14b_lightning", f"out={f}", "rank=64", "layout=original",
              f"expert={expert}", f"seed={k}"])
    j = split(load_config([
        "job=wan22_lightning_batch", "model.source=random", f"output.dir={tmp_path / 'out'}",
        f"model.adapters=[{{path: {files[0]}}}, {{path: {files[1]}, expert: transformer_2}}]",
        # no warm-up call: the test's one video compiles the graphs, as the warm-up call would,
        # and its peak counts the compile's too; a second full 720P video (~35 s of the suite's
        # longest test on 2 GPUs) would show nothing the first does not
        "run.canary_every_items=0", "run.warmup_steps=0"]))
    cfg = job.worker_config(j, job.constraints(j["model"]), on_gpu=True)
    assert cfg.compile.mode == "O3" and not cfg.canary
    t_files = time.perf_counter() - t0
    w = Worker(0, cfg)
    try:
        w.warmup()
        t_ready = time.perf_counter()
        g = cfg.generation
        assert (g.height, g.width, g.num_frames, g.num_inference_steps) == (720, 1280, 81, 4)
        rows = w.run_shard([Item(id="v", prompt="a red fox running in the snow",
                                 negative_prompt="", seed=0, height=720, width=1280, num_frames=81,
                                 num_inference_steps=4, guidance_scale=1.0, file="p", row=0)])
        t_video = time.perf_counter() - t_ready
        m = w.metrics()
        report = w.pipe._compile_report
    finally:                    # 28 GiB of FP8 experts: freed before the next test
        free_pipeline(w.pipe)
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    print(f"A14B Lightning 720x1280x81 O3 + 2 adapters: start-up peak "
          f"{m['startup_peak_mem_gb']:.1f} GiB, serving peak {m['peak_mem_gb']:.1f} GiB of "
          f"{total:.1f} GiB; FP8 linears {report.get('fp8_linears')}")
    parts = {k: round(v, 1) for k, v in m["startup_parts_s"].items()}
    print(f"seconds: adapter files {t_files:.1f}, load {m['model_load_s']:.1f}, warm-up "
          f"{m['warmup_s']:.1f} {parts}, the video {t_video:.1f}")
    assert rows[0]["status"] == "ok", rows[0]["error"]
    assert report.get("fp8_linears", 0) >= 2 * 40 * 6    # both experts' block Linears in FP8
    # an H100 80GB's 79.2 GiB (its total_memory) minus what its CUDA context takes
    assert max(m["startup_peak_mem_gb"], m["peak_mem_gb"]) <= H100_GIB - 0.7
