import dataclasses
import os

import pyarrow as pa
import pytest

from runner.config import GenerationDefaults
from runner.io.prompts import (Constraints, PromptError, case_collisions, check_prompts, plan_shards,
                            sanitize_id)
from conftest import GUARD_S

GEN = GenerationDefaults(seed=3, height=64, width=64, num_frames=4, num_inference_steps=2,
                         guidance_scale=4.5, negative_prompt="ugly")
IMAGE = Constraints(size_factor=16)
VIDEO = Constraints(size_factor=16, video_length=4)


def check(path, limits=IMAGE, on_empty="error", gen=GEN):
    return check_prompts((path,), gen, limits, on_empty)


def test_defaults_fill_absent_columns_and_null_cells(write_prompts):
    p = write_prompts({"prompt": ["a", "b"], "seed": [5, None], "height": [128, None]})
    _, rows, items = check(p)
    assert rows == {p: 2}
    a, b = items
    assert (a.seed, a.height, a.width, a.negative_prompt) == (5, 128, 64, "ugly")
    assert (b.seed, b.height) == (3, 64)
    assert a.num_frames is None                       # image model
    assert [i.id for i in items] == ["prompts-000000", "prompts-000001"]  # stable row ids


def test_video_frames_default_and_mismatch(write_prompts):
    p = write_prompts({"prompt": ["a", "b"], "num_frames": [4, 8]})
    with pytest.raises(PromptError, match=r"prompts.parquet:1: num_frames=8.*exactly 4 frames"):
        check(p, VIDEO)
    p = write_prompts({"prompt": ["a"]}, "ok.parquet")
    assert check(p, VIDEO)[2][0].num_frames == 4


def test_frames_of_a_4k_plus_1_model(write_prompts):
    """Wan's VAE compresses time by 4: 4k+1 frames only (the pipeline would silently round)."""
    wan, gen5 = Constraints(size_factor=16, frame_step=4), dataclasses.replace(GEN, num_frames=5)
    p = write_prompts({"prompt": ["a", "b", "c"], "num_frames": [5, 33, 16]})
    with pytest.raises(PromptError, match=r"prompts.parquet:2: num_frames=16, but this model takes "
                                          r"k \* 4 \+ 1 frames \(e.g. 13 or 17\)"):
        check(p, wan, gen=gen5)
    p = write_prompts({"prompt": ["a", "b"], "num_frames": [5, 81]}, "ok.parquet")
    assert [i.num_frames for i in check(p, wan, gen=gen5)[2]] == [5, 81]
    with pytest.raises(PromptError, match=r"generation.num_frames=4, but this model takes"):
        check(p, wan, gen=GEN)                        # the default (4) is the key's error


def test_size_not_divisible(write_prompts):
    p = write_prompts({"prompt": ["a", "b"], "width": [64, 72]})
    with pytest.raises(PromptError, match=r":1: width=72 must be a positive multiple of 16"):
        check(p)


def test_steps_below_model_minimum(write_prompts):
    p = write_prompts({"prompt": ["a"], "num_inference_steps": [1]})
    with pytest.raises(PromptError, match="num_inference_steps=1 must be >= 2"):
        check(p, Constraints(size_factor=16, min_steps=2))


def test_steps_above_model_maximum_name_the_row_its_id_and_the_bound(write_prompts, monkeypatch):
    """Past `max_steps` the worker's pipeline fails (or makes NaN) after load and compile: refused
    here, by the column-wise path and the row-by-row one alike; the bound itself passes."""
    from runner.io import prompts
    limits = Constraints(size_factor=16, max_steps=999)
    p = write_prompts({"id": ["fox", "city", "sea"], "prompt": ["a", "b", "c"],
                       "num_inference_steps": [20, 1000, 999]})
    for fast in (True, False):
        with monkeypatch.context() as m:
            if not fast:
                m.setattr(prompts, "_fast_items", lambda *a: None)
            with pytest.raises(PromptError) as e:
                check(p, limits)
        assert str(e.value) == (f"{p}:1 (id 'city'): num_inference_steps=1000 must be <= 999 for "
                                f"this model (its scheduler's limit: docs/models.md, \"Step limits\")")
    ok = write_prompts({"prompt": ["a", "b"], "num_inference_steps": [999, None]}, "ok.parquet")
    assert [i.num_inference_steps for i in check(ok, limits)[2]] == [999, GEN.num_inference_steps]
    # the default past it is the key's error, not every row's
    with pytest.raises(PromptError, match=r"^generation.num_inference_steps=1000 must be <= 999 for "
                                          r"this model .*set generation.num_inference_steps"):
        check(ok, limits, gen=dataclasses.replace(GEN, num_inference_steps=1000))


