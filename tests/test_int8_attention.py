"""`compiler.kernels.int8_attention` (compile flag `int8-attention`, part of O3): the processor's logic on
the CPU (where `attention8` is exact SDPA), the flag's fallback line, the job's output settings;
the kernel itself at the published shapes on a Hopper GPU (`gpu`)."""

import logging
import math
import os
import subprocess
import sys

import pytest
import torch

from compiler.kernels import int8_attention as ia
from compiler import parse_options
from compiler.pipeline import _gpu_transforms
from compiler.transforms import fuse_qkv
from runner.serve.models import ModelSpec, build_pipeline

gpu = pytest.mark.gpu
hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                            reason="needs a Hopper (sm90) GPU")


def _tiny_wan(dtype=torch.bfloat16):
    """A 2-block Wan of head dim 64 (one of the kernel's; the family's tiny model has 12)."""
    from diffusers import WanTransformer3DModel
    torch.manual_seed(0)
    den = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64,
                                in_channels=4, out_channels=4, text_dim=32, freq_dim=16, ffn_dim=32,
                                num_layers=2, rope_max_seq_len=64, qk_norm="rms_norm_across_heads",
                                cross_attn_norm=True).to(dtype).eval()
    x = torch.randn(1, den.config.in_channels, 3, 8, 8, dtype=dtype)
    ctx = torch.randn(1, 7, den.config.text_dim, dtype=dtype)
    return den, (x, torch.tensor([500]), ctx)


def test_wan_processor_equals_diffusers_where_it_takes_over_and_where_it_falls_back():
    den, args = _tiny_wan()
    fuse_qkv(den)
    with torch.no_grad():
        ref = den(*args).sample
        n = ia.use_int8_attention(den, min_tokens=1)   # every self-attention through attention8
        assert n == len(den.blocks)
        assert all(isinstance(b.attn1.processor, ia.LongSelfAttnProcessor) for b in den.blocks)
        assert not any(isinstance(b.attn2.processor, ia.LongSelfAttnProcessor) for b in den.blocks)
        torch.testing.assert_close(den(*args).sample, ref, atol=0, rtol=0)   # exact SDPA on the CPU
        calls = []
        real = ia.attention8
        ia.attention8 = lambda *a: calls.append(a) or real(*a)
        try:
            den(*args)
            assert len(calls) == len(den.blocks) and calls[0][0].shape[1] == 3 * 4 * 4   # (B, N, H, D)
            den.blocks[0].attn1.processor.min_tokens = 10 ** 6   # shared: every block falls back
            calls.clear()
            torch.testing.assert_close(den(*args).sample, ref, atol=0, rtol=0)
            assert calls == []
        finally:
            ia.attention8 = real


def _tiny_anyflow():
    """The family's tiny AnyFlow denoiser (2 blocks, 2 heads) at head dim 64, one of the
    kernel's (the family's tiny model has 12), in fp32; its inputs: 3 frames of 8x8 latents."""
    from diffusers import AnyFlowTransformer3DModel
    from runner.families.anyflow import denoiser_config
    torch.manual_seed(0)
    den = AnyFlowTransformer3DModel.from_config({**denoiser_config({}, True), "attention_head_dim": 64})
    frames = 3
    x = torch.randn(1, frames, den.config.in_channels, 8, 8)
    ctx = torch.randn(1, 7, den.config.text_dim)
    return den.eval(), (x, torch.full((1, frames), 500.0), torch.full((1, frames), 250.0), ctx)


def _rel(out, ref) -> float:
    return float((out - ref).norm() / ref.norm())


def _on_cpu_in_fp32(monkeypatch):
    """`attention8` takes fp32 too (on the CPU it is exact SDPA), and records its calls."""
    monkeypatch.setattr(ia, "DTYPES", (torch.float16, torch.bfloat16, torch.float32))
    calls, real = [], ia.attention8
    monkeypatch.setattr(ia, "attention8", lambda *a: calls.append(a) or real(*a))
    return calls


def test_anyflow_self_attention_fused_and_on_the_processor_equals_the_untouched_model(monkeypatch):
    """AnyFlow's self-attention (diffusers' `AnyFlowAttention`, its own processor): `fuse_qkv`
    gives it one `to_qkv` GEMM (to_q/k/v never called; cross-attention left alone) and
    `use_int8_attention` the processor in every block, whose q, k, v reach `attention8` (exact
    SDPA on the CPU) and whose fallback (short sequences) is AnyFlow's fused processor: the
    denoiser's output is the untouched model's within fp32 rounding either way."""
    calls = _on_cpu_in_fp32(monkeypatch)
    den, args = _tiny_anyflow()
    with torch.no_grad():
        ref = den(*args).sample
        assert list(ia.self_attentions(den)) == ["blocks.0.attn1", "blocks.1.attn1"]   # not attn2
        assert ia.outside_domain(den) == {}       # diffusers' RMSNorm over all heads' channels
        assert fuse_qkv(den) == len(den.blocks)
        assert all(hasattr(b.attn1, "to_qkv") and not hasattr(b.attn2, "to_qkv") for b in den.blocks)
        used = {n: 0 for n in ("to_q", "to_k", "to_v", "to_qkv")}
        for b in den.blocks:
            for n in used:
                getattr(b.attn1, n).register_forward_hook(lambda *_, n=n: used.__setitem__(n, used[n] + 1))
        assert _rel(den(*args).sample, ref) <= 1e-5
        assert used == {"to_q": 0, "to_k": 0, "to_v": 0, "to_qkv": len(den.blocks)}   # one GEMM
        assert ia.use_int8_attention(den, min_tokens=1) == len(den.blocks)
        assert all(isinstance(b.attn1.processor, ia.LongSelfAttnProcessor) for b in den.blocks)
        assert not any(isinstance(b.attn2.processor, ia.LongSelfAttnProcessor) for b in den.blocks)
        assert _rel(den(*args).sample, ref) <= 1e-5
        assert len(calls) == len(den.blocks) and calls[0][0].shape == (1, 3 * 4 * 4, 2, 64)
        assert used["to_q"] == 0 and used["to_qkv"] == 2 * len(den.blocks)
        den.blocks[0].attn1.processor.min_tokens = 10 ** 6   # shared: every block falls back
        calls.clear()
        assert _rel(den(*args).sample, ref) <= 1e-5 and calls == []


