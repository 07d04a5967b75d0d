"""Benchmark: eager vs compiled, side by side in one run, as the seed tables report them.

    python -m runner.bench.compiled model=pixart_alpha_1024 compile.mode=O3 steps=20 height=1024 width=1024 \
        [frames=16] [batch=1] [reps=3] [profile=0|1|2] [prewarm=1] [out=bench.json] [extra=none,cache-all,O2] [compile.dynamic=true] \
        [compile.memory_format=channels_last] [compile.options='{"max_fusion_size": 64}'] \
        [step_cache.method=fastercache|pab] [step_cache.block_skip_range=2] [...]

Builds `source=random` (published size, random weights) fp16 on CUDA and measures, in this order:
  1. matmul peak: a big fp16 and bf16 GEMM (TFLOP/s), for the "fraction of peak" column;
  2. FLOPs of one denoiser call (torch.utils.flop_counter, batch incl. classifier-free guidance);
  3. eager: warm-up call, then `reps` timed calls (default 3): median denoising it/s over steps 2..N
     from CUDA events recorded in the step callback, median E2E wall time of a call, peak memory
     (reset after warm-up);
  4. compiled (`compile.mode`) on a fresh cache directory (a temporary one, removed at the end;
     `cache_dir=DIR`: yours, kept): warm-up with compilation (first call),
     then the same timed calls; max abs error and PSNR of the decoded output vs eager (same seed);
     with `step_cache.method=...` (step reuse, runner/serve/step_cache.py; keys as in a job) the step cache
     is also measured alone on the eager pipeline (it/s, speed-up, error and PSNR vs eager) and
     then applied to the compiled one (whose mode then runs without its cudagraphs step graph);
  5. warm-up with cache: a second Python process on the filled cache directory (and the packed
     `save_cache_artifacts` artifact) times its first call;
  6. `extra=`: more modes on fresh copies of the denoiser (ablations: what each part gives): it/s,
     and max abs error and PSNR against eager at the same step count (at most 10 steps).
`profile=1`: torch.profiler kernel tables of a 4-step eager and compiled call; `profile=2` also a
cProfile of the second process's first call (where a warm start's CPU time goes). `prewarm=1`
(default): the second process starts `compiler.prewarm()` before building the model, as the runner's
workers do.
Prints a markdown table and writes JSON (`out=`).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import inspect
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch

from compiler import cache, compile_pipe, denoiser_of, parse_options, prewarm
from compiler.options import BOOL_KEYS

from ..families import DEFAULT_PRESET
from . import parse_args


USAGE = ("python -m runner.bench.compiled model=NAME compile.mode=MODE [steps=N] [height=H width=W] "
         "[frames=N] [batch=N] [reps=N] [out=FILE] [compile.KEY=V ...] [step_cache.KEY=V ...]")
INT_ARGS = ("steps", "frames", "batch", "seed", "height", "width", "profile", "prewarm", "reps")


def parse_argv(argv: list[str]) -> dict:
    a, rest = parse_args(argv, dict(
        model=DEFAULT_PRESET, steps=20, height=None, width=None, frames=16, batch=1, out=None,
        extra="", profile=0, prewarm=1, reps=3, seed=0, child=None, cache_dir=None, source="random",
        dtype="fp16", device="cuda"), USAGE, passthrough=True)
    a.update({k: int(a[k]) for k in INT_ARGS if isinstance(a[k], str)})
    comp: dict = {"mode": "O2"}
    sc: dict = {}
    for item in rest:                    # compile.* and step_cache.*: typed values
        k, _, v = item.partition("=")
        if k.startswith("compile."):
            sub = k[len("compile."):]
            comp[sub] = json.loads(v) if sub == "options" or sub in BOOL_KEYS else v
        elif k == "compile":
            comp = json.loads(v)
        elif k.startswith("step_cache."):
            import yaml   # values as a job's command line parses them: 2, [100, 800], null
            sc[k[len("step_cache."):]] = yaml.safe_load(v)
        else:
            raise SystemExit(f"unknown argument {k!r}; valid: {sorted(a)}, compile.* and "
                             f"step_cache.*\nusage: {USAGE}")
    from ..serve import step_cache
    from ..config import ConfigError, StepCacheSection
    try:
        a["step_cache"] = StepCacheSection(**sc)
    except (ConfigError, TypeError) as e:
        raise SystemExit(f"step_cache: {e}")
    a["compile"] = step_cache.compile_options(parse_options(comp), a["step_cache"]).to_dict()
    return a


def error_vs(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """Max abs error and PSNR (dB, peak 1: decoded outputs in [0, 1]) of `out` against `ref`."""
    d = out.float().cpu() - ref.float().cpu()
    mse = d.pow(2).mean().item()
    return dict(max_abs_err=d.abs().max().item(),
                psnr_db=float("inf") if mse == 0 else 10 * math.log10(1.0 / mse))


# ---------------------------------------------------------------------------------------------

def build(args):
    from ..serve.models import ModelSpec, build_pipeline, video_length
    spec = ModelSpec(args["model"], source=args["source"], dtype=args["dtype"], device=args["device"])
    pipe = build_pipeline(spec)
    tiny = args["source"] == "tiny"
    args["height"] = args["height"] or (64 if tiny else spec.info["height"])
    args["width"] = args["width"] or (64 if tiny else spec.info["width"])
    # video: the model's only frame count (Latte), else frames=; images: none
    args["frames"] = (video_length(spec) or args["frames"]) if spec.family.kind == "video" else None
    return pipe, spec


def call_kwargs(pipe, spec, args, steps: int) -> dict:
    kw = dict(prompt=["a red fox running through a snowy forest at dawn"] * args["batch"],
              num_inference_steps=steps, height=args["height"], width=args["width"], output_type="pt")
    kw.update(spec.family.call_args(pipe, args["frames"]))
    params = inspect.signature(pipe.__call__).parameters
    if "use_resolution_binning" in params:   # the size asked for, not the nearest bucket
        kw["use_resolution_binning"] = False
    if "mask_feature" in params:             # all of the text length (Latte: 120 tokens)
        kw["mask_feature"] = False
    return kw


def run_call(pipe, spec, args, steps: int, events: bool = False, start: list | None = None):
    """One full call; returns (output, e2e seconds, per-step CUDA events or None). `start`: a list
    that gets a mark (CUDA event) recorded just before the call, to time step 1 against."""
    kw = call_kwargs(pipe, spec, args, steps)
    evs: list = []
    if events:
        def mark():
            if torch.cuda.is_available():
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                evs.append(e)
            else:  # CPU smoke runs (source=tiny device=cpu): wall clock
                evs.append(time.perf_counter())
        params = inspect.signature(pipe.__call__).parameters
        if "callback_on_step_end" in params:
            def on_end(p, i, t, kwargs):
                mark()
                return kwargs
            kw["callback_on_step_end"] = on_end
        else:  # PixArt: old API callback(step, t, latents)
            kw.update(callback=lambda i, t, lat: mark(), callback_steps=1)
    g = torch.Generator(args["device"]).manual_seed(args["seed"])
    sync()
    t0 = time.perf_counter()
    if start is not None:
        start.append(torch.cuda.Event(enable_timing=True) if torch.cuda.is_available() else t0)
        if torch.cuda.is_available():
            start[-1].record()
    out = pipe(**kw, generator=g)
    sync()
    e2e = time.perf_counter() - t0
    out = out.frames if hasattr(out, "frames") else out.images
    return out, e2e, evs


def its(evs) -> float:
    """Denoising it/s over steps 2..N: from the end of step 1 to the end of step N."""
    if isinstance(evs[0], float):
        return (len(evs) - 1) / (evs[-1] - evs[0])
    return (len(evs) - 1) / (evs[0].elapsed_time(evs[-1]) / 1e3)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def max_mem_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def measure(pipe, spec, args, steps: int) -> tuple[dict, torch.Tensor]:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    out, e2e, evs = run_call(pipe, spec, args, steps, events=True)
    return dict(its=its(evs), e2e_s=e2e, peak_mem_gib=max_mem_gib()), out


def measure_reps(pipe, spec, args, steps: int) -> tuple[dict, torch.Tensor]:
    """`reps` timed calls: median it/s and E2E (timings vary ~10 % call to call), max peak memory."""
    runs, out = [], None
    for _ in range(max(1, args["reps"])):
        m, out = measure(pipe, spec, args, steps)
        runs.append(m)
    med = lambda k: sorted(r[k] for r in runs)[len(runs) // 2]
    return dict(its=med("its"), e2e_s=med("e2e_s"), peak_mem_gib=max(r["peak_mem_gib"] for r in runs),
                its_runs=[r["its"] for r in runs]), out


def matmul_peak(dtype, n: int = 8192, iters: int = 30) -> float:
    if not torch.cuda.is_available():
        return float("nan")
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    for _ in range(3):
        a @ b
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        a @ b
    e.record()
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (s.elapsed_time(e) / 1e3) / 1e12


def denoiser_flops(pipe, spec, args) -> float:
    """FLOPs of one denoiser call as the pipeline makes it (captured by a pre-hook, replayed)."""
    from torch.utils.flop_counter import FlopCounterMode
    den = denoiser_of(pipe)
    seen = {}

    def hook(mod, a, kw):
        if not seen:
            seen["a"], seen["kw"] = a, kw
    h = den.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        run_call(pipe, spec, args, 2)
    finally:
        h.remove()
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        den(*seen["a"], **seen["kw"])
    return float(fc.get_total_flops())


def profile_table(pipe, spec, args, rows: int = 25) -> str:
    """Top CUDA kernels of a 4-step call (where the step time goes), as torch.profiler's table."""
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        run_call(pipe, spec, args, 4)
    return prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                     row_limit=rows, max_name_column_width=70)


