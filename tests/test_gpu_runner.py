"""GPU checks of the runner's worker path (skipped without CUDA; run `pytest -m gpu` on the device)."""
import numpy as np
import pytest
import torch

from runner.config import GenerationDefaults
from runner.serve.models import ModelSpec, build_pipeline
from runner.io.prompts import Constraints, Item
from runner.serve.worker import Worker, WorkerConfig

pytestmark = pytest.mark.gpu


def test_worker_on_cuda_fp16_reports_gpu_metrics(tmp_path):
    items = [Item(id=i, prompt=f"a photo of {i}", negative_prompt="", seed=k, height=64, width=64,
                  num_frames=None, num_inference_steps=4, guidance_scale=4.5, file="p", row=k)
             for k, i in enumerate("abc")]
    w = Worker(0, WorkerConfig(model=ModelSpec("pixart_alpha_1024", source="tiny"),
                               generation=GenerationDefaults(height=64, width=64, num_inference_steps=4),
                               limits=Constraints(size_factor=16, min_steps=2), on_empty="error",
                               job_dir=str(tmp_path), batch_size=2))
    assert (w.spec.device, w.spec.dtype) == ("cuda", "fp16")      # auto on a GPU worker
    w.warmup()
    rows = w.run_shard(items)
    assert [r["status"] for r in rows] == ["ok"] * 3
    m = w.metrics()
    assert m["gpu_name"] and m["peak_mem_gb"] > 0 and m["steady_it_s"] > 0
    assert m["startup_peak_mem_gb"] > 0      # the load's and warm-up's own peak, kept apart
    # device-side figures: GPU ms per item of each stage (CUDA events), NVML when nvidia-ml-py is there
    assert all(v > 0 for v in m["gpu_ms_per_item"].values()) and "gpu_busy_fraction" not in m
    assert all(m["time_s"][k] > 0 for k in ("text_encode", "denoise", "decode", "to_host", "write"))


def test_uint8_on_the_gpu_equals_the_host_conversion_of_diffusers_float32_output():
    from runner.io.outputs import to_uint8
    from runner.serve.worker import to_host_uint8
    x = torch.rand(2, 3, 64, 48, device="cuda", dtype=torch.float16)
    x[0, 0, 0, :3] = torch.tensor([0.0, 1.0, 0.5 / 255], device="cuda")   # edges and a tie
    u8, finite = to_host_uint8(x, pin=True)
    torch.cuda.synchronize()
    want = to_uint8(x.cpu().permute(0, 2, 3, 1).float().numpy())      # diffusers' output_type="np"
    np.testing.assert_array_equal(u8.numpy(), want)
    assert finite.tolist() == [True, True] and u8.is_pinned()


def test_random_full_size_pixart_builds_on_gpu_in_half_precision():
    pipe = build_pipeline(ModelSpec("pixart_alpha_1024", source="random", device="cuda"))
    n = sum(p.numel() for p in pipe.transformer.parameters())
    assert 600e6 < n < 620e6                                       # published: 611 M
    assert pipe.transformer.dtype == torch.float16 and pipe.text_encoder.device.type == "cuda"
    out = pipe(prompt="a cat", num_inference_steps=2, output_type="np", clean_caption=False).images
    assert out.shape == (1, 1024, 1024, 3) and np.isfinite(out).all()


def test_full_size_o2_item_alone_and_in_a_shard_match_eager():
    """PixArt-α 1024² at the published size (random weights, fp16, T5-XXL): an item generated alone
    (text encoded alone) by the eager pipeline vs by O2 (text encoder, denoiser and VAE compiled)
    in a batch of 2 with its text encoded together with a shard of 4: within fp16 tolerance."""
    from compiler import compile_pipe
    from runner.serve.text import TextCache
    from runner.serve.worker import generate
    pipe = build_pipeline(ModelSpec("pixart_alpha_1024", source="random", device="cuda"))
    shard = [Item(id=f"i{k}", prompt=p, negative_prompt="", seed=k, height=1024, width=1024,
                  num_frames=None, num_inference_steps=4, guidance_scale=4.5, file="p", row=k)
             for k, p in enumerate(["a red fox in the snow", "a city street at night",
                                    "a small boat on a blue lake under the moon", "a cat"])]
    fam = ModelSpec("pixart_alpha_1024").family
    with torch.inference_mode():
        ref = [generate(pipe, fam, [it], "cuda", output_type="pt").float() for it in shard[:2]]
        compile_pipe(pipe, {"mode": "O2"})
        assert pipe._compile_report["text_encoder_blocks"] and pipe._compile_report["vae_blocks"]
        text = TextCache.of(pipe, fam)
        text.batch = 4
        generate(pipe, fam, shard[:2], "cuda", output_type="pt")          # compile, capture
        embeds = text.encode(shard)
        out = generate(pipe, fam, shard[:2], "cuda", output_type="pt", embeds=embeds).float()
        alone = generate(pipe, fam, shard[:1], "cuda", output_type="pt").float()
    for k in range(2):
        err = (out[k] - ref[k][0]).abs()
        assert err.max().item() <= 3e-2 and err.mean().item() <= 2e-3, (k, err.max().item())
    assert (alone[0] - out[0]).abs().max().item() <= 3e-2