def _no_rotary(attn, hidden_states, rotary_emb):
    return ia.self_attention_qkv(attn, hidden_states, None)


def _kv_swapped(attn, hidden_states, rotary_emb):
    q, k, v = ia.self_attention_qkv(attn, hidden_states, rotary_emb)
    return q, v, k


@pytest.mark.parametrize("broken", [_no_rotary, _kv_swapped], ids=lambda f: f.__name__[1:])
def test_the_anyflow_check_fails_a_processor_with_broken_q_k_v(monkeypatch, broken):
    """The comparison above is not blind: the same processor making q, k, v wrongly (rotary
    embedding skipped: 0.7 % error; k and v swapped: 5 %) is far outside fp32 rounding."""
    _on_cpu_in_fp32(monkeypatch)
    den, args = _tiny_anyflow()
    with torch.no_grad():
        ref = den(*args).sample
        fuse_qkv(den)
        ia.use_int8_attention(den, min_tokens=1)
        den.blocks[0].attn1.processor.qkv = broken    # shared by every block
        assert _rel(den(*args).sample, ref) > 1e-3


def _complex_nodes(fn, *args) -> list[str]:
    """The ops of `fn`'s traced graph that make a complex tensor (what Inductor cannot generate)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    return [str(n.target) for n in make_fx(fn)(*args).graph.nodes
            if n.op == "call_function" and getattr(n.meta.get("val"), "is_complex", lambda: False)()]


def test_complex_rope_is_anyflows_rotary_embedding_in_real_pointwise_math():
    """`complex_rope` against diffusers' `apply_rotary_emb` on AnyFlow's own frequency table
    (complex128, 3 x 6 x 10 latent positions, head dim 128): fp32 within 1e-6, fp16 equal but for
    last-bit ties; its traced graph makes no complex tensor, where diffusers' does (the reason:
    Inductor leaves complex ops to eager kernels). The conjugate rotation (a sign slip) is far off."""
    from diffusers.models.transformers.transformer_anyflow import AnyFlowRotaryPosEmbed, apply_rotary_emb
    heads, d, (f, h, w) = 2, 128, (3, 6, 10)
    freqs = AnyFlowRotaryPosEmbed(d, (1, 2, 2), 64)(
        {"total_frames": f, "full_frame_shape": (h, w), "full_token_per_frame": h * w},
        torch.device("cpu"))["query"]                          # (1, 1, N, D/2) complex128
    assert freqs.dtype == torch.complex128 and freqs.shape == (1, 1, f * h * w, d // 2)
    x = torch.randn(1, f * h * w, heads, d, generator=torch.Generator().manual_seed(0))  # (B, N, H, D)
    ref = apply_rotary_emb(x.transpose(1, 2), freqs).transpose(1, 2)   # diffusers': (B, H, N, D)
    assert _rel(ia.complex_rope(x, freqs.transpose(1, 2)), ref) <= 1e-6
    x16 = x.half()
    got = ia.complex_rope(x16, freqs.transpose(1, 2)).float()
    want = apply_rotary_emb(x16.transpose(1, 2), freqs).transpose(1, 2).float()
    ulp = torch.finfo(torch.float16).eps * want.abs().clamp_min(2 ** -14)
    assert ((got - want).abs() <= ulp).all() and (got != want).float().mean() < 1e-3
    conj = ia.complex_rope(x, freqs.transpose(1, 2).conj().resolve_conj())
    assert _rel(conj, ref) > 0.1
    assert _complex_nodes(ia.complex_rope, x, freqs.transpose(1, 2)) == []
    assert _complex_nodes(lambda x, f: apply_rotary_emb(x, f), x.transpose(1, 2), freqs) != []


def test_o3_on_the_cpu_takes_anyflow_self_attentions_as_the_kernel_candidates(caplog):
    """compile_pipe("O3") on the family's tiny AnyFlow pipeline on the CPU: its self-attentions
    are fused and are int8-attention's (one per block, all inside the domain), and the flag is
    off for want of CUDA, said as for Wan (the report's `int8_attention_off`, one line)."""
    from compiler import compile_pipe
    pipe = build_pipeline(ModelSpec("anyflow_wan21_t2v_1_3b", source="tiny"))
    den = pipe.transformer
    assert ia.has_long_attention(den) and ia.outside_domain(den) == {}
    assert list(ia.self_attentions(den)) == [f"blocks.{i}.attn1" for i in range(len(den.blocks))]
    with caplog.at_level(logging.WARNING, logger="compiler"):
        compile_pipe(pipe, "O3")
    report = pipe._compile_report
    why = "no CUDA device (cpu)"
    assert report["int8_attention_off"] == why and "int8_attention" not in report
    assert report["fused_attention"] == len(den.blocks)
    assert [r.getMessage() for r in caplog.records if "int8 attention off" in r.getMessage()] == \
        [f"int8 attention off, Wan self-attention stays on SDPA (cuDNN): {why}"]
    assert all(isinstance(b.attn1.processor, ia.FusedAnyFlowAttnProcessor) for b in den.blocks)


def test_signed_hadamard_is_orthogonal_and_exact_in_half_precision():
    for d in (64, 128):
        h = ia.signed_hadamard(d, "cpu", torch.float16)
        assert set(h.unique().tolist()) == {-1.0, 1.0}
        torch.testing.assert_close(h.double() @ h.double().T / d, torch.eye(d, dtype=torch.float64))


def test_the_flag_falls_back_with_one_line_where_the_kernel_cannot_run(monkeypatch, caplog):
    """`_gpu_transforms` (compile_pipe's CUDA step) on a tiny Wan: the kernel missing -> one warning
    naming why, cuDNN's processors stay; available -> every self-attention gets the processor."""
    opts = parse_options("O3")
    assert opts.has("int8_attention") and not opts.lossless
    assert not parse_options("cudagraphs:cache-all:max-optimize:low-precision").has("int8_attention")
    for unavailable in ("no nvcc on PATH (test)", None):
        den, _ = _tiny_wan()
        fuse_qkv(den)
        monkeypatch.setattr(ia, "unavailable", lambda why=unavailable: why)
        report: dict = {}
        with caplog.at_level(logging.WARNING, logger="compiler"):
            caplog.clear()
            _gpu_transforms(den, opts, True, report)
        if unavailable:
            assert report["int8_attention_off"] == unavailable and "int8_attention" not in report
            assert [r.getMessage() for r in caplog.records if "int8 attention off" in r.getMessage()] == \
                [f"int8 attention off, Wan self-attention stays on SDPA (cuDNN): {unavailable}"]
            assert not any(isinstance(b.attn1.processor, ia.LongSelfAttnProcessor) for b in den.blocks)
        else:
            assert report["int8_attention"] == len(den.blocks) and "int8_attention_off" not in report


def _strip_qk_norm(attn, which=("norm_q", "norm_k")):
    """An attention whose q / k are not normalised per token, as a model without qk norm has it
    (diffusers 0.42 builds Wan's RMS norms whatever the config's `qk_norm` says)."""
    for name in which:
        setattr(attn, name, torch.nn.Identity())


def test_the_domain_is_read_from_the_attention_q_and_k_normalised_per_token():
    """`domain_miss`: Wan's RMS norm across heads is inside; so is a per-head norm or a layer
    norm; no norm on q or on k, or a norm over other channels, is outside, whatever the module's
    class or the model's family."""
    den, _ = _tiny_wan()
    attn = den.blocks[0].attn1
    assert isinstance(attn.norm_q, torch.nn.RMSNorm) and attn.norm_q.normalized_shape == (128,)
    assert ia.domain_miss(attn) is None and ia.outside_domain(den) == {}
    assert list(ia.self_attentions(den)) == ["blocks.0.attn1", "blocks.1.attn1"]   # not attn2
    attn.norm_q, attn.norm_k = torch.nn.RMSNorm(64), torch.nn.LayerNorm(64)      # per head
    assert ia.domain_miss(attn) is None
    from diffusers.models.normalization import RMSNorm
    attn.norm_q = RMSNorm(128, eps=1e-6)                                          # diffusers' own
    assert ia.domain_miss(attn) is None
    attn.norm_k = torch.nn.RMSNorm(32)                                            # other channels
    assert ia.domain_miss(attn) == "k not normalised per token (norm_k: RMSNorm)"
    _strip_qk_norm(attn, ("norm_k",))
    assert ia.domain_miss(attn) == "k not normalised per token (norm_k: Identity)"
    _strip_qk_norm(attn)
    assert ia.domain_miss(attn) == "q not normalised per token (norm_q: Identity)"
    assert ia.outside_domain(den) == {"blocks.0.attn1": "q not normalised per token (norm_q: Identity)"}
    assert ia.use_int8_attention(den) == 1                                        # block 1 only
    assert isinstance(den.blocks[1].attn1.processor, ia.LongSelfAttnProcessor)
    assert not isinstance(den.blocks[0].attn1.processor, ia.LongSelfAttnProcessor)


def test_the_flag_keeps_attentions_outside_its_domain_lossless_with_one_line(monkeypatch, caplog):
    """compile_pipe's CUDA step on a tiny Wan with and without qk norm (the kernel available):
    with it every self-attention gets the processor; without it on one block, that block keeps
    diffusers' processor and one line says so; without it anywhere, the flag is off (one line,
    the reason in the report, no kernel build asked for)."""
    opts = parse_options("O3")
    asked = []
    monkeypatch.setattr(ia, "unavailable", lambda: asked.append(1))   # None: the kernel runs
    for stripped in ((), (1,), (0, 1)):
        den, _ = _tiny_wan()
        fuse_qkv(den)
        for i in stripped:
            _strip_qk_norm(den.blocks[i].attn1)
        report: dict = {}
        asked.clear()
        with caplog.at_level(logging.WARNING, logger="compiler"):
            caplog.clear()
            _gpu_transforms(den, opts, True, report)
        lines = [r.getMessage() for r in caplog.records if "int8 attention" in r.getMessage()]
        on = [isinstance(b.attn1.processor, ia.LongSelfAttnProcessor) for b in den.blocks]
        if not stripped:
            assert (report["int8_attention"], on, lines) == (2, [True, True], [])
            assert "int8_attention_lossless" not in report
        elif stripped == (1,):
            assert (report["int8_attention"], report["int8_attention_lossless"], on) == (1, 1, [True, False])
            assert lines == ["int8 attention: 1 self-attention(s) stay on SDPA (lossless), outside its "
                             "domain: q not normalised per token (norm_q: Identity) (blocks.1.attn1, ...)"]
        else:
            why = "no self-attention inside its domain: q not normalised per token (norm_q: Identity)"
            assert report["int8_attention_off"] == why and "int8_attention" not in report
            assert lines == [f"int8 attention off, Wan self-attention stays on SDPA (cuDNN): {why}"]
            assert on == [False, False] and asked == []


def test_unavailable_names_the_reason_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: the reason is about its GPU or nvcc")
    ia._unavailable.cache_clear()
    assert ia.unavailable() == "no CUDA device"


def test_output_settings_carry_the_flag_only_where_it_changes_outputs():
    from omegaconf import OmegaConf
    from runner.driver.results import settings_id, int8_attention
    assert int8_attention("O3", "wan21_t2v_1_3b") and int8_attention("O3", "wan22_ti2v_5b")
    assert int8_attention("O3", "anyflow_wan21_t2v_1_3b")           # Wan 2.1's DiT, its own class
    assert not int8_attention("O3", "pixart_alpha_1024")            # short sequences: unchanged
    assert not int8_attention("O2", "wan21_t2v_1_3b")
    cfg = lambda preset, mode: OmegaConf.create({"model": {"preset": preset, "source": "random", "path": None,
                                                           "dtype": "float16", "mask_feature": True},
                                                 "output": {"fps": 16}, "compile": {"mode": mode}})
    o3_no_int8 = "cudagraphs:cache-all:max-optimize:low-precision"
    assert settings_id(cfg("wan21_t2v_1_3b", "O3")) != settings_id(cfg("wan21_t2v_1_3b", o3_no_int8))
    assert settings_id(cfg("pixart_alpha_1024", "O3")) == settings_id(cfg("pixart_alpha_1024", o3_no_int8))


def test_a_cpu_worker_falls_back_and_its_rows_are_recorded_without_the_kernel(
        tmp_path, write_prompts, caplog):
    """The real worker (tiny Wan, compiled on the CPU with the flag): the kernel cannot run, so
    its ready info says so and why, the compiler's one line is logged, each row it makes says
    `int8_attention: false`, and the job's record puts those rows under the settings without
    the kernel, which a rerun counts done (`Plan.fallback`: remade only where the kernel runs)."""
    from runner.driver import checks, job
    from runner.config import load_config, split
    from runner.driver.results import Results, fallback_settings_id, settings_id
    from runner.serve.worker import Worker
    p = write_prompts({"prompt": ["a cat", "a dog walking"]}, name="p.parquet")
    cfg = load_config(["job=wan_batch", "model.source=tiny", f"prompts.path={p}",
                       f"output.dir={tmp_path}", "generation.height=64", "generation.width=48",
                       "generation.num_frames=5", "generation.num_inference_steps=2",
                       "run.batch_size=2", "compile.mode=int8-attention",
                       "compile.compile_text_encoder=false", "compile.compile_vae=false"])
    j = split(cfg)
    checked = checks.check_input(j)
    # (the tiny model loads before `compiler.prewarm`'s thread has imported Inductor: compile_pipe
    # waits for those imports, else it raced them: "cannot import name 'lowering'")
    w = Worker(0, job.worker_config(j, checked.limits, on_gpu=False))
    with caplog.at_level(logging.WARNING, logger="compiler"):
        ready = w.warmup()
    why = "no CUDA device (cpu)"
    assert (ready["int8_attention"], ready["int8_attention_off"]) == (False, why)
    assert [r.getMessage() for r in caplog.records if "int8 attention off" in r.getMessage()] == \
        [f"int8 attention off, Wan self-attention stays on SDPA (cuDNN): {why}"]
    assert w.metrics()["int8_attention"] is False
    made = w.run_shard(checked.items)
    assert [(r["status"], r["int8_attention"]) for r in made] == [("ok", False)] * 2
    results = Results(j["output"].job_dir, settings_id(cfg), fallback_settings_id(cfg))
    results.add(made)
    assert {r["settings"] for r in results.rows.values()} == {fallback_settings_id(cfg)}
    plan = Results(j["output"].job_dir, settings_id(cfg), fallback_settings_id(cfg)).load() \
        .plan(checked.items)
    assert plan.done == {it.id for it in checked.items}
    assert [it.id for it in plan.fallback] == [it.id for it in checked.items] and not plan.changed


# The quantisation's layout (what the sm90 kernel reads), written out in torch: K's mean over
# tokens subtracted, Q and K times R / sqrt(D) in INT8 with the kernel's per-thread scales, V / its
# per-channel |max| / 448 in e4m3, transposed with each 16 tokens permuted. Run by the CPU test
# (Triton's interpreter, in a subprocess) and the gpu test (the compiled kernels) alike. The layout is
# the Triton code's, transcribed: that the sm90 kernel reads it so, the attention tests below show.
_QUANT_REFERENCE = r"""
import torch
from compiler.bench import quant8_probe
from compiler.kernels import int8_attention as ia


def reference(q, k, v):
    b, n, h, d = q.shape
    r = ia.signed_hadamard(d, str(q.device), q.dtype).float()
    km = k.mean(dim=1)                                                    # (B, H, D)
    out = []
    for x, mean, rows in ((q, None, 64), (k, km, 128)):
        t = x if mean is None else x - mean[:, None]                      # rounded to x's dtype
        y = (t.float() @ r) * d ** -0.5                                   # (B, N, H, D)
        nb = (n + rows - 1) // rows
        y = torch.cat([y, y.new_zeros(b, nb * rows - n, h, d)], 1)         # padding rows: 0
        amax = y.abs().amax(-1).transpose(1, 2)                           # (B, H, nb * rows)
        if mean is None:   # rows 16i + 8j + r of a 64-row block share scale (i, r)
            s = amax.reshape(b, h, nb, 4, 2, 8).amax(4) / 127.0 + 1e-7        # (B, H, nb, 4, 8)
            srow = s[:, :, :, :, None, :].expand(b, h, nb, 4, 2, 8)
        else:              # rows 8i + 2t + j of a 128-row block share scale t
            s = amax.reshape(b, h, nb, 16, 4, 2).amax((3, 5)) / 127.0 + 1e-7    # (B, H, nb, 4)
            srow = s[:, :, :, None, :, None].expand(b, h, nb, 16, 4, 2)
        qv = y / srow.reshape(b, h, nb * rows).transpose(1, 2)[..., None]
        qv = (qv + torch.where(qv >= 0, 0.5, -0.5)).to(torch.int8)[:, :n]   # half away from zero
        out += [qv, s.reshape(b, h, -1)]
    vs = (v.abs().amax(1).float() / 448.0).clamp_min(1e-12)               # (B, H, D)
    np_ = (n + 127) // 128 * 128
    p = torch.arange(np_, device=q.device)
    pq = p % 16
    tok = p // 16 * 16 + (pq // 2 % 2) * 8 + (pq // 4) * 2 + pq % 2         # kernel position -> token
    vp = torch.cat([v.float(), v.new_zeros(b, np_ - n, h, d).float()], 1)[:, tok]   # (B, Np, H, D)
    v8 = (vp / vs[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).permute(0, 2, 3, 1)
    return out[0], out[1], out[2], out[3], v8, vs


def check(got, want):
    # the Hadamard sums in another order: a value may round to the next INT8 step now and then;
    # V / its scale may differ in the last bit (division), so an FP8 value may be the next one
    for i in (0, 2):
        step = (got[i].int() - want[i].int()).abs()
        assert step.max() <= 1 and (step == 0).float().mean() >= 0.999, (i, int(step.max()))
        torch.testing.assert_close(got[i + 1], want[i + 1], rtol=1e-5, atol=0)
    assert got[4].shape == want[4].shape
    a, b = got[4].float(), want[4].float()
    assert (a == b).float().mean() >= 0.999 and ((a - b).abs() <= b.abs() / 8).all(), (a - b).abs().max()
    assert torch.equal(got[5], want[5])


def inputs(b, n, h, d, device, exact_v=False):
    # the probe's: q, k with channel outliers, v a strided view of a fused projection, fp16
    q, k, v = quant8_probe.inputs(b, n, h, d, torch.Generator(device).manual_seed(0))
    if exact_v:   # e4m3 values times 2^e per channel, |max| 448 * 2^e: V / its scale is exact
        e = 2.0 ** (torch.arange(d, device=device) % 5 - 2)
        v.copy_((100 * v.float()).clamp(-448, 448).to(torch.float8_e4m3fn).float() * e)
        v[:, 0] = 448 * e
    return q, k, v
"""

_QUANT_CASES = r"""
# V's values exact in e4m3 (the interpreter's float8 cast does not round to nearest even: 31 -> 16)
for b, n, h, d in ((1, 300, 2, 64), (2, 200, 1, 128), (1, 129, 3, 128), (2, 300, 3, 64)):
    x = inputs(b, n, h, d, "cpu", exact_v=True)
    want = reference(*x)
    got = ia.quantize(*x)
    check(got, want)
    assert torch.equal(got[4].view(torch.uint8), want[4].view(torch.uint8))
    check(ia.quantize(*x, stats=(128, 4), rot_q=(4, 4), rot_k=(1, 4)), want)
    for i, wrong in ((4, want[4].flip(-1)), (0, want[0].roll(1, 1)), (3, want[3].roll(1, -1))):
        try:                  # V's tokens reversed, Q's rows or K's scales shifted by one
            check(got, [wrong if j == i else w for j, w in enumerate(want)])
        except AssertionError:
            continue
        raise SystemExit(f"check() passed a wrong output {i}")
# a rotation program's tiles past the last write no scale: a buffer longer than the scales keeps
# its sentinel tail (5 Q tiles of 64 rows, 3 programs of 2 tiles; 3 K tiles of 128, 2 programs)
_, rotate_quant, _ = ia._kernels()
b, n, h, d = 1, 300, 2, 64
q, k, _ = inputs(b, n, h, d, "cpu")
km = k.mean(1)
r = ia.signed_hadamard(d, "cpu", q.dtype)
for x, rows, per, key in ((q, 64, 32, False), (k, 128, 4, True)):
    nb = (n + rows - 1) // rows
    sc = torch.full((b, h, (nb + 1) * per), -1.0)
    out = torch.empty(x.shape, dtype=torch.int8)
    rotate_quant[((nb + 1) // 2, h, b)](x, km, r, out, sc, n, *x.stride()[:3], *out.stride()[:3], *sc.stride()[:2],
                                        *km.stride()[:2], d ** -0.5, D=d, KEY=key, TILES=2, num_warps=4)
    assert (sc[..., nb * per:] == -1).all() and (sc[..., :nb * per] > 0).all(), key
print("ok")
"""


def test_quantize_under_the_interpreter_equals_its_layout_in_torch():
    """`quantize`'s Triton kernels (K/V statistics, Q and K rotation with two tiles a program, V to
    FP8) run by Triton's CPU interpreter on ragged token counts (a last program half past the end),
    B = 1-2, head dims 64 and 128, V a strided view, at the default launch settings and others:
    the layout written out in torch, INT8 values within one step (>= 99.9 % equal), scales to
    1e-5, V's FP8 bytes and scales equal; a reversed V order fails the same check. And the
    programs' tiles past the end write no scale (a sentinel tail kept). Triton is a dependency on
    Linux: there a missing Triton fails the test."""
    if not sys.platform.startswith("linux"):
        pytest.skip("Triton is a dependency on Linux only")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", _QUANT_REFERENCE + _QUANT_CASES], env=env, capture_output=True,
                       text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr[-2000:]


# --- on a Hopper GPU -------------------------------------------------------------------------

SHAPES = {"wan21_81f": (1, 12, 32760, 128), "wan22_ti2v": (1, 24, 27280, 128),
          "wan21_14b": (1, 40, 32760, 128), "odd_tokens": (2, 12, 16411, 128), "head_dim_64": (1, 8, 20001, 64)}


def _qkv(b, h, n, d, outliers, gen):
    qkv = torch.randn(b, n, 3, h, d, device="cuda", generator=gen) * 1.3
    if outliers:   # 4 channels of Q/K with constant offsets of 20-50x the std
        ch = torch.randperm(d, device="cuda", generator=gen)[:4]
        off = 1.3 * (20 + 30 * torch.rand(2, h, 4, device="cuda", generator=gen))
        qkv[:, :, 0, :, ch] += 0.5 * off[0]
        qkv[:, :, 1, :, ch] += off[1]
    qkv = qkv.half()
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]


