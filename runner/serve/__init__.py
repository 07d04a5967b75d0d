"""The worker side, inside Ray actors: models and adapters, the worker and its actor, step reuse,
text encoding, canaries, timing, the compile cache. Never imports runner.driver
(tests/test_layout.py)."""
