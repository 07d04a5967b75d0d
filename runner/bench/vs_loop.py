"""The runner against what users would run instead, side by side in one command on one GPU.

    python -m runner.bench.vs_loop job=pixart_batch model.source=random prompts=40 modes=none,O3 \
        [arms=loop,loop_compile,cachedit,job] [out=DIR] [key=value ...]

The same generated prompts (ids, seeds) go through:
  loop          a plain diffusers loop, eager: `pipe(prompt, generator=...)` then `.save()` (PIL PNG)
                or `export_to_video` per prompt, as the diffusers docs write it;
  loop_compile  the same loop after `pipe.<denoiser> = torch.compile(pipe.<denoiser>)`;
  cachedit      the peer stack users pip-install: the loop with cache-dit's DBCache as its docs
                recommend for speed, its first `Fn` blocks computed on every step (`FnB0`), Fn =
                the job's `step_cache.first_blocks`, so that both sides compute the same blocks on
                a reused step; but at least 1: cache-dit (1.5.3) refuses Fn_compute_blocks=0
                (`CachedContextManager.Fn_compute_blocks` asserts >= 1), so against the job's
                usual first_blocks=0 the peer computes one block more on each reused step (the
                rows' `first_blocks` column: the peer's Fn, the job's reuse arms' first_blocks;
                the table says so under it); a static
                step-computation mask with exactly the steps the job's `step_cache` schedule
                computes, `runner.serve.step_cache.plan`; Wan 2.2 A14B: each expert its slice, the
                second expert's first step computed, as the job does),
                `cache_dit.set_compile_configs()`, then `torch.compile(pipe.transformer)`; its
                outputs are compared with the `loop` arm's (its own no-reuse output, when that arm
                runs: PSNR per output). cache-dit is the
                optional `bench` extra, never a runtime dependency;
  cachedit_sage the same with cache-dit's `sage` attention backend (`cache_dit.set_attn_backend`:
                sageattention's INT8 QK kernels, the peer's 8-bit attention), compared with the
                `cachedit` arm's outputs (else the loop's). diffusers 0.42 refuses the backend below
                sageattention 2.1.1 (PyPI's last release is 1.0.6; 2.x builds from source): then
                the arm's row carries that error;
  job           `python -m runner` with each `compile.mode` of `modes` (its own process and
                local Ray, one worker on the GPU); `MODE+METHOD` (e.g. `O3+residual`) runs that
                mode with `step_cache.method=METHOD`, `+cfg` with `step_cache.cfg_reuse=fastercache`
                (the unconditional branch reused; `O3+residual+cfg`: both), and its outputs are
                compared with those of the mode without its last `+` part (else MODE alone, else
                the first mode): PSNR of each output's decoded frames, written to the job's
                `metrics/psnr_vs_<mode>.json` and summarised in the table.
Items/s are steady figures: a loop's from the end of its first item (warm-up, compilation) to
the end of its last; the job's once its worker serves (`steady_items_per_s` of summary.json).
`ready_s`: a loop's seconds from building the pipeline to its first item written; the job's
worker's load + warm-up. `computed_steps`: denoising steps computed in full per item (the rest
reuse), for the step-reuse arms; `computed_calls`: denoiser calls computed in full per item (two a
step with guidance: the conditional and the unconditional one), and `uncond_skipped` the
unconditional calls `+cfg` skips, both from the schedules (`runner.serve.step_cache.computed_calls`).
GPU busy is NVML's utilisation over the same windows (what nvidia-smi shows; the job's comes from
its worker's metrics); null on CPU. Other `key=value` arguments go to the job and decide the
loop's model and sizes too (`model.*`, `generation.*`). Arms run in the order `arms=` names them; each
finished arm's row is printed as a JSON line and `vs_loop.json` (under `out`) rewritten, so a
table cut short keeps its finished arms. Prints a markdown table at the end.
`lanes=2` (a machine with two GPUs) runs the job's arms on the first GPU and the loops' on the
second at the same time, as two child processes of this command: one table in about half the time.
`ends_items_per_s`: every arm's rate from its first output written to its last (the loops'
`items_per_s`; for the job, from results.parquet, next to its steady figure, which also counts the
first item's fill and the last write). A loop's `call_items_per_s` is its rate without the serial write (pipe calls only: outputs kept as
arrays), for a peer whose loop would not write files. `peak_mem_gb`: the GPU memory peak (torch's
allocator, weights included): a loop's over its whole run, the job's while serving.
`loop_warmup=N` (default 0: none): each loop first makes one untimed call of the first prompt at N
steps (the same shapes: torch.compile compiles every graph the timed calls run; a two-expert
model's both experts when N >= 2), not written; its rate then counts every item from the end of
that call, so one video (`prompts=1`) gives a steady figure: a long setting (MLPerf's 720P A14B
video) within one device call.
`images=auto|all|half|none`: which generated prompts carry an image (`auto`: all of them for a
model that takes one; `half`: every other row, for a model where it is optional: Wan 2.2 TI2V;
not with the cachedit arms, which cache the one pipeline object the rows call: TI2V's image rows
call its image-to-video pipeline, its text rows the text one).
An arm that fails is a row with its `error` (the table goes on with the next arm).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq

from ..io.outputs import format_table, write_json
from . import parse_args, release_gpu

ARMS = ("loop", "loop_compile", "cachedit", "cachedit_sage", "job")
# the loops' `mode` column; {fn}: the peer's Fn_compute_blocks (`peer_first_blocks`)
LOOPS = {"loop": "eager", "loop_compile": "torch.compile", "cachedit": "cache-dit F{fn}B0 + torch.compile",
         "cachedit_sage": "cache-dit F{fn}B0 + sage attention + torch.compile"}
PEER_MIN_FIRST_BLOCKS = 1   # cache-dit asserts Fn_compute_blocks >= 1 (module docstring)
IMAGES = ("auto", "all", "half", "none")


USAGE = (f"python -m runner.bench.vs_loop job=NAME [prompts=N] [modes=none,O3] "
         f"[arms={','.join(ARMS)}] [lanes=1|2] [images={'|'.join(IMAGES)}] [loop_warmup=STEPS] "
         f"[out=DIR] [key=value ...]")


def _args(argv: list[str]) -> tuple[dict, list[str]]:
    opts, rest = parse_args(argv, {"job": None, "prompts": "40", "modes": "none,O3",
                                   "arms": ",".join(ARMS), "out": "vs_loop",
                                   "lanes": "1", "record": "vs_loop.json", "images": "auto",
                                   "loop_warmup": "0"},
                           USAGE, passthrough=True)
    bad = set(opts["arms"].split(",")) - set(ARMS)
    if opts["lanes"] not in ("1", "2"):
        raise SystemExit(f"lanes={opts['lanes']!r}: 1 (every arm on one GPU, one after another) or 2 "
                         "(the job's arms on the first GPU, the loops' on the second, at once)")
    if opts["images"] not in IMAGES:
        raise SystemExit(f"images={opts['images']!r}: one of {', '.join(IMAGES)} (which prompts carry "
                         "an image; auto: all of them for a model that takes one)")
    if not opts["loop_warmup"].isdigit():
        raise SystemExit(f"loop_warmup={opts['loop_warmup']!r}: the steps of the loops' untimed first "
                         "call (0: none)")
    if not opts["job"] or bad:
        raise SystemExit(f"usage: {USAGE}" + (f"\nunknown arms {sorted(bad)}" if bad else ""))
    return opts, rest


def _write_prompts(out: str, n: int, images: str = "none") -> str:
    """`n` prompts; with `images` "all" each with its own drawn 640x480 still (a colour gradient
    per prompt) under out/images, in the `image` column (relative to the Parquet file); "half":
    every other row (the first has one), the rest none."""
    words = "cat dog robot castle river forest city ocean mountain flower".split()
    path = os.path.join(out, "prompts.parquet")
    cols = {"id": [f"v{i:05d}" for i in range(n)],
            "prompt": [f"a {words[i % 10]} and a {words[i * 7 % 10]}, photo {i}" for i in range(n)],
            "seed": list(range(n))}
    if images in ("all", "half"):
        cols["image"] = [_draw(out, i) if images == "all" or i % 2 == 0 else None for i in range(n)]
    pq.write_table(pa.table(cols), path)
    return path


def _draw(out: str, i: int) -> str:
    import numpy as np
    from PIL import Image
    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    y, x = np.mgrid[0:480, 0:640]
    rgb = np.stack([(x * (i + 1)) % 256, (y * 2 + 40 * i) % 256, (x + y + 17 * i) % 256], -1)
    Image.fromarray(rgb.astype(np.uint8)).save(os.path.join(out, "images", f"v{i:05d}.png"))
    return f"images/v{i:05d}.png"


def run_loop(job: dict, prompts: list[dict], out: str, arm: str, warmup_steps: int = 0) -> dict:
    """The ten-line script a user writes instead of the runner (`arm`: a key of LOOPS); with
    `warmup_steps`, after one untimed call of the first prompt at that many steps."""
    import torch
    from diffusers.utils import export_to_video

    from ..serve.models import build_pipeline
    from ..serve.timing import UtilSampler
    t0 = time.perf_counter()
    spec, g = job["model"].resolved(), job["generation"]
    cuda = spec.device.startswith("cuda")
    if cuda:   # (an earlier arm gave its memory back as it ended: `_arm`, below)
        torch.cuda.reset_peak_memory_stats()   # this arm's peak, not an earlier arm's
    peer = arm in ("cachedit", "cachedit_sage")
    on_i2v = peer and _peer_on_image_pipeline(spec.family, prompts)   # before any GPU time
    pipe = build_pipeline(spec)
    _fuse_adapters(pipe, spec)
    # image rows run the family's image-to-video pipeline over the same modules (TI2V), if any
    i2v = spec.family.image_pipeline(pipe) if spec.family.image_pipeline else pipe
    mask = (_cachedit(i2v if on_i2v else pipe, job["step_cache"], g.num_inference_steps)
            if peer else None)
    if arm == "cachedit_sage":
        _sage(pipe)
    if arm != "loop":
        names = ["unet"] if hasattr(pipe, "unet") else ["transformer", "transformer_2"]
        for name in names:          # a second expert (Wan 2.2 A14B) compiled as the first
            if getattr(pipe, name, None) is not None:
                setattr(pipe, name, torch.compile(getattr(pipe, name)))
                if i2v is not pipe:   # the image rows' pipeline calls the same compiled module
                    setattr(i2v, name, getattr(pipe, name))
    video = spec.family.kind == "video"
    extra = spec.family.call_args(pipe, g.num_frames if video else None)   # as the job calls it
    if g.guidance_scale <= 1 and "guidance_scale_2" in extra:   # no CFG on either expert, as
        extra["guidance_scale_2"] = 1.0                         # runner.serve.worker.generate
    if spec.family.image:   # image-to-video: the row's image, fitted as the job fits it
        from ..io import images
    os.makedirs(out, exist_ok=True)
    util = UtilSampler.start(cuda)
    ends, calls = [], []   # end of each item (written); seconds of each pipe call alone
    warmed = None          # the end of the untimed warm-up call, if any
    if warmup_steps and prompts and not (spec.family.image and prompts[0].get("image")):
        pipe(prompt=prompts[0]["prompt"], height=g.height, width=g.width,
             num_inference_steps=warmup_steps, guidance_scale=g.guidance_scale,
             generator=torch.Generator(spec.device).manual_seed(prompts[0]["seed"]), **extra)
        if cuda:
            torch.cuda.synchronize()
        warmed = time.perf_counter()
    for p in prompts:
        runner, kw = pipe, dict(extra)
        if spec.family.image and p.get("image"):
            with open(os.path.join(os.path.dirname(out), p["image"]), "rb") as f:
                runner, kw["image"] = i2v, images.fit(f.read(), g.width, g.height)
        t_call = time.perf_counter()
        gen = torch.Generator(spec.device).manual_seed(p["seed"])
        if hasattr(pipe.scheduler, "generators"):   # a distilled sampler re-noises from it
            pipe.scheduler.generators = [gen]
        result = runner(prompt=p["prompt"], height=g.height, width=g.width,
                        num_inference_steps=g.num_inference_steps, guidance_scale=g.guidance_scale,
                        generator=gen, **kw)
        calls.append(time.perf_counter() - t_call)
        if video:
            export_to_video(result.frames[0], os.path.join(out, f"{p['id']}.mp4"), fps=8)
        else:
            result.images[0].save(os.path.join(out, f"{p['id']}.png"))
        ends.append(time.perf_counter())
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None   # weights included
    pipe = runner = result = i2v = None   # noqa: F841  (the job's arm after this needs the memory)
    release_gpu()
    if warmed is not None and ends:   # every item counts, from the end of the warm-up call
        window, counted, timed = (warmed, ends[-1]), len(ends), calls
    else:
        window = (ends[0], ends[-1]) if len(ends) > 1 else None
        counted, timed = len(ends) - 1, calls[1:]
    rate = counted / (window[1] - window[0]) if window else None
    return dict(items=len(ends), ready_s=((warmed if warmed is not None else ends[0]) - t0
                                          if ends else None),
                items_per_s=rate, ends_items_per_s=rate, loop_warmup_steps=warmup_steps or None,
                gpu_util=util.mean(*window) if util and window else None,
                # the rate without the loop's serial write (outputs kept as arrays): pipe calls only
                call_items_per_s=len(timed) / sum(timed) if timed else None,
                computed_steps=sum(mask) if mask else None, peak_mem_gb=peak)


def _fuse_adapters(pipe, spec) -> None:
    """The job's LoRA adapters as a diffusers user fuses them: `load_lora_weights`, `fuse_lora`
    at the adapter's scale, `unload_lora_weights` (the fused weights stay)."""
    from ..serve.adapters import local_file
    for i, a in enumerate(spec.adapters):
        extra = {"load_into_transformer_2": True} if a.expert == "transformer_2" else {}
        pipe.load_lora_weights(local_file(a), adapter_name=f"a{i}", **extra)
        pipe.fuse_lora(components=[a.expert], lora_scale=a.scale, adapter_names=[f"a{i}"])
        pipe.unload_lora_weights()