def versions() -> dict:
    import diffusers
    env = cache.environment()
    env["diffusers"] = diffusers.__version__
    return env


# ---------------------------------------------------------------------------------------------

def child(args) -> dict:
    """Second process: warm up on the filled cache directory (and the artifact)."""
    t_start = time.perf_counter()
    cache.configure_cache_dir(args["cache_dir"])
    if args["prewarm"]:
        prewarm()   # as the runner's workers do: Inductor's imports overlap with building the model
    pipe, spec = build(args)
    t_built = time.perf_counter()
    key = cache.cache_key(pipe, args["compile"], shape_dict(args))
    blob = cache.read_artifact(args["cache_dir"], key)
    hit = blob is not None and cache.unpack_and_load(blob, key)
    t_loaded = time.perf_counter()
    compile_pipe(pipe, args["compile"])
    from ..serve import step_cache
    step_cache.apply(pipe, args["step_cache"], spec.family)
    start: list = []
    if args["profile"] >= 2:  # where the warm first call's CPU time goes (Python profile)
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    _, first_call, evs = run_call(pipe, spec, args, args["steps"], events=True, start=start)
    warm_profile = None
    if args["profile"] >= 2:
        import io
        import pstats
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(60)
        warm_profile = "\n".join(line[:220] for line in buf.getvalue().splitlines())
    # Where the first call goes: until the end of denoising step 1 (text encoding, graph loading and
    # tracing, CUDA-graph capture, step 1) and steps 2..N; the rest of the call is the decode.
    to_step1 = (evs[0] - start[0] if isinstance(evs[0], float) else start[0].elapsed_time(evs[0]) / 1e3)
    steps_its = its(evs) if len(evs) > 1 else float("nan")
    from torch._dynamo.utils import counters
    ind = counters["inductor"]   # a warm start should hit and benchmark nothing
    return dict(warmup_with_cache_s=first_call, artifact_hit=bool(hit), artifact_load_s=t_loaded - t_built,
                first_call_to_step1_s=to_step1,
                first_call_steps_s=(len(evs) - 1) / steps_its if len(evs) > 1 else 0.0,
                first_call_its=steps_its,
                build_s=t_built - t_start, process_ready_s=time.perf_counter() - t_start,
                fxgraph_cache_hit=ind["fxgraph_cache_hit"], fxgraph_cache_miss=ind["fxgraph_cache_miss"],
                kernel_benchmarks=sum(v for k, v in ind.items()   # whichever benchmarker class ran
                                      if k.startswith("benchmarking.") and k.endswith(".benchmark_gpu")),
                warm_profile=warm_profile)


