"""LoRA adapters (`runner.serve.adapters`) and the step-distilled presets, on tiny Wan models on the CPU:
the fused adapter in each published key layout against diffusers' unfused path; LightX2V's full
differences (`.diff`, `.diff_b`, `diff_m`) against the base weights plus them by hand; the driver's
refusals (exit 2 before any worker, naming the adapter); resume with another scale refused; the
distilled samplers' timesteps and per-row noise; one denoiser call a step at guidance 1.0; step
reuse refused where it cannot apply; O3's FP8 linears leave no 16-bit fused weight behind."""
import dataclasses
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from runner.driver import job
from runner.serve import adapters
from runner.config import ModelSpec
from runner.families.wan import LORA_NAMES, diff_parameter
from runner.serve.models import build_pipeline

TINY = dict(height=64, width=48, num_frames=5, num_inference_steps=2, guidance_scale=1.0,
            output_type="np")


def _spec(preset="wan21_t2v_1_3b", **kw):
    return ModelSpec(preset=preset, source="tiny", **kw)


def _denoiser(preset="wan21_t2v_1_3b", expert="transformer"):
    with torch.device("meta"):
        return getattr(_spec(preset).family.build(_spec(preset).info, True), expert)


# Per-row adapters in the switch tests change disjoint Linears: a switch from one to the other
# that left the first's change on the Linears the second does not touch is then seen
SELF_ATTN = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0")
CROSS_ATTN = ("attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0")
FFN = ("ffn.net.0.proj", "ffn.net.2")


def _lora_file(tmp_path, layout="original", preset="wan21_t2v_1_3b", expert="transformer", seed=0,
               rank=4, extra=None, linears=None, **kw):
    """A random adapter's file; `linears` (block Linears as diffusers names them, original layout):
    only those Linears' pairs."""
    model = _denoiser(preset, expert)
    tensors = model_family(preset).random_adapter(model, layout, rank=rank, seed=seed, **kw)
    if linears is not None:
        names = [f".{LORA_NAMES[n]}." for n in linears]
        tensors = {k: t for k, t in tensors.items() if any(n in k for n in names)}
        assert tensors, linears
    tensors.update(extra or {})
    f = tmp_path / f"{layout}{seed}.safetensors"
    save_file(tensors, str(f))
    return str(f)


def _frames(pipe):
    return pipe(prompt="a fox", generator=torch.Generator().manual_seed(0), **TINY).frames


def model_family(preset):
    return _spec(preset).family


@pytest.mark.parametrize("layout", ["diffusers", "original", "kohya"])
def test_fused_adapter_equals_diffusers_unfused_in_each_layout(tmp_path, layout):
    f = _lora_file(tmp_path, layout)
    spec = _spec(adapters=[{"path": f, "scale": 0.7}])
    adapters.check(spec)                                     # the driver accepts it
    ours, ref, base = build_pipeline(spec), build_pipeline(spec), build_pipeline(spec)
    assert adapters.fuse(ours, spec.adapters) == 20           # 2 blocks x 10 Linears
    ref.load_lora_weights(f, adapter_name="x")
    ref.set_adapters(["x"], [0.7])
    a, b, c = _frames(ours), _frames(ref), _frames(base)
    assert np.abs(a - b).max() < 1e-4                          # fp32 here: rounding only
    assert np.abs(b - c).max() > 100 * np.abs(a - b).max()     # the adapter does change the video
    assert not any("lora" in type(m).__module__ for m in ours.transformer.modules())


def test_second_expert_gets_its_own_adapter(tmp_path):
    preset = "wan22_t2v_a14b_lightning"
    f1 = _lora_file(tmp_path, preset=preset, seed=1)
    f2 = _lora_file(tmp_path, preset=preset, expert="transformer_2", seed=2)
    spec = _spec(preset, adapters=[{"path": f1}, {"path": f2, "expert": "transformer_2"}])
    adapters.check(spec)
    base, pipe = build_pipeline(spec), build_pipeline(spec)
    adapters.fuse(pipe, spec.adapters)
    for name in ("transformer", "transformer_2"):
        w0 = getattr(base, name).blocks[0].attn1.to_q.weight
        w1 = getattr(pipe, name).blocks[0].attn1.to_q.weight
        assert not torch.equal(w0, w1), f"{name} kept its base weights"
    with pytest.raises(ValueError, match="denoisers are"):
        _spec(adapters=[{"path": f1, "expert": "transformer_2"}])    # Wan 2.1 has one


def _run(tmp_path, *args) -> int:
    return job.main(["job=wan_distill_batch", "model.source=tiny", "generation.height=64",
                     "generation.width=48", "generation.num_frames=5", "ray.cpu_workers=1",
                     "compile.mode=none", f"output.dir={tmp_path / 'out'}", *args])


def _bad(tmp_path, capsys, path, *args) -> str:
    assert _run(tmp_path, f"model.adapters=[{{path: '{path}', name: mine}}]", *args) == 2
    err = capsys.readouterr().err
    assert "model.adapters['mine']" in err, err
    return err


