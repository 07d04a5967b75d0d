"""Step reuse over a block stack (`compiler.step_reuse`, `step_cache.method=residual`) on the tiny
Wan (two denoiser calls per step: the guidance branches) and PixArt (one call), on CPU.

What could break: the reuse changing the model when off, or its parameters; a reused step running
the skipped blocks, or not running the first ones; the two guidance branches sharing one residual
(the unconditional pass would add the conditional one's); outputs depending on call order or on
batch-mates; per-block compile recompiling or diverging from the eager reuse; the peer arm of
`runner.bench.vs_loop` (cache-dit) computing other steps than the job's schedule. GPU tests at the
published sizes: tests/test_step_cache.py (Latte) and the end of this file (Wan, PixArt).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from compiler import step_reuse
from runner.serve import step_cache
from runner.config import ConfigError, StepCacheSection, load_config, split
from runner.families import FAMILIES
from runner.serve.models import ModelSpec, build_pipeline
from runner.io.prompts import Item
from runner.serve.worker import generate
from conftest import GUARD_S

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6
CASES = {"wan21_t2v_1_3b": (FAMILIES["wan21"], dict(num_frames=5, height=64, width=48)),
         "pixart_alpha_512": (FAMILIES["pixart_alpha"], dict(num_frames=None, height=64, width=64))}


def item(preset: str, seed: int, steps: int = STEPS) -> Item:
    return Item(id=f"s{seed}", prompt="a cat walking in the city", negative_prompt="", seed=seed,
                guidance_scale=5.0, num_inference_steps=steps, file="p.parquet", row=seed,
                **CASES[preset][1])


def pipe_of(preset: str, method: str = "residual", **params):
    pipe = build_pipeline(ModelSpec(preset, source="tiny"))
    sc = StepCacheSection(method=method, compute_ratio=0.5, **params)
    step_cache.apply(pipe, sc, CASES[preset][0])
    return pipe


def run(pipe, preset: str, *items: Item, **kw) -> torch.Tensor:
    with torch.inference_mode():
        return generate(pipe, CASES[preset][0], list(items), "cpu", output_type="pt", **kw)


# ---------------------------------------------------------------------------------------------
# compiler.step_reuse on a denoiser

def _wan_inputs(den):
    g = torch.Generator().manual_seed(0)
    return dict(hidden_states=torch.randn(1, 16, 2, 8, 6, generator=g),
                timestep=torch.tensor([500]), encoder_hidden_states=torch.randn(1, 7, 32, generator=g),
                return_dict=False)


def test_install_keeps_the_model_and_reuse_adds_the_kept_residual():
    den = build_pipeline(ModelSpec("wan21_t2v_1_3b", source="tiny")).transformer
    keys, x = list(den.state_dict()), _wan_inputs(den)
    with torch.inference_mode():
        plain = den(**x)[0]
        assert step_reuse.install(den, "blocks", first=1) == 1          # 2 blocks, the first always runs
        assert step_reuse.install(den, "blocks", first=1) == 1          # idempotent
        assert list(den.state_dict()) == keys and step_reuse.installed(den)
        ran = []
        hooks = [b.register_forward_pre_hook(lambda m, a, i=i: ran.append(i)) for i, b in enumerate(den.blocks)]
        assert torch.equal(den(**x)[0], plain)                             # off: the model's own
        with pytest.raises(RuntimeError, match="no computed step"):
            den(**x, step_reuse="reuse", branch="cond")
        ran.clear()
        assert torch.equal(den(**x, step_reuse="compute", branch="cond")[0], plain)
        assert ran == [0, 1]
        ran.clear()
        # same inputs: input of block 1 + (its output - that input) = its output, up to rounding
        torch.testing.assert_close(den(**x, step_reuse="reuse", branch="cond")[0], plain,
                                   atol=1e-5, rtol=1e-5)
        assert ran == [0]                                                  # block 1 skipped
        with pytest.raises(RuntimeError, match="branch 'uncond'"):         # a residual per branch
            den(**x, step_reuse="reuse", branch="uncond")
        assert list(den.blocks) == list(den.blocks._modules.values())     # iteration restored
    for h in hooks:
        h.remove()
    with pytest.raises(ValueError, match="first=1"):
        step_reuse.install(den, "blocks", first=0)
    with pytest.raises(ValueError, match=r"first=2 must be in \[0, 1\]"):
        step_reuse.install(build_pipeline(ModelSpec("wan21_t2v_1_3b", source="tiny")).transformer,
                           "blocks", first=2)


# ---------------------------------------------------------------------------------------------
# The schedule through the pipeline (runner.serve.step_cache.Scheduled)

@pytest.mark.parametrize("preset", list(CASES))
def test_reuse_follows_the_plan_per_branch_and_outputs_depend_on_the_item_only(preset):
    ref = run(pipe_of(preset, "none"), preset, item(preset, 1))
    pipe = pipe_of(preset)
    a = run(pipe, preset, item(preset, 1))
    planned = STEPS - sum(step_cache.plan(STEPS, pipe.transformer.forward.sc))
    calls_per_step = 2 if preset.startswith("wan") else 1        # Wan: cond and uncond calls
    assert step_cache.skipped(pipe) == calls_per_step * planned > 0
    assert not torch.equal(a, ref)                                  # lossy: it did reuse
    if preset.startswith("wan"):                                     # one residual per branch
        assert {k[0] for k in pipe.transformer.blocks.__dict__["_step_residual"]} == {"cond", "uncond"}
    b = run(pipe, preset, item(preset, 2))
    assert torch.equal(run(pipe, preset, item(preset, 1)), a)      # call order does not matter
    # batch-mates: an item alone or beside another gets the same output (full-length text)
    pair = run(pipe, preset, item(preset, 2), item(preset, 1), mask_feature=False)
    torch.testing.assert_close(pair[1], run(pipe, preset, item(preset, 1), mask_feature=False)[0],
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(run(pipe, preset, item(preset, 2)), b)


def test_first_blocks_run_on_every_step():
    pipe = pipe_of("wan21_t2v_1_3b", first_blocks=1)
    ran = []
    for i, blk in enumerate(pipe.transformer.blocks):
        blk.register_forward_pre_hook(lambda m, a, i=i: ran.append(i))
    run(pipe, "wan21_t2v_1_3b", item("wan21_t2v_1_3b", 1))
    computed = sum(step_cache.plan(STEPS, pipe.transformer.forward.sc))
    assert ran.count(0) == 2 * STEPS and ran.count(1) == 2 * computed


def test_a_denoisers_first_call_is_computed_whatever_the_plan():
    """Wan 2.2's second expert starts mid-schedule: its first call has nothing of this call to
    reuse, so it computes even where the plan says reuse."""
    pipe = pipe_of("wan21_t2v_1_3b")
    pipe.scheduler.set_timesteps(STEPS)
    sched, seen = pipe.transformer.forward, []
    sched.inner = lambda *a, **k: seen.append((k["step_reuse"], k["branch"]))
    sched.reset()
    assert not step_cache.plan(STEPS, sched.sc)[3]          # step 3: a reused step of the plan
    for name in ("cond", "uncond", "cond"):
        with pipe.transformer.cache_context(name, step_index=3):
            sched()
    assert seen == [("compute", "cond"), ("compute", "uncond"), ("reuse", "cond")]


def test_warm_up_captures_a_reused_step_too():
    sc = StepCacheSection(method="residual", compute_ratio=0.75)
    n = step_cache.warmup_steps(sc, 2)
    assert n > 2 and not all(step_cache.plan(n, sc))
    assert step_cache.warmup_steps(StepCacheSection(method="residual", compute_ratio=1.0), 2) == 2
    assert step_cache.warmup_steps(StepCacheSection(method="none"), 2) == 2


# ---------------------------------------------------------------------------------------------
# Config and CLI

@pytest.mark.parametrize("arg, needle", [
    ("step_cache.first_blocks=-1", "step_cache.first_blocks=-1 must be an integer >= 0"),
    ("step_cache.first_blocks=1.5", "step_cache.first_blocks=1.5"),
])
def test_bad_first_blocks_is_a_config_error(arg, needle):
    with pytest.raises(ConfigError) as e:
        split(load_config(["job=demo_image", "step_cache.method=residual", arg]))
    assert needle in str(e.value)


def test_first_blocks_past_the_stack_exits_2_before_ray(tmp_path):
    r = subprocess.run([sys.executable, "-m", "runner", "job=demo_image", f"output.dir={tmp_path}",
                        "step_cache.method=residual", "step_cache.first_blocks=2"], cwd=ROOT,
                       capture_output=True, text=True, timeout=GUARD_S)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "step_cache.first_blocks=2" in r.stderr and "2 blocks" in r.stderr
    assert not (tmp_path / "demo_image").exists()


@pytest.mark.e2e
def test_demo_image_job_with_step_reuse(tmp_path):
    """The real CLI: the tiny PixArt with `residual`, one CPU worker (the tiny Wan job runs with it
    in tests/test_e2e.py)."""
    r = subprocess.run([sys.executable, "-m", "runner", "job=demo_image", f"output.dir={tmp_path}",
                        "ray.cpu_workers=1", "step_cache.method=residual",
                        "step_cache.compute_ratio=0.5", "generation.num_inference_steps=4"],
                       cwd=ROOT, capture_output=True, text=True, timeout=GUARD_S)
    assert r.returncode == 0, r.stderr[-4000:]
    m = json.load(open(tmp_path / "demo_image" / "metrics" / "worker-0.json"))
    assert m["step_cache_reused"] > 0 and m["items"] == len(os.listdir(tmp_path / "demo_image" / "media"))


# ---------------------------------------------------------------------------------------------
# The peer arm of runner.bench.vs_loop

def test_cachedit_arm_computes_the_steps_of_the_jobs_schedule():
    pytest.importorskip("cache_dit", reason="cache-dit: the `bench` extra (installed by `.[test]`)")
    from runner.bench.vs_loop import _cachedit, reuse_plan
    pipe = build_pipeline(ModelSpec("wan21_t2v_1_3b", source="tiny"))
    ran = []
    for i, blk in enumerate(pipe.transformer.blocks):
        blk.register_forward_pre_hook(lambda m, a, i=i: ran.append(i))
    sc = split(load_config(["job=wan_batch", "step_cache.compute_ratio=0.5"]))["step_cache"]
    mask = _cachedit(pipe, sc, STEPS)
    assert mask == [int(c) for c in reuse_plan(sc, STEPS)] and 0 < sum(mask) < STEPS
    with torch.inference_mode():
        pipe("a cat", height=64, width=48, num_frames=5, num_inference_steps=STEPS,
             guidance_scale=5.0, generator=torch.Generator().manual_seed(0), output_type="np")
    # F1B0: block 0 on every call (2 per step), block 1 on the masked steps' calls only
    assert ran.count(0) == 2 * STEPS and ran.count(1) == 2 * sum(mask)


def test_cachedit_arm_caches_the_pipeline_ti2v_image_rows_call():
    """TI2V's image rows run its own WanImageToVideoPipeline over the same modules; cache-dit
    enabled on the text pipeline left it without a cache context, so every step ran in full
    (2026-11-27, on an H100: "Cache context not exist ... skip cache" on each call)."""
    pytest.importorskip("cache_dit", reason="cache-dit: the `bench` extra (installed by `.[test]`)")
    from PIL import Image

    from runner.bench.vs_loop import _cachedit, _peer_on_image_pipeline
    fam = FAMILIES["wan22_ti2v"]
    rows = [{"image": "images/a.png"}, {"image": "images/b.png"}]
    with pytest.raises(ValueError, match="images=all or images=none"):
        _peer_on_image_pipeline(fam, rows + [{"image": None}])
    assert not _peer_on_image_pipeline(fam, [{"image": None}])
    assert not _peer_on_image_pipeline(FAMILIES["wan21"], rows)   # one pipeline: no choice
    assert _peer_on_image_pipeline(fam, rows)
    pipe = build_pipeline(ModelSpec("wan22_ti2v_5b", source="tiny"))
    i2v = fam.image_pipeline(pipe)
    ran = []
    for i, blk in enumerate(pipe.transformer.blocks):
        blk.register_forward_pre_hook(lambda m, a, i=i: ran.append(i))
    sc = split(load_config(["job=wan22_ti2v_batch", "step_cache.compute_ratio=0.5"]))["step_cache"]
    mask = _cachedit(i2v, sc, STEPS)
    assert 0 < sum(mask) < STEPS
    with torch.inference_mode():
        i2v(prompt="a cat", image=Image.new("RGB", (64, 64), (200, 30, 60)), height=64, width=64,
            num_frames=5, num_inference_steps=STEPS, guidance_scale=5.0,
            generator=torch.Generator().manual_seed(0), output_type="np")
    assert ran.count(0) == 2 * STEPS and ran.count(1) == 2 * sum(mask)   # F1B0, both branches


def _block_steps(pipe, run) -> dict:
    """{(expert, block): {step: calls}} for blocks 0 and 1 of each expert during `run()`: the step
    is the index of the pipeline's current timestep in the call's schedule."""
    from collections import Counter
    seen = {}
    for name in ("transformer", "transformer_2"):
        for b in (0, 1):
            getattr(pipe, name).blocks[b].register_forward_pre_hook(
                lambda m, a, k=(name, b): seen.setdefault(k, []).append(float(pipe._current_timestep)))
    run()
    ts = [float(t) for t in pipe.scheduler.timesteps]
    return {k: Counter(ts.index(t) for t in v) for k, v in seen.items()}


def test_cachedit_arm_computes_the_jobs_steps_on_each_a14b_expert():
    """Wan 2.2 A14B, 8 steps: transformer on steps 0-2, transformer_2 on 3-7 (t < 875). The job
    (residual, F1B0) computes the plan's {0, 1, 6, 7} and transformer_2's first step 3; cache-dit
    counts each expert's steps from 0 in its own context, so one 8-step mask would compute
    transformer_2's own steps 0 and 1 (steps 3, 4): the arm gives each expert its slice."""
    pytest.importorskip("cache_dit", reason="cache-dit: the `bench` extra (installed by `.[test]`)")
    from runner.bench.vs_loop import _cachedit, expert_split
    fam, steps = FAMILIES["wan22_a14b"], 8
    sc = StepCacheSection(method="residual", compute_ratio=0.5, first_blocks=1)
    job = build_pipeline(ModelSpec("wan22_t2v_a14b", source="tiny"))
    assert expert_split(job, steps) == 3 and expert_split(job, 40) == 13
    step_cache.apply(job, sc, fam)
    with torch.inference_mode():
        ours = _block_steps(job, lambda: generate(job, fam, [_a14b_item(1, steps)], "cpu",
                                                  output_type="pt"))
    peer = build_pipeline(ModelSpec("wan22_t2v_a14b", source="tiny"))
    mask = _cachedit(peer, sc, steps)
    with torch.inference_mode():
        theirs = _block_steps(peer, lambda: peer(
            "a cat walking in the city", height=64, width=48, num_frames=5, num_inference_steps=steps,
            guidance_scale=4.0, generator=torch.Generator().manual_seed(1), output_type="np"))
    computed = {1: [0, 1], 2: [3, 6, 7]}
    assert [i for i, m in enumerate(mask) if m] == computed[1] + computed[2]
    for run in (ours, theirs):   # both guidance branches per step: 2 calls
        for name, served, comp in (("transformer", range(3), computed[1]),
                                   ("transformer_2", range(3, 8), computed[2])):
            assert run[(name, 0)] == {i: 2 for i in served}, name      # F1: every step it serves
            assert run[(name, 1)] == {i: 2 for i in comp}, name        # B0: its computed steps
    assert ours == theirs

