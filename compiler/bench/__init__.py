"""Measurement probes of the compiler's kernels (`python -m compiler.bench.<probe>`, CUDA): tools,
not the library; nothing in `compiler` imports them."""
