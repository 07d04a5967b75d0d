import pytest
from omegaconf import OmegaConf

from runner.config import ConfigError, load_config, parse_adapters, split


def test_merge_order_defaults_preset_job_cli(tmp_path):
    # defaults: height 1024, steps 20; latte1 preset: 512, 50 steps; job file: steps 30; CLI: seed 7
    job = tmp_path / "j.yaml"
    job.write_text("model: {preset: latte1}\nprompts: {path: x.parquet}\n"
                   "generation: {num_inference_steps: 30}\n")
    cfg = load_config([f"job={job}", "generation.seed=7", "generation.num_inference_steps=40"])
    assert cfg.generation.height == 512              # preset beats defaults
    assert cfg.generation.guidance_scale == 7.5      # preset
    assert cfg.generation.num_inference_steps == 40  # CLI beats job beats preset
    assert cfg.generation.seed == 7
    assert cfg.run.batch_size == 1                   # defaults
    assert cfg.job.name == "j"                       # from the job file name


def test_job_file_beats_preset_and_cli_switches_preset():
    cfg = load_config(["job=demo_image"])
    assert cfg.generation.height == 128 and cfg.model.preset == "pixart_alpha_1024"
    cfg = load_config(["job=demo_image", "model.preset=sd21"])
    assert cfg.model.preset == "sd21"
    assert cfg.generation.guidance_scale == 7.5      # sd21 preset applied
    assert cfg.generation.height == 128              # job still beats the preset


def test_unknown_key_names_key_and_valid_ones():
    with pytest.raises(ConfigError) as e:
        load_config(["job=demo_image", "generation.stepz=3"])
    msg = str(e.value)
    assert "generation.stepz" in msg and "num_inference_steps" in msg and "command line" in msg
    with pytest.raises(ConfigError, match="did you mean 'run.batch_size'"):
        load_config(["job=demo_image", "run.batch_sise=3"])
    with pytest.raises(ConfigError, match="unknown config key 'modle'"):
        load_config(["job=demo_image", "modle.preset=sd21"])


def test_unknown_key_in_job_file(tmp_path):
    job = tmp_path / "bad.yaml"
    job.write_text("prompts: {path: x.parquet}\nrun: {shards: 3}\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'run.shards' in job file .*bad.yaml"):
        load_config([f"job={job}"])


@pytest.mark.parametrize("arg,needle", [
    ("generation.num_inference_steps=abc", "expected int"),
    ("generation.guidance_scale=high", "expected float"),
    ("compile.dynamic=maybe", "expected bool"),
    ("generation.height=1.5", "expected int"),
])
def test_wrong_type_is_an_error(arg, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(["job=demo_image", arg])


def test_int_is_accepted_for_float_and_values_may_contain_equals():
    cfg = load_config(["job=demo_image", "generation.guidance_scale=5",
                       "generation.negative_prompt=a=b, c==d"])
    assert cfg.generation.guidance_scale == 5
    assert cfg.generation.negative_prompt == "a=b, c==d"


def test_misspelt_job_preset_and_adapter_key_suggest_the_closest():
    """Issue 75: did-you-mean for job names, presets and adapter keys, as for config keys."""
    with pytest.raises(ConfigError, match=r"unknown job 'demo_imag' \(did you mean 'demo_image'\?\)"):
        load_config(["job=demo_imag"])
    with pytest.raises(ConfigError, match=r"unknown model.preset 'pixart_alpha_102' \(did you "
                                          r"mean 'pixart_alpha_1024'\?\)"):
        load_config(["job=demo_image", "model.preset=pixart_alpha_102"])
    with pytest.raises(ConfigError, match=r"unknown keys \['sacle'\] \(did you mean 'scale'\?\)"):
        parse_adapters([{"path": "a.safetensors", "sacle": 0.5}], ("transformer",))


def test_unknown_job_and_preset_list_valid_names():
    with pytest.raises(ConfigError, match=r"unknown job 'nope'; valid: \[.*latte_batch.*\]"):
        load_config(["job=nope"])
    with pytest.raises(ConfigError, match=r"unknown model.preset 'sdxl'; valid: \[.*sd21.*\]"):
        load_config(["job=demo_image", "model.preset=sdxl"])
    with pytest.raises(ConfigError, match="no job given"):
        load_config(["run.batch_size=2"])
    with pytest.raises(ConfigError, match="not key=value"):
        load_config(["job=demo_image", "fast"])


def test_missing_required_key(tmp_path):
    job = tmp_path / "j.yaml"
    job.write_text("model: {source: tiny}\n")
    with pytest.raises(ConfigError, match=r"required config keys not set: \['prompts.path'\]"):
        load_config([f"job={job}"])


def test_free_form_inductor_options_pass_through():
    cfg = load_config(["job=demo_image", "compile.options.coordinate_descent_tuning=true"])
    job = split(cfg)
    assert job["compile"].options.inductor == {"coordinate_descent_tuning": True}


@pytest.mark.parametrize("arg,needle", [
    ("model.source=weights", "model.source 'weights'"),
    ("model.dtype=fp8", "model.dtype 'fp8'"),
    ("prompts.on_empty=drop", "prompts.on_empty='drop'"),
    ("run.batch_size=0", "run.batch_size=0 must be > 0"),
    ("ray.cpu_workers=0", "ray.cpu_workers=0"),
    ("job.name=../x", "job.name"),
    ("prompts.max_image_mib=-1", "prompts.max_image_mib=-1 must be > 0"),   # the MiB given, not bytes
])
def test_split_validates_each_section(arg, needle):
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[")):
        split(load_config(["job=demo_image", arg]))


def test_every_shipped_job_loads():
    from runner.config import available_jobs
    for name in available_jobs():
        job = split(load_config([f"job={name}"]))
        assert job["name"] == name
    assert {"latte_batch", "pixart_batch", "sd2_batch"} <= set(available_jobs())


def test_resolved_config_is_struct():
    cfg = load_config(["job=demo_image"])
    assert OmegaConf.is_struct(cfg)


@pytest.mark.parametrize("arg,needle", [
    ("generation.guidance_scale=.nan", "generation.guidance_scale=nan is not a finite number"),
    ("generation.guidance_scale=.inf", "generation.guidance_scale=inf is not a finite number"),
    ("generation.guidance_scale=-1", "generation.guidance_scale=-1 must be a finite number >= 0"),
    ("ray.worker_start_timeout_s=.nan", "ray.worker_start_timeout_s=nan is not a finite number"),
    ("output.results_every_s=-.inf", "output.results_every_s=-inf is not a finite number"),
    ("step_cache.timestep_range=[.nan,800]", r"step_cache.timestep_range=\[nan, 800\] holds nan"),
])
def test_non_finite_and_out_of_range_numbers_name_the_key(arg, needle):
    """NaN passes every range check (NaN < 0 is False), and NaN != NaN made a resumed run refuse
    its own directory: every number of the config must be finite."""
    with pytest.raises(ConfigError, match=needle):
        split(load_config(["job=demo_image", arg]))