# ---------------------------------------------------------------------------------------------
# GPU: the published architectures

@pytest.mark.gpu
@pytest.mark.parametrize("preset, kw", [
    ("wan21_t2v_1_3b", dict(height=480, width=832, num_frames=33)),
    ("pixart_alpha_1024", dict(height=1024, width=1024, clean_caption=False, use_resolution_binning=False)),
])
def test_full_size_step_reuse_under_compiled_modes(preset, kw):
    """At the published size (every block), random weights, fp16: `residual` under O2 and O3
    reuses the planned steps inside captured step graphs (one per kind of step and guidance
    branch), recompiles nothing on later calls, O2 within fp16 tolerance of the eager reuse, O3
    (FP8, lossy) close to it."""
    import copy

    import compiler
    fam = CASES.get(preset, (FAMILIES["pixart_alpha"],))[0]
    base = build_pipeline(ModelSpec(preset, source="random", dtype="fp16", device="cuda"))
    parts = dict(base.components)
    steps, sc = 8, StepCacheSection(method="residual", compute_ratio=0.5)

    def variant(mode):
        pipe = type(base)(**{**parts, "transformer": copy.deepcopy(parts["transformer"])})
        if mode:
            compiler.compile_pipe(pipe, {"mode": mode, "compile_text_encoder": False,
                                         "compile_vae": False})
        step_cache.apply(pipe, sc, fam)
        return pipe

    def call(pipe):
        step_cache.reset(pipe)
        with torch.inference_mode():
            out = pipe(prompt="a red fox running in the snow", num_inference_steps=steps,
                       guidance_scale=5.0, output_type="latent",
                       generator=torch.Generator("cuda").manual_seed(0), **kw)
        return (out.frames if hasattr(out, "frames") else out.images).float()

    ref = call(variant(None))
    branches = 2 if preset.startswith("wan") else 1
    planned = steps - sum(step_cache.plan(steps, sc))
    scale = max(ref.abs().max().item(), 1.0)
    for mode, tol in (("O2", 2e-2), ("O3", 0.25)):
        pipe = variant(mode)
        call(pipe)
        with torch._dynamo.config.patch(error_on_recompile=True):
            out = call(pipe)
        assert step_cache.skipped(pipe) == 2 * branches * planned
        assert len(pipe.transformer.forward.inner.graphs) == 2 * branches   # StepGraph
        assert torch.isfinite(out).all()
        err = (out - ref).abs().max().item()
        print(f"{preset} {mode} residual vs eager residual: max abs {err:.3g} (scale {scale:.3g})")
        assert err <= tol * scale, mode
        del pipe
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# A stack over several block lists whose blocks return a pair (FLUX), and a second expert (Wan 2.2)

