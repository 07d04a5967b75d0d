"""`python -m runner.bench.lora`: a random LoRA adapter for a preset's denoiser, in a published layout.

    python -m runner.bench.lora preset=PRESET out=FILE.safetensors [layout=original|kohya|diffusers]
        [rank=64] [source=random|tiny] [seed=0] [expert=transformer] [diffs=false|true]
        [device=auto|cpu|cuda]

No adapter weights can be downloaded here, and the compute of a fused adapter does not depend on its
values: benchmarks and tests use one of the published rank and key layout with random values
(the family's `random_adapter`: Wan's original layout is LightX2V's, `diffusion_model.blocks.N.
self_attn.q.lora_down.weight`). `diffs=true` (Wan, original layout) adds the full differences of
LightX2V's extracted LoRAs (`.diff`, `.diff_b`, `diff_m` of every other parameter, the 14B's
embedding Linears as pairs), as its distilled LoRAs carry them. The denoiser is built on the meta
device (no memory). The values are drawn on `device` (auto: a GPU where there is one: a 14B's
292 M values in milliseconds, where a CPU takes seconds; a seed gives other values there).
"""

from __future__ import annotations

import sys

USAGE = " ".join(line.strip() for line in __doc__.splitlines()[2:5])


def main(argv: list[str]) -> None:
    import torch
    from safetensors.torch import save_file

    from ..config import ModelSpec
    from . import parse_args
    args, _ = parse_args(argv, dict(preset="", out="", layout="original", rank="64",
                                    source="random", seed="0", expert="transformer",
                                    diffs="false", device="auto"), USAGE)
    if not args["out"] or not args["preset"]:
        sys.exit(f"usage: {USAGE}")
    if args["diffs"].lower() not in ("false", "true", "0", "1"):
        sys.exit(f"diffs={args['diffs']!r}: true or false\nusage: {USAGE}")
    diffs = {"diffs": True} if args["diffs"].lower() in ("true", "1") else {}
    device = args["device"]
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        sys.exit(f"device={device!r}: auto, cpu or cuda\nusage: {USAGE}")
    spec = ModelSpec(preset=args["preset"], source=args["source"])
    if spec.family.random_adapter is None:
        sys.exit(f"{spec.preset}: no LoRA layout known for its family")
    with torch.device("meta"):
        denoiser = getattr(spec.family.build(spec.info, spec.source == "tiny"), args["expert"])
    tensors = spec.family.random_adapter(denoiser, args["layout"], int(args["rank"]),
                                         int(args["seed"]), device=device, **diffs)
    save_file(tensors, args["out"])
    print(f"{args['out']}: {len(tensors)} tensors, "
          f"{sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main(sys.argv[1:])
