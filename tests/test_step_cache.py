"""Step reuse (`step_cache.*`, runner/serve/step_cache.py) on the tiny Latte, on CPU.

What could break: a bad method or parameter reaching Ray (exit 2 naming the valid values, before
any model); the hooks not skipping anything; state leaking from one pipeline call into the next
(outputs depending on call order, or on a call that raised); per-block compile tracing into the
hooks (a full-graph error) or recompiling per block; a rerun with another step-cache setting
silently mixing outputs in one directory. GPU tests (marked `gpu`) check the compiled modes there.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from runner.serve import step_cache
from runner.config import ConfigError, StepCacheSection, load_config, split
from runner.families.latte import LATTE
from runner.serve.models import ModelSpec, build_pipeline
from runner.io.prompts import Item
from runner.serve.worker import generate
from conftest import GUARD_S, compile_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6   # DDIM over 1000: timesteps 834..1: several inside both methods' reuse ranges


def item(seed: int, steps: int = STEPS, guidance: float = 4.5) -> Item:
    return Item(id=f"s{seed}", prompt="a cat walking in the city", negative_prompt="", seed=seed,
                height=64, width=64, num_frames=4, guidance_scale=guidance,
                num_inference_steps=steps, file="p.parquet", row=seed)


def run(pipe, it: Item) -> torch.Tensor:
    with torch.inference_mode():
        return generate(pipe, LATTE, [it], "cpu", output_type="pt")


def latte(method: str = "none", compile_mode: str | None = None, **params):
    pipe = build_pipeline(ModelSpec("latte1", source="tiny"))
    sc = StepCacheSection(method=method, **params)
    if compile_mode:
        import compiler
        # the denoiser only: the hooks live there; the text encoder's and VAE's compile (most of
        # the CPU compile time) is tested in test_compiler_compile.py
        options = {"mode": compile_mode, "compile_text_encoder": False, "compile_vae": False}
        compiler.compile_pipe(pipe, step_cache.compile_options(options, sc))
    step_cache.apply(pipe, sc, LATTE)
    return pipe


# ---------------------------------------------------------------------------------------------
# Config: checked before Ray, naming the key and the valid values.

@pytest.mark.parametrize("arg, needle", [
    ("step_cache.method=teacache", "step_cache.method='teacache' is not valid; choose one of "
                                   "['none', 'residual', 'fastercache', 'pab']"),
    ("step_cache.block_skip_range=1", "step_cache.block_skip_range=1 must be >= 2"),
    ("step_cache.uncond_skip_range=0", "step_cache.uncond_skip_range=0 must be > 0"),
    ("step_cache.timestep_range=[800,100]", "must be two numbers [low, high] with low < high"),
    ("step_cache.timestep_range=[1,2,3]", "must be two numbers"),
    ("step_cache.block_skip_range=two", "step_cache.block_skip_range='two' has the wrong type"),
    ("step_cache.skip=2", "unknown config key 'step_cache.skip'"),
    ("step_cache.compute_ratio=0", "step_cache.compute_ratio=0 must be in (0, 1]"),
    ("step_cache.compute_ratio=1.5", "step_cache.compute_ratio=1.5 must be in (0, 1]"),
    ("step_cache.compute_steps=[1,2]", "must be distinct step indices >= 0 that include 0"),
    ("step_cache.compute_steps=[0,0,3]", "must be distinct step indices"),
    ("step_cache.compute_steps=[0,-1]", "must be distinct step indices"),
])
def test_bad_step_cache_settings_are_config_errors(arg, needle):
    with pytest.raises(ConfigError) as e:
        split(load_config(["job=demo_video", "step_cache.method=pab", arg]))
    assert needle in str(e.value)


def test_good_parameters_reach_the_diffusers_config():
    job = split(load_config(["job=demo_video", "step_cache.method=fastercache",
                             "step_cache.timestep_range=[-1, 900]", "step_cache.block_skip_range=3",
                             "step_cache.uncond_skip_range=2"]))
    cfg = step_cache.BUILDERS["fastercache"](job["step_cache"], lambda: 500.0)
    assert cfg.spatial_attention_timestep_skip_range == (-1, 900)
    assert cfg.spatial_attention_block_skip_range == 3 and cfg.unconditional_batch_skip_range == 2
    pab = step_cache.BUILDERS["pab"](StepCacheSection(method="pab"), lambda: 500.0)
    assert pab.spatial_attention_timestep_skip_range == (100, 800)      # null: the method's default


@pytest.mark.parametrize("args, needle", [
    (["job=demo_video", "step_cache.method=fastcache"], "choose one of ['none', 'residual', 'fastercache', 'pab']"),
    (["job=demo_image", "step_cache.method=pab"], "is not offered for pixart_alpha models; it is "
                                                  "for: ['latte']"),
    (["job=demo_video", "step_cache.method=pab", "step_cache.block_skip_range=1"],
     "step_cache.block_skip_range=1 must be >= 2"),
])
def test_cli_exits_2_naming_the_valid_ones_before_ray(args, needle, tmp_path, capsys):
    """The job's entry point in-process (`python -m runner` runs the same `main`; the command line
    itself: test_compile_job.py's test_bad_compile_mode_with_a_step_cache_is_exit_2_naming_it)."""
    from runner.driver.job import main
    assert main([*args, f"output.dir={tmp_path}"]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "demo_video").exists() and not (tmp_path / "demo_image").exists()


