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
    assert o2.flags == set(PRESETS["O2"]) == {"cudagraphs", "cache-all"}
    assert o2.lossless
    assert o3.flags >= o2.flags and "low-precision" in o3.flags and not o3.lossless
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