def _peer_on_image_pipeline(family, prompts: list[dict]) -> bool:
    """Whether cache-dit goes on the family's `image_pipeline` (TI2V's own WanImageToVideoPipeline
    over the same modules, which the loop calls for image rows) rather than on the pipeline.
    cache-dit keeps its cache context on the pipeline object it was enabled on; a call on another
    runs every step in full ("Cache context not exist ... skip cache"), so with two pipelines the
    rows must be all image rows or none."""
    with_image = {bool(p.get("image")) for p in prompts}
    if family.image_pipeline is None or with_image == {False}:
        return False
    if with_image == {True}:
        return True
    raise ValueError(f"the cachedit arms cache one pipeline object, and {family.name}'s image rows "
                     "run another (its image-to-video pipeline): give rows all with an image or "
                     "all without (images=all or images=none), not images=half")


def _sage(pipe) -> None:
    """cache-dit's `sage` attention backend on every denoiser of `pipe` (sageattention's Triton
    INT8 QK / FP16 PV kernels), as cache-dit's examples set it (`--attn sage`)."""
    import cache_dit
    for name in ("transformer", "transformer_2"):
        if getattr(pipe, name, None) is not None:
            cache_dit.set_attn_backend(getattr(pipe, name), attention_backend="sage")


def reuse_plan(sc, steps: int) -> tuple[bool, ...]:
    """The steps the job's `residual` schedule computes (`sc`: the job's step_cache section, its
    method aside): what the job's `+residual` arms run and the cachedit arm's mask."""
    import dataclasses

    from ..serve.step_cache import plan
    return plan(steps, dataclasses.replace(sc, method="residual"))


