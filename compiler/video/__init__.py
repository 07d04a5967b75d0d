"""Video-model parts of the compiler: Wan's causal video VAEs decoded in chunks (`video_vae`) and
Latte-1's spatial+temporal block pairs compiled as one graph (`block_pairs`)."""