def _flux_inputs():
    g = torch.Generator().manual_seed(0)
    # tiny FLUX: 4x4 latent patches of 16 channels, 8 text tokens of 32, pooled 16
    return dict(hidden_states=torch.randn(1, 16, 16, generator=g),
                encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
                pooled_projections=torch.randn(1, 16, generator=g), timestep=torch.tensor([0.5]),
                guidance=torch.tensor([3.5]), img_ids=torch.rand(16, 3), txt_ids=torch.zeros(8, 3),
                return_dict=False)


@pytest.mark.parametrize("first, runs_on_reuse", [(3, ["d0", "d1", "s0"]), (1, ["d0"]), (0, [])])
def test_a_stack_over_two_lists_reuses_both_streams_of_pair_blocks(first, runs_on_reuse):
    fam = FAMILIES["flux1"]
    den = build_pipeline(ModelSpec("flux1_dev", source="tiny")).transformer
    x = _flux_inputs()
    ran = []
    for tag, blocks in (("d", den.transformer_blocks), ("s", den.single_transformer_blocks)):
        for i, b in enumerate(blocks):
            b.register_forward_pre_hook(lambda m, a, tag=f"{tag}{i}": ran.append(tag))
    with torch.inference_mode():
        plain = den(**x)[0]
        ran.clear()
        assert step_reuse.install(den, fam.step_blocks, first, fam.step_outputs) == 4 - first
        assert torch.equal(den(**x, step_reuse="compute", branch="cond")[0], plain)
        assert ran == ["d0", "d1", "s0", "s1"]
        ran.clear()
        # same inputs: the kept residuals of both streams give the computed output back
        torch.testing.assert_close(den(**x, step_reuse="reuse", branch="cond")[0], plain,
                                   atol=1e-5, rtol=1e-5)
        assert ran == runs_on_reuse
        store = den.transformer_blocks.__dict__["_step_residual"]
        assert {(k[0], k[1][:2]) for k in store} == {(("cond", 0), (1, 8)), (("cond", 1), (1, 16))}
        assert list(den.single_transformer_blocks) == list(den.single_transformer_blocks._modules.values())
    with pytest.raises(ValueError, match=r"first=4 must be in \[0, 3\]"):
        step_reuse.install(build_pipeline(ModelSpec("flux1_dev", source="tiny")).transformer,
                           fam.step_blocks, 4, fam.step_outputs)