def expert_split(pipe, steps: int) -> int | None:
    """The first step a two-expert pipeline (Wan 2.2 A14B) runs on `transformer_2`, as diffusers'
    WanPipeline decides it: the first timestep < boundary_ratio * num_train_timesteps (None: one
    denoiser for every step)."""
    import copy
    ratio = getattr(pipe.config, "boundary_ratio", None)
    if getattr(pipe, "transformer_2", None) is None or ratio is None:
        return None
    sched = copy.deepcopy(pipe.scheduler)      # the pipeline's own is set again by its call
    sched.set_timesteps(steps, device="cpu")
    bound = ratio * sched.config.num_train_timesteps
    return next((i for i, t in enumerate(sched.timesteps) if t < bound), steps)


def peer_first_blocks(sc) -> int:
    """The peer's Fn_compute_blocks: the job's `step_cache.first_blocks` (`sc`: its step_cache
    section), at least the 1 cache-dit accepts."""
    return max(PEER_MIN_FIRST_BLOCKS, sc.first_blocks)


def peer_cache_config(sc, part: list[int]) -> dict:
    """The keyword arguments of the peer's `cache_dit.DBCacheConfig` for the steps `part` (1 =
    computed): FnB0 (`peer_first_blocks`), a static mask."""
    return dict(Fn_compute_blocks=peer_first_blocks(sc), Bn_compute_blocks=0,
                num_inference_steps=len(part), steps_computation_mask=part,
                steps_computation_policy="static")