def test_missing_prompt_column(write_prompts):
    p = write_prompts({"text": ["a"]})
    with pytest.raises(PromptError, match=r"no 'prompt' column \(columns: \['text'\]\)"):
        check(p)


def test_unreadable_parquet(tmp_path):
    p = tmp_path / "broken.parquet"
    p.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(PromptError, match="cannot read Parquet file"):
        check(str(p))


def test_duplicate_column_names_are_named_with_the_fix(tmp_path):
    """A file with two `prompt` columns (pandas writes one after a careless concat): the error
    names the column and how to drop the copy, not pyarrow's internal field list."""
    import pyarrow.parquet as pq
    p = str(tmp_path / "dup.parquet")
    pq.write_table(pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"]), pa.array([1])],
                                        names=["prompt", "prompt", "seed"]), p)
    with pytest.raises(PromptError) as e:
        check(p)
    msg = str(e.value)
    assert "more than one column named 'prompt'" in msg and "duplicated()" in msg, msg
    assert "seed" not in msg and "__fragment_index" not in msg, msg


def test_no_prompts(tmp_path, write_prompts):
    with pytest.raises(PromptError, match="does not exist"):
        check(str(tmp_path / "missing.parquet"))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(PromptError, match="has no .parquet files"):
        check(str(tmp_path / "empty_dir"))
    import pyarrow as pa, pyarrow.parquet as pq
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "zero.parquet")
    with pytest.raises(PromptError, match="no prompts to run"):
        check(str(tmp_path / "zero.parquet"))


def test_null_or_empty_prompts_error_or_skip(write_prompts):
    p = write_prompts({"prompt": ["a", None, "  ", "d"]})
    with pytest.raises(PromptError, match=r":1: prompt is null or empty.*on_empty=skip"):
        check(p)
    _, rows, items = check(p, on_empty="skip")
    assert [i.prompt for i in items] == ["a", "d"]
    assert [i.id for i in items] == ["prompts-000000", "prompts-000003"]  # row numbers kept


def test_ids_are_sanitized_and_collisions_rejected(write_prompts):
    p = write_prompts({"prompt": ["a", "b", "c"], "id": ["../../x", "a b/c", "7"]})
    ids = [i.id for i in check(p)[2]]
    assert ids == ["_.._x", "a_b_c", "7"]
    for i in ids:  # every id is a plain file name
        assert os.path.basename(i) == i and not i.startswith(".")
    p = write_prompts({"prompt": ["a", "b"], "id": ["x/y", "x_y"]}, "dup.parquet")
    with pytest.raises(PromptError, match=r"id 'x_y' .* is also used by .*dup.parquet:0"):
        check(p)
    assert sanitize_id("..\\..\\etc") == "_.._etc"


def test_ids_differing_only_in_case_are_paired_for_the_output_dir_check(write_prompts):
    """Not an error here (a case-sensitive output.dir keeps both: runner.driver.job decides, see
    tests/test_jobrun.py): each later id pairs with the first of its folded name."""
    p = write_prompts({"prompt": list("abcde"), "id": ["Fox", "cat", "fox", "FOX", "a/b"]})
    items = check(p)[2]
    assert [(a.id, b.id, a.row, b.row) for a, b in case_collisions(items)] == \
        [("Fox", "fox", 0, 2), ("Fox", "FOX", 0, 3)]
    assert case_collisions(items[:2] + items[4:]) == []


def test_directory_and_multiple_files_and_shards(tmp_path, write_prompts):
    d = tmp_path / "many"
    d.mkdir()
    import pyarrow as pa, pyarrow.parquet as pq
    pq.write_table(pa.table({"prompt": [f"a{i}" for i in range(5)]}), d / "b.parquet")
    pq.write_table(pa.table({"prompt": [f"b{i}" for i in range(3)]}), d / "a.parquet")
    files, rows, items = check_prompts((str(d),), GEN, IMAGE, "error")
    assert [os.path.basename(f) for f in files] == ["a.parquet", "b.parquet"]   # sorted, stable
    assert len(items) == 8 and items[0].id == "a-000000" and items[3].id == "b-000000"
    shards = plan_shards(items, 2)
    assert [(os.path.basename(s.file), s.start, s.stop) for s in shards] == [
        ("a.parquet", 0, 2), ("a.parquet", 2, 3),
        ("b.parquet", 0, 2), ("b.parquet", 2, 4), ("b.parquet", 4, 5)]
    # shards cover every row exactly once (the driver sends each shard's items with it)
    seen = [i.id for s in shards for i in items if i.file == s.file and s.start <= i.row < s.stop]
    assert seen == [i.id for i in items]