def shape_dict(args) -> dict:
    return {k: args[k] for k in ("height", "width", "frames", "batch", "steps")}


def main(argv: list[str]) -> dict:
    args = parse_argv(argv)
    if args["child"]:
        res = child(args)
        with open(args["child"], "w") as f:
            json.dump(res, f)
        return res

    if args["device"] == "cuda":
        assert torch.cuda.is_available(), "the benchmark needs a CUDA GPU (or: source=tiny device=cpu)"
    if args["cache_dir"]:
        return bench(args, argv, args["cache_dir"])
    # a fresh cache directory of this run's own (a real model's is gigabytes): gone at its end
    with tempfile.TemporaryDirectory(prefix="compile-cache-") as cache_dir:
        return bench(args, argv, cache_dir)


def bench(args: dict, argv: list[str], cache_dir: str) -> dict:
    """Steps 1-6 of the module docstring, compiling into `cache_dir`; the result (`out=`)."""
    cache.configure_cache_dir(cache_dir)  # fresh: warm-up with compilation compiles everything
    res: dict = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                 "versions": versions(), "argv": argv, "args": {k: (dataclasses.asdict(v) if k == "step_cache" else v)
                                                          for k, v in args.items() if k != "child"}}
    res["matmul_tflops"] = {"fp16": matmul_peak(torch.float16), "bf16": matmul_peak(torch.bfloat16)}

    t0 = time.perf_counter()
    pipe, spec = build(args)
    res["build_s"] = time.perf_counter() - t0
    res["args"].update(height=args["height"], width=args["width"], frames=args["frames"])
    steps = args["steps"]
    res["flops_per_step"] = denoiser_flops(pipe, spec, args)
    attr = "unet" if hasattr(pipe, "unet") else "transformer"
    pristine = copy.deepcopy(denoiser_of(pipe)).to("cpu") if args["extra"] else None  # for extra variants

    # eager
    t0 = time.perf_counter()
    run_call(pipe, spec, args, steps)
    res["eager_warmup_s"] = time.perf_counter() - t0
    res["eager"], ref = measure_reps(pipe, spec, args, steps)
    if args["profile"]:
        res["profile_eager"] = profile_table(pipe, spec, args)
        print(res["profile_eager"])
    ref = ref.float().cpu()

    # step cache alone (eager), then off again for the compiled run (which gets it after compiling)
    from ..serve import step_cache
    sc = args["step_cache"]
    if sc.method != "none":
        step_cache.apply(pipe, sc, spec.family)
        run_call(pipe, spec, args, steps)
        res["step_cache_eager"], out = measure_reps(pipe, spec, args, steps)
        res["step_cache_eager"].update(error_vs(out, ref), reused=step_cache.skipped(pipe),
                                       speedup=res["step_cache_eager"]["its"] / res["eager"]["its"])
        pipe.transformer.disable_cache()

    # compiled, fresh cache
    try:
        torch._dynamo.reset()
        compile_pipe(pipe, args["compile"])
        step_cache.apply(pipe, sc, spec.family)
        res["compile_report"] = pipe._compile_report
        t0 = time.perf_counter()
        run_call(pipe, spec, args, steps)
        res["warmup_with_compile_s"] = time.perf_counter() - t0
        res["compiled"], out = measure_reps(pipe, spec, args, steps)
        out = out.float().cpu()
        err = error_vs(out, ref)
        res["max_abs_err_vs_eager"], res["psnr_vs_eager_db"] = err["max_abs_err"], err["psnr_db"]
        res["output_finite"] = bool(torch.isfinite(ref).all() and torch.isfinite(out).all())
        res["speedup"] = res["compiled"]["its"] / res["eager"]["its"]
        if args["profile"]:
            res["profile_compiled"] = profile_table(pipe, spec, args)
            print(res["profile_compiled"])

        key = cache.cache_key(pipe, args["compile"], shape_dict(args))
        blob = cache.pack_artifact(key)
        if blob:
            cache.write_artifact(cache_dir, key, blob)
        res["artifact_bytes"] = len(blob) if blob else 0
    except Exception as e:  # keep the eager figures and the ablations
        import traceback
        res["compiled_error"] = traceback.format_exc()[-4000:]
        print(res["compiled_error"], file=sys.stderr)
    if sc.method != "none":  # the ablations below run without the step cache
        pipe.transformer.disable_cache()
    setattr(pipe, attr, None)  # free the compiled denoiser before the ablations
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    # extra variants (ablations) on fresh copies of the eager denoiser: it/s, and error and PSNR
    # against eager at the same (shorter) step count, so a lossy ablation states what it costs
    res["extra"] = {}
    extras = [m for m in args["extra"].split(",") if m]
    short = min(steps, 10)
    ref_short = ref
    if extras and short != steps:
        setattr(pipe, attr, copy.deepcopy(pristine).to(args["device"]))
        ref_short = run_call(pipe, spec, args, short)[0].float().cpu()
        setattr(pipe, attr, None)
    # "MODE[-nofuse][-nosdpa][-nogelu][-noshort][-nocross]": ablate QKV fusion / SDPA priority /
    # GELU epilogue / short-sequence attention kernel / short-key-set cross-attention kernel.
    # A mode named twice is measured twice (the repeat as "MODE#2", ...): arms alternated in one
    # process.
    off = {"-nofuse": "fuse_qkv", "-nosdpa": "sdpa_priority", "-nogelu": "fuse_gelu",
           "-noshort": "short_attention", "-nocross": "short_cross_attention"}
    for i, mode in enumerate(extras):
        name = mode if mode not in extras[:i] else f"{mode}#{extras[:i].count(mode) + 1}"
        opts = {**args["compile"], **{key: suffix not in mode for suffix, key in off.items()}}
        opts["mode"] = mode
        for suffix in off:
            opts["mode"] = opts["mode"].replace(suffix, "")
        torch._dynamo.reset()
        setattr(pipe, attr, copy.deepcopy(pristine).to(args["device"]))
        # The denoiser is a fresh eager copy: the pipeline may be compiled again. (compile_pipe
        # refuses a second, different compile of the same pipeline, whose transforms it cannot undo.)
        pipe._compile_options = None
        try:
            compile_pipe(pipe, opts)
            t0 = time.perf_counter()
            run_call(pipe, spec, args, short)
            first = time.perf_counter() - t0
            m, out = measure(pipe, spec, args, short)
            res["extra"][name] = dict(its=m["its"], first_call_s=first, speedup=m["its"] / res["eager"]["its"],
                                      peak_mem_gib=m["peak_mem_gib"], **error_vs(out, ref_short))
        except Exception as e:  # an ablation failing must not lose the rest of the run
            res["extra"][name] = dict(error=f"{type(e).__name__}: {e}"[:2000])
        setattr(pipe, attr, None)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # warm-up with cache: a second process on the filled directory
    if "compiled_error" in res:
        print(json.dumps(res, indent=1, default=str))
        if args["out"]:
            json.dump(res, open(args["out"], "w"), indent=2, default=str)
        return res
    t0 = time.perf_counter()
    res.update(cache_process(argv, cache_dir))
    res["cache_process_wall_s"] = time.perf_counter() - t0

    peak = res["matmul_tflops"]["bf16" if args["dtype"] == "bf16" else "fp16"] * 1e12
    for k in ("eager", "compiled"):
        res[k]["frac_of_matmul_peak"] = res["flops_per_step"] * res[k]["its"] / peak
    res["flops_per_step_tflop"] = res["flops_per_step"] / 1e12
    print(table(res))
    if args["out"]:
        with open(args["out"], "w") as f:
            json.dump(res, f, indent=2, default=str)
    return res