def test_bad_adapters_exit_2_naming_the_adapter(tmp_path, capsys):
    good = _lora_file(tmp_path)
    assert "no such file" in _bad(tmp_path, capsys, tmp_path / "missing.safetensors")
    data = open(good, "rb").read()
    (tmp_path / "cut.safetensors").write_bytes(data[:len(data) * 3 // 4])
    assert "truncated" in _bad(tmp_path, capsys, tmp_path / "cut.safetensors")
    (tmp_path / "head.safetensors").write_bytes(data[:200])
    assert "truncated" in _bad(tmp_path, capsys, tmp_path / "head.safetensors")
    (tmp_path / "text.safetensors").write_text("not a tensor file\n")
    assert "not a readable safetensors" in _bad(tmp_path, capsys, tmp_path / "text.safetensors")
    assert "needs weight_name" in _bad(tmp_path, capsys, "org/lora")     # a hub id alone
    assert _run(tmp_path, "model.adapters=[{path: org/lora, weight_name: x.safetensors, "
                "name: mine}]", "model.local_files_only=true") == 2
    assert "not in the local hub cache (offline)" in capsys.readouterr().err
    # made for another base model: the 14B's adapter against the 1.3B's Linears
    with torch.device("meta"):
        big = ModelSpec("wan21_t2v_14b", source="random")
        big = big.family.build(big.info, False).transformer
    big.blocks = big.blocks[:1]                               # one block: 10 of its 400 pairs
    save_file(model_family("wan21_t2v_14b").random_adapter(big, "original", rank=2),
              str(tmp_path / "other.safetensors"))
    err = _bad(tmp_path, capsys, tmp_path / "other.safetensors")
    assert "do not fit" in err and "against a Linear 24x24" in err


def _header(f) -> tuple[int, dict, bytes]:
    import json
    data = open(f, "rb").read()
    n = int.from_bytes(data[:8], "little")
    return n, json.loads(data[8:8 + n]), data[8 + n:]


def _with_header(f, out, change) -> str:
    """File `f` with its header changed by `change(header)`, padded to its length (the byte ranges
    and the file's size as they were: only safetensors' own header checks can refuse it)."""
    import json
    n, header, body = _header(f)
    change(header)
    text = json.dumps(header, separators=(",", ":")).encode()    # compact: fits the length
    assert len(text) <= n
    out.write_bytes(n.to_bytes(8, "little") + text.ljust(n) + body)
    return str(out)


def test_malformed_adapters_and_values_out_of_range_exit_2_naming_them(tmp_path, capsys):
    """What the hostile trial found: a header whose byte ranges do not fit its shapes, or an
    unknown dtype (a traceback, exit 1); NaN values or a scale of 1e30 (two worker start-ups,
    then the worker's model blamed); a FIFO or /dev/zero ("no such file"). Each is exit 2 on the
    driver, naming the adapter and what is wrong with it."""
    good = _lora_file(tmp_path)
    key = next(k for k in _header(good)[1] if k.endswith("lora_down.weight"))

    def shape(h):      # a byte range too short for its shape
        h[key]["shape"] = [h[key]["shape"][0], h[key]["shape"][1] + 1]
        h.pop("__metadata__", None)

    def dtype(h):
        h[key]["dtype"] = "XF16"
    for change in (shape, dtype):
        bad = _with_header(good, tmp_path / f"{change.__name__}.safetensors", change)
        err = _bad(tmp_path, capsys, bad)
        assert "is not a valid safetensors file" in err and bad in err, err
        assert "Traceback" not in err
    from safetensors.torch import load_file
    t = load_file(good)
    t[key][0, 0] = float("nan")
    save_file(t, str(tmp_path / "nan.safetensors"))
    err = _bad(tmp_path, capsys, tmp_path / "nan.safetensors")
    assert f"{key} holds NaN or inf values" in err, err
    assert _run(tmp_path, f"model.adapters=[{{path: '{good}', name: mine, scale: 1.0e+30}}]") == 2
    err = capsys.readouterr().err
    assert "model.adapters['mine']" in err and "at scale 1e+30 it changes a weight by up to" in \
        err and "NaN or inf" in err, err
    os.mkfifo(tmp_path / "fifo.safetensors")
    assert "not a regular file or directory (a FIFO" in _bad(tmp_path, capsys,
                                                            tmp_path / "fifo.safetensors")
    assert "not a regular file or directory (a character device)" in _bad(tmp_path, capsys,
                                                                          "/dev/zero")


def test_an_adapter_fused_into_inf_weights_is_refused_naming_it():
    """The worker's own check, past the driver's (which bounds the change, not the base weights):
    an fp16 model whose fused weights overflow is refused naming the adapter, not run into NaN
    outputs that blame the worker's model or GPU."""
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as d:
        f = _lora_file(Path(d))
        spec = _spec(dtype="fp16", adapters=[{"path": f, "name": "hot", "scale": 1e6}])
        pipe = build_pipeline(spec)
        with pytest.raises(adapters.AdapterError, match=r"model.adapters\['hot'\].*at scale "
                                                        r"1e\+06 it makes \d+ weights inf or NaN"):
            adapters.fuse(pipe, spec.adapters)


def test_an_adapter_that_partly_does_not_apply_is_refused(tmp_path, capsys):
    # every layer of the tiny model's 2 blocks, and a third block it does not have
    model = _denoiser()
    tensors = model_family("wan21_t2v_1_3b").random_adapter(model, "diffusers", rank=4)
    tensors["transformer.blocks.2.attn1.to_q.lora_A.weight"] = torch.zeros(4, 24)
    tensors["transformer.blocks.2.attn1.to_q.lora_B.weight"] = torch.zeros(24, 4)
    save_file(tensors, str(tmp_path / "part.safetensors"))
    err = _bad(tmp_path, capsys, tmp_path / "part.safetensors")
    assert "1 of its 21 LoRA layers" in err and "blocks.2.attn1.to_q" in err
    # full differences (applied: test_full_differences_...) of a block the model lacks, of another
    # shape, or of an unknown kind (diffusers' loader would drop `.diff`-like keys with a log)
    f = _lora_file(tmp_path, extra={"diffusion_model.blocks.2.norm3.diff": torch.ones(24)})
    err = _bad(tmp_path, capsys, f)
    assert "1 of its 1 full differences" in err and "blocks.2.norm3.diff: no parameter " \
        "blocks.2.norm2.weight" in err
    f = _lora_file(tmp_path, extra={"diffusion_model.head.diff_m": torch.ones(1, 6, 24)})
    assert "a difference of shape [1, 6, 24] for scale_shift_table of shape [1, 2, 24]" in \
        _bad(tmp_path, capsys, f)
    f = _lora_file(tmp_path, extra={"diffusion_model.blocks.0.norm3.diff_w": torch.ones(24)})
    err = _bad(tmp_path, capsys, f)
    assert "unknown kind" in err and "blocks.0.norm3.diff_w" in err
    # another family's full differences (its converter may drop them): still refused
    save_file({"diffusion_model.double_blocks.0.img_attn.qkv.diff": torch.ones(8, 8)},
              str(tmp_path / "flux.safetensors"))
    with pytest.raises(adapters.AdapterError, match=r"model.adapters\['flux'\].*would be ignored"):
        adapters.check(_spec("flux1_dev", adapters=[{"path": str(tmp_path / "flux.safetensors")}]))


# LightX2V's extracted LoRAs (`random_adapter(diffs=True)`): each full difference's parameter, by
# hand from diffusers' scripts/convert_wan_to_diffusers.py (not `runner.serve.adapters`' own table)
_BY_HAND = {**{orig: sub for sub, orig in LORA_NAMES.items()},
            "self_attn.norm_q": "attn1.norm_q", "self_attn.norm_k": "attn1.norm_k",
            "cross_attn.norm_q": "attn2.norm_q", "cross_attn.norm_k": "attn2.norm_k",
            "norm3": "norm2", "head.head": "proj_out", "patch_embedding": "patch_embedding",
            "text_embedding.0": "condition_embedder.text_embedder.linear_1",
            "text_embedding.2": "condition_embedder.text_embedder.linear_2",
            "time_embedding.0": "condition_embedder.time_embedder.linear_1",
            "time_embedding.2": "condition_embedder.time_embedder.linear_2",
            "time_projection.1": "condition_embedder.time_proj"}


def _kind(key: str) -> str | None:
    """A full difference's kind (what the test leaves out one at a time), None for LoRA keys."""
    if key.endswith("diff_m"):
        return "modulation diff_m"
    if not key.endswith((".diff", ".diff_b")):
        return None
    what = "patch_embedding" if "patch_embedding" in key else "norm" if "norm" in key else "Linear"
    return f"{what} {key.rsplit('.', 1)[1]}"


def _by_hand(key: str) -> str:
    name = key.removeprefix("diffusion_model.")
    if name.endswith("diff_m"):
        return "scale_shift_table" if name == "head.diff_m" else \
            name.replace("diff_m", "scale_shift_table")
    module, kind = name.rsplit(".", 1)
    block = ""
    if module.startswith("blocks."):
        _, i, module = module.split(".", 2)
        block = f"blocks.{i}."
    return block + _BY_HAND[module] + (".weight" if kind == "diff" else ".bias")


def _reference(pipe, tensors: dict, scale: float, without: str | None = None):
    """`pipe`'s frames with the file's full differences added to the base weights by hand (but
    those of kind `without`) and its LoRA pairs through diffusers' unfused PEFT path; `pipe` is
    left as it was."""
    base = {n: p.detach().clone() for n, p in pipe.transformer.named_parameters()}
    with torch.no_grad():
        for k, t in tensors.items():
            if _kind(k) not in (None, without):
                pipe.transformer.get_parameter(_by_hand(k)).add_(t.float() * scale)
    pipe.load_lora_weights({k: t for k, t in tensors.items() if _kind(k) is None},
                           adapter_name="x")
    pipe.set_adapters(["x"], [scale])
    frames = _frames(pipe)
    pipe.unload_lora_weights()
    with torch.no_grad():
        for n, p in pipe.transformer.named_parameters():
            p.copy_(base[n])
    return frames


def test_full_differences_are_fused_as_base_weights_plus_them(tmp_path):
    """Every kind of LightX2V's full differences (a Linear's `.diff` and `.diff_b`, a norm's,
    the patch embedding's, the modulation tables' `diff_m`) with the LoRA pairs: the fused
    pipeline's frames are the base weights plus scale x each difference by hand, then diffusers'
    unfused LoRA; each kind left out moves the frames far past that tolerance."""
    f = _lora_file(tmp_path, diffs=True, strength=0.2)
    from safetensors.torch import load_file
    tensors = load_file(f)
    kinds = {_kind(k) for k in tensors} - {None}
    assert kinds == {"Linear diff", "Linear diff_b", "norm diff", "norm diff_b",
                     "patch_embedding diff", "patch_embedding diff_b", "modulation diff_m"}
    assert all(diff_parameter(k) == _by_hand(k) for k in tensors if _kind(k))
    spec = _spec(adapters=[{"path": f, "scale": 0.7}])
    adapters.check(spec)                                     # the driver accepts it
    ours, ref = build_pipeline(spec), build_pipeline(spec)
    base = dict(ref.transformer.named_parameters())
    # 20 block Linears (LoRA + .diff_b), 6 other Linears (.diff + .diff_b), 17 other parameters
    assert adapters.fuse(ours, spec.adapters, diffs=diff_parameter) == 43
    fused = dict(ours.transformer.named_parameters())
    for k, t in tensors.items():           # each difference is in its parameter
        if _kind(k):
            name = _by_hand(k)
            want = base[name] + t.float() * 0.7
            assert torch.allclose(fused[name], want, rtol=0, atol=1e-6), k
            assert (want - base[name]).abs().max() > 1e-3, k
    a, b = _frames(ours), _reference(ref, tensors, 0.7)
    err = np.abs(a - b).max()
    assert err < 1e-4                                          # fp32 here: rounding only
    for kind in sorted(kinds):             # a skipped kind would fail the comparison above
        moved = np.abs(_reference(ref, tensors, 0.7, without=kind) - a).max()
        assert moved > 1e-3 and moved > 100 * err, f"{kind}: {moved} against {err}"
    assert not any("lora" in type(m).__module__ for m in ours.transformer.modules())


def test_per_row_adapters_switch_full_differences_of_linears_and_refuse_others(tmp_path):
    """A per-row adapter's `.diff` / `.diff_b` of Linears are written by the `Switch` as a job's
    fused adapter writes them (the same bits); its norms' or modulation's are refused on the
    driver, naming the adapter (a switch writes Linear weights only)."""
    from safetensors.torch import load_file
    full = _lora_file(tmp_path, diffs=True, seed=5)
    with pytest.raises(adapters.AdapterError, match=r"model.adapters\['A'\].*per-row adapter "
                                                    r"switches Linear weights only"):
        adapters.check(_spec(adapters=[{"path": full, "name": "A", "per_row": True}]))
    linear = {k: t for k, t in load_file(full).items() if _kind(k) in (None, "Linear diff",
                                                                       "Linear diff_b")}
    f = tmp_path / "linear.safetensors"
    save_file(linear, str(f))
    rows = _spec(adapters=[{"path": str(f), "name": "A", "per_row": True, "scale": 0.6}])
    adapters.check(rows)
    job_wide = _spec(adapters=[{"path": str(f), "scale": 0.6}])
    pipe, fixed, base = build_pipeline(rows), build_pipeline(job_wide), build_pipeline(rows)
    adapters.fuse(fixed, job_wide.adapters, diffs=diff_parameter)
    switch = adapters.Switch(pipe, rows.adapters, diffs=diff_parameter)
    for name, want in (("A", fixed), (None, base), ("A", fixed)):
        switch.use(name)
        for (n, p), (_, q) in zip(pipe.transformer.named_parameters(),
                                  want.transformer.named_parameters()):
            assert torch.equal(p, q), (name, n)


def test_a_switch_between_adapters_of_other_linears_writes_every_weight_in_place(tmp_path):
    """Per-row adapters A (self-attention Linears) and B (cross-attention and feed-forward), each
    switch in turn against a pipeline of that adapter fused job-wide (or none): every parameter
    equal, so a switch from A to B that left A's change on the self-attention (B does not touch
    it) fails here; and every write in place (the storage a compiled step and its CUDA graph
    read never moves)."""
    fa = _lora_file(tmp_path, seed=1, linears=SELF_ATTN)
    fb = _lora_file(tmp_path, seed=2, linears=CROSS_ATTN + FFN)
    rows = _spec(adapters=[{"path": fa, "name": "A", "per_row": True, "scale": 0.8},
                           {"path": fb, "name": "B", "per_row": True}])
    adapters.check(rows)
    pipe, base = build_pipeline(rows), build_pipeline(rows)
    want = {None: base}
    for name, f, scale in (("A", fa, 0.8), ("B", fb, 1.0)):
        want[name] = build_pipeline(rows)
        job_wide = _spec(adapters=[{"path": f, "scale": scale}])
        assert adapters.fuse(want[name], job_wide.adapters, diffs=diff_parameter) == 2 * len(
            SELF_ATTN if name == "A" else CROSS_ATTN + FFN)
    switch = adapters.Switch(pipe, rows.adapters, diffs=diff_parameter)
    storage = {n: p.data_ptr() for n, p in pipe.transformer.named_parameters()}
    for name in ("A", "B", None, "B", "A", None, "A"):
        switch.use(name)
        for (n, p), (_, q) in zip(pipe.transformer.named_parameters(),
                                  want[name].transformer.named_parameters()):
            assert torch.equal(p, q), f"use({name!r}): {n} is not that adapter's"
        assert {n: p.data_ptr() for n, p in pipe.transformer.named_parameters()} == storage, \
            f"use({name!r}) moved a weight to new storage"
    # the adapters do change what the other leaves alone (else the check above is empty)
    for n in ("blocks.0.attn1.to_q.weight", "blocks.0.ffn.net.2.weight"):
        a, b, c = (want[k].transformer.get_parameter(n) for k in ("A", "B", None))
        assert torch.equal(a, c) != torch.equal(b, c), n


def test_resume_with_another_scale_is_refused_and_a_replaced_file_remade(tmp_path, capsys):
    """The real CLI (its own process and Ray) makes the outputs; a rerun with another scale into
    the same directory is refused before any worker, as another model is."""
    from test_faults import cli
    f = _lora_file(tmp_path)
    common = ["job=wan_distill_batch", "model.source=tiny", "generation.height=64",
              "generation.width=48", "generation.num_frames=5", "ray.cpu_workers=1",
              "compile.mode=none", f"output.dir={tmp_path / 'out'}", "run.shard_size=8"]
    code, _, err = cli([*common, f"model.adapters=[{{path: '{f}', scale: 1.0}}]"])
    assert code == 0, err
    assert _run(tmp_path, f"model.adapters=[{{path: '{f}', scale: 0.5}}]") == 2
    err = capsys.readouterr().err
    assert "different config" in err and "'scale': 0.5" in err
    # the adapter file replaced under its path (retrained: the same keys and shapes): every row
    # is remade from the new file, none kept as made from the old one
    import glob

    import pyarrow.parquet as pq
    (job_dir,) = {os.path.dirname(p) for p in glob.glob(f"{tmp_path}/out/**/results.parquet",
                                                         recursive=True)}
    first = pq.read_table(f"{job_dir}/results.parquet").to_pylist()

    def made_from(file):      # what a row of this job is made from (its one job-wide adapter)
        return adapters.row_hashes((adapters.Adapter(path=file),), [_sha(file)])[None]
    old = made_from(f)
    assert {r["adapters_sha256"] for r in first} == {old} and len(first) > 1
    made = {r["id"]: os.stat(f"{job_dir}/{r['output']}").st_mtime_ns for r in first}
    (tmp_path / "new").mkdir()
    os.replace(_lora_file(tmp_path / "new", seed=9), f)
    assert made_from(f) != old
    assert _run(tmp_path, f"model.adapters=[{{path: '{f}', scale: 1.0}}]") == 0
    again = pq.read_table(f"{job_dir}/results.parquet").to_pylist()
    assert {r["adapters_sha256"] for r in again} == {made_from(f)}
    assert [r["status"] for r in again] == ["ok"] * len(first)
    assert all(os.stat(f"{job_dir}/{r['output']}").st_mtime_ns != made[r["id"]] for r in again)


def test_distilled_samplers_run_the_published_timesteps():
    from runner.families.distill import scheduler
    s = scheduler(shift=5.0, stochastic=True)
    s.set_timesteps(4)
    assert s.timesteps.tolist() == pytest.approx([1000, 937.5, 833.333, 625], abs=0.01)
    fast = scheduler(shift=1.0, stochastic=True, sigmas=[1.0, 0.757, 0.522])
    fast.set_timesteps(3)
    assert fast.timesteps.tolist() == pytest.approx([1000, 757, 522], abs=0.01)
    with pytest.raises(ValueError, match="exactly 3 steps"):
        fast.set_timesteps(4)


def test_renoising_draws_each_rows_noise_from_its_own_seed():
    """An output depends on its seed, not its batch-mates: a row alone equals it in a batch."""
    from runner.io.prompts import Item
    from runner.serve.worker import generate
    spec = _spec("wan21_t2v_14b_lightx2v")
    pipe = build_pipeline(spec)
    assert type(pipe.scheduler).__name__ == "DistilledFlowScheduler"

    def item(seed):
        return Item(id=f"r{seed}", prompt="a fox", negative_prompt="", seed=seed, height=64,
                    width=48, num_frames=5, num_inference_steps=4, guidance_scale=1.0,
                    file="p", row=seed)
    alone = generate(pipe, spec.family, [item(7)], "cpu")
    pair = generate(pipe, spec.family, [item(3), item(7)], "cpu")
    # equal but for the batched matmuls' rounding (a batch-mate's noise would move it by ~0.1)
    assert np.abs(alone[0] - pair[1]).max() < 1e-5
    assert np.abs(pair[0] - pair[1]).max() > 1e-2


def test_guidance_1_runs_one_denoiser_call_a_step_and_no_negative_prompt(monkeypatch):
    from runner.io.prompts import Item
    from runner.serve.text import TextCache
    from runner.serve.worker import generate
    spec = _spec("wan21_t2v_14b_lightx2v")
    pipe = build_pipeline(spec)
    calls = []
    pipe.transformer.register_forward_hook(lambda *a: calls.append(1))
    encoded = []
    real = TextCache.negative
    monkeypatch.setattr(TextCache, "negative", lambda self, t: encoded.append(t) or real(self, t))
    it = Item(id="a", prompt="a fox", negative_prompt="blurry", seed=0, height=64, width=48,
              num_frames=5, num_inference_steps=4, guidance_scale=1.0, file="p", row=0)
    generate(pipe, spec.family, [it], "cpu")
    assert len(calls) == 4 and encoded == []
    generate(pipe, spec.family, [Item(**{**it.__dict__, "guidance_scale": 5.0})], "cpu")
    assert len(calls) == 4 + 8 and set(encoded) == {"blurry"}   # with CFG: two calls a step


def test_i2v_a14b_lightning_runs_two_steps_on_each_expert_from_the_rows_image(tmp_path):
    """Wan 2.2 I2V A14B Lightning (tiny): an adapter per expert accepted on the driver and fused;
    a row with its image runs the published 4 steps as 2 on the high-noise expert (t >= 900) and
    2 on the low-noise one, one call a step (guidance 1.0: no CFG on either), and the video
    depends on the image."""
    from runner.io.images import placeholder
    from runner.io.prompts import Item
    from runner.serve.worker import generate
    preset = "wan22_i2v_a14b_lightning"
    files = [_lora_file(tmp_path, preset=preset, expert=e, seed=k)
             for k, e in enumerate(("transformer", "transformer_2"))]
    spec = _spec(preset, adapters=[{"path": files[0]},
                                   {"path": files[1], "expert": "transformer_2"}])
    adapters.check(spec)
    pipe = build_pipeline(spec)
    assert adapters.fuse(pipe, spec.adapters) == 2 * 20        # each expert: 2 blocks x 10
    assert pipe.image_encoder is None and pipe.config.boundary_ratio == 0.9
    calls = {"transformer": [], "transformer_2": []}
    for name, seen in calls.items():
        getattr(pipe, name).register_forward_pre_hook(
            lambda m, a, k, seen=seen: seen.append(float(k["timestep"].flatten()[0])),
            with_kwargs=True)
    it = Item(id="a", prompt="a fox", negative_prompt="blurry", seed=0, height=64, width=48,
              num_frames=5, num_inference_steps=4, guidance_scale=1.0, file="p", row=0, image="x")
    out = generate(pipe, spec.family, [it], "cpu", image=placeholder(48, 64))
    assert calls["transformer"] == pytest.approx([1000, 937.5], abs=0.01)
    assert calls["transformer_2"] == pytest.approx([833.333, 625], abs=0.01)
    from PIL import Image
    red = Image.new("RGB", (48, 64), (200, 30, 30))
    other = generate(pipe, spec.family, [it], "cpu", image=red)
    assert out.shape == other.shape and not np.allclose(out, other)
    # with CFG both experts guide at the row's scale (the published 3.5, 3.5; T2V A14B: 4.0, 3.0)
    generate(pipe, spec.family, [Item(**{**it.__dict__, "guidance_scale": 3.5})], "cpu",
             image=red)
    assert pipe._guidance_scale == pipe._guidance_scale_2 == 3.5


def test_distilled_presets_warn_of_other_steps_or_guidance_and_anyflow_refuses_200(tmp_path,
                                                                                   capsys, caplog):
    """LightX2V at 50 steps and guidance 7 (the base model's setting) runs, with one warning
    naming both; AnyFlow (distilled for 1-32 steps) at 200 is refused, exit 2, naming the bound."""
    import logging
    f = _lora_file(tmp_path)
    with caplog.at_level(logging.WARNING, logger="runner"):
        assert _run(tmp_path, f"model.adapters=[{{path: '{f}'}}]", "run.dry_run=true",
                    "generation.num_inference_steps=50", "generation.guidance_scale=7.0") == 0
    text = caplog.text
    assert "wan21_t2v_14b_lightx2v is distilled for 4 steps at guidance 1" in text, text
    assert "rows other than 4 steps" in text and "rows guidance above 1" in text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="runner"):
        assert _run(tmp_path, f"model.adapters=[{{path: '{f}'}}]", "run.dry_run=true") == 0
    assert "distilled for" not in caplog.text           # as published: no word
    assert job.main(["job=anyflow_batch", "model.source=tiny", "run.dry_run=true",
                     "generation.num_inference_steps=200", f"output.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "200" in err and "32" in err, err


def test_step_reuse_refused_on_distilled_presets_and_cfg_reuse_without_guidance(tmp_path, capsys):
    f = _lora_file(tmp_path)
    assert _run(tmp_path, "step_cache.method=residual", f"model.adapters=[{{path: '{f}'}}]") == 2
    err = capsys.readouterr().err
    assert "step-distilled" in err and "step_cache.method='residual'" in err   # names what was set
    assert job.main(["job=wan_batch", "model.source=tiny", "generation.guidance_scale=1.0",
                     "step_cache.cfg_reuse=fastercache", "run.dry_run=true",
                     f"output.dir={tmp_path}"]) == 2
    assert "no unconditional branch" in capsys.readouterr().err


def test_fp8_leaves_no_16_bit_copy_of_fused_projections():
    """`to_fp8` after `fuse_qkv`: the q/k/v views into the fused 16-bit weight are emptied, so no
    16-bit block weight stays but biases and norms (the full-size measure: tests/test_gpu_adapters)."""
    from diffusers import WanTransformer3DModel

    from compiler.transforms import fuse_qkv, to_fp8
    cfg = dict(_spec().family.denoiser_config(_spec().info, True), num_attention_heads=2,
               attention_head_dim=16, ffn_dim=64, text_dim=32)
    model = WanTransformer3DModel.from_config(cfg).half()
    fuse_qkv(model)
    # a block: to_qkv, to_out (self); to_q, to_kv, to_out (cross); the two feed-forward linears
    assert to_fp8(model, (type(model.blocks[0]).__name__,)) == 2 * 7
    left = {n: p.numel() for n, p in model.blocks.named_parameters()
            if p.dtype == torch.float16 and p.dim() == 2 and p.numel()}
    assert not left, f"16-bit weights left in the blocks: {left}"


def test_adapters_are_output_settings_and_absent_when_none():
    from omegaconf import OmegaConf

    from runner.config import load_config
    from runner.driver.results import settings_id
    base = load_config(["job=demo_video"])
    with_a = load_config(["job=demo_video", "model.adapters=[{path: /x.safetensors}]"])
    other = load_config(["job=demo_video", "model.adapters=[{path: /x.safetensors, scale: 2}]"])
    renamed = load_config(["job=demo_video", "model.adapters=[{path: /x.safetensors, name: y}]"])
    assert len({settings_id(base), settings_id(with_a), settings_id(other)}) == 3
    assert settings_id(renamed) == settings_id(with_a)   # a job-wide adapter's name: nothing
    assert OmegaConf.select(base, "model.adapters") == []


def test_an_adapter_on_s3_is_fetched_once_and_checked(tmp_path, s3_bucket, monkeypatch):
    """A real S3 server (moto): the object copied into the local adapter cache once, keyed by its
    URI, size and modification time, then checked as a local file; a missing key names the
    adapter."""
    from runner.io.storage import resolve
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    f = _lora_file(tmp_path)
    resolve(f"s3://{s3_bucket}/loras").write_file_atomic("style.safetensors", f)
    spec = _spec(adapters=[{"path": f"s3://{s3_bucket}/loras", "weight_name": "style.safetensors"}])
    adapters.check(spec)
    local = adapters.local_file(spec.adapters[0])
    assert local.startswith(str(tmp_path / "home" / ".cache" / "runner" / "adapters"))
    assert open(local, "rb").read() == open(f, "rb").read()
    with pytest.raises(adapters.AdapterError, match=r"model.adapters\['gone'\].*not an object"):
        adapters.check(_spec(adapters=[{"path": f"s3://{s3_bucket}/loras/gone.safetensors"}]))


def test_an_adapter_store_that_does_not_answer_is_exit_3_naming_it(tmp_path, capsys, monkeypatch):
    """An adapter on an S3 endpoint nothing listens at: the store is named, exit 3 (a store
    fault, as an image store's), not exit 2 with the AWS client's own text."""
    from conftest import free_port
    for k, v in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_ACCESS_KEY_ID": "x",
                 "AWS_SECRET_ACCESS_KEY": "x", "AWS_REGION": "us-east-1",
                 "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(k, v)
    assert _run(tmp_path, "model.adapters=[{path: 's3://no-answer/style.safetensors', "
                          "name: mine}]") == 3
    err = capsys.readouterr().err
    assert "model.adapters['mine']" in err and "the adapter's store 'no-answer' refused the " \
        "connection" in err, err


def test_a_full_adapter_cache_is_named_and_leaves_no_partial_file(tmp_path, s3_bucket,
                                                                   monkeypatch):
    """The local copy of an s3:// adapter onto a full disk (a real one: a filled tmpfs): the
    cache directory and the full disk named, no `.tmp` file left behind."""
    import os

    from conftest import full_disk
    from runner.io.storage import resolve
    home = tmp_path / "home"
    cache = home / ".cache" / "runner" / "adapters"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    resolve(f"s3://{s3_bucket}/loras").write_file_atomic("style.safetensors", _lora_file(tmp_path))
    spec = _spec(adapters=[{"path": f"s3://{s3_bucket}/loras/style.safetensors"}])
    with full_disk(cache):
        with pytest.raises(adapters.AdapterError, match=rf"cannot keep its \d+-byte copy in the "
                                                        rf"adapter cache {cache} \(the disk is full"):
            adapters.local_file(spec.adapters[0])
        left = [os.path.join(r, n) for r, _, ns in os.walk(cache) for n in ns if ".tmp" in n]
        assert not left, left


def test_an_s3_adapter_uploaded_again_is_fetched_again(tmp_path, s3_bucket, monkeypatch):
    """An adapter retrained and uploaded again under its URI has as many bytes (the same ranks and
    shapes): the local copy of the first upload must not stand for it."""
    import time

    from runner.io.storage import resolve
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    first, second = _lora_file(tmp_path, seed=1), _lora_file(tmp_path, seed=2)
    assert open(first, "rb").read() != open(second, "rb").read()
    store = resolve(f"s3://{s3_bucket}/loras")
    spec = _spec(adapters=[{"path": f"s3://{s3_bucket}/loras", "weight_name": "style.safetensors"}])
    for f in (first, second):
        store.write_file_atomic("style.safetensors", f)
        assert open(adapters.local_file(spec.adapters[0]), "rb").read() == open(f, "rb").read()
        time.sleep(1.1)             # S3's Last-Modified is in whole seconds


def _wan16():
    """A tiny Wan denoiser whose Linears are multiples of 16 wide (what `to_fp8` converts)."""
    from diffusers import WanTransformer3DModel
    cfg = dict(_spec().family.denoiser_config(_spec().info, True), num_attention_heads=2,
               attention_head_dim=16, ffn_dim=64, text_dim=32)
    torch.manual_seed(0)
    return WanTransformer3DModel.from_config(cfg).half()


@pytest.mark.parametrize("fp8", [True, False])
def test_a_weight_written_after_fusion_and_fp8_is_what_fusing_it_before_gives(fp8):
    """`set_linear_weight` into a fused QKV's rows and a feed-forward Linear, 16-bit or FP8: the
    weights are what converting the model with that weight from the start gives, bit for bit,
    in place (every parameter's and buffer's storage where it was: a compiled step's CUDA graph
    replays from it)."""
    from compiler.kernels.quant import fp8_feedforward
    from compiler.transforms import FP8Linear, fuse_qkv, set_linear_weight, to_fp8
    new = {"blocks.0.attn1.to_k": None, "blocks.1.attn2.to_v": None, "blocks.0.ffn.net.2": None}
    before, after = _wan16(), _wan16()
    for path in new:
        w = before.get_submodule(path).weight
        new[path] = (w.float() * 1.5 + 0.01).half()
        before.get_submodule(path).weight.data.copy_(new[path])
    blocks = (type(before.blocks[0]).__name__,)
    for m in (before, after):
        fuse_qkv(m)
        if fp8:
            to_fp8(m, blocks)
            fp8_feedforward(m)

    def tensors(m):
        return list(m.named_parameters()) + list(m.named_buffers())
    storage = {n: t.data_ptr() for n, t in tensors(after)}
    for path, w in new.items():
        set_linear_weight(after, path, w)
    assert {n: t.data_ptr() for n, t in tensors(after)} == storage   # written in place
    for (n, b1), (_, b2) in zip(tensors(before), tensors(after)):
        assert torch.equal(b1.float(), b2.float()), n
    assert isinstance(after.blocks[0].attn1.to_qkv, FP8Linear) == fp8
    if not fp8:      # the 16-bit weights written are the fused QKV's rows and the Linear's own
        qkv = after.blocks[0].attn1.to_qkv.weight
        d = qkv.shape[0] // 3
        assert torch.equal(qkv[d:2 * d], new["blocks.0.attn1.to_k"])
        return
    # a broken write (rows of the wrong projection) is caught by the same comparison
    set_linear_weight(after, "blocks.0.attn1.to_q", new["blocks.0.attn1.to_k"])
    assert not torch.equal(before.blocks[0].attn1.to_qkv.w8.float(),
                           after.blocks[0].attn1.to_qkv.w8.float())


def _worker(tmp_path, name, adapter_entries, mode="max-optimize"):
    from compiler import parse_options
    from runner.config import CompileConfig, GenerationDefaults, WorkerConfig
    from runner.io.prompts import Constraints
    from runner.serve.worker import Worker
    spec = _spec(adapters=adapter_entries)
    # The denoiser compiled only: adapters change its weights alone. The tiny Wan VAE's cold
    # compile was ~50 of the per-row test's 66 s alone on a 2-core box (the text encoder's and
    # VAE's compile: test_compiler_compile.py; Wan's compiled VAE decode: its gpu tests).
    options = parse_options({"mode": mode, "compile_text_encoder": False, "compile_vae": False})
    cfg = WorkerConfig(model=spec, generation=GenerationDefaults(
                           height=64, width=48, num_frames=5, num_inference_steps=2,
                           guidance_scale=1.0),
                       limits=Constraints(size_factor=16, frame_step=4,
                                          adapters=tuple(a.name for a in spec.adapters
                                                         if a.per_row)),
                       on_empty="error", job_dir=str(tmp_path / name), warmup_steps=2,
                       compile=CompileConfig(options=options, mode=mode))
    w = Worker(0, cfg)
    w.warmup()
    return w


def _items(rows):
    from runner.io.prompts import Item
    return [Item(id=i, prompt=f"a fox {i}", negative_prompt="", seed=k, height=64, width=48,
                 num_frames=5, num_inference_steps=2, guidance_scale=1.0, file="p.parquet",
                 row=k, adapter=a) for k, (i, a) in enumerate(rows)]


def _video(w, i):
    import imageio.v3 as iio
    return iio.imread(f"{w.cfg.job_dir}/media/{i}.mp4")


def test_per_row_adapters_switch_in_place_with_no_recompile_and_equal_single_adapter_jobs(
        tmp_path):
    """Rows naming adapter A (self-attention Linears), B (cross-attention and feed-forward) or
    none, on one compiled worker: 0 recompiles after the warm-up, the weights' storage never
    moved, and every row's video is the one a job with that adapter alone (or none) makes. The
    rows record the adapters' contents as this worker read them (`adapters_sha256`), not what
    their items said."""
    from torch._dynamo.utils import counters
    fa = _lora_file(tmp_path, seed=1, linears=SELF_ATTN)
    fb = _lora_file(tmp_path, seed=2, linears=CROSS_ATTN + FFN)
    rows = [("a1", "A"), ("b1", "B"), ("n1", None), ("b2", "B"), ("a2", "A")]
    entries = [{"path": fa, "name": "A", "per_row": True},
               {"path": fb, "name": "B", "per_row": True}]
    per_row = _worker(tmp_path, "rows", entries)
    graphs = dict(counters["stats"])
    assert graphs.get("unique_graphs", 0) > 0, "nothing was compiled: the check would be empty"
    storage = {n: p.data_ptr() for n, p in per_row.pipe.transformer.named_parameters()}
    stale = [dataclasses.replace(it, adapters_sha256="an old file's") for it in _items(rows)]
    out = per_row.run_shard(stale)
    assert [r["status"] for r in out] == ["ok"] * len(rows)
    assert dict(counters["stats"]) == graphs, "a graph was compiled again after the warm-up"
    assert {n: p.data_ptr() for n, p in per_row.pipe.transformer.named_parameters()} == storage
    sha = adapters.row_hashes(_spec(adapters=entries).adapters, [_sha(fa), _sha(fb)])
    assert {r["id"]: r["adapters_sha256"] for r in out} == {i: sha[a] for i, a in rows}
    # the jobs of one adapter each, and of none: each compiles its own graphs (the same code)
    refs = {"A": _worker(tmp_path, "only_a", [{"path": fa}]),
            "B": _worker(tmp_path, "only_b", [{"path": fb}]), None: _worker(tmp_path, "none", [])}
    plain = _items([(i, None) for i, _ in rows])     # the same rows (seeds, prompts), no adapter
    for name, ref in refs.items():     # the job without adapters makes every row
        ref.run_shard([it for it, (_, a) in zip(plain, rows) if a == name or name is None])
    for i, a in rows:          # every row, of either adapter or none
        assert np.array_equal(_video(per_row, i), _video(refs[a], i)), (i, a)
        # each adapter changes its rows' videos (else a switch that did nothing would pass)
        assert a is None or not np.array_equal(_video(refs[a], i), _video(refs[None], i)), i


def _sha(f) -> str:
    import hashlib
    return hashlib.sha256(open(f, "rb").read()).hexdigest()


def test_a_switch_that_fails_part_way_rewrites_every_weight_next_time(tmp_path, monkeypatch):
    """A switch from A to B that fails after some Linears (out of memory: the worker records the
    rows failed and goes on) must not leave B's weights in place for A's next rows."""
    import compiler.transforms
    fa, fb = _lora_file(tmp_path, seed=1), _lora_file(tmp_path, seed=2)
    rows = _spec(adapters=[{"path": fa, "name": "A", "per_row": True},
                           {"path": fb, "name": "B", "per_row": True}])
    pipe, ref = build_pipeline(rows), build_pipeline(rows)
    switch = adapters.Switch(pipe, rows.adapters, diffs=diff_parameter)
    adapters.Switch(ref, rows.adapters, diffs=diff_parameter).use("A")
    switch.use("A")
    write, calls = compiler.transforms.set_linear_weight, []

    def fails_on_the_11th(*a, **kw):
        calls.append(a[1])
        if len(calls) == 11:
            raise torch.OutOfMemoryError("CUDA out of memory (a test)")
        return write(*a, **kw)
    monkeypatch.setattr(compiler.transforms, "set_linear_weight", fails_on_the_11th)
    with pytest.raises(torch.OutOfMemoryError):
        switch.use("B")
    monkeypatch.setattr(compiler.transforms, "set_linear_weight", write)
    switch.use("A")
    for (n, p), (_, q) in zip(pipe.transformer.named_parameters(),
                              ref.transformer.named_parameters()):
        assert torch.equal(p, q), f"{n} kept B's weights after use('A')"


def test_per_row_adapters_names_are_output_settings():
    """A row names its per-row adapter: two names swapped between their files change what those
    rows are made from, so the settings id changes (a job-wide adapter's name still does not)."""
    from runner.config import load_config
    from runner.driver.results import settings_id

    def ids(n1, n2):
        return settings_id(load_config([
            "job=demo_video",
            f"model.adapters=[{{path: /x.safetensors, name: {n1}, per_row: true}}, "
            f"{{path: /y.safetensors, name: {n2}, per_row: true}}]"]))
    assert ids("A", "B") == ids("A", "B")
    assert ids("A", "B") != ids("B", "A")


def test_rows_name_per_row_adapters_checked_on_the_driver_and_sharded_together(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from runner.io.prompts import plan_shards
    f = _lora_file(tmp_path)
    names = ["A", "B", None, "A", "B", "A"]
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(6)], "prompt": ["a fox"] * 6,
                             "adapter": names}), tmp_path / "p.parquet")
    entries = (f"model.adapters=[{{path: '{f}', name: A, per_row: true}}, "
               f"{{path: '{f}', name: B, scale: 0.5, per_row: true}}]")
    assert _run(tmp_path, entries, f"prompts.path={tmp_path / 'p.parquet'}",
                "run.dry_run=true") == 0
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["a fox"], "adapter": ["C"]}), bad)
    capsys.readouterr()
    assert _run(tmp_path, entries, f"prompts.path={bad}", "run.dry_run=true") == 2
    err = capsys.readouterr().err
    assert "adapter='C' is not a per-row adapter" in err and "['A', 'B']" in err
    # shards never mix adapters, those of one adapter come one after another, and a file's rows
    # interleaving adapters row by row are grouped by adapter (one-row shards were 4.9x slower),
    # each row keeping its id (its output's name) and row
    items = _items(list(zip([f"r{i}" for i in range(6)], names)))
    shards = plan_shards(items, shard_size=4)
    assert [[(it.id, it.row, it.adapter) for it in s.items] for s in shards] == [
        [("r2", 2, None)], [("r0", 0, "A"), ("r3", 3, "A"), ("r5", 5, "A")],
        [("r1", 1, "B"), ("r4", 4, "B")]]
    assert [s.index for s in shards] == list(range(3))
    many = _items([(f"m{i}", "AB"[i % 2]) for i in range(10)])
    assert [len(s) for s in plan_shards(many, shard_size=4)] == [4, 1, 4, 1]
    # resume: a done row ends its adapter's run, as before
    assert [[it.id for it in s.items] for s in plan_shards(many, 4, done={"m2"})] == [
        ["m0"], ["m4", "m6", "m8"], ["m1", "m3", "m5", "m7"], ["m9"]]
