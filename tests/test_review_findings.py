"""Output-integrity bugs found by review, each shown by the run that exposed it (CPU, no Ray: the
simulated pool of tests/test_jobrun.py)."""

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