def test_a_directory_named_dot_parquet_is_read_once(tmp_path):
    """Spark's `df.write.parquet("out.parquet")` makes a directory of part files. Under prompts.path
    it matched "*.parquet" as if a file: read whole as a dataset, and its part files again, every
    prompt ran twice (under two ids) without a word."""
    import pyarrow.parquet as pq
    part = tmp_path / "prompts" / "out.parquet"
    part.mkdir(parents=True)
    pq.write_table(pa.table({"prompt": ["a", "b"]}), part / "part-00000.snappy.parquet")
    (part / "_SUCCESS").touch()
    files, _, items = check_prompts((str(tmp_path / "prompts"),), GEN, IMAGE, "error")
    assert files == [str(part / "part-00000.snappy.parquet")]
    assert [i.prompt for i in items] == ["a", "b"]


def test_bad_cell_types(write_prompts):
    p = write_prompts({"prompt": ["a"], "seed": ["lucky"]})
    with pytest.raises(PromptError, match="seed='lucky' must be an integer"):
        check(p)
    p = write_prompts({"prompt": ["a"], "seed": [-1]}, "neg.parquet")
    with pytest.raises(PromptError, match="seed=-1"):
        check(p)


@pytest.mark.parametrize("col, values, limits", [
    ("height", pa.array([64, 2**64 - 16], pa.uint64()), IMAGE),            # the column-wise path
    ("width", [64.0, 2.0**64], IMAGE),                                      # a float column: row by row
    ("num_inference_steps", pa.array([2, 2**64 - 1], pa.uint64()), IMAGE),
    ("num_frames", pa.array([5, 2**64 - 3], pa.uint64()), Constraints(size_factor=16, frame_step=4)),
])
def test_integers_past_int64_are_an_error(write_prompts, col, values, limits):
    """A uint64 (or float) cell >= 2**63 passed every check but the seed's, ran on the workers,
    then the job died with an OverflowError traceback writing results.parquet (an int64 column)."""
    p = write_prompts({"prompt": ["a", "b"], col: values})
    with pytest.raises(PromptError, match=rf"prompts.parquet:1: {col}=\d+ must be < 2\*\*63"):
        check(p, limits, gen=dataclasses.replace(GEN, num_frames=5))


@pytest.mark.parametrize("limits", [IMAGE, VIDEO])
def test_columnwise_checks_give_the_same_items_as_row_by_row(write_prompts, monkeypatch, limits):
    """check_prompts' column-wise fast path (a million rows in seconds) and the row-by-row path
    (which words the errors) agree item for item, defaults and null cells included."""
    import runner.io.prompts as prompts
    cols = {"prompt": ["a", " b ", "c", "d"], "id": ["x/1", "y", None, "z"],
            "seed": [1, None, 2**40, 0], "height": [32, None, 64, 128], "width": [16, 48, None, 64],
            "num_frames": [4, None, 4, 4], "num_inference_steps": [3, None, 1, 9],
            "guidance_scale": [1.5, None, 7.0, 0.0], "negative_prompt": ["no", None, "", "x"]}
    for drop in (None, "id", "guidance_scale"):
        c = {k: v for k, v in cols.items() if k != drop}
        if drop != "id":
            c["id"] = ["x/1", "y", "w", "z"]
        p = write_prompts(c, name=f"t-{drop}.parquet")
        fast = check_prompts((p,), GEN, limits, "error")[2]
        with monkeypatch.context() as m:
            m.setattr(prompts, "_fast_items", lambda *a: None)
            slow = check_prompts((p,), GEN, limits, "error")[2]
        assert fast == slow and [type(i.guidance_scale) for i in fast] == [float] * 4


def test_a_bad_default_is_the_keys_error_not_every_rows(tmp_path):
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "runner", "job=demo_image", f"output.dir={tmp_path}",
                        "generation.num_inference_steps=1"], cwd=root, capture_output=True,
                       text=True, timeout=GUARD_S)
    assert r.returncode == 2
    assert "generation.num_inference_steps=1 must be >= 2 for this model" in r.stderr
    assert "sample.parquet:" not in r.stderr          # no row is blamed


