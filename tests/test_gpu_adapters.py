"""LoRA adapters on the full-size Wan 14B denoiser (random weights, fp16, CUDA): the runner's fused
adapter (`runner.serve.adapters.fuse`) against diffusers' unfused PEFT path, for Wan 2.1 T2V 14B and Wan
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

from runner.serve import adapters
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
    """The job's own worker (`runner.driver.job.worker_config` of `wan22_lightning_batch`: O3, FP8
    linears, compiled blocks and step graphs) with a random rank-64 adapter in LightX2V's layout
    fused into each expert, one 720x1280 x 81-frame video in the published 4 steps (2 + 2), no
    CFG: the start-up's peak (both experts' 16-bit weights are on the GPU before FP8) and the
    serving peak (a step + the decode, the first call's compile counted) within an 80 GB GPU, the
    video made."""
    from runner.driver import checks, job
    from runner.bench.lora import main as lora
    from runner.config import load_config, split
    from runner.io.prompts import Item
    from runner.serve.worker import Worker
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
    cfg = job.worker_config(j, checks.constraints(j["model"]), on_gpu=True)
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


def _checksums(den, paths) -> dict:
    """{Linear path: a bitwise checksum of its live weight}, wherever `compile_pipe` put it (its
    rows of a fused QKV/KV linear): equal weights give equal sums, one changed bit another."""
    from compiler.transforms import linear_rows
    out = {}
    for p in paths:
        target, start = linear_rows(den, p)     # a 16-bit weight (O2: no FP8 rows)
        w = target.weight[start:start + den.get_submodule(p).out_features]
        bits = w.contiguous().view(torch.int16).long()
        out[p] = (bits.sum() * 1_000_003 + (bits * bits).sum()).item()
    return out


@pytest.mark.parametrize("fp8", [False, True])
def test_a_captured_cuda_graph_replays_the_weights_set_linear_weight_writes(fp8):
    """`set_linear_weight` after the step is captured (`compiler.cudagraph.wrap_step`: what a
    per-row adapter switch writes into): the next replay computes with the new weights, as the
    same module run eagerly does, for 16-bit weights (a fused QKV's rows, a feed-forward Linear)
    and FP8 ones alike. A write into a new tensor would leave the graph replaying the old
    weights: the replay would equal the one before the write."""
    from diffusers import WanTransformer3DModel

    from compiler.cudagraph import wrap_step
    from compiler.kernels.quant import fp8_feedforward
    from compiler.transforms import fuse_qkv, set_linear_weight, to_fp8
    tiny = ModelSpec("wan21_t2v_1_3b", source="tiny")
    cfg = dict(tiny.family.denoiser_config(tiny.info, True), num_attention_heads=2,
               attention_head_dim=16, ffn_dim=64, text_dim=32)   # Linears 16-wide: FP8 takes them
    torch.manual_seed(0)
    model = WanTransformer3DModel.from_config(cfg).half().cuda().eval().requires_grad_(False)
    paths = ("blocks.0.attn1.to_k", "blocks.1.attn2.to_v", "blocks.0.ffn.net.2")
    new = {p: (model.get_submodule(p).weight.float() * 1.5 + 0.01).half() for p in paths}
    fuse_qkv(model)
    if fp8:
        to_fp8(model, (type(model.blocks[0]).__name__,))
        fp8_feedforward(model)
    g = torch.Generator("cuda").manual_seed(1)
    x = dict(hidden_states=torch.randn(1, cfg["in_channels"], 2, 16, 16, generator=g,
                                       device="cuda", dtype=torch.float16),
             encoder_hidden_states=torch.randn(1, 16, 32, generator=g, device="cuda",
                                               dtype=torch.float16),
             timestep=torch.tensor([500.0], device="cuda"), return_dict=False)
    eager = model.forward
    step = wrap_step(model)
    with torch.inference_mode():
        model(**x)                                   # warm-up and capture
        before = model(**x)[0].float()               # a replay
        assert len(step.graphs) == 1
        for p, w in new.items():
            set_linear_weight(model, p, w)
        replay = model(**x)[0].float()
        ref = eager(**x)[0].float()                  # the new weights, eagerly
    assert len(step.graphs) == 1                     # replayed, not captured again
    err, moved = (replay - ref).abs().max().item(), (ref - before).abs().max().item()
    print(f"fp8={fp8}: replay vs eager after the write {err:.3g}; the write moved it {moved:.3g}")
    assert err <= 1e-3 * ref.abs().max().item(), "the replay does not compute with the new weights"
    assert moved > 100 * max(err, 1e-6), "the new weights do not change the output"


# Wan 2.1 T2V 1.3B at full size (random weights), its block Linears split over three per-row
# adapters: each one's change on Linears the others leave alone
_ADAPTERS = {"A": ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0"),
             "B": ("attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0"),
             "C": ("ffn.net.0.proj", "ffn.net.2")}


def _partial_adapters(tmp_path) -> dict:
    """{name: file}: a random rank-32 LoRA of `_ADAPTERS[name]`'s Linears of every block of the
    full-size 1.3B denoiser (built on the meta device for its shapes), drawn on the GPU."""
    from safetensors.torch import save_file

    from runner.families.wan import LORA_NAMES
    spec = ModelSpec("wan21_t2v_1_3b", source="random")
    with torch.device("meta"):
        den = spec.family.build(spec.info, False).transformer
    files = {}
    for k, (name, linears) in enumerate(_ADAPTERS.items()):
        keys = [f".{LORA_NAMES[n]}." for n in linears]
        tensors = {key: t for key, t in random_adapter(den, "original", rank=32, seed=k,
                                                      device="cuda").items()
                   if any(n in key for n in keys)}
        assert len(tensors) == 3 * len(linears) * len(den.blocks)   # down, up, alpha
        files[name] = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(files[name]))
    return files


def test_per_row_adapters_on_the_full_size_1_3b_equal_single_adapter_jobs(tmp_path):
    """The job's own worker (`wan_batch`, Wan 2.1 T2V 1.3B at full size with random weights, O2:
    compiled blocks and the step as CUDA graphs) with three per-row adapters of rank 32, each on
    other Linears: rows switching A -> B -> C -> A after the warm-up make 0 new graphs and 0 new
    captures, and each row's video is bit-equal to the one a job with its adapter alone makes (a
    row without one: a job without adapters), every row compared before the test fails, naming
    the rows and whether the live weights already differed. Small rows of the full architecture (256x256, 5 frames, 4 steps, guidance 1.0): the weights
    and the switch are full size, the seconds few."""
    import numpy as np
    from torch._dynamo.utils import counters

    from runner.driver import checks, job
    from runner.config import load_config, split
    from runner.io.prompts import Item
    from runner.serve.worker import Worker
    import imageio.v3 as iio
    t0 = time.perf_counter()     # where the test's seconds go, printed
    files = _partial_adapters(tmp_path)
    # (id, adapter, take): each adapter's rows, and rows without one of the same takes (prompt
    # and seed) that show each adapter changes its video
    rows = [("a1", "A", 0), ("b1", "B", 1), ("n0", None, 0), ("c1", "C", 2), ("a2", "A", 3),
            ("n1", None, 1), ("n2", None, 2)]

    def worker(name, entries) -> Worker:
        # one compile cache for the test's workers, as a job's workers share one; that workers of
        # one config make the same bits at all is O2's `deterministic` flag (without it Inductor
        # keeps the fastest timed config of each reduction: on an H200 rows differed from their
        # jobs by up to 32 of 255 in 855k values, every weight bit-equal): the next test
        j = split(load_config([
            "job=wan_batch", "model.source=random", f"output.dir={tmp_path / name}",
            f"compile.cache_dir={tmp_path / 'compile-cache'}",
            "compile.mode=O2", "compile.compile_text_encoder=false", "compile.compile_vae=false",
            "generation.height=256",
            "generation.width=256", "generation.num_frames=5", "generation.num_inference_steps=4",
            "generation.guidance_scale=1.0", "run.canary_every_items=0",
            "model.adapters=[" + ", ".join("{" + ", ".join(f"{k}: {v}" for k, v in e.items())
                                           + "}" for e in entries) + "]"]))
        cfg = job.worker_config(j, checks.constraints(j["model"]), on_gpu=True)
        w = Worker(0, cfg)
        w.warmup()
        return w

    def items(adapter_of) -> list:
        return [Item(id=i, prompt=f"a red fox running in the snow, take {k}", negative_prompt="",
                     seed=k, height=256, width=256, num_frames=5, num_inference_steps=4,
                     guidance_scale=1.0, file="p", row=r, adapter=adapter_of(a))
                for r, (i, a, k) in enumerate(rows)]

    def videos(w, ids) -> dict:
        return {i: iio.imread(f"{w.cfg.job_dir}/media/{i}.mp4") for i in ids}

    w = worker("rows", [{"path": f, "name": n, "per_row": "true"} for n, f in files.items()])
    t_ready = time.perf_counter()
    try:
        graphs, step = dict(counters["stats"]), w.pipe.transformer.forward
        captured = len(step.graphs)
        assert graphs.get("unique_graphs", 0) > 0 and captured > 0, "nothing compiled or captured"
        out = w.run_shard(items(lambda a: a))
        assert [r["status"] for r in out] == ["ok"] * len(rows), [r["error"] for r in out]
        assert dict(counters["stats"]) == graphs, "a graph was compiled again after the warm-up"
        assert len(step.graphs) == captured, "the step was captured again after the warm-up"
        per_row = videos(w, [i for i, _, _ in rows])
        paths = [p for _, p in w.switch.base]
        switched = {}                       # adapter -> the live weights' checksums once switched
        for name in (*files, None):
            w.switch.use(name)
            switched[name] = _checksums(w.pipe.transformer, paths)
    finally:
        free_pipeline(w.pipe)
    t_rows = time.perf_counter()
    # every row against a job of its adapter alone (job-wide), the rows without one against a job
    # without adapters; all compared before failing, so that a failure says which rows and whether
    # the weights (bitwise checksums of every Linear the adapters touch) were already different
    wrong = []
    for name, f in (*files.items(), (None, None)):
        ref = worker(f"only_{name}", [{"path": f}] if f else [])
        try:
            mine = [i for i, a, _ in rows if a == name]
            ref.run_shard([it for it in items(lambda a: None) if it.id in mine])
            weights = _checksums(ref.pipe.transformer, paths)
            for i, v in videos(ref, mine).items():
                if not np.array_equal(per_row[i], v):
                    diff = np.abs(per_row[i].astype(int) - v.astype(int))
                    off = [p for p in paths if weights[p] != switched[name][p]]
                    wrong.append(f"{i} (adapter {name}): {int((diff > 0).sum())} values differ, "
                                 f"at most by {int(diff.max())}; {len(off)} of {len(paths)} Linears' "
                                 f"weights differ from that job's{' (first ' + off[0] + ')' if off else ''}")
        finally:
            free_pipeline(ref.pipe)
    assert not wrong, "rows not equal to their adapter's job alone:\n" + "\n".join(wrong)
    # each adapter changes its rows' videos (else a switch that did nothing would pass): a row
    # of the same take without an adapter is another video
    for i, n in (("a1", "n0"), ("b1", "n1"), ("c1", "n2")):
        assert not np.array_equal(per_row[i], per_row[n]), f"{i}: its adapter changed nothing"
    print(f"seconds: adapter files + per-row worker ready {t_ready - t0:.1f}, its rows "
          f"{t_rows - t_ready:.1f}, four reference jobs {time.perf_counter() - t_rows:.1f}")


def test_fresh_o2_workers_of_one_job_make_the_same_videos(tmp_path):
    """Four fresh O2 workers of one job (`wan_batch`, the full-size Wan 2.1 T2V 1.3B with random
    weights, one compile cache, one after another in one process, as a job's workers start) make
    bit-equal videos of the same rows: O2's `deterministic` flag has Inductor take one heuristic
    config per reduction kernel instead of the fastest of a few it times at first launch. Without
    it (`cudagraphs:cache-all`) two of four workers made other videos of one row on an H200, every
    weight, text embedding and VAE decode bit-equal (benchmarks/2026-12-04-o2-deterministic-h200.md);
    the per-row adapter test above rests on this. Small rows of the full architecture (256x256,
    5 frames, 4 steps, guidance 1.0)."""
    import hashlib

    from runner.driver import checks, job
    from runner.config import load_config, split
    from runner.io.prompts import Item
    from runner.serve.worker import Worker
    import imageio.v3 as iio
    rows = [("r0", 0), ("r1", 1)]
    made = []                                   # per worker: {row id: sha1 of its decoded frames}
    for n in range(4):
        j = split(load_config([
            "job=wan_batch", "model.source=random", f"output.dir={tmp_path / f'w{n}'}",
            f"compile.cache_dir={tmp_path / 'compile-cache'}", "compile.mode=O2",
            "compile.compile_text_encoder=false", "compile.compile_vae=false",
            "generation.height=256", "generation.width=256", "generation.num_frames=5",
            "generation.num_inference_steps=4", "generation.guidance_scale=1.0",
            "run.canary_every_items=0"]))
        w = Worker(0, job.worker_config(j, checks.constraints(j["model"]), on_gpu=True))
        try:
            w.warmup()
            out = w.run_shard([Item(id=i, prompt=f"a red fox running in the snow, take {k}",
                                    negative_prompt="", seed=k, height=256, width=256, num_frames=5,
                                    num_inference_steps=4, guidance_scale=1.0, file="p", row=k,
                                    adapter=None) for i, k in rows])
            assert [r["status"] for r in out] == ["ok"] * len(rows), [r["error"] for r in out]
            made.append({i: hashlib.sha1(iio.imread(f"{w.cfg.job_dir}/media/{i}.mp4").tobytes())
                         .hexdigest()[:12] for i, _ in rows})
        finally:
            free_pipeline(w.pipe)
    print("videos per worker:", made)
    assert made[0]["r0"] != made[0]["r1"], "two takes made one video: the rows do not test anything"
    assert all(m == made[0] for m in made), f"fresh O2 workers made other videos: {made}"