def _cachedit(pipe, sc, steps: int) -> list[int]:
    """cache-dit's DBCache on `pipe` as its docs recommend for speed: FnB0 (`peer_cache_config`),
    a static mask of the steps the job's schedule computes. Returns the mask over the pipeline
    call's steps (1 = computed). Two experts (Wan 2.2 A14B): cache-dit keeps a context per expert that counts that
    expert's own calls from 0, so each gets its slice of the mask (`ParamsModifier`), and the
    second's first step is computed, as the job computes it (`runner.serve.step_cache.Scheduled`: an
    expert's first call has nothing of its own to reuse)."""
    import cache_dit
    from cache_dit import DBCacheConfig, ParamsModifier
    mask = [int(c) for c in reuse_plan(sc, steps)]
    k = expert_split(pipe, steps)

    def config(part):
        return DBCacheConfig(**peer_cache_config(sc, part))
    if k is None or not 0 < k < steps:      # one denoiser runs every step: the whole mask
        cache_dit.enable_cache(pipe, cache_config=config(mask))
    else:
        mask[k] = 1
        cache_dit.enable_cache(pipe, cache_config=config(mask), params_modifiers=[
            ParamsModifier(cache_config=config(mask[:k])),
            ParamsModifier(cache_config=config(mask[k:]))])
    cache_dit.set_compile_configs()
    return mask