def test_cudagraphs_is_dropped_from_the_mode_for_the_hook_methods_only():
    job = split(load_config(["job=demo_video", "compile.mode=O3", "step_cache.method=pab"]))
    step_cache.prepare(job)
    assert job["compile"].options.mode == job["compile"].mode == "cache-all:int8-attention:low-precision:max-optimize"
    job = split(load_config(["job=demo_video", "compile.mode=O2", "step_cache.method=pab"]))
    step_cache.prepare(job)
    assert job["compile"].options.flags == {"cache-all", "deterministic"}
    assert job["compile"].mode == "cache-all:deterministic"
    for method in ("none", "residual"):   # off, or residual (a graph per kind of step): untouched
        job = split(load_config(["job=demo_video", "compile.mode=O2", f"step_cache.method={method}"]))
        step_cache.prepare(job)
        assert job["compile"].mode == "O2" and "cudagraphs" in job["compile"].options.flags
    job = split(load_config(["job=demo_video", "compile.mode=cudagraphs", "step_cache.method=pab"]))
    step_cache.prepare(job)
    assert job["compile"].options.flags == {"none"}          # nothing left: eager


def test_residual_schedule_depends_on_step_count_and_settings_only():
    sc = StepCacheSection(method="residual")
    p50 = step_cache.plan(50, sc)
    assert sum(p50) == 27 and p50[0] and p50[-1] and p50[-2]      # the default: 27 of 50
    assert all(p50[:10]) and not all(p50[10:])                       # dense first, then spread
    computed = [i for i, c in enumerate(p50) if c]
    assert max(b - a for a, b in zip(computed, computed[1:])) <= 3   # at most 2 reused in a row
    for n in (1, 2, 3, 7, 20, 100):
        p = step_cache.plan(n, sc)
        assert len(p) == n and p[0] and sum(p) == max(1, round(0.54 * n))
    assert step_cache.plan(50, StepCacheSection(method="residual", compute_ratio=1.0)) == (True,) * 50
    explicit = StepCacheSection(method="residual", compute_steps=[0, 3, 60])
    assert [i for i, c in enumerate(step_cache.plan(6, explicit)) if c] == [0, 3]


def test_step_cache_settings_name_only_the_keys_the_method_reads():
    assert StepCacheSection(method="residual").settings() == {
        "method": "residual", "compute_ratio": 0.54, "compute_steps": None, "first_blocks": 0}
    assert "compute_ratio" not in StepCacheSection(method="pab").settings()


def test_step_cache_is_part_of_the_settings_id_only_when_on():
    from runner.driver.results import fingerprint, settings_id
    ids = {m: settings_id(load_config(["job=demo_video", f"step_cache.method={m}"]))
           for m in ("none", "residual", "fastercache", "pab")}
    assert len(set(ids.values())) == 4
    assert settings_id(load_config(["job=demo_video", "step_cache.method=residual",
                                    "step_cache.compute_ratio=0.6"])) != ids["residual"]
    # a key the method does not read changes nothing
    assert settings_id(load_config(["job=demo_video", "step_cache.method=residual",
                                    "step_cache.block_skip_range=3"])) == ids["residual"]
    # a changed parameter is a different output, too
    assert settings_id(load_config(["job=demo_video", "step_cache.method=pab",
                                    "step_cache.block_skip_range=3"])) != ids["pab"]
    # a directory made before step_cache existed (its config.yaml has no such section)
    old = load_config(["job=demo_video"])
    from omegaconf import OmegaConf
    old = OmegaConf.create({k: v for k, v in OmegaConf.to_container(old).items() if k != "step_cache"})
    assert settings_id(old) == ids["none"] and "step_cache" not in fingerprint(old)


