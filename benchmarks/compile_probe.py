"""Where a compiled Wan VAE decode's first call spends its seconds (compile phases, graph count).
    python benchmarks/compile_probe.py wan22|wan21_720p|wan21_480p_33
Diagnostic for the gpu suite's compile cost; prints one JSON line."""
import json
import os
import sys
import time

import torch
import compiler
from compiler.pipeline import _compile_vae
from runner.families import PRESETS
from torch._dynamo.utils import compile_times, counters
import torch._inductor.config as ic

which = sys.argv[1]
shapes = {"wan22": (48, 31, 44, 80), "wan21_720p": (16, 21, 90, 160), "wan21_480p_33": (16, 9, 60, 104)}
with torch.device("cuda"):
    if which == "wan22":
        vae = PRESETS["wan22_ti2v_5b"].video_vae(False)
    else:
        from diffusers import AutoencoderKLWan
        vae = AutoencoderKLWan()
vae = vae.to(torch.float16).eval()
z = torch.randn(1, *shapes[which], device="cuda", dtype=torch.float16)
torch._dynamo.config.recompile_limit = 64
opts = compiler.parse_options("O2")
counts = _compile_vae(vae, opts, compiler.compile_kwargs(opts, denoiser=False), "cuda")
t = []                  # the first call compiles; the second is the steady call
with torch.no_grad():
    for _ in range(2):
        t0 = time.perf_counter()
        vae.decode(z)
        torch.cuda.synchronize()
        t.append(time.perf_counter() - t0)
print(json.dumps(dict(which=which, compile_threads=ic.compile_threads, cpus=len(os.sched_getaffinity(0)),
                      counts=counts, first_s=round(t[0], 1), second_s=round(t[1], 2),
                      stats=dict(counters["stats"]), inductor=dict(counters["inductor"]))))
print(compile_times(repr="str", aggregate=True))
