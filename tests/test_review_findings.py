"""Output-integrity bugs found by review, each shown by the run that exposed it (CPU, no Ray: the
simulated pool of tests/test_jobrun.py)."""
import json
import logging

import pytest
from omegaconf import OmegaConf

from runner import job
from test_jobrun import IDS, Int8Cluster, rows, wan_o3_args



@pytest.fixture(autouse=True)
def stop_signals(monkeypatch):
    monkeypatch.setattr(job, "STOPS", [])


@pytest.fixture
def prompts(write_prompts):
    return write_prompts({"prompt": [f"prompt number {i}" for i in range(len(IDS))], "id": IDS})


# -- 1. two lossy compile modes that make different outputs shared one settings id ------------

def _settings(preset: str, mode: str):
    return OmegaConf.create({"model": {"preset": preset, "source": "random", "path": None,
                                       "dtype": "float16", "mask_feature": True},
                             "output": {"fps": 16}, "compile": {"mode": mode},
                             "generation": {"seed": 0}})


@pytest.mark.parametrize("preset, a, b", [
    # Wan: int8-attention alone (SDPA-exact Linears) vs O3 (its Linears in FP8 too)
    ("wan21_t2v_1_3b", "int8-attention", "O3"),
    # PixArt: int8-attention does not apply (eager-equal outputs) vs FP8 Linears
    ("pixart_alpha_1024", "int8-attention", "low-precision"),
])
def test_lossy_modes_that_make_different_outputs_have_different_settings(preset, a, b):
    from runner.results import fallback_settings_id, fingerprint, settings_id
    assert settings_id(_settings(preset, a)) != settings_id(_settings(preset, b))
    assert fingerprint(_settings(preset, a)) != fingerprint(_settings(preset, b))
    # a worker without the kernel under int8-attention alone makes SDPA outputs without FP8
    # Linears: not the outputs of `low-precision` alone
    if preset.startswith("wan"):
        assert fallback_settings_id(_settings(preset, a)) != \
            settings_id(_settings(preset, "low-precision"))


def test_settings_ids_of_existing_directories_are_unchanged():
    """The fix adds a key only where low-precision is off in a lossy mode: every other id stays."""
    from runner.results import settings_id
    o3_no_int8 = "cudagraphs:cache-all:max-optimize:low-precision"
    for preset in ("wan21_t2v_1_3b", "pixart_alpha_1024"):
        for mode in ("none", "O2", "O3", o3_no_int8, "low-precision"):
            assert "low_precision" not in _output(preset, mode), (preset, mode)
    assert settings_id(_settings("pixart_alpha_1024", "O3")) == \
        settings_id(_settings("pixart_alpha_1024", o3_no_int8))


def _output(preset, mode):
    from runner.results import _output_settings
    return _output_settings(_settings(preset, mode))


def test_a_rerun_with_fp8_linears_does_not_skip_outputs_made_without_them(
        prompts, tmp_path, capsys):
    """A Wan job made with compile.mode=int8-attention, rerun into its directory with O3 (FP8
    Linears on top): before the fix the fingerprint and every row's settings matched, so the
    rerun said "nothing to do" and kept 12 outputs made without FP8 as O3's. Now it is refused
    before any worker starts (exit 2), naming the mode change."""
    first = wan_o3_args(prompts, tmp_path, "compile.mode=int8-attention")
    assert Int8Cluster().main(first) == 0
    assert all(r["status"] == "ok" for r in rows(tmp_path / "j"))
    capsys.readouterr()
    c = Int8Cluster()
    assert c.main(wan_o3_args(prompts, tmp_path)) == 2
    assert c.generated == [] and c.pools == []
    err = capsys.readouterr().err
    assert "holds results of a different config" in err and "compile.mode" in err, err


# -- 2. a remake whose worker then failed its canary was recorded as the old ok row ------------

class ReorderedInt8Cluster(Int8Cluster):
    """Files take as long to write as an item to generate (`write_s` = `item_s`), so a shard's
    rows and the canary queued behind its GPU work are done at the same moment, and the pool's
    `wait` returns done futures last first: `Pool.wait` promises no order (Ray's does not
    either), and on Ray the canary's verdict can be read while its shard's files are still
    being written. The dispatcher then finds that shard done when the canary fails
    (`Dispatcher._canary_failed`: "rows done by then go to `on_rows` as suspect")."""

    def __call__(self, j, limits):
        pool = super().__call__(j, limits)
        pool.write_s = self.item_s
        wait = pool.wait
        pool.wait = lambda futures, timeout: list(reversed(wait(futures, timeout)))
        return pool


def test_a_remake_made_by_a_worker_that_then_fails_its_canary_is_suspect(
        prompts, tmp_path, write_prompts, caplog):
    """Run 1: every output made without int8-attention's kernel. Run 2 (a row more, one worker
    that runs the kernel, a canary every 4 items): the worker makes p12, then remakes p00-p02
    (their files replaced), then fails its canary. p00-p02 come back through the canary's
    "done by now" path, as suspect rows; `JobRun._kept` took them for failed remakes and dropped
    them, so the record kept the old ok rows (settings without the kernel) for files a worker
    in doubt had just rewritten: reported ok, and skipped by every later rerun."""
    args = wan_o3_args(prompts, tmp_path, "ray.cpu_workers=1")
    d = tmp_path / "j"
    assert Int8Cluster(falls_back={0}).main(args) == 0
    assert all(r["int8_attention"] is False for r in rows(d))

    write_prompts({"prompt": [f"prompt number {i}" for i in range(13)], "id": IDS + ["p12"]})
    c = ReorderedInt8Cluster(drift={0: 1})
    with caplog.at_level(logging.WARNING, logger="runner"):
        assert c.main(args + ["run.canary_every_items=4"]) == 1
    assert c.generated[:4] == ["p12", "p00", "p01", "p02"]
    after = {r["id"]: r for r in rows(d)}
    assert [after[i]["status"] for i in ("p12", "p00", "p01", "p02")] == ["suspect"] * 4, \
        {i: after[i]["status"] for i in after}
    assert "remaking p00" not in caplog.text        # not a failed remake: its file was replaced
    # the counts agree with the table: 9 ok (remade by the replacement), 4 suspect, none of the
    # 12 outputs of the earlier run kept as it was (each was remade, 3 of them in doubt)
    s = json.loads((d / "summary.json").read_text())
    assert (s["ok"], s["suspect"], s["resumed"]) == (9, 4, 0), s

    # the next rerun regenerates exactly them
    c = Int8Cluster()
    assert c.main(args) == 0
    assert sorted(c.generated) == ["p00", "p01", "p02", "p12"]
    assert all(r["status"] == "ok" for r in rows(d))