# ---------------------------------------------------------------------------------------------
# The hooks on the tiny Latte, in process.

@pytest.mark.parametrize("method", ["residual", "fastercache", "pab"])
def test_cache_reuses_and_outputs_are_independent_of_call_order(method):
    ref = run(latte(), item(1))
    pipe = latte(method)
    a = run(pipe, item(1))
    assert step_cache.skipped(pipe) > 0              # it did reuse something
    assert not torch.equal(a, ref)                   # ... and that changed the output (lossy)
    b = run(pipe, item(2))
    assert torch.equal(run(pipe, item(1)), a)        # same item after another: identical
    assert torch.equal(run(pipe, item(2)), b)
    # a call that raises mid-denoising leaves hook state behind (diffusers resets only at the end
    # of a call that finished); the next call must not see it
    def boom(p, i, t, kw):
        if i == 2:
            raise RuntimeError("stop")
        return kw
    with pytest.raises(RuntimeError, match="stop"), torch.inference_mode():
        pipe(prompt="x", num_inference_steps=STEPS, height=64, width=64, video_length=4,
             clean_caption=False, output_type="pt", callback_on_step_end=boom)
    assert torch.equal(run(pipe, item(1)), a)


def test_residual_output_is_independent_of_batch_mates():
    """The schedule is per step, the residual per item: an item alone or in a batch of two (the
    CFG batch then holds 4 videos) gets the same frames."""
    pipe = latte("residual")
    # mask_feature=False: full-length text, so that only the step reuse could couple the items
    with torch.inference_mode():
        alone = generate(pipe, LATTE, [item(1)], "cpu", output_type="pt", mask_feature=False)
        pair = generate(pipe, LATTE, [item(1), item(5)], "cpu", output_type="pt", mask_feature=False)
    torch.testing.assert_close(pair[0], alone[0], atol=1e-5, rtol=1e-5)
    assert step_cache.skipped(pipe) == 2 * (STEPS - sum(step_cache.plan(STEPS, pipe.transformer.forward.sc)))


def test_fastercache_without_guidance_reuses_attention_only():
    """guidance_scale <= 1: Latte runs no CFG batch; FasterCache must not split one (it raised)."""
    pipe = latte("fastercache")
    a = run(pipe, item(1, guidance=1.0))
    assert step_cache.skipped(pipe) > 0 and torch.isfinite(a).all()
    assert torch.equal(run(pipe, item(1, guidance=1.0)), a)
    run(pipe, item(1))                                 # and CFG again after it
    assert torch.equal(run(pipe, item(1, guidance=1.0)), a)


def test_fastercache_skips_the_unconditional_branch():
    pipe = latte("fastercache", uncond_skip_range=2)
    seen = []   # the batch the transformer's own forward gets: (B * frames, C, H, W) into pos_embed
    h = pipe.transformer.pos_embed.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[0]))
    run(pipe, item(1))
    h.remove()
    # the CFG batch (2 x 4 frames) on some steps, the conditional half alone on the others
    assert len(seen) == STEPS and 8 in seen and 4 in seen


@pytest.mark.parametrize("method", ["fastercache", "pab"])
def test_a_hooked_pipeline_is_freed_once_dropped(method):
    """The opaque op finds each hooked attention module by its key buffer's address; that table
    held the modules, and through their hooks the whole pipeline, for the life of the process (on
    a GPU: Latte-1's 11.3 GiB stayed allocated after its test, through all later tests)."""
    import gc
    import weakref
    pipe = latte(method)
    run(pipe, item(1))
    refs = [weakref.ref(pipe.transformer), weakref.ref(pipe.text_encoder)]
    del pipe
    gc.collect()
    assert [r() for r in refs] == [None, None]


