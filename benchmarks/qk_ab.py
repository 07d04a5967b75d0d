"""How the compiler makes a Wan / AnyFlow self-attention's q and k, variants side by side in one process:
each variant on a fresh full-size pipeline (random weights, fp16) compiled with O3, 4 steps at
480x832 x 81 frames, guidance as the preset has it: median E2E and it/s of `reps` calls, the kernel
table of one call, and every variant's output against the first one's. On the GPU machine, from the
checkout root:

    source .devbundle/install.sh && python3 benchmarks/qk_ab.py [model=anyflow_wan21_t2v_1_3b] \
        [variants=fused,inductor] [reps=5] [out=ab.json]
    python3 benchmarks/qk_ab.py source=tiny device=cpu reps=1        # the logic, on a CPU

Variants (`compiler/kernels/int8_attention.py`'s q/k/v functions read these names at trace time):
  fused       as the compiler makes them: the norms + rotary embedding in one Triton pass each
              (`fused_norm_rope` -> `compiler.kernels.qk_norm`);
  inductor    `fused_norm_rope` off: the modules' norms, then the rotation (`complex_rope` in fp32
              for AnyFlow, `_rope` for Wan), compiled by Inductor (the path before 33127ab);
  complex128  AnyFlow only: `inductor` with diffusers' own `apply_rotary_emb` (complex128, eager
              kernels: the path before 0b6d862).
  quant_old   `fused` with the int8 attention's quantisation before 2026-11-28
              (`compiler.bench.quant8_probe.old_quantize`: K's mean and V's |max| by torch).
Ratios are the last variant's time over each variant's (> 1: faster than the last).
"""
import gc
import json
import sys

import torch

from compiler import compile_pipe
from compiler.bench.quant8_probe import old_quantize
from compiler.kernels import int8_attention as ia
from runner.bench import compiled as bench


def _diffusers_rope(x, freqs):
    """diffusers' AnyFlow `apply_rotary_emb` on (B, N, H, D) with freqs (1, N, 1, D/2)."""
    from diffusers.models.transformers.transformer_anyflow import apply_rotary_emb
    return apply_rotary_emb(x, freqs)


VARIANTS = {"fused": {}, "inductor": {"fused_norm_rope": lambda *a: None},
            "complex128": {"fused_norm_rope": lambda *a: None, "complex_rope": _diffusers_rope},
            "quant_old": {"quantize": old_quantize}}


def main(argv):
    kw = dict(a.split("=", 1) for a in argv)
    args = dict(model=kw.get("model", "anyflow_wan21_t2v_1_3b"), source=kw.get("source", "random"),
                dtype="fp16", device=kw.get("device", "cuda"), height=None, width=None, frames=81,
                batch=1, seed=0, reps=int(kw.get("reps", 5)))
    names = kw.get("variants", "fused,inductor").split(",")
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown variants {bad}; choose from {list(VARIANTS)}")
    saved = {k: getattr(ia, k) for k in set().union(*VARIANTS.values())}   # what any variant replaces
    res, outs = {}, {}
    for name in names:
        for k, v in {**saved, **VARIANTS[name]}.items():
            setattr(ia, k, v)
        torch._dynamo.reset()
        pipe, spec = bench.build(args)
        compile_pipe(pipe, "O3")
        bench.run_call(pipe, spec, args, 4)                  # compiles, captures the graphs
        m, out = bench.measure_reps(pipe, spec, args, 4)
        m["profile"] = bench.profile_table(pipe, spec, args, rows=40)
        print(f"{name}: E2E {m['e2e_s']:.3f} s, {m['its']:.3f} it/s (its {m['its_runs']}), "
              f"peak {m['peak_mem_gib']:.1f} GiB\n{m['profile']}", flush=True)
        res[name], outs[name] = m, out.float().cpu()
        del pipe, out
        gc.collect()
        torch.cuda.empty_cache()
    for k, v in saved.items():
        setattr(ia, k, v)
    last = res[names[-1]]
    summary = dict(model=args["model"],
                   device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                   torch=torch.__version__,
                   e2e_ratio={n: last["e2e_s"] / r["e2e_s"] for n, r in res.items()},
                   its_ratio={n: r["its"] / last["its"] for n, r in res.items()},
                   outputs_against_the_first={n: bench.error_vs(outs[n], outs[names[0]]) for n in names[1:]},
                   variants=res)
    print(json.dumps({k: v for k, v in summary.items() if k != "variants"}, indent=1))
    if "out" in kw:
        with open(kw["out"], "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