@gpu
@hopper
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("outliers", [False, True])
def test_attention8_against_fp32_attention(shape, outliers):
    """Output cosine >= 0.999 against cuDNN fp16 and relative error <= 5 % against an fp32
    reference (256 query rows), Gaussian inputs and Q/K with outlier channels; every row written."""
    assert ia.unavailable() is None, ia.unavailable()
    gen = torch.Generator("cuda").manual_seed(0)
    b, h, n, d = SHAPES[shape]
    q, k, v = _qkv(b, h, n, d, outliers, gen)
    out = ia.attention8(q, k, v)
    assert out.shape == q.shape and torch.isfinite(out).all()
    ref16 = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    cos = torch.nn.functional.cosine_similarity(out.float().flatten(), ref16.float().flatten(), dim=0)
    assert cos >= 0.999, float(cos)
    rows = torch.randperm(n, device="cuda", generator=gen)[:256]
    qs, kk, vv = (t.float().transpose(1, 2) for t in (q[:, rows], k, v))
    ref = torch.softmax(qs @ kk.transpose(-1, -2) / math.sqrt(d), -1) @ vv
    err = (out[:, rows].float().transpose(1, 2) - ref).norm() / ref.norm()
    assert err <= 0.05, float(err)


@gpu
@hopper
@pytest.mark.parametrize("shape", ["wan21_81f", "wan21_14b", "odd_tokens", "head_dim_64"])
def test_quantize_equals_its_layout_in_torch(shape):
    """The compiled quantisation kernels at the published shapes, Q/K with outlier channels and V
    a strided view with outlier channels: the layout written out in torch (`_QUANT_REFERENCE`),
    INT8 values within one step (>= 99.9 % equal), scales to 1e-5, FP8 values within one step
    (>= 99.9 % equal), V's scales equal."""
    ns = {}
    exec(_QUANT_REFERENCE, ns)
    b, h, n, d = SHAPES[shape]
    x = ns["inputs"](b, n, h, d, "cuda")
    ns["check"](ia.quantize(*x), ns["reference"](*x))