@pytest.mark.parametrize("method", ["residual", "fastercache", "pab"])
def test_per_block_compile_with_step_cache_matches_eager_step_cache(method):
    """Per-block compile (Latte's compiled block pairs; `O2` on CPU, whose step graph is dropped)
    with the hooked attentions as opaque ops: the eager step cache's output, graphs shared by the
    block pairs (never one per pair), no recompiles on later calls."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from compiler.video import block_pairs
    torch._dynamo.reset()
    ref = run(latte(method), item(1))
    pipe = latte(method, compile_mode="O2")
    assert pipe._compile_options.mode == ("cache-all:cudagraphs:deterministic" if method == "residual"
                                          else "cache-all:deterministic")
    assert pipe._compile_report["compiled_blocks"]
    out = run(pipe, item(1))
    assert step_cache.skipped(pipe) > 0
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    with torch._dynamo.config.patch(error_on_recompile=True):
        torch.testing.assert_close(run(pipe, item(1)), ref, atol=1e-4, rtol=1e-4)
        run(pipe, item(2))
    # Graphs of the pair function: FasterCache also runs the conditional half of the CFG batch
    # alone on some steps (one more batch size). And under inference_mode (as in the worker) pair
    # 0's temporal position (a buffer) and the later pairs' zeros (made in inference mode) differ in
    # dispatch keys: two graphs per batch size, with or without a step cache (compiler/video/block_pairs.py,
    # not this module). The hooks themselves add none.
    graphs = len(_debug_get_cache_entry_list(block_pairs._pair.__code__))
    assert graphs == 2 * (2 if method == "fastercache" else 1)
    # hooked attentions: their class carries the opaque forward, never the instance (Dynamo would
    # guard on each instance's forward: a recompile per block pair)
    assert all("forward" not in m.__dict__ for m in pipe.transformer.modules()
               if hasattr(m, "_step_cache_key"))


# ---------------------------------------------------------------------------------------------
# The demo video job with a step cache: its worker (in-process, built from the job's command line
# as the driver builds it), and the job directory's refusal of another step-cache setting.

@pytest.mark.parametrize("method, mode, runs_as", [("residual", "O2", "O2")])
def test_demo_video_with_step_cache(method, mode, runs_as, tmp_path, write_prompts, capsys):
    """The worker applies the step cache at warm-up, after compiling (O2 on CPU: per-block
    compile; the mode each hook method runs as: test_cudagraphs_is_dropped_...). The text encoder
    and VAE stay eager: their compile is tested in test_compiler_compile.py and costs most of the
    CPU compile time; the shapes and the session's compile cache are those of the in-process
    compiles above (their C++ kernels reused; the cold build: test_compile_job.py)."""
    from runner.driver import checks, job
    from runner.config import load_config, split
    from runner.serve.worker import Worker
    from test_jobrun import Cluster
    p = write_prompts({"prompt": ["a cat", "a dog walking", "a red car"]}, name="p.parquet")
    args = ["job=demo_video", f"output.dir={tmp_path}", "ray.cpu_workers=1", f"prompts.path={p}",
            f"generation.num_inference_steps={STEPS}", "run.batch_size=1",
            f"compile.cache_dir={compile_cache()}", f"step_cache.method={method}",
            f"compile.mode={mode}", "compile.compile_text_encoder=false", "compile.compile_vae=false"]
    j = split(load_config(args))
    checked = checks.check_input(j)
    w = Worker(0, job.worker_config(j, checked.limits, on_gpu=False))
    w.warmup()
    assert [r["status"] for r in w.run_shard(checked.items)] == ["ok"] * 3
    assert len(os.listdir(tmp_path / "demo_video" / "media")) == 3
    m = w.metrics()
    assert m["step_cache_reused"] > 0                  # the worker did skip attention or steps
    assert m["compile_mode"] == runs_as
    # the job directory remembers the step cache: another setting into it is refused like any
    # output setting (the job's own run, its workers simulated)
    c = Cluster()
    assert c.main(args) == 0
    other = "pab" if method == "fastercache" else "fastercache"
    capsys.readouterr()
    assert c.main(args + [f"step_cache.method={other}"]) == 2
    err = capsys.readouterr().err
    assert "step_cache" in err and "output.overwrite=true" in err and len(c.pools) == 1


# ---------------------------------------------------------------------------------------------
# GPU (not run on CPU): step cache with the compiled modes, within a tolerance of step cache alone.

@pytest.mark.gpu
@pytest.mark.parametrize("mode, tol", [("O2", 2e-2), ("O3", 1.5e-1)])
@pytest.mark.parametrize("method", ["fastercache", "pab"])
def test_step_cache_with_compiled_modes_on_gpu(method, mode, tol):
    """Tiny Latte in fp16 on CUDA: step cache + O2 (its step graph dropped) within fp16 tolerance of
    the eager step cache; + O3 (FP8 linears, lossy) within 0.15 on outputs in [0, 1]. The denoiser
    is compiled, the text encoder and VAE (which the step cache does not touch) stay eager, as in
    the full-size test below: compiled, they were 8 of the 12 graphs (fastercache under O2, counted
    on a CPU); the same T5 and 2-D VAE compiled on a GPU are the full-size PixArt-α tests'."""
    def pipe_of(m):
        p = build_pipeline(ModelSpec("latte1", source="tiny", dtype="fp16", device="cuda"))
        sc = StepCacheSection(method=method)
        if m:
            import compiler
            compiler.compile_pipe(p, step_cache.compile_options(
                {"mode": m, "compile_text_encoder": False, "compile_vae": False}, sc))
        step_cache.apply(p, sc, LATTE)
        return p

    def call(p):
        with torch.inference_mode():
            return generate(p, LATTE, [item(1)], "cuda", output_type="pt").float()

    ref = call(pipe_of(None))
    pipe = pipe_of(mode)
    call(pipe)
    out = call(pipe)
    assert step_cache.skipped(pipe) > 0 and torch.isfinite(out).all()
    assert (out - ref).abs().max().item() <= tol