def test_item_is_the_one_definition_of_a_row(write_prompts):
    """Column lists, generation defaults, result rows and resume's comparison all derive from
    Item's fields: a per-row parameter added there is read, defaulted and compared everywhere."""
    from runner.io import prompts
    params = prompts.PARAMS
    assert params == ("prompt", "negative_prompt", "seed", "height", "width", "num_frames",
                      "num_inference_steps", "guidance_scale", "image_sha256", "adapter",
                      "adapters_sha256")
    # the image is a column, not a parameter: its content hash is (runner.io.images), no column;
    # the adapters' content hash likewise (runner.serve.adapters.row_hashes)
    hashes = {"image_sha256", "adapters_sha256"}
    assert set(prompts.OPTIONAL_COLUMNS) == {"id", "image", *params} - {"prompt", *hashes}
    # every parameter but the prompt, the content hashes and the per-row adapter (none unless
    # the column names one) has a generation default of that name
    assert {f.name for f in dataclasses.fields(GenerationDefaults)} == \
        set(params) - {"prompt", "adapter", *hashes}
    p = write_prompts({"prompt": ["a"], "seed": [7], "guidance_scale": [2.0]})
    item = check(p)[2][0]
    assert item.made_from() == ("a", "ugly", 7, 64, 64, None, 2, 2.0, None, None, None)
    row = item.params()
    assert tuple(row[k] for k in params) == item.made_from()
    assert "image" in row and "image_bytes" not in row     # a bytes cell's bytes stay out of rows


@pytest.mark.parametrize("column,values,bad_row,needle", [
    ("seed", [1.0, float("nan"), 2.0], 1, "seed=nan is not a finite number"),
    ("height", [64.0, float("inf")], 1, "height=inf is not a finite number"),
    ("guidance_scale", [2.0, float("nan")], 1, "guidance_scale=nan is not a finite number"),
    ("guidance_scale", [float("-inf"), 2.0], 0, "guidance_scale=-inf is not a finite number"),
    ("guidance_scale", [2.0, 3.0, -0.5], 2, r"guidance_scale=-0.5 must be a finite number >= 0"),
])
def test_non_finite_and_negative_numbers_are_the_rows_error(write_prompts, column, values, bad_row,
                                                            needle):
    """NaN is not a null: a NaN seed used to run with the default seed, a NaN guidance was
    accepted and made every rerun refuse the directory (NaN != NaN)."""
    p = write_prompts({"prompt": [f"p{i}" for i in range(len(values))], column: values})
    with pytest.raises(PromptError, match=rf"prompts.parquet:{bad_row}: {needle}") as e:
        check(p)
    assert str(e.value).count("prompts.parquet:") == 1          # only the bad row is blamed
    nulls = [None if i == bad_row else v for i, v in enumerate(values)]
    p = write_prompts({"prompt": [f"p{i}" for i in range(len(values))], column: nulls}, "ok.parquet")
    assert getattr(check(p)[2][bad_row], column) == getattr(GEN, column)   # null: the default


def test_a_non_finite_default_is_the_keys_error():
    with pytest.raises(Exception, match=r"generation.guidance_scale=nan must be a finite number"):
        GenerationDefaults(**{**dataclasses.asdict(GEN), "guidance_scale": float("nan")})


def test_binary_text_columns_are_decoded_strictly(write_prompts):
    import pyarrow as pa
    cafe = "caf\u00e9 \u2615"
    p = write_prompts({"prompt": pa.array([cafe.encode(), b"b"], pa.binary()),
                       "id": pa.array([b"ok-id", b"x y"], pa.large_binary()),
                       "negative_prompt": pa.array([b"blurry", None], pa.binary())})
    items = check(p)[2]
    assert [(i.id, i.prompt, i.negative_prompt) for i in items] == [
        ("ok-id", cafe, "blurry"), ("x_y", "b", "ugly")]            # text, never "b'...'"
    p = write_prompts({"prompt": ["a", "b", "c"],
                       "id": pa.array([b"fine", b"\xff\xfebad", b"\xc3"], pa.binary())}, "bad.parquet")
    with pytest.raises(PromptError) as e:
        check(p)
    msg = str(e.value)
    assert "bad.parquet:1: column 'id' is binary and this value is not UTF-8" in msg
    assert "bad.parquet:2: column 'id'" in msg and "bad.parquet:0" not in msg


@pytest.mark.parametrize("column", ["id", "prompt", "negative_prompt"])
def test_a_text_column_of_another_type_names_the_column(write_prompts, column):
    cols = {"prompt": ["a", "b"], column: [1, 2]}
    p = write_prompts(cols)
    with pytest.raises(PromptError, match=rf"prompts.parquet: column '{column}' has type int64; it "
                                          rf"must be text .*df\['{column}'\].astype\(str\)"):
        check(p)