# The kernel's domain (issue 61; `int8_attention.domain_miss`): perturbations of Gaussian q, k, v
# at Wan 2.1's 81-frame shape, alone and combined, against fp32 attention. Cosines measured on an
# H200 (seeds 0-2) are in each list; the bound is the kernel test's (cosine >= 0.999, <= 5 %).
COS_MIN, ERR_MAX = 0.999, 0.05
INSIDE = [(),                                           # 0.99923
          ("k_offsets",), ("q_outliers",), ("sharp",),  # 0.99924, 0.99904-0.99910, 0.99901
          ("v_outliers",),                              # 0.99925
          ("k_offsets", "q_outliers", "v_outliers"),    # 0.99913
          ("k_offsets", "sharp", "v_outliers")]         # 0.99902
# Outside: key token spikes (why the rule), and Q outliers with a sharp softmax together. With q
# and k through a per-token norm the spiked ones hold again (where the rest is inside).
OUTSIDE = {("k_spikes",): 0.99923,                                   # raw 0.9976-0.9980
           ("k_offsets", "k_spikes", "v_outliers"): 0.99922,         # raw 0.9836-0.9862
           ("k_offsets", "q_outliers", "sharp", "v_outliers", "k_spikes"): None,   # raw 0.9594
           ("q_outliers", "sharp"): None}                            # raw 0.9979, normed 0.9977