def test_first_blocks_is_checked_against_the_whole_stack():
    """FLUX's stack is both lists: first_blocks=2 is the first single block of the tiny model,
    not past its 2 double blocks; 4 is past all 4."""
    def job(n):
        return split(load_config(["job=flux_batch", "model.source=tiny", "step_cache.method=residual",
                                  f"step_cache.first_blocks={n}"]))
    step_cache.prepare(job(2))
    with pytest.raises(ConfigError, match="has 4 blocks"):
        step_cache.prepare(job(4))


def _a14b_item(seed, steps=8):
    return Item(id=f"s{seed}", prompt="a cat walking in the city", negative_prompt="", seed=seed,
                guidance_scale=4.0, num_inference_steps=steps, file="p.parquet", row=seed,
                num_frames=5, height=64, width=48)


def test_both_experts_reuse_each_from_its_own_first_call():
    """Wan 2.2 A14B: 8 steps, transformer on steps 0-2 (t >= 875), transformer_2 on 3-7; the plan
    computes {0, 1, 6, 7}: the first expert reuses step 2, the second computes its first step 3
    (nothing of its own to reuse yet) and reuses 4 and 5."""
    fam = FAMILIES["wan22_a14b"]
    pipe = build_pipeline(ModelSpec("wan22_t2v_a14b", source="tiny"))
    sc = StepCacheSection(method="residual", compute_ratio=0.5)
    assert step_cache.apply(pipe, sc, fam) == 2
    kinds = {}
    for name in ("transformer", "transformer_2"):
        sched = getattr(pipe, name).forward
        inner = sched.inner
        sched.inner = lambda *a, _i=inner, _n=name, **k: (
            kinds.setdefault(_n, []).append(k["step_reuse"]), _i(*a, **k))[1]
    with torch.inference_mode():
        a = generate(pipe, fam, [_a14b_item(1)], "cpu", output_type="pt")
    # cond and uncond per step: (computed or reused) twice
    assert kinds["transformer"] == ["compute"] * 4 + ["reuse"] * 2
    assert kinds["transformer_2"] == ["compute"] * 2 + ["reuse"] * 4 + ["compute"] * 4
    assert step_cache.skipped(pipe) == 6
    for name in ("transformer", "transformer_2"):
        assert {k[0] for k in getattr(pipe, name).blocks.__dict__["_step_residual"]} == {"cond", "uncond"}
    with torch.inference_mode():
        generate(pipe, fam, [_a14b_item(2)], "cpu", output_type="pt")
        assert torch.equal(generate(pipe, fam, [_a14b_item(1)], "cpu", output_type="pt"), a)


