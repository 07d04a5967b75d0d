"""Mode parsing, preset expansion and every error of compiler.options (no compilation: fast)."""

import json

import pytest

from compiler import FLAG_TABLE_MD, FLAGS, PRESETS, CompileOptions, parse_options


def test_nexfort_dict_and_json_string_parse_the_same():
    d = {"mode": "max-autotune:cudagraphs:cache-all", "memory_format": "channels_last", "dynamic": False,
         "options": {"epilogue_fusion": False}}
    a, b = parse_options(d), parse_options(json.dumps(d))
    assert a == b
    assert a.flags == {"max-autotune", "cudagraphs", "cache-all"}
    assert a.memory_format == "channels_last" and a.dynamic is False and a.fuse_qkv is True
    # user overrides come last
    assert a.inductor_config()["epilogue_fusion"] is False
    assert a.inductor_config()["max_autotune"] is True


def test_none_empty_and_bare_mode():
    assert parse_options(None).flags == {"none"}
    assert not parse_options(None).compile
    assert parse_options({"mode": ""}).flags == {"none"}
    assert parse_options("O2") == parse_options({"mode": "O2"})
    opts = parse_options("O2")
    assert parse_options(opts) is opts


def test_presets_expand():
    o2, o3 = parse_options("O2"), parse_options("O3")
    assert o2.flags == set(PRESETS["O2"]) == {"cudagraphs", "cache-all", "deterministic"}
    assert o2.inductor_config()["deterministic"] is True and "deterministic" not in o3.inductor_config()
    assert o2.lossless
    assert o3.flags >= o2.flags - {"deterministic"} and "low-precision" in o3.flags and not o3.lossless
    assert parse_options("O2:max-autotune").flags == o2.flags | {"max-autotune"}
    assert parse_options("O2:cudagraphs").flags == o2.flags  # duplicates collapse


def test_every_flag_is_in_the_table():
    for name in list(FLAGS) + list(PRESETS):
        assert f"| `{name}` " in FLAG_TABLE_MD, name
        parse_options({"mode": name})


@pytest.mark.parametrize("bad, match", [
    ({"mode": "O4"}, r"'O4'.*valid flags.*max-autotune"),
    ({"mode": "max-autotune:turbo"}, r"'turbo'"),
    ({"mode": "none:O2"}, r"cannot be combined"),
    ({"mode": "O2", "speed": 1}, r"\['speed'\].*valid keys"),
    ({"mode": "O2", "options": {"no_such_inductor_knob": 1}}, r"no_such_inductor_knob.*torch._inductor.config"),
    ({"memory_format": "nhwc"}, r"'nhwc'.*channels_last"),
    ({"dynamic": "yes"}, r"'dynamic' must be true or false"),
    ({"mode": 3}, r"must be a string"),
    ('{"mode": "O2",', r"not valid JSON"),
    (42, r"must be a dict"),
])
def test_errors_name_the_bad_value_and_the_valid_ones(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_options(bad)


def test_options_hashable_and_roundtrip():
    o = parse_options({"mode": "O3", "options": {"max_fusion_size": 32}, "dynamic": True})
    assert hash(o) == hash(parse_options(o.to_dict()))
    assert parse_options(o.to_dict()) == o
    assert isinstance(o, CompileOptions)


def test_compile_vae_is_true_false_or_null_other_keys_strictly_bool():
    assert parse_options("O2").compile_vae is None  # null: the compiler decides per pipeline
    assert parse_options({"mode": "O2", "compile_vae": None}).compile_vae is None
    assert parse_options({"mode": "O2", "compile_vae": False}).compile_vae is False
    with pytest.raises(ValueError, match="compile_vae"):
        parse_options({"compile_vae": "yes"})
    with pytest.raises(ValueError, match="fuse_qkv"):
        parse_options({"fuse_qkv": None})


def test_max_optimize_sets_single_pass_rows_and_other_modes_reset_them(monkeypatch):
    """`persistent_rows` is process-wide (Inductor's heuristics handler): each compile_pipe sets it
    from its own flags, so an O2 pipeline after an O3 one compiles with Inductor's rule."""
    import sympy
    from torch._inductor.runtime.hints import ReductionHint
    from compiler import compile_pipe, heuristics
    from runner.serve.models import ModelSpec, build_pipeline

    class Rows:  # the two things the rule reads of Inductor's kernel features
        def __init__(self, n, hint=ReductionHint.INNER):
            self.reduction_numel, self.hint = n, hint

        def get_reduction_hint(self):
            return self.hint

    try:
        compile_pipe(build_pipeline(ModelSpec("pixart_alpha_512", source="tiny")), "max-optimize")
        assert heuristics.persistent_rows() == FLAGS["max-optimize"]["persistent_rows"] == 2048
        # everything but a static inner row of <= 2048 goes to Inductor's own rule
        monkeypatch.setattr(heuristics.InductorChoices, "should_use_persistent_reduction",
                            staticmethod(lambda features, cooperative: "inductor"))
        choose = heuristics.V.choices.should_use_persistent_reduction
        assert choose(Rows(sympy.Integer(1152)), False) is True        # a DiT row: 1152 > Inductor's 1024
        assert choose(Rows(sympy.Integer(4096)), False) == "inductor"
        assert choose(Rows(sympy.Symbol("s0", positive=True, integer=True)), False) == "inductor"  # dynamic
        assert choose(Rows(sympy.Integer(1152), ReductionHint.OUTER), False) == "inductor"
        assert choose(Rows(sympy.Integer(1152)), True) == "inductor"    # cooperative
        monkeypatch.undo()
        compile_pipe(build_pipeline(ModelSpec("pixart_alpha_512", source="tiny")), "O2")
        assert heuristics.persistent_rows() == 0
        # a handler someone else installed survives the reset
        mine = heuristics.InductorChoices()
        heuristics.V.set_choices_handler(mine)
        compile_pipe(build_pipeline(ModelSpec("pixart_alpha_512", source="tiny")), "O2")
        assert heuristics.V.choices is mine
    finally:
        heuristics.set_persistent_rows(0)
        heuristics.V.set_choices_handler(heuristics.InductorChoices())


def test_tuning_probe_names_its_valid_variants():
    # the dev tool imports (it moved with the benchmark helpers) and rejects a bad variant by name
    from runner.bench import tuning
    with pytest.raises(SystemExit, match=r"unknown variant 'x'; valid: \['cdt', 'mapw', 'nocdt'\]"):
        tuning.main(["variant=x", "cache_dir=/nonexistent"])
