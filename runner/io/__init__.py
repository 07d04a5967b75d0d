"""Inputs, outputs and storage, used by both sides: prompts, images, the media encoders and result
rows, the filesystem layer (local, s3://, gs://). Never imports runner.driver
(tests/test_layout.py)."""