def _perturbed(kinds, gen, b=2, h=12, n=32760, d=128):
    """q, k, v (B, N, H, D) fp16: Gaussian (q, k of std 1.3), then each kind in `kinds`:
    k_offsets: 4 channels of K offset by 20-50x the std; q_outliers: 4 channels of Q 20x larger;
    sharp: the logits x4 (Q x4); v_outliers: 4 channels of V 20x larger; k_spikes: 0.1 % of the
    key tokens 20-50x larger."""
    q, k = (torch.randn(b, n, h, d, device="cuda", generator=gen) * 1.3 for _ in range(2))
    v = torch.randn(b, n, h, d, device="cuda", generator=gen)
    ch = lambda: torch.randperm(d, device="cuda", generator=gen)[:4]
    if "k_offsets" in kinds:
        off = 1.3 * (20 + 30 * torch.rand(h, 4, device="cuda", generator=gen))
        k[..., ch()] += off * torch.where(torch.rand(h, 4, device="cuda", generator=gen) < 0.5, -1.0, 1.0)
    if "q_outliers" in kinds:
        q[..., ch()] *= 20
    if "sharp" in kinds:
        q *= 4
    if "v_outliers" in kinds:
        v[..., ch()] *= 20
    if "k_spikes" in kinds:
        tokens = torch.randperm(n, device="cuda", generator=gen)[:max(1, n // 1000)]
        k[:, tokens] *= 20 + 30 * torch.rand(len(tokens), 1, 1, device="cuda", generator=gen)
    return q.half(), k.half(), v.half()


def _per_token_norm(x):
    """An RMS norm of each token over all heads' channels (Wan's `rms_norm_across_heads`) whose
    weight keeps the tensor's overall RMS: spikes between tokens go, channel structure stays."""
    x = x.float()
    return (x * (x.square().mean().sqrt() / x.square().mean((2, 3), keepdim=True).sqrt())).half()


def _rows(n, gen, rows=256):
    return torch.randperm(n, device="cuda", generator=gen)[:rows]


def _exact(q, k, v, rows):
    """fp32 attention of the query rows `rows`: (B, H, len(rows), D)."""
    qs, kk, vv = (t.float().transpose(1, 2) for t in (q[:, rows], k, v))
    return torch.softmax(qs @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ vv


def _score(out, ref, rows):
    """(cosine, relative error) of `out` (B, N, H, D) on `rows` against `ref` from `_exact`."""
    got = out[:, rows].float().transpose(1, 2)
    cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0)
    return float(cos), float((got - ref).norm() / ref.norm())


def _within(score) -> bool:
    return score[0] >= COS_MIN and score[1] <= ERR_MAX


def _against_fp32(q, k, v, gen):
    rows = _rows(q.shape[1], gen)
    out = ia.attention8(q, k, v)
    assert torch.isfinite(out).all()
    return _score(out, _exact(q, k, v, rows), rows)


def _name(kinds):
    return "+".join(kinds) or "gaussian"


@gpu
@hopper
@pytest.mark.parametrize("kinds", INSIDE, ids=_name)
def test_attention8_holds_inside_its_domain(kinds):
    """Each perturbation alone and the combinations measured to hold: cosine >= 0.999 and
    relative error <= 5 % against fp32 attention (issue 61 measured each alone >= 0.999)."""
    assert ia.unavailable() is None, ia.unavailable()
    gen = torch.Generator("cuda").manual_seed(0)
    score = _against_fp32(*_perturbed(kinds, gen), gen)
    print(f"{_name(kinds)}: cosine {score[0]:.5f}, relative error {score[1]:.4f}")
    assert _within(score), score


@gpu
@hopper
@pytest.mark.parametrize("kinds", OUTSIDE, ids=_name)
def test_attention8_fails_outside_its_domain(kinds):
    """Where the kernel does not hold, pinned: key token spikes (issue 61: 0.989 with K offsets
    and V outliers, 0.954 with all five), the reason `int8-attention` takes only attentions
    whose q and k are normalised per token; and Q outlier channels with a sharp softmax
    together. The spiked inputs with q and k through a per-token RMS norm, as such attentions
    have them, hold again where the rest is inside (`OUTSIDE`'s figure: measured normed)."""
    assert ia.unavailable() is None, ia.unavailable()
    gen = torch.Generator("cuda").manual_seed(0)
    q, k, v = _perturbed(kinds, gen)
    raw = _against_fp32(q, k, v, gen)
    normed = _against_fp32(_per_token_norm(q), _per_token_norm(k), v, gen)
    print(f"{_name(kinds)}: cosine {raw[0]:.5f} (error {raw[1]:.4f}) as they come; "
          f"{normed[0]:.5f} ({normed[1]:.4f}) with q and k normalised per token")
    assert raw[0] < COS_MIN, raw          # if this holds one day, the domain may widen
    if OUTSIDE[kinds] is not None:
        assert _within(normed), normed


@gpu
@hopper
def test_attention8_replays_in_a_cuda_graph_and_is_faster_than_cudnn_at_wan_81_frames():
    """Every launch goes to the capturing stream: a replay on new inputs equals a direct call (the
    upstream kernel launched on the legacy stream: stale outputs). And at Wan 2.1's 480x832 x 81
    shape (2 x 12 x 32,760 x 128) it beats cuDNN fp16, quantisation included (1.40x measured)."""
    import triton
    gen = torch.Generator("cuda").manual_seed(1)
    q, k, v = (t.contiguous() for t in _qkv(2, 12, 32760, 128, False, gen))
    ia.attention8(q, k, v)
    g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ia.attention8(q, k, v)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            out = ia.attention8(q, k, v)
    for t, new in zip((q, k, v), _qkv(2, 12, 32760, 128, True, gen)):
        t.copy_(new)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ia.attention8(q, k, v))
    t8 = triton.testing.do_bench(lambda: ia.attention8(q, k, v), return_mode="median")
    t16 = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v))), return_mode="median")
    print(f"attention8 {t8:.2f} ms, cuDNN fp16 {t16:.2f} ms: {t16 / t8:.3f}x")
    assert t16 / t8 >= 1.2   # 1.40 measured on an H100; the bound leaves room for noise