def _arm(fn, *args) -> dict:
    """One arm's figures, or its error: a failed arm (a peer's backend that will not run, an OOM)
    is a row of the table, and the next arm still runs."""
    try:
        return fn(*args)
    except (Exception, SystemExit) as e:
        msg = f"{type(e).__name__}: {e}"
        print(f"arm failed: {msg[-3000:]}", file=sys.stderr, flush=True)
        row = dict(items=0, items_per_s=None, error=msg[-2000:])
    release_gpu()   # here, not in the except block: its traceback still held the arm's pipeline
    return row


def _job_name(mode: str) -> str:
    return f"job-{mode.replace(':', '_').replace('+', '-')}"


def mode_args(mode: str) -> list[str]:
    """A job arm's `MODE[+METHOD][+cfg]` as the job's arguments."""
    mode, *parts = mode.split("+")
    return [f"compile.mode={mode}", *("step_cache.cfg_reuse=fastercache" if p == "cfg"
                                      else f"step_cache.method={p}" for p in parts)]


def mode_reference(mode: str, modes: list[str]) -> str:
    """The arm a `+` mode's outputs are compared with: the mode without its last `+` part if it
    runs (`O3+residual+cfg` against `O3+residual`), else the mode alone, else the first."""
    for ref in (mode.rpartition("+")[0], mode.partition("+")[0]):
        if ref in modes:
            return ref
    return modes[0]


def mode_calls(sc, mode: str, steps: int, two_calls: bool) -> dict:
    """`computed_steps`, `computed_calls` and `uncond_skipped` of a job arm (None without step
    reuse): the job's step_cache section with the arm's `+` parts. `two_calls`: the pipeline runs
    the guidance branches as two denoiser calls a step (else one call a step)."""
    import dataclasses

    from ..serve.step_cache import computed_calls
    parts = mode.split("+")[1:]
    if not parts:
        return dict(computed_steps=None, computed_calls=None, uncond_skipped=None)
    methods = [p for p in parts if p != "cfg"]
    sc = dataclasses.replace(sc, method=methods[-1] if methods else "none",
                             cfg_reuse="fastercache" if "cfg" in parts else "none")
    c = computed_calls(steps, sc)
    return dict(computed_steps=c["cond"] if sc.method == "residual" else None,
                computed_calls=c["cond"] + c["uncond"] if two_calls else c["cond"],
                uncond_skipped=c["uncond_skipped"] if two_calls else None)