@pytest.mark.parametrize("preset, blocks", [
    ("wan22_t2v_a14b", {"WanTransformerBlock": 4}),              # 2 per expert, one graph
    ("flux1_dev", {"FluxTransformerBlock": 2, "FluxSingleTransformerBlock": 2}),
    ("wan21_i2v_14b_480p", {"WanTransformerBlock": 2}),
])
def test_o2_with_reuse_on_cpu_matches_eager_reuse_without_recompiles(preset, blocks):
    """O2 on CPU (per-block compile; the step graph is CUDA-only): the families' blocks (Wan's
    WanPipeline, here with two experts sharing a compiled function (Wan 2.1 T2V's one-transformer
    case, the same block class and pipeline, had a test of its own: 11 CPU-s for nothing new); FLUX's two block classes returning pairs, its QKV fused,
    its two text encoders compiled; Wan I2V's image cross-attention) with `residual` reuse give the
    eager reuse's output (unfused, uncompiled) and recompile nothing on later calls."""
    import compiler
    torch._dynamo.reset()
    spec = ModelSpec(preset, source="tiny")
    fam = spec.family
    sc = StepCacheSection(method="residual", compute_ratio=0.5)
    image = _image_of(fam)
    frames = 5 if fam.kind == "video" else None

    def it(seed):
        return Item(id=f"s{seed}", prompt="a cat walking in the city", negative_prompt="", seed=seed,
                    guidance_scale=4.0, num_inference_steps=6, file="p.parquet", row=seed,
                    num_frames=frames, height=64, width=64, image="x" if image else None)

    def run(pipe, seed):
        with torch.inference_mode():
            return generate(pipe, fam, [it(seed)], "cpu", output_type="pt", image=image)

    ref = build_pipeline(spec)
    step_cache.apply(ref, sc, fam)
    want = run(ref, 1)
    pipe = build_pipeline(spec)
    two_encoders = fam.tokenizer == "tokenizer_2"       # FLUX: CLIP and T5, both compiled
    compiler.compile_pipe(pipe, {"mode": "O2", "compile_vae": False,
                                 "compile_text_encoder": two_encoders})
    assert pipe._compile_report["compiled_blocks"] == blocks
    if two_encoders:
        assert pipe._compile_report["text_encoder_blocks"] == {"CLIPEncoderLayer": 2, "T5Block": 2}
    step_cache.apply(pipe, sc, fam)
    torch.testing.assert_close(run(pipe, 1), want, atol=1e-4, rtol=1e-4)
    with torch._dynamo.config.patch(error_on_recompile=True):
        torch.testing.assert_close(run(pipe, 1), want, atol=1e-4, rtol=1e-4)
        run(pipe, 2)
    assert step_cache.skipped(pipe) > 0


def _image_of(fam):
    from runner.io.images import placeholder
    return placeholder(64, 64) if fam.image == "required" else None