class _CheckedAttention:
    """A Wan self-attention processor for tests: each call's q, k, v as the model makes them
    (`self_attention_qkv`), each of `attends` scored against fp32 attention on 256 query rows
    (`scores[name]`, one (cosine, error) per call), and the exact output returned, so every
    later layer sees the model's own activations."""

    def __init__(self, attends: dict, gen):
        self.attends, self.gen = attends, gen
        self.scores = {name: [] for name in attends}

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None):
        q, k, v = ia.self_attention_qkv(attn, hidden_states, rotary_emb)
        rows = _rows(q.shape[1], self.gen)
        ref = _exact(q, k, v, rows)
        for name, attend in self.attends.items():
            self.scores[name].append(_score(attend(q, k, v), ref, rows))
        out = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
        return attn.to_out[1](attn.to_out[0](out.transpose(1, 2).flatten(2, 3).type_as(q)))


BROKEN = {"zeros": lambda q, k, v: torch.zeros_like(q),
          "mean_v": lambda q, k, v: v.float().mean(1, keepdim=True).expand_as(v)}


@gpu
@hopper
def test_full_size_wan_self_attentions_on_attention8_match_exact_attention_per_layer():
    """Wan 2.1 1.3B at full size (random weights), 480x832 x 81 frames: all 30 self-attentions
    are inside the kernel's domain, and on the q, k, v each of them makes in one denoiser call,
    `attention8`'s output is within the kernel test's bound of fp32 attention (cosine >= 0.999,
    error <= 5 %; measured on an H200: >= 0.99999, <= 0.5 %), layer by layer. The same check
    fails a broken attention in every layer: zeros (cosine 0) and mean(V) (0.79-0.95, error
    30-61 %). (The model's output alone could not tell: with random weights it stays within
    cosine 0.9993 of the reference with every self-attention returning zeros.)"""
    pipe = build_pipeline(ModelSpec("wan21_t2v_1_3b", source="random", device="cuda"))
    den = pipe.transformer
    assert len(ia.self_attentions(den)) == 30 and ia.outside_domain(den) == {}
    gen = torch.Generator("cuda").manual_seed(0)
    check = _CheckedAttention({"attention8": ia.attention8, **BROKEN}, gen)
    for attn in ia.self_attentions(den).values():
        attn.set_processor(check)
    x = torch.randn(1, 16, 21, 60, 104, device="cuda", dtype=torch.float16, generator=gen)
    ctx = torch.randn(1, 512, 4096, device="cuda", dtype=torch.float16, generator=gen)
    with torch.no_grad():
        den(x, torch.tensor([500], device="cuda"), ctx, return_dict=False)
    for name, scores in check.scores.items():
        cos, err = min(c for c, _ in scores), max(e for _, e in scores)
        print(f"{name}: per layer cosine >= {cos:.6f}, error <= {err:.4f} against fp32 attention")
    assert len(check.scores["attention8"]) == 30
    assert all(map(_within, check.scores["attention8"])), check.scores["attention8"]
    for name in BROKEN:
        assert not any(map(_within, check.scores[name])), (name, check.scores[name])