def _relay(cmd: list[str], env: dict, prefix: str) -> subprocess.CompletedProcess:
    """Run `cmd`, its output (stdout and stderr as one stream) relayed line by line to our stderr
    as it comes, so that a bench cut at its time limit still shows how far the job got (its
    phases and progress lines); returns its exit status and the whole text (`.text`)."""
    lines = []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, bufsize=1) as p:
        for line in p.stdout:
            lines.append(line)
            print(prefix + line, end="", file=sys.stderr, flush=True)
    done = subprocess.CompletedProcess(cmd, p.returncode)
    done.text = "".join(lines)
    return done


def run_job(opts: dict, rest: list[str], prompts: str, mode: str) -> dict:
    name = _job_name(mode)
    cmd = [sys.executable, "-m", "runner", f"job={opts['job']}", f"prompts.path={prompts}",
           f"output.dir={opts['out']}", f"job.name={name}", "ray.num_workers=1",
           f"compile.cache_dir={opts['out']}/cache-{name}", "output.overwrite=true", *rest,
           *mode_args(mode)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}   # always its own local Ray
    log = _relay(cmd, env, prefix=f"[{name}] ")
    if log.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({log.returncode}):\n{log.text[-3000:]}")
    job_dir = os.path.join(opts["out"], name)
    s = json.load(open(os.path.join(job_dir, "summary.json")))
    ms = [json.load(open(p)) for p in glob.glob(os.path.join(job_dir, "metrics", "*.json"))]
    m = ms[0] if ms else {}
    rows = pq.read_table(os.path.join(job_dir, "results.parquet")).to_pylist()
    ends = sorted(r["started_at"] + r["e2e_s"] for r in rows if r.get("e2e_s"))   # each written
    return dict(items=s["ok"], items_per_s=s.get("steady_items_per_s") or s["items_per_s"],
                # as the loops' figure: from the first output written to the last
                ends_items_per_s=(len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) > 1 else None,
                ready_s=(m["model_load_s"] + m["warmup_s"]) if "warmup_s" in m else None,
                # Dynamo's recompile warnings in the job's log (there should be none)
                recompiles=log.text.count("torch._dynamo hit config.recompile_limit")
                + log.text.count("Recompiling function"),
                gpu_util=ms[0].get("gpu_util") if ms else None,
                it_s=m.get("steady_it_s"),   # denoising steps/s (the worker's steady figure)
                gpu_ms_per_item=m.get("gpu_ms_per_item"), peak_mem_gb=m.get("peak_mem_gb"),
                startup_peak_mem_gb=m.get("startup_peak_mem_gb"),
                time_s=ms[0].get("time_s") if ms else None)


def _frames(path: str):
    import imageio.v3 as iio
    import numpy as np
    return np.asarray(iio.imread(path, index=None) if path.endswith(".mp4") else iio.imread(path))


def psnr(a, b) -> float:
    """PSNR in dB of two uint8 arrays (inf when equal)."""
    import numpy as np
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def compare_outputs(out: str, mode: str, ref: str) -> dict:
    """PSNR of each output of job `mode` against job `ref`'s output of the same id (decoded mp4
    frames: the H.264 encoding at crf 18 adds its own error to both), written to the job's
    metrics directory; returns the median and the worst."""
    a_dir, b_dir = (os.path.join(out, _job_name(m), "media") for m in (mode, ref))
    res = compare_dirs(a_dir, b_dir, os.path.join(out, _job_name(mode), "metrics",
                                                  f"psnr_vs_{_job_name(ref)}.json"), ref)
    return dict(res, psnr_ref=ref)


def compare_dirs(a_dir: str, b_dir: str, record: str, ref: str) -> dict:
    """PSNR of each file of `a_dir` against the file of the same name in `b_dir`, written to
    `record` (JSON); the median and the worst."""
    import numpy as np
    per = {f: psnr(_frames(os.path.join(a_dir, f)), _frames(os.path.join(b_dir, f)))
           for f in sorted(os.listdir(a_dir)) if os.path.exists(os.path.join(b_dir, f))}
    write_json(record, dict(reference=ref, psnr_db=per))
    vals = list(per.values())
    return dict(psnr_median_db=float(np.median(vals)) if vals else None,
                psnr_min_db=min(vals) if vals else None)


