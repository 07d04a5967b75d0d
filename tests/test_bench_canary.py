"""`python -m runner.bench.canary` (the canary's cost, a benchmark: it replaced a gpu test whose
bound could only fail if one canary cost more than two items) on a CPU with the tiny model: the
canaries fire where the job's dispatcher asks for them, and the figures are the measured ones."""
import pytest

from runner.bench import canary as bench
from runner.config import CANARY_BATCHES

TINY = ["model.source=tiny", "compile.mode=none", "generation.height=64", "generation.width=64",
        "generation.num_inference_steps=2", "run.batch_size=1", "run.shard_size=2",
        "run.canary_every_items=4"]


def test_the_default_window_is_the_jobs_canary_period(tmp_path):
    job = bench.config("pixart_batch", [], "on", str(tmp_path))
    assert job["compile"].mode == "O3" and job["model"].source == "random"   # the bench's defaults
    assert job["run"].canary_every_items is None
    assert bench._period_batches(job["run"]) == CANARY_BATCHES
    assert bench._period_batches(bench.config("pixart_batch", ["run.canary_every_items=6",
                                                               "run.batch_size=2"], "on",
                                              str(tmp_path))["run"]) == 3
    off = bench.config("pixart_batch", [], "off", str(tmp_path))["run"]
    assert off.canary_items == 0 and not off.canary


def test_a_window_of_two_periods_runs_two_canaries_on_the_dispatchers_schedule(tmp_path):
    report = bench.main(["batches=8", "arms=on,off", f"out={tmp_path / 'canary.json'}",
                         f"dir={tmp_path / 'work'}", *TINY])
    on, off = report["arms"]["on"], report["arms"]["off"]
    # a canary after every 4 items handed out, before the next shard: the job's rule, not a call
    assert on["schedule"] == ["shard:2", "shard:2", "canary", "shard:2", "shard:2", "canary",
                              "extra:2"]
    assert len(on["canaries"]) == on["worker_canaries"] == 2
    assert all(c["ok"] and c["rule"] == "bit for bit" and c["s"] > 0 for c in on["canaries"])
    # the worker's own seconds, summed; the share is theirs over the window's wall time
    assert on["canary_s"] == pytest.approx(sum(c["s"] for c in on["canaries"]), abs=2e-4)
    assert on["canary_s"] == pytest.approx(on["worker_canary_s"], abs=2e-4)
    assert 0 < on["canary_s"] < on["window_s"]
    # share is computed before rounding; canary_s and window_s are rounded to 0.1 ms, which on
    # tiny-model windows (~0.02 s of canaries in ~0.08 s) moves their ratio by up to ~0.3 %
    rounding = 5e-5 * (1 + on["share"]) / on["window_s"] + 5e-6
    assert on["share"] == pytest.approx(on["canary_s"] / on["window_s"], abs=rounding)
    assert on["items"] == 8 and on["items_per_s"] == pytest.approx(8 / on["window_s"], rel=2e-3)
    assert on["canary_ref_s"] > 0
    # the same window without the canary: no reference, none asked
    assert off["schedule"] == ["shard:2"] * 4 + ["extra:2"]
    assert off["canaries"] == [] and off["worker_canaries"] == 0 and off["share"] == 0
    assert off["canary_ref_s"] is None and off["items"] == 8
    assert report["rate_cost"] == pytest.approx(1 - on["items_per_s"] / off["items_per_s"],
                                                abs=1e-4)
    assert (tmp_path / "canary.json").is_file()