@pytest.mark.e2e
def test_bench_reports_error_and_psnr_of_each_lossy_variant(tmp_path):
    """`python -m runner.bench.compiled` on the tiny Latte on CPU: the step cache alone, compiled + step
    cache and an ablation, each with its speed-up, max abs error and PSNR against eager on the
    same seed."""
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "runner.bench.compiled", "model=latte1", "source=tiny",
                        "device=cpu", "dtype=fp32", f"steps={STEPS}", "compile.mode=O2",
                        "step_cache.method=pab", "reps=1", "extra=none", f"out={out}", f"cache_dir={compile_cache()}",
                        "compile.compile_text_encoder=false", "compile.compile_vae=false"],
                       cwd=ROOT, capture_output=True, text=True, timeout=GUARD_S)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.load(open(out))
    alone = res["step_cache_eager"]
    assert alone["reused"] > 0 and alone["speedup"] > 0
    assert 0 < alone["max_abs_err"] <= 1 and 10 < alone["psnr_db"] < float("inf")
    assert res["args"]["compile"]["mode"] == "cache-all:deterministic"      # step graph dropped
    assert res["max_abs_err_vs_eager"] > 0 and res["psnr_vs_eager_db"] > 10
    # per-block compile + step cache gives the eager step cache's output
    assert abs(res["psnr_vs_eager_db"] - alone["psnr_db"]) < 1.0
    assert "PSNR" in r.stdout and "step cache `pab` alone" in r.stdout
    # ablations state their error too (without the step cache: lossless here, fp32 on CPU; `none`
    # is the QKV fusion alone, not a second compile on the 2-core CI machine)
    assert res["extra"]["none"]["max_abs_err"] < 1e-3 and res["extra"]["none"]["psnr_db"] > 60


def test_bad_step_cache_argument_of_the_bench_names_the_valid_ones():
    from runner.bench.compiled import parse_argv
    with pytest.raises(SystemExit, match=r"choose one of \['none', 'residual', 'fastercache', 'pab'\]"):
        parse_argv(["step_cache.method=teacache"])