def _compare(out: str, rows: list[dict], arms: list[str], modes: list[str]) -> None:
    """The PSNRs whose two sides have finished and are not yet in the rows (called after each arm,
    so a table cut short by a time limit keeps them): cache-dit against its own no-reuse output (the
    eager loop); each job mode with step reuse against the same mode without it (else the first)."""
    done = {(r["arm"], r["mode"]): r for r in rows if r.get("items")}
    ran = {r["arm"] for r in rows if r.get("items")}
    for arm, refs in (("cachedit", ("loop",)), ("cachedit_sage", ("cachedit", "loop"))):
        cd = next((r for r in rows if r["arm"] == arm and r.get("items")), None)
        ref = next((a for a in refs if a in ran), None)
        if cd and ref and "psnr_ref" not in cd:
            cd.update(psnr_ref=ref, **compare_dirs(
                os.path.join(out, arm), os.path.join(out, ref),
                os.path.join(out, f"psnr_{arm}_vs_{ref}.json"), ref))
    for r in rows:
        ref = mode_reference(r["mode"], modes)
        if (r["arm"] == "job" and r.get("items") and "+" in r["mode"] and ref != r["mode"]
                and "psnr_ref" not in r
                and ("job", ref) in done):
            r.update(compare_outputs(out, r["mode"], ref))


def _two_lanes(argv: list[str], out: str, arms: list[str]) -> list[dict]:
    """`lanes=2`: this command's arms as two child processes at once, the job's on the first GPU
    this process may use and the loops' on the second (each arm alone on its GPU; they share the
    host); their rows, in the order `arms=` names them (the PSNRs are the parent's)."""
    import torch
    if torch.cuda.device_count() < 2:
        raise SystemExit(f"lanes=2 needs two GPUs, this machine has {torch.cuda.device_count()}: "
                         "leave lanes out (one GPU, one arm after another)")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",")] if visible else ["0", "1"]
    lanes = [[a for a in arms if a == "job"], [a for a in arms if a != "job"]]
    procs = []
    for gpu, lane in zip(ids, lanes):
        if lane:
            cmd = [sys.executable, "-m", "runner.bench.vs_loop",
                   *[a for a in argv if not a.startswith(("arms=", "lanes=", "record="))],
                   f"arms={','.join(lane)}", f"record=lane-{lane[0]}.json"]
            print("$", f"CUDA_VISIBLE_DEVICES={gpu}", *cmd, flush=True)
            procs.append((lane, subprocess.Popen(cmd, env={**os.environ, "CUDA_VISIBLE_DEVICES": gpu})))
    status = [(lane, p.wait()) for lane, p in procs]
    failed = [f"{','.join(lane)}: exit status {rc}" for lane, rc in status if rc != 0]
    rows = [r for lane, _ in procs if os.path.exists(os.path.join(out, f"lane-{lane[0]}.json"))
            for r in json.load(open(os.path.join(out, f"lane-{lane[0]}.json")))["rows"]]
    if failed:
        print("lanes failed (their finished arms are kept):", "; ".join(failed), flush=True)
    order = {a: i for i, a in enumerate(dict.fromkeys(arms))}
    return sorted(rows, key=lambda r: order[r["arm"]])   # stable: the job's modes keep their order