@gpu
@hopper
def test_full_size_anyflow_self_attention_on_the_int8_processor_matches_exact_attention():
    """One self-attention of AnyFlow's Wan 2.1 1.3B at full size (12 heads x 128, random
    weights) on 480x832 x 81 frames (32,760 tokens) in fp16, fused and on the processor as
    `int8-attention` installs it: `attention8` gets the q, k, v AnyFlow's own processor makes
    (to_q/k/v, RMS norms across heads, its rotary embedding: computed here apart), and its output
    is within the Wan per-layer test's bound of fp32 attention on them (cosine >= 0.999, error
    <= 5 %) where the broken attentions (zeros, mean(V)) are not; the processor's output is
    AnyFlow's own processor's (cuDNN) to cosine >= 0.999. A few seconds once the kernel is built."""
    from diffusers.models.transformers.transformer_anyflow import (
        AnyFlowAttention, AnyFlowAttnProcessor, AnyFlowRotaryPosEmbed, apply_rotary_emb)
    assert ia.unavailable() is None, ia.unavailable()
    torch.manual_seed(0)
    heads, d, (f, h, w) = 12, 128, (21, 30, 52)
    attn = AnyFlowAttention(heads * d, heads, d, processor=AnyFlowAttnProcessor()).to("cuda", torch.float16)
    rotary = AnyFlowRotaryPosEmbed(d, (1, 2, 2), 1024)(
        {"total_frames": f, "full_frame_shape": (h, w), "full_token_per_frame": h * w}, torch.device("cuda"))
    gen = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(1, f * h * w, heads * d, device="cuda", dtype=torch.float16, generator=gen)
    seen = []
    with torch.no_grad():
        q, k, v = (t.unflatten(2, (heads, -1)).transpose(1, 2)      # AnyFlow's layout: (B, H, N, D)
                   for t in (attn.norm_q(attn.to_q(x)), attn.norm_k(attn.to_k(x)), attn.to_v(x)))
        q, k = apply_rotary_emb(q, rotary["query"]), apply_rotary_emb(k, rotary["key"])
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))             # (B, N, H, D)
        expected = attn(hidden_states=x, rotary_emb=rotary, attention_mask=None)
        assert fuse_qkv(attn) == 1 and ia.outside_domain(attn) == {} and ia.use_int8_attention(attn) == 1
        real = ia.attention8
        ia.attention8 = lambda *a: seen.append((a, real(*a))) or seen[-1][1]
        try:
            out = attn(hidden_states=x, rotary_emb=rotary, attention_mask=None)
        finally:
            ia.attention8 = real
    assert len(seen) == 1
    (q8, k8, v8), o8 = seen[0]
    for name, got, want in zip("qkv", (q8, k8, v8), (q, k, v)):    # one fused GEMM vs three: rounding
        assert got.shape == want.shape and _rel(got.float(), want.float()) <= 1e-3, name
    rows = _rows(q.shape[1], gen)
    ref = _exact(q, k, v, rows)
    scores = {"attention8": _score(o8, ref, rows), **{n: _score(b(q, k, v), ref, rows) for n, b in BROKEN.items()}}
    cos = torch.nn.functional.cosine_similarity(out.float().flatten(), expected.float().flatten(), dim=0)
    print(f"{scores} against fp32 attention; processor output cosine {float(cos):.6f} against AnyFlow's")
    assert _within(scores["attention8"]), scores
    assert not any(_within(scores[n]) for n in BROKEN), scores
    assert cos >= 0.999, float(cos)
