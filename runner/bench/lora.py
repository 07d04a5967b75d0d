"""`python -m runner.bench.lora`: a random LoRA adapter for a Wan denoiser, in a published layout.

    python -m runner.bench.lora preset=wan21_t2v_14b out=/tmp/lora.safetensors [layout=wan]
        [rank=64] [source=random|tiny] [seed=0]

No adapter weights can be downloaded here; the compute of a fused adapter does not depend on its
values, so benchmarks and tests use one of the published rank and key layout, with random values:
- `wan`:       the original Wan layout of LightX2V's distill LoRAs: `diffusion_model.blocks.N.
               self_attn.q.lora_down.weight` / `lora_up.weight` / `.alpha`, cross_attn, ffn.0, ffn.2;
- `kohya`:     musubi-tuner's `lora_unet_blocks_N_self_attn_q.lora_down.weight` / `.alpha`;
- `diffusers`: diffusers' / PEFT's own `transformer.blocks.N.attn1.to_q.lora_A.weight`.
Every block's attention and feed-forward Linears get a pair (A (r, in), B (out, r)); the delta
B @ A * alpha / r is ~`strength` of the weights' typical size.
"""

from __future__ import annotations

import sys

LAYOUTS = ("wan", "kohya", "diffusers")
# diffusers' module names in a Wan block -> the original Wan names (convert_wan_to_diffusers.py)
WAN_NAMES = {"attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
             "attn1.to_out.0": "self_attn.o", "attn2.to_q": "cross_attn.q",
             "attn2.to_k": "cross_attn.k", "attn2.to_v": "cross_attn.v",
             "attn2.to_out.0": "cross_attn.o", "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2"}


def wan_linears(denoiser) -> dict[str, tuple[int, int]]:
    """{diffusers module path: (out, in)} of every block's attention and feed-forward Linears."""
    out = {}
    for i, blk in enumerate(denoiser.blocks):
        for sub in WAN_NAMES:
            lin = blk.get_submodule(sub)
            out[f"blocks.{i}.{sub}"] = (lin.out_features, lin.in_features)
    return out


def random_lora(shapes: dict[str, tuple[int, int]], layout: str = "wan", rank: int = 64,
                seed: int = 0, strength: float = 0.05, alpha: float | None = None) -> dict:
    """The adapter's tensors (bf16, alphas fp32) in `layout`. `alpha` (default: rank / 2, as
    many trainers) is written where the layout carries it (wan, kohya)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    alpha = rank / 2 if alpha is None else alpha
    out = {}
    for path, (n_out, n_in) in shapes.items():
        a = torch.randn(rank, n_in, generator=g) / n_in ** 0.5
        # B @ A * alpha / rank ~ strength / sqrt(n_in) per entry, the size of a weight's entries
        b = torch.randn(n_out, rank, generator=g) * strength * rank / alpha / rank ** 0.5
        a, b = a.to(torch.bfloat16), b.to(torch.bfloat16)
        if layout == "diffusers":   # PEFT's scaling = lora_alpha / r: with no metadata, 1
            out[f"transformer.{path}.lora_A.weight"] = a
            out[f"transformer.{path}.lora_B.weight"] = (b.float() * alpha / rank).to(torch.bfloat16)
            continue
        blk, rest = path.split(".", 2)[1], path.split(".", 2)[2]
        name = f"blocks.{blk}.{WAN_NAMES[rest]}"
        key = f"diffusion_model.{name}" if layout == "wan" else "lora_unet_" + name.replace(".", "_")
        out[f"{key}.lora_down.weight"] = a
        out[f"{key}.lora_up.weight"] = b
        out[f"{key}.alpha"] = torch.tensor(float(alpha))
    return out


def main(argv: list[str]) -> None:
    import torch
    from safetensors.torch import save_file
    from ..config import ModelSpec
    from . import parse_args
    usage = " ".join(line.strip() for line in __doc__.splitlines()[2:4])
    args, _ = parse_args(argv, dict(preset="wan21_t2v_1_3b", out="", layout="wan", rank="64",
                                    source="random", seed="0", expert="transformer"), usage)
    if not args["out"] or args["layout"] not in LAYOUTS:
        sys.exit(f"usage: {usage} (layouts: {LAYOUTS})")
    spec = ModelSpec(preset=args["preset"], source=args["source"])
    with torch.device("meta"):
        denoiser = getattr(spec.family.build(spec.info, spec.source == "tiny"), args["expert"])
    tensors = random_lora(wan_linears(denoiser), args["layout"], int(args["rank"]),
                          int(args["seed"]))
    save_file(tensors, args["out"])
    print(f"{args['out']}: {len(tensors)} tensors, "
          f"{sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main(sys.argv[1:])
