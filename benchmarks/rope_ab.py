"""AnyFlow's rotary embedding, side by side in one process: `int8_attention.complex_rope` (fp32,
pointwise, fused by Inductor) against diffusers' `apply_rotary_emb` (complex128, eager kernels),
each on a fresh full-size AnyFlow 1.3B pipeline (random weights, fp16) compiled with O3, 4 steps
at 480x832 x 81 frames: median E2E and it/s of `reps` calls, the kernel table of one call, and the
two variants' outputs against each other. On the GPU machine, from the checkout root:

    source .devbundle/install.sh && python3 benchmarks/rope_ab.py [reps=5] [out=rope_ab.json]
    python3 benchmarks/rope_ab.py source=tiny device=cpu reps=1        # the logic, on a CPU
"""
import gc
import json
import sys

import torch

from compiler import compile_pipe
from compiler.kernels import int8_attention as ia
from runner.bench import compiled as bench


def _diffusers_rope(x, freqs):
    """What `_qkv_complex_rope` called before `complex_rope`: diffusers' own, on (B, N, H, D)."""
    from diffusers.models.transformers.transformer_anyflow import apply_rotary_emb
    return apply_rotary_emb(x, freqs)


def main(argv):
    kw = dict(a.split("=", 1) for a in argv)
    args = dict(model="anyflow_wan21_t2v_1_3b", source=kw.get("source", "random"), dtype="fp16",
                device=kw.get("device", "cuda"), height=None, width=None, frames=81, batch=1,
                seed=0, reps=int(kw.get("reps", 5)))      # source=tiny device=cpu: a smoke run
    ours = ia.complex_rope
    res, outs = {}, {}
    for name, rope in (("fp32 pointwise (complex_rope)", ours), ("complex128 (diffusers)", _diffusers_rope)):
        ia.complex_rope = rope        # `_qkv_complex_rope` reads the module's name at trace time
        torch._dynamo.reset()
        pipe, spec = bench.build(args)
        compile_pipe(pipe, "O3")
        bench.run_call(pipe, spec, args, 4)                  # compiles, captures the graphs
        m, out = bench.measure_reps(pipe, spec, args, 4)
        m["profile"] = bench.profile_table(pipe, spec, args, rows=12)
        print(f"{name}: E2E {m['e2e_s']:.3f} s, {m['its']:.3f} it/s (its {m['its_runs']}), "
              f"peak {m['peak_mem_gib']:.1f} GiB\n{m['profile']}", flush=True)
        res[name], outs[name] = m, out.float().cpu()
        del pipe, out
        gc.collect()
        torch.cuda.empty_cache()
    ia.complex_rope = ours
    (a, ra), (b, rb) = res.items()
    cmp = bench.error_vs(outs[a], outs[b])
    summary = dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                   torch=torch.__version__,
                   e2e_ratio=rb["e2e_s"] / ra["e2e_s"], its_ratio=ra["its"] / rb["its"],
                   outputs_against_each_other=cmp, variants=res)
    print(json.dumps({k: v for k, v in summary.items() if k != "variants"}, indent=1))
    if "out" in kw:
        with open(kw["out"], "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
