"""q and k's RMS norm + rotary embedding as one Triton pass each (`compiler.kernels.qk_norm`, through
`int8_attention.fused_norm_rope`) against Inductor's own kernels for them, side by side in one
process: each variant on a fresh full-size pipeline (random weights, fp16) compiled with O3, 4 steps
at 480x832 x 81 frames, guidance as the preset has it: median E2E and it/s of `reps` calls, the
kernel table of one call, and the two variants' outputs against each other. On the GPU machine,
from the checkout root:

    source .devbundle/install.sh && python3 benchmarks/qknorm_ab.py [model=anyflow_wan21_t2v_1_3b] [reps=5] [out=ab.json]
    python3 benchmarks/qknorm_ab.py source=tiny device=cpu reps=1        # the logic, on a CPU
"""
import gc
import json
import sys

import torch

from compiler import compile_pipe
from compiler.kernels import int8_attention as ia
from runner.bench import compiled as bench


def main(argv):
    kw = dict(a.split("=", 1) for a in argv)
    args = dict(model=kw.get("model", "anyflow_wan21_t2v_1_3b"), source=kw.get("source", "random"),
                dtype="fp16", device=kw.get("device", "cuda"), height=None, width=None, frames=81,
                batch=1, seed=0, reps=int(kw.get("reps", 5)))
    ours = ia.fused_norm_rope
    res, outs = {}, {}
    for name, hook in (("qk_norm_rope (one Triton pass)", ours), ("Inductor (before)", lambda *a: None)):
        ia.fused_norm_rope = hook     # the q/k/v functions read the module's name at trace time
        torch._dynamo.reset()
        pipe, spec = bench.build(args)
        compile_pipe(pipe, "O3")
        bench.run_call(pipe, spec, args, 4)                  # compiles, captures the graphs
        m, out = bench.measure_reps(pipe, spec, args, 4)
        m["profile"] = bench.profile_table(pipe, spec, args, rows=16)
        print(f"{name}: E2E {m['e2e_s']:.3f} s, {m['its']:.3f} it/s (its {m['its_runs']}), "
              f"peak {m['peak_mem_gib']:.1f} GiB\n{m['profile']}", flush=True)
        res[name], outs[name] = m, out.float().cpu()
        del pipe, out
        gc.collect()
        torch.cuda.empty_cache()
    ia.fused_norm_rope = ours
    (a, ra), (b, rb) = res.items()
    summary = dict(model=args["model"],
                   device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                   torch=torch.__version__,
                   e2e_ratio=rb["e2e_s"] / ra["e2e_s"], its_ratio=ra["its"] / rb["its"],
                   outputs_against_each_other=bench.error_vs(outs[a], outs[b]), variants=res)
    print(json.dumps({k: v for k, v in summary.items() if k != "variants"}, indent=1))
    if "out" in kw:
        with open(kw["out"], "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