def test_unknown_columns_warn_with_the_closest_name_or_fail_when_strict(write_prompts, caplog):
    import json
    import pyarrow as pa
    import pyarrow.parquet as pq
    p = write_prompts({"prompt": ["a", "b"], "seeds": [5, 6], "colour": ["r", "g"]})
    with caplog.at_level("WARNING", logger="runner"):
        items = check(p)[2]
    assert [i.seed for i in items] == [GEN.seed] * 2
    lines = [r.getMessage() for r in caplog.records if "unknown prompt column" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "'seeds' (did you mean 'seed'?)" in lines[0] and "'colour'" in lines[0]
    assert p in lines[0] and "prompts.strict=true" in lines[0]
    with pytest.raises(PromptError, match=r"unknown prompt columns in .*'seeds' \(did you mean "
                                          r"'seed'\?\).*prompts.strict=false"):
        check_prompts((p,), GEN, IMAGE, "error", strict=True)
    # a pandas index stored in the file (df.to_parquet of a filtered frame) is not a column
    table = pa.table({"prompt": ["a"], "__index_level_0__": [7]})
    meta = {b"pandas": json.dumps({"index_columns": ["__index_level_0__"], "columns": []}).encode()}
    pq.write_table(table.replace_schema_metadata(meta), p)
    caplog.clear()
    with caplog.at_level("WARNING", logger="runner"):
        check_prompts((p,), GEN, IMAGE, "error", strict=True)
    assert not caplog.records


@pytest.mark.parametrize("case", ["nan_guidance", "inf_guidance", "nan_seed_row", "binary_id_row",
                                  "compute_steps_past_the_end", "strict_unknown_column",
                                  "steps_past_the_scheduler", "warmup_past_the_scheduler"])
def test_hostile_inputs_exit_2_before_ray_naming_the_key_or_row(tmp_path, write_prompts, case):
    """The hostile evaluation's cases (issue 37, D1 and D4), on the real CLI, without a dry run:
    each is exit 2 with one error naming the key or file:row, before Ray starts."""
    import subprocess
    import sys
    import pyarrow as pa
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    job = ["job=demo_image"]
    if case == "nan_guidance":
        args, needle = ["generation.guidance_scale=.nan"], "generation.guidance_scale=nan is not a finite"
    elif case == "inf_guidance":
        args, needle = ["generation.guidance_scale=.inf"], "generation.guidance_scale=inf is not a finite"
    elif case == "nan_seed_row":
        p = write_prompts({"prompt": ["a", "b"], "seed": [3.0, float("nan")]})
        args, needle = [f"prompts.path={p}"], f"{p}:1: seed=nan is not a finite number"
    elif case == "binary_id_row":
        p = write_prompts({"prompt": ["a", "b"], "id": pa.array([b"ok", b"\xff\xfe\x00bad"])})
        args, needle = [f"prompts.path={p}"], f"{p}:1: column 'id' is binary and this value is not UTF-8"
    elif case == "compute_steps_past_the_end":       # demo_video: Latte, 4 steps
        job = ["job=demo_video"]
        args = ["step_cache.method=residual", "step_cache.compute_steps=[0,2,9]"]
        needle = "step_cache.compute_steps=[0, 2, 9] names step 9, past the last step of"
    elif case == "steps_past_the_scheduler":        # demo_image: PixArt-α, at most 999 steps
        p = write_prompts({"id": ["fox", "city"], "prompt": ["a", "b"],
                           "num_inference_steps": [20, 1000]})
        args = [f"prompts.path={p}"]
        needle = f"{p}:1 (id 'city'): num_inference_steps=1000 must be <= 999 for this model"
    elif case == "warmup_past_the_scheduler":
        args, needle = ["run.warmup_steps=1000"], "run.warmup_steps=1000: the warm-up call would run"
    else:
        p = write_prompts({"prompt": ["a"], "sed": [1]})
        args = [f"prompts.path={p}", "prompts.strict=true"]
        needle = "unknown prompt column in"
    r = subprocess.run([sys.executable, "-m", "runner", *job, f"output.dir={tmp_path}/out", *args],
                       cwd=root, capture_output=True, text=True, timeout=GUARD_S)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and needle in last, r.stderr[-2000:]
    assert "Ray" not in r.stderr and not (tmp_path / "out").exists()      # nothing started


def test_a_misspelt_row_adapter_suggests_the_closest(write_prompts):
    """Issue 75: a row's `adapter` naming no per-row adapter of the job says which one it may mean."""
    p = write_prompts({"prompt": ["a", "b"], "adapter": ["anime", "animee"]})
    limits = dataclasses.replace(IMAGE, adapters=("anime", "pixel"))
    with pytest.raises(PromptError, match=r"adapter='animee' is not a per-row adapter of this job "
                                          r"\(did you mean 'anime'\?\)"):
        check(p, limits)
