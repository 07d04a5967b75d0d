"""The compiler's own kernels: Triton kernels (FP8 feed-forward quantisation, q/k norm + rotary
embedding, short self- and cross-attention, the Wan VAE's Winograd passes) and the INT8/FP8
attention with its vendored CUDA source (`csrc/`). Transforms in `compiler` install them; nothing
here is imported until used."""
