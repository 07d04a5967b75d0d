"""Where the sm90 INT8/FP8 attention kernel's time goes: variants of its source side by side (CUDA, sm90).

    python3 benchmarks/sage_ab.py [variants=base,k64,...] [shapes=1_3b,14b] [out=sage_ab.json]

Each variant is the vendored source (`compiler/kernels/csrc/sage_sm90`) with textual edits,
copied to a temp folder and built there (in parallel, one process each), then timed on the same
quantised inputs in this process (`triton.testing.do_bench`, median) and compared with `base`'s
output (max abs difference, bit-equal or not) and with fp32 attention on 256 query rows (relative
error, cosine), on Gaussian inputs and on K with channel offsets (`attn8_probe`'s). Variants named `no_*` leave a stage out: wrong
outputs, timing only ("time variants that leave one stage out, and take differences"). The SASS
of each build is counted for the instructions the variants move (I2F, MUFU.EX2, F2FP, FMUL ...).

Why: per 64 x 128 tile the kernel issues 2.1 M INT8 + 2.1 M FP8 tensor-core operations (~512
cycles of an SM at the dense rate) and, per score, one I2F, one MUFU.EX2 and half an F2FP: 20,480
of them, ~1,280 cycles if they share the 16-a-cycle unit, which matches the measured ~807 TOPS
(41 % of the dense rate).
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib.machinery
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "compiler" / "kernels" / "csrc" / "sage_sm90"
KERNEL = "qattn/qk_int_sv_f8_cuda_sm90.cu"
UTILS = "qattn/attn_utils.cuh"
I2F = "__int2float_rz(RS[fq][fk][k])"
MAGIC = "__int_as_float(RS[fq][fk][k] + 0x4B400000) - 12582912.0f"
EXP = "math::ptx_exp2(fmaf(RS[fq][fk][k * 2 + {i}], sm_scale, negative_m))"

NOACC = [(KERNEL, "wgmma::wgmma_f8f8f32<head_dim, 0, CTA_K>(RO_temp[fq]", "wgmma::wgmma_f8f8f32<head_dim, 1, CTA_K>(RO[fq]", 2),
         (KERNEL, "wgmma::wgmma_f8f8f32<head_dim, 1, CTA_K>(RO_temp[fq]", "wgmma::wgmma_f8f8f32<head_dim, 1, CTA_K>(RO[fq]", 2),
         (KERNEL, "RO[fq][fv][k] += RO_temp[fq][fv][k];", "", 2)]
K64 = [(KERNEL, "constexpr int CTA_K = 128;", "constexpr int CTA_K = 64;", 1)]
# the software-pipelined main loop (benchmarks/sage_pipe.cuh) where it applies, the vendored kernel
# elsewhere; V double-buffered (one more 16 KB tile of shared memory)
LAUNCH = ("auto* kernel = qk_int8_sv_f8_attn_kernel<CTA_Q, CTA_K, NUM_THREADS, HEAD_DIM,  static_cast<QuantGranularity>"
          "(QK_QUANT_GRAN), static_cast<QuantGranularity>(QK_QUANT_GRAN), DTypeOut, mask_mode, RETURN_LSE, true>;")
HOST = "torch::Tensor qk_int8_sv_f8_accum_f32_fuse_v_scale_attn_inst_buf("
SMEM = "size_t sMemSize = CTA_Q * HEAD_DIM * sizeof(int8_t) + CTA_K * HEAD_DIM * sizeof(int8_t) + CTA_K * HEAD_DIM * sizeof(int8_t);"


def _spliced(header: str, selector: str, smem: str) -> list:
    """The edits that put a kernel from benchmarks/`header` beside the vendored one: the header
    copied into the tree and included before the host function, the launch through `selector`
    (a constexpr function returning the kernel to launch), the dynamic shared memory `smem` bytes."""
    return [(f"qattn/{header}", None, str(Path(__file__).with_name(header)), 0),
            (KERNEL, HOST, f'#include "{header}"\n' + HOST, 1),
            (KERNEL, LAUNCH, LAUNCH.replace("qk_int8_sv_f8_attn_kernel<", selector).replace("true>;", "true>();"), 1),
            (KERNEL, SMEM, f"size_t sMemSize = {smem};", 1)]


PIPE = _spliced("sage_pipe.cuh", "pipe_kernel<", "CTA_Q * HEAD_DIM * sizeof(int8_t) + 3 * CTA_K * HEAD_DIM * sizeof(int8_t)")


def _bounds(n):
    return [(KERNEL, "__global__ void qk_int8_sv_f8_attn_kernel(",
             f"__global__ void __launch_bounds__(128, {n}) qk_int8_sv_f8_attn_kernel(", 1)]


ONES_WGMMA = """template<int ScaleD, typename T>
__device__ __forceinline__ void wgmma_ones(float d[4], uint32_t RA[], T* sB) {
    uint64_t desc_b = wgmma::make_smem_desc<128>(&sB[0]);
    asm volatile("{\\nwgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, %9, %10, %11;\\n}\\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(RA[0]), "r"(RA[1]), "r"(RA[2]), "r"(RA[3]), "l"(desc_b), "n"(int32_t(ScaleD)), "n"(1), "n"(1));
}

"""
ROWSUM = [
    (KERNEL, "template<uint32_t CTA_Q, uint32_t CTA_K, uint32_t NUM_THREADS, uint32_t head_dim, QuantGranularity Q_GRAN",
     ONES_WGMMA + "template<uint32_t CTA_Q, uint32_t CTA_K, uint32_t NUM_THREADS, uint32_t head_dim, QuantGranularity Q_GRAN", 1),
    (KERNEL, "  int32_t RS[num_tiles_q][num_tiles_k][8];",
     "  static_assert(CTA_K == 128);\n"
     "  int8_t *sOnes = (int8_t*)(smem_ + CTA_Q * head_dim + 2 * CTA_K * head_dim);   // 8 x CTA_K e4m3, row 0 ones\n"
     "  for (uint32_t i = threadIdx.x; i < 8 * CTA_K / 4; i += NUM_THREADS)\n"
     "    ((uint32_t*)sOnes)[i] = i < CTA_K / 4 ? 0x38383838u : 0u;\n"
     "  asm volatile(\"fence.proxy.async.shared::cta;\\n\" ::: \"memory\");\n"
     "  int32_t RS[num_tiles_q][num_tiles_k][8];", 1),
    (KERNEL, "        d[fq][0] += (RS_f32[fq][fk][0] + RS_f32[fq][fk][1] + RS_f32[fq][fk][4] + RS_f32[fq][fk][5]);\n"
             "        d[fq][1] += (RS_f32[fq][fk][2] + RS_f32[fq][fk][3] + RS_f32[fq][fk][6] + RS_f32[fq][fk][7]);", "", 2),
    (KERNEL, "    float RO_temp[num_tiles_q][num_tiles_v][8];",
     "    float RO_temp[num_tiles_q][num_tiles_v][8];\n    float D4[num_tiles_q][4];", 2),
    (KERNEL, "wgmma::wgmma_f8f8f32<head_dim, 0, CTA_K>(RO_temp[fq], RS_f8[fq][0], &sV[0]);",
     "wgmma::wgmma_f8f8f32<head_dim, 0, CTA_K>(RO_temp[fq], RS_f8[fq][0], &sV[0]); wgmma_ones<0>(D4[fq], RS_f8[fq][0], sOnes);", 2),
    (KERNEL, "wgmma::wgmma_f8f8f32<head_dim, 1, CTA_K>(RO_temp[fq], RS_f8[fq][v_it], &sV[v_it * 32]);",
     "wgmma::wgmma_f8f8f32<head_dim, 1, CTA_K>(RO_temp[fq], RS_f8[fq][v_it], &sV[v_it * 32]); "
     "wgmma_ones<1>(D4[fq], RS_f8[fq][v_it], &sOnes[v_it * 32]);", 2),
    (KERNEL, "RO[fq][fv][k] += RO_temp[fq][fv][k];",
     "RO[fq][fv][k] += RO_temp[fq][fv][k]; if (fv == 0 && k == 0) { d[fq][0] += D4[fq][0] + D4[fq][1]; "
     "d[fq][1] += D4[fq][2] + D4[fq][3]; }", 2),
    (KERNEL, SMEM, "size_t sMemSize = CTA_Q * HEAD_DIM * sizeof(int8_t) + 2 * CTA_K * HEAD_DIM * sizeof(int8_t) + 8 * CTA_K;", 1),
]



def _lazy(tau: float) -> list:
    """`lazy` (benchmarks/sage_lazy.cuh): the O rescale skipped while no row's max grew past `tau`
    (log2 units), on top of NOACC (the rescale then is the only FP32 pass over O a tile)."""
    # copied into the tree and included as `_spliced` does, but before the kernel that calls it
    anchor = "template<uint32_t CTA_Q, uint32_t CTA_K, uint32_t NUM_THREADS, uint32_t head_dim, QuantGranularity Q_GRAN"
    call = "update_mdo<num_tiles_q, num_tiles_k, num_tiles_v, false, true, false>(RS_f32, RO, m, d, sm_scale);"
    return [("qattn/sage_lazy.cuh", None, str(Path(__file__).with_name("sage_lazy.cuh")), 0),
            (KERNEL, anchor, f'#define LAZY_TAU {tau:.1f}f\n#include "sage_lazy.cuh"\n' + anchor, 1),
            (KERNEL, call, call.replace("update_mdo<", "update_mdo_lazy<").replace(", false, true, false>", ">"), 2)] + NOACC


# the warp-specialised kernel (benchmarks/sage_ws.cuh) where it applies: a loader warpgroup and two
# consumer warpgroups on 128-row query blocks, K and V double-buffered; 384 threads, 80 KB (hd 128)
WS = _spliced("sage_ws.cuh", "ws_kernel<WS, ",
              "WS ? (2 * CTA_Q + 4 * CTA_K) * HEAD_DIM : CTA_Q * HEAD_DIM + 2 * CTA_K * HEAD_DIM") + [
      (KERNEL, "constexpr MaskMode mask_mode = IS_CAUSAL ? MaskMode::kCausal : MaskMode::kNone;",
       "constexpr MaskMode mask_mode = IS_CAUSAL ? MaskMode::kCausal : MaskMode::kNone;\n"
       "            constexpr bool WS = ws_applies<mask_mode, RETURN_LSE, QK_QUANT_GRAN>();", 1),
      (KERNEL, "create_tensor_map_4D<CTA_Q, HEAD_DIM>(reinterpret_cast<int8_t*>(query.data_ptr())",
       "create_tensor_map_4D<(WS ? 2 * CTA_Q : CTA_Q), HEAD_DIM>(reinterpret_cast<int8_t*>(query.data_ptr())", 1),
      (KERNEL, "dim3 grid(div_ceil(qo_len, CTA_Q), num_qo_heads, batch_size);",
       "dim3 grid(div_ceil(qo_len, WS ? 2 * CTA_Q : CTA_Q), num_qo_heads, batch_size);", 1),
      (KERNEL, "kernel<<<grid, NUM_THREADS, sMemSize, at::cuda::getCurrentCUDAStream()>>>(",
       "kernel<<<grid, WS ? 384 : NUM_THREADS, sMemSize, at::cuda::getCurrentCUDAStream()>>>(", 1),
      # a launch that fails (resources, shared memory) is an error here, not a "not bit-equal" row
      (KERNEL, "qo_len, kv_len, num_kv_groups, sm_scale);",
       "qo_len, kv_len, num_kv_groups, sm_scale);\n            C10_CUDA_KERNEL_LAUNCH_CHECK();", 1)]

# FA3's consumer loop on the warp-specialised kernel (benchmarks/sage_fa3.cuh): setmaxnreg (loader
# 24, consumers 240) and, inside a consumer, S(t+1) and P(t) V(t) issued in one turn with
# softmax(S(t+1)) beside P(t) V(t); the launch and shared memory as `ws`. Bit-equal, 0.945-0.989x
# base at 32,760 tokens x head dim 128, 0.71x at head dim 64 (H200, 2026-11-28 session 10): not kept
# (sage_fa3.cuh includes sage_ws.cuh, copied in by WS's first edit)
FA3 = [("qattn/sage_fa3.cuh", None, str(Path(__file__).with_name("sage_fa3.cuh")), 0)] + [
    (f, o, n if o is None else n.replace('#include "sage_ws.cuh"', '#include "sage_fa3.cuh"')
     .replace("ws_kernel<WS, ", "fa3_kernel<WS, ").replace("ws_applies<", "fa3_applies<"), c) for f, o, n, c in WS]

# 2^x on the FMA pipe (FlashAttention-4's software exponential): the nearest integer j by the
# 1.5 x 2^23 trick, 2^(x - j) by a degree-3 polynomial on [-0.5, 0.5] (max relative error 7.5e-5,
# far inside FP8 P's 2^-4), j added to the exponent bits; x clamped at -125 (masked scores are
# -5e6). 8 instructions on the FMA and integer pipes instead of one MUFU, whose 16 results a cycle
# an SM bound the softmax's burst of 64 exponentials a warp and tile (ncu, fa3: 52 % of the
# fixed-latency stalls sit on MUFU.EX2)
POLY_EXP2 = """__device__ __forceinline__ float poly_exp2(float x)
{
  x = fmaxf(x, -125.0f);
  const float t = x + 12582912.0f;             // 1.5 x 2^23: the nearest integer in t's low bits
  const float f = x - (t - 12582912.0f);       // in [-0.5, 0.5]
  const float p = fmaf(fmaf(fmaf(0.05517028f, f, 0.24260769f), f, 0.69326091f), f, 0.99992829f);
  return __uint_as_float(__float_as_uint(p) + (__float_as_uint(t) << 23));   // unsigned: defined overflow
}

// for DTypeQKAccum float"""


def _poly(elements: tuple) -> list:
    """The exponentials of the score elements `elements` (of 0, 1, 4, 5, each a quarter of a
    tile's: 5 is elements 5 and 7 of each 8 a thread holds, 1 and 5 are 1, 3, 5, 7) in
    `update_mdo` by `poly_exp2`, the rest by MUFU."""
    return [(UTILS, "// for DTypeQKAccum float", POLY_EXP2, 1)] + [
        (UTILS, EXP.format(i=i), EXP.format(i=i).replace("math::ptx_exp2(", "poly_exp2("), 1) for i in elements]


# the row max over a tile's 8 column blocks as a tree (depth 3) instead of a chain of 8 (the
# same maximum: bit-equal), for the dependency stalls ncu shows in the softmax: 0.95-1.02x base,
# in fa3 0.81-0.86x at head dim 128 (H200, 2026-11-28 session 10, one call): not kept
MAX_CHAIN = """      float m_temp = -5000000.0f;
#pragma unroll
      for (uint32_t fk = 0; fk < num_tiles_k; fk++)
      {
        float m_local = max(max(RS[fq][fk][k * 2 + 0], RS[fq][fk][k * 2 + 1]),
                                max(RS[fq][fk][k * 2 + 4], RS[fq][fk][k * 2 + 5]));
        m_temp = max(m_temp, m_local);
      }
"""
MAX_TREE = """      static_assert(num_tiles_k == 8);
      float m_l[num_tiles_k];
#pragma unroll
      for (uint32_t fk = 0; fk < num_tiles_k; fk++)
      {
        m_l[fk] = max(max(RS[fq][fk][k * 2 + 0], RS[fq][fk][k * 2 + 1]),
                      max(RS[fq][fk][k * 2 + 4], RS[fq][fk][k * 2 + 5]));
      }
      float m_temp = max(max(max(m_l[0], m_l[1]), max(m_l[2], m_l[3])),
                         max(max(m_l[4], m_l[5]), max(m_l[6], m_l[7])));
"""
MAXTREE = [(UTILS, MAX_CHAIN, MAX_TREE, 1)]


# name: ([(file, old, new, count)], CTA_K): the edits on top of the vendored source (count: how many
# times `old` must occur, so a variant that no longer matches the source fails loudly) and the key
# block the build runs with (its K scales are the 128-row blocks' repeated: the same INT8 keys).
# Registers (ptxas -v, sm_90a): base 168 (3 CTAs an SM), k64 165, k64_noacc 128 (4 CTAs an SM),
# noacc 199; forcing 4 CTAs (__launch_bounds__) spills 220-836 bytes except on k64_noacc.
VARIANTS = {
    "base": ([], 128),
    # I2F by the float trick (exact below 2^22); the second edit's product binds to the constant:
    # only the last key block is wrong, the timing holds
    "magic": ([(KERNEL, I2F, MAGIC, 2)], 128),
    "no_i2f": ([(KERNEL, I2F, "__int_as_float(RS[fq][fk][k])", 2)], 128),
    "no_exp": ([(UTILS, EXP.format(i=i), f"fmaf(RS[fq][fk][k * 2 + {i}], sm_scale, negative_m)", 1)
                for i in (0, 1, 4, 5)], 128),
    "no_cvt": ([("numeric_conversion.cuh", 'cvt.rn.satfinite.e4m3x2.f32   lo, %2, %1;', 'mov.b16 lo, 0x3838;', 1),
                ("numeric_conversion.cuh", 'cvt.rn.satfinite.e4m3x2.f32   hi, %4, %3;', 'mov.b16 hi, 0x3838;', 1)], 128),
    # P V accumulated by the tensor cores into O directly (no second FP32 accumulator; yet ptxas
    # gives it more registers, 199)
    "noacc": (NOACC, 128),
    "k64": (K64, 64),
    "k64_noacc": (K64 + NOACC, 64),
    "k64_lb4": (K64 + _bounds(4), 64),
    "k64_noacc_lb4": (K64 + NOACC + _bounds(4), 64),
    "pipe": (PIPE, 128),
    # the row sums of P on the tensor cores (P times an 8 x CTA_K tile whose row 0 is ones: a
    # m64n8k32 wgmma beside each P V one) instead of 64 FADDs a thread and tile; the sums are then
    # of the FP8 P that multiplies V
    "rowsum_tc": (ROWSUM, 128),
    # 0.75-0.82x base, bit-equal (H200, 2026-11-28 session 9)
    "ws": (WS, 128),
    "fa3": (FA3, 128),
    # the same without the turns (each consumer issues its products when it is ready; ";" keeps
    # the `if` before each call an empty statement): 0.93-0.96x base at head dim 128, 0.89x at 64
    "fa3_free": (FA3 + [("qattn/sage_fa3.cuh", f"ws_bar_{x};", ";", n)
                        for x, n in (("sync(1 + c, 256)", 2), ("arrive(2 - c, 256)", 2), ("arrive(1, 256)", 1))], 128),
    # the row max as a tree (MAX_TREE; bit-equal)
    "maxtree": (MAXTREE, 128),
    "fa3_maxtree": (FA3 + MAXTREE, 128),
    # a quarter / half of the exponentials on the FMA pipe (`poly_exp2`), in the vendored kernel
    # and in fa3: not bit-equal (P's exponentials differ by <= 7.5e-5 relative before FP8), the
    # same error against fp32; slower: 0.94-0.95x / 0.85-0.89x, in fa3 0.90-0.94x / 0.84-0.85x
    # base at 32,760 tokens x head dim 128 (H200, 2026-11-28 session 10)
    "exp25": (_poly((5,)), 128),
    "exp50": (_poly((1, 5)), 128),
    "fa3_exp25": (FA3 + _poly((5,)), 128),
    "fa3_exp50": (FA3 + _poly((1, 5)), 128),
    # FA4's lazy rescaling (benchmarks/sage_lazy.cuh) with P V into O by the tensor cores: 168
    # registers (3 CTAs an SM, as base), 517 instructions a tile without a rescale where base
    # issues 571; 0.96-1.0x base on an H200 (2026-11-28 session 9): not kept
    "lazy2": (_lazy(2.0), 128),
    "lazy4": (_lazy(4.0), 128),
    "exp_nonvolatile": ([("math.cuh", 'asm volatile("ex2.approx.ftz.f32 %0, %1;"', 'asm("ex2.approx.ftz.f32 %0, %1;"', 1)], 128),
}
SHAPES = {"1_3b": (1, 12, 32760, 128), "14b": (1, 40, 32760, 128),
          # the masked last key block, a single block, head dim 64: correctness more than speed
          "odd": (2, 4, 16411, 128), "one": (1, 2, 100, 128), "d64": (1, 4, 8200, 64)}
FLAGS = ["-O3", "-std=c++17", "-DENABLE_BF16", "-DSAGE_SLIM"]
CUDA_FLAGS = FLAGS + ["-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "--use_fast_math",
                      "--threads=4", "-diag-suppress=174,177,549", "-gencode", "arch=compute_90a,code=sm_90a"]


def _source(name: str, root: Path) -> Path:
    d = root / name
    shutil.copytree(SRC, d)
    for f, old, new, count in VARIANTS[name][0]:
        p = d / f
        if old is None:          # a file added to the tree: `new` is its source
            shutil.copy(new, p)
            continue
        text = p.read_text()
        if text.count(old) != count:
            raise SystemExit(f"variant {name}: {old!r} occurs {text.count(old)} times in {f}, expected {count}")
        p.write_text(text.replace(old, new))
    return d


def _build(name: str, root: str) -> str:
    from torch.utils.cpp_extension import load
    d = _source(name, Path(root))
    build = d / "build"
    build.mkdir()
    mod = f"sage_ab_{name}"
    load(name=mod, sources=[str(d / KERNEL)], build_directory=str(build), extra_cflags=FLAGS,
         extra_ldflags=["-lcuda"], extra_cuda_cflags=CUDA_FLAGS, verbose=False)
    return str(build / f"{mod}.so")


def _load(path: str):
    name = Path(path).stem
    spec = importlib.util.spec_from_file_location(name, path, loader=importlib.machinery.ExtensionFileLoader(name, path))
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def launch(mod, q8, qs, k8, ks, v8, vs, o) -> None:
    """One call of a build's entry point on `compiler.kernels.int8_attention.quantize`'s outputs
    (as the job calls the vendored kernel), into `o`."""
    mod.qk_int8_sv_f8_accum_f32_fuse_v_scale_attn_inst_buf(
        q8, k8, v8.permute(0, 2, 1, 3), o, qs, ks, vs, 0, 0, 3, q8.shape[-1] ** -0.5, 0)


def _sass(path: str) -> dict:
    """Instruction counts over every kernel in the build (head dim 64 and 128, fp16 and bf16 out:
    the same loop four times), for comparing variants, not absolute per-tile figures."""
    try:
        text = subprocess.run(["cuobjdump", "--dump-sass", path], capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": str(e)}
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)", text)
    want = ("I2F", "I2FP", "MUFU.EX2", "F2FP", "FMUL", "FFMA", "FADD", "IADD3", "FMNMX", "HGMMA", "IGMMA", "QGMMA", "SHFL")
    return {w: sum(1 for o in ops if o == w or o.startswith(w + ".")) for w in want} | {"total": len(ops)}


def main(argv: list[str]) -> dict:
    bad = [a for a in argv if "=" not in a or a.split("=", 1)[0] not in ("variants", "shapes", "out")]
    if bad:
        raise SystemExit(f"sage_ab.py: unknown argument(s) {bad}; usage: sage_ab.py "
                         f"[variants=base,...] [shapes={','.join(SHAPES)}] [out=FILE.json]")
    args = dict(a.split("=", 1) for a in argv)
    names = list(dict.fromkeys(args.get("variants", ",".join(VARIANTS)).split(",")))
    shapes = args.get("shapes", "1_3b,14b").split(",")
    unknown = [n for n in names if n not in VARIANTS] + [s for s in shapes if s not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown variant or shape {unknown}; variants: {list(VARIANTS)}, shapes: {list(SHAPES)}")
    names = ["base"] + [n for n in names if n != "base"]     # the reference every comparison uses
    root = tempfile.mkdtemp(prefix="sage_ab_")
    t0 = time.perf_counter()
    with cf.ProcessPoolExecutor(len(names)) as pool:
        paths = dict(zip(names, pool.map(_build, names, [root] * len(names))))
    print(f"built {len(names)} variants in {time.perf_counter() - t0:.0f} s", flush=True)
    mods = {n: _load(p) for n, p in paths.items()}
    sys.path.insert(0, str(ROOT))
    import triton
    from compiler.bench.attn8_probe import _cos, _inputs, _reference
    from compiler.kernels.int8_attention import quantize

    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "variants": {}}
    for n in names:
        res["variants"][n] = {"edits": [e[:3] if e[1] else e[:1] + e[2:3] for e in VARIANTS[n][0]], "cta_k": VARIANTS[n][1],
                              "sass": _sass(paths[n])}
    for s in shapes:
        b, h, n_tok, d = SHAPES[s]
        g = torch.Generator(device="cuda").manual_seed(0)
        for kind in ("gauss", "offset"):    # offset: K channels offset by 20-50x the std (attn8_probe)
            q, k, v = _inputs(b, h, n_tok, d, kind, g)
            q8, qs, k8, ks, v8, vs = quantize(q, k, v)
            ks64 = ks.view(b, h, -1, 1, 4).expand(-1, -1, -1, 2, -1).reshape(b, h, -1)[..., :(n_tok + 63) // 64 * 4].contiguous()
            rows = torch.randperm(n_tok, device="cuda", generator=g)[:256]
            ref32 = _reference(q, k, v, rows)
            ref, outs = None, {}
            for name in names:
                o = torch.empty_like(q)
                kscale = ks64 if VARIANTS[name][1] == 64 else ks
                fn = lambda m=mods[name], o=o, kscale=kscale: launch(m, q8, qs, k8, kscale, v8, vs, o)
                fn()
                torch.cuda.synchronize()
                if ref is None:
                    ref = o.clone()
                r = res["variants"][name].setdefault("shapes", {}).setdefault(s, {})
                r[f"{kind}_relerr_fp32"] = round(float((o[:, rows].float() - ref32).norm() / ref32.norm()), 6)
                r[f"{kind}_cos_fp32"] = round(_cos(o[:, rows], ref32), 6)
                r[f"{kind}_max_abs_vs_base"] = (o.float() - ref.float()).abs().max().item()
                r[f"{kind}_bit_equal"] = bool(torch.equal(o, ref))
                r[f"{kind}_bit_equal_to"] = [n for n, x in outs.items() if torch.equal(o, x)]
                outs[name] = o
                if kind == "gauss":
                    ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
                    r.update(ms=round(ms, 4), tops=round(4 * b * h * n_tok * n_tok * d / ms / 1e9, 1))
                print(f"{s} {kind} {name}: {r}", flush=True)     # as it goes: a variant that hangs
            del q, k, v, q8, k8, v8, ref32, outs
        base = res["variants"]["base"]["shapes"][s]["ms"]
        for name in names:
            r = res["variants"][name]["shapes"][s]
            r["x_base"] = round(base / r["ms"], 3)
    print(f"\n{'variant':15} {'shape':5} {'ms':>7} {'TOPS':>6} {'x base':>6} {'bit-eq':>6} {'relerr':>8} "
          f"{'offset':>8}  SASS (relerr: against fp32 on 256 rows, Gaussian / K offsets)")
    for name in names:
        v = res["variants"][name]
        for s, r in v["shapes"].items():
            print(f"{name:15} {s:5} {r['ms']:7.3f} {r['tops']:6.1f} {r['x_base']:6.3f} {str(r['gauss_bit_equal']):>6} "
                  f"{r['gauss_relerr_fp32']:8.5f} {r['offset_relerr_fp32']:8.5f}  {v['sass']}")
    if "out" in args:
        Path(args["out"]).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
