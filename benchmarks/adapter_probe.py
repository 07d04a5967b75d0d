"""Where a full-size 14B adapter load and a random A14B build spend their seconds (CUDA):

    python3 benchmarks/adapter_probe.py [out=DIR]

Times (CUDA-synchronised) and cProfile's top functions for: building the 14B denoiser, a random
rank-64 adapter file in LightX2V's layout, diffusers' `load_lora_weights` + `unload_lora_weights`,
`runner.adapters.fuse`, `runner.models.build_pipeline` of the A14B Lightning preset (random
weights) and two adapters fused into its experts. Written to DIR/adapter_probe.txt (default: stdout only)."""
import cProfile
import io
import pstats
import sys
import tempfile
import time

import torch

sys.path.insert(0, "tests")


def timed(label, fn, log, prof=True):
    torch.cuda.synchronize()
    p = cProfile.Profile() if prof else None
    t = time.perf_counter()
    if p:
        p.enable()
    out = fn()
    torch.cuda.synchronize()
    if p:
        p.disable()
    dt = time.perf_counter() - t
    log.write(f"== {label}: {dt:.2f} s\n")
    if p:
        s = io.StringIO()
        pstats.Stats(p, stream=s).sort_stats("cumulative").print_stats(22)
        log.write("\n".join(s.getvalue().splitlines()[6:]) + "\n")
        s = io.StringIO()
        pstats.Stats(p, stream=s).sort_stats("tottime").print_stats(12)
        log.write("\n".join(s.getvalue().splitlines()[6:]) + "\n")
    print(f"{label}: {dt:.2f} s", flush=True)
    return out


def main():
    from safetensors.torch import save_file

    from runner import adapters
    from runner.config import ModelSpec
    from runner.families.wan import random_adapter
    from runner.models import build_pipeline
    from test_gpu_adapters import _denoiser, _pipe
    out = dict(a.split("=", 1) for a in sys.argv[1:]).get("out")
    log = io.StringIO()
    tmp = tempfile.mkdtemp()
    model = timed("build 14B denoiser", lambda: _denoiser("wan21_t2v_14b"), log)
    f = f"{tmp}/a.safetensors"
    timed("random adapter + save_file", lambda: save_file(
        random_adapter(model, "original", rank=64, seed=0, device="cuda"), f), log)
    pipe = _pipe(model)
    timed("load_lora_weights", lambda: pipe.load_lora_weights(f, adapter_name="ref"), log)
    timed("unload_lora_weights", pipe.unload_lora_weights, log)
    timed("adapters.fuse", lambda: adapters.fuse(pipe, (adapters.Adapter(path=f),)), log)
    del pipe, model
    torch.cuda.empty_cache()
    spec = ModelSpec("wan22_t2v_a14b_lightning", source="random", device="cuda")
    pipe = timed("build_pipeline A14B lightning random", lambda: build_pipeline(spec), log)
    fs = [f"{tmp}/{e}.safetensors" for e in ("transformer", "transformer_2")]
    for k, e in enumerate(("transformer", "transformer_2")):
        save_file(random_adapter(getattr(pipe, e), "original", rank=64, seed=k, device="cuda"),
                  fs[k])
    two = (adapters.Adapter(path=fs[0]), adapters.Adapter(path=fs[1], expert="transformer_2"))
    timed("adapters.fuse A14B, 2 adapters",
          lambda: adapters.fuse(pipe, two, diffs=spec.family.lora_diffs), log)
    if out:
        with open(f"{out}/adapter_probe.txt", "w") as fh:
            fh.write(log.getvalue())
    else:
        print(log.getvalue())


if __name__ == "__main__":
    main()