@pytest.mark.gpu
def test_full_size_latte_step_reuse_under_compiled_modes():
    """Latte-1 at the published size (all 28 block pairs), random weights, fp16, 512² x 16 frames:
    `residual` under O2 and O3 starts (no recompile on later calls, the pairs share one graph),
    reuses the planned steps inside captured step graphs, O2 within fp16 tolerance of the eager
    `residual` output, O3 (FP8, lossy) close to it; and `fastercache` under O2 starts too (its
    opaque attentions recompiled once per pair, past Dynamo's limit, before their class carried
    the forward)."""
    import copy

    import compiler
    base = build_pipeline(ModelSpec("latte1", source="random", dtype="fp16", device="cuda"))
    parts = dict(base.components)
    steps, kw = 10, dict(height=512, width=512, video_length=16, clean_caption=False)

    def variant(method, mode, **params):
        # a fresh denoiser per variant; the text encoder and VAE (untouched here) are shared
        pipe = type(base)(**{**parts, "transformer": copy.deepcopy(parts["transformer"])})
        sc = StepCacheSection(method=method, **params)
        if mode:
            compiler.compile_pipe(pipe, step_cache.compile_options(
                {"mode": mode, "compile_text_encoder": False, "compile_vae": False}, sc))
        step_cache.apply(pipe, sc, LATTE)
        return pipe

    def call(pipe, n=steps):
        step_cache.reset(pipe)
        with torch.inference_mode():
            return pipe(prompt="a red fox running in the snow", num_inference_steps=n,
                        output_type="latent", generator=torch.Generator("cuda").manual_seed(0),
                        **kw).frames.float()

    ref = call(variant("residual", None))
    planned = steps - sum(step_cache.plan(steps, StepCacheSection(method="residual")))
    scale = max(ref.abs().max().item(), 1.0)
    for mode, tol in (("O2", 2e-2), ("O3", 0.25)):
        pipe = variant("residual", mode)
        assert pipe._compile_options.flags >= {"cudagraphs"}          # the step graph stays
        call(pipe)
        with torch._dynamo.config.patch(error_on_recompile=True):
            out = call(pipe)
        assert step_cache.skipped(pipe) == 2 * planned
        graphs = pipe.transformer.forward.inner.graphs                 # StepGraph: compute, reuse
        assert len(graphs) == 2
        assert torch.isfinite(out).all()
        assert (out - ref).abs().max().item() <= tol * scale, mode
        del pipe
        torch.cuda.empty_cache()
    pipe = variant("fastercache", "O2")
    out = call(pipe, 4)
    assert step_cache.skipped(pipe) > 0 and torch.isfinite(out).all()


def test_compile_cache_key_covers_the_step_reuse_setting(tmp_path):
    """A cached artifact is never found for another step-reuse setting (it was, before)."""
    from compiler.cache import cache_key
    from runner.config import GenerationDefaults
    from runner.io.prompts import Constraints
    from runner.config import WorkerConfig
    from runner.serve.worker import Worker

    def key(**sc):
        w = Worker(0, WorkerConfig(model=ModelSpec("latte1", source="tiny"),
                                   generation=GenerationDefaults(height=64, width=64, num_frames=4),
                                   limits=Constraints(size_factor=16, video_length=4),
                                   on_empty="error", job_dir=str(tmp_path),
                                   step_cache=StepCacheSection(**sc)))
        return cache_key(w.pipe, {"mode": "O2"}, w.cache_shapes())
    keys = [key(), key(method="residual"), key(method="residual", compute_ratio=0.6),
            key(method="pab")]
    assert len(set(keys)) == 4
    assert key(method="residual", block_skip_range=3) == keys[1]     # a key residual does not read


def test_compute_steps_past_a_rows_step_count_is_an_error_naming_the_rows():
    """plan() ignores an index past a row's last step: the schedule asked for would silently not
    run. Checked against every row (rows may differ in their step count)."""
    sc = StepCacheSection(method="residual", compute_steps=[0, 3, 7])
    step_cache.check_steps(sc, [item(1, steps=8), item(2, steps=10)])       # index 7 < 8: fine
    with pytest.raises(ConfigError, match=r"compute_steps=\[0, 3, 7\] names step 7, past the last "
                                          r"step of 1 prompt row \(p.parquet:3 \(7 steps\)\)"):
        step_cache.check_steps(sc, [item(1, steps=8), item(3, steps=7), item(4, steps=50)])
    # a ratio scales with each row's count; other methods do not read compute_steps
    step_cache.check_steps(StepCacheSection(method="residual"), [item(1, steps=2)])
    step_cache.check_steps(StepCacheSection(method="pab", compute_steps=[0, 99]), [item(1, steps=2)])
