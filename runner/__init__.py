"""Batch video/image generation on Ray with compiled diffusers pipelines (see README.md)."""