def main(argv: list[str]) -> list[dict]:
    from omegaconf import OmegaConf

    from ..config import load_config, split
    opts, rest = _args(argv)
    os.makedirs(opts["out"], exist_ok=True)
    # The job's config decides the loop's model and sizes; its prompts are the generated ones.
    cfg = load_config([f"job={opts['job']}", *rest, "prompts.path=generated"])
    job = split(cfg)
    path = os.path.join(opts["out"], "prompts.parquet")
    if opts["record"] == "vs_loop.json" or not os.path.exists(path):   # a lane's parent wrote them
        images = opts["images"] if opts["images"] != "auto" else (
            "all" if job["model"].family.image else "none")
        path = _write_prompts(opts["out"], int(opts["prompts"]), images=images)
    prompts = pq.read_table(path).to_pylist()
    arms = opts["arms"].split(",")
    rows = []

    def done(row: dict) -> None:
        """Each arm's row as it finishes (a log line and vs_loop.json so far): a table cut short
        keeps its finished arms."""
        rows.append(row)
        _compare(opts["out"], rows, arms, modes)   # PSNRs as soon as both sides exist
        print(json.dumps(row, default=str), flush=True)
        write_json(os.path.join(opts["out"], opts["record"]), dict(argv=argv, rows=rows, partial=True))

    modes = opts["modes"].split(",")
    steps = job["generation"].num_inference_steps
    two_calls = job["model"].family.cfg_calls and job["generation"].guidance_scale > 1
    if opts["lanes"] == "2":
        for row in _two_lanes(argv, opts["out"], arms):
            done(row)
        arms = []
    sc = job["step_cache"]
    for arm in dict.fromkeys(arms):   # in the order given (a table cut short keeps the first)
        if arm in LOOPS:
            done(dict(arm=arm, mode=loop_label(arm, sc), first_blocks=arm_first_blocks(arm, sc),
                      **_arm(run_loop, job, prompts, os.path.join(opts["out"], arm), arm,
                             *([int(opts["loop_warmup"])] if int(opts["loop_warmup"]) else []))))
        for mode in modes if arm == "job" else ():
            done(dict(arm="job", mode=mode, first_blocks=arm_first_blocks("job", sc, mode),
                      **_arm(run_job, opts, rest, path, mode),
                      **mode_calls(sc, mode, steps, two_calls)))
    base = {r["arm"]: r["items_per_s"] for r in rows if r["arm"] != "job"}
    for r in rows:
        for arm, rate in base.items():
            r[f"x_{arm}"] = r["items_per_s"] / rate if rate and r["items_per_s"] else None
    # the faster peer at its rate without the serial file write (outputs kept as arrays)
    peer = max((r["call_items_per_s"] for r in rows if r["arm"].startswith("cachedit")
                and r.get("call_items_per_s")), default=None)
    for r in rows:
        r["x_peer_calls"] = r["items_per_s"] / peer if peer and r["items_per_s"] else None
    jobs = {r["mode"]: r["items_per_s"] for r in rows if r["arm"] == "job"}
    for r in rows:   # step reuse: the speed-up over the arm its outputs are compared with
        plain = (jobs.get(mode_reference(r["mode"], list(jobs)))
                 if r["arm"] == "job" and "+" in r["mode"] else None)
        r["x_same_mode"] = r["items_per_s"] / plain if plain and r["items_per_s"] else None
    write_json(os.path.join(opts["out"], "vs_loop.json"),
               dict(argv=argv, config=OmegaConf.to_container(cfg), rows=rows))
    print(format_table(rows, ["arm", "mode", "items", "items_per_s", "ends_items_per_s", "call_items_per_s", "it_s", "ready_s", "recompiles",
                              "gpu_util", "computed_steps", "computed_calls", "first_blocks",
                              *[f"x_{a}" for a in base],
                              "x_same_mode", "x_peer_calls", "psnr_ref", "psnr_median_db", "psnr_min_db", "peak_mem_gb", "error"]))
    note = first_blocks_note(rows)
    if note:
        print(note)
    return rows


def loop_label(arm: str, sc) -> str:
    """A loop arm's `mode` column: LOOPS's, the peer's Fn filled in."""
    return LOOPS[arm].format(fn=peer_first_blocks(sc))


def arm_first_blocks(arm: str, sc, mode: str = "") -> int | None:
    """The blocks an arm computes on every step, reused ones included: the peer's Fn for the
    cachedit arms, the job's `step_cache.first_blocks` for a job arm that reuses steps with the
    residual method (`+residual`, or `step_cache.method=residual` given); None for the others."""
    if arm.startswith("cachedit"):
        return peer_first_blocks(sc)
    if arm == "job" and ("residual" in mode.split("+")[1:] or sc.method == "residual"):
        return sc.first_blocks
    return None


def first_blocks_note(rows: list[dict]) -> str | None:
    """A line under the table where the peer computes more leading blocks on a reused step than
    the job's reuse arms (cache-dit's floor of 1 against first_blocks=0), else None."""
    peer = {r["first_blocks"] for r in rows if r["arm"].startswith("cachedit")
            and r.get("first_blocks") is not None}
    job = {r["first_blocks"] for r in rows if r["arm"] == "job" and r.get("first_blocks") is not None}
    if not peer or not job or peer == job:
        return None
    return (f"first_blocks: the peer computes its first {'/'.join(map(str, sorted(peer)))} blocks on "
            f"every step, the job's reuse arms {'/'.join(map(str, sorted(job)))}: cache-dit refuses "
            f"Fn_compute_blocks < {PEER_MIN_FIRST_BLOCKS}, so the peer computes "
            f"{max(peer) - min(job)} block(s) more on each reused step")


if __name__ == "__main__":
    main(sys.argv[1:])