def cache_process(argv: list[str], cache_dir: str) -> dict:
    """Step 5: this benchmark again in a second process on the filled `cache_dir` (`child=`: it
    writes its result to a file of ours, removed after). Its result and warm-up time, or its
    error."""
    with tempfile.TemporaryDirectory(prefix="bench-child-") as d:
        child_out = os.path.join(d, "result.json")
        cmd = [sys.executable, "-m", "runner.bench.compiled", *argv, f"cache_dir={cache_dir}",
               f"child={child_out}"]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            return {"cache_process_error": p.stderr[-3000:]}
        with open(child_out) as f:
            result = json.load(f)
    return {"cache_process": result, "warmup_with_cache_s": result["warmup_with_cache_s"]}


def table(r: dict) -> str:
    e, c = r["eager"], r["compiled"]
    a = r["args"]
    shape = f"{a['height']}x{a['width']}" + (f", {a['frames']} frames" if a.get("frames") else "")
    lines = [f"**{a['model']} {shape}, {a['steps']} steps, batch {a['batch']}, {r['device']}**, "
             f"mode `{a['compile']['mode']}`, torch {r['versions']['torch']}, triton {r['versions']['triton']}, "
             f"diffusers {r['versions']['diffusers']}, {r['date']}",
             "",
             "| metric | eager | compiled |", "| --- | --- | --- |",
             f"| iteration speed (steps 2..N), median of {len(c.get('its_runs', [0]))} calls "
             f"| {e['its']:.2f} it/s | {c['its']:.2f} it/s ({r['speedup']:.2f}x) |",
             f"| E2E, one call | {e['e2e_s']:.2f} s | {c['e2e_s']:.2f} s |",
             f"| max memory (after warm-up) | {e['peak_mem_gib']:.2f} GiB | {c['peak_mem_gib']:.2f} GiB |",
             f"| warm-up (first call) | {r['eager_warmup_s']:.1f} s | {r['warmup_with_compile_s']:.1f} s with compilation |",
             f"| warm-up with cache (2nd process) | | {r.get('warmup_with_cache_s', float('nan')):.1f} s "
             f"(artifact hit: {r.get('cache_process', {}).get('artifact_hit')}; to the end of step 1 "
             f"{r.get('cache_process', {}).get('first_call_to_step1_s', float('nan')):.1f} s, steps 2..N "
             f"{r.get('cache_process', {}).get('first_call_steps_s', float('nan')):.1f} s) |",
             f"| fraction of measured matmul peak ({r['matmul_tflops']['fp16']:.0f} TFLOP/s fp16) "
             f"| {e['frac_of_matmul_peak']:.1%} | {c['frac_of_matmul_peak']:.1%} |",
             f"| error vs eager, same seed (output in [0,1]) | | max abs {r['max_abs_err_vs_eager']:.2e}, "
             f"PSNR {r['psnr_vs_eager_db']:.1f} dB |"]
    sc = r.get("step_cache_eager")
    if sc:   # a lossy variant: its error next to its speed-up
        lines.append(f"| step cache `{a['step_cache']['method']}` alone (eager; in the compiled "
                     f"column too) | | {sc['its']:.2f} it/s ({sc['speedup']:.2f}x), max abs "
                     f"{sc['max_abs_err']:.2e}, PSNR {sc['psnr_db']:.1f} dB, {sc['reused']} "
                     f"{'denoiser' if a['step_cache']['method'] == 'residual' else 'attention'} calls reused |")
    for mode, x in r.get("extra", {}).items():
        if "error" in x:
            lines.append(f"| ablation `{mode}` | | failed: {x['error'][:120]} |")
            continue
        lines.append(f"| ablation `{mode}` | | {x['its']:.2f} it/s ({x['speedup']:.2f}x), first call {x['first_call_s']:.1f} s, "
                     f"max abs {x['max_abs_err']:.2e}, PSNR {x['psnr_db']:.1f} dB |")
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
