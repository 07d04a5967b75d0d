// FlashAttention-3's consumer loop on the warp-specialised kernel (an experiment:
// `benchmarks/sage_ab.py variants=base,ws,fa3` builds it in place of the kernel the job uses).
// Measured (H200, 2026-11-28 session 10, benchmarks/2026-11-28-fa3-consumer-loop-h200.md):
// bit-equal to the vendored kernel on every shape; 0.945-0.989x its speed at 32,760 tokens x head
// dim 128 (ws re-measured: 0.83-0.86x), 0.71x at head dim 64; without the turns (`fa3_free`)
// 0.93-0.96x at head dim 128, 0.89x at 64. Not kept.
//
// Why (ncu of the vendored kernel at the Wan 1.3B shape, H200, 2026-11-28 session 8): per 64 x 128
// tile a warp issues 573 instructions while the SM's tensor cores need ~512 cycles for the tile's
// two products, yet each warp sits ~17 % of its time on WARPGROUP.DEPBAR (its own products) and the
// issue slots are 53 % busy: nothing overlaps a warpgroup's softmax with its own products, and the
// three CTAs of an SM drift into step. sage_ws.cuh (loader + 2 consumers, turns on Q K^T only) was
// bit-equal but 0.75-0.82x (session 9). Here, FA3's remaining two pieces on top of it:
//   - setmaxnreg: the loader warpgroup drops to 24 registers, the consumers rise to 240;
//   - inside a consumer, iteration t issues S(t+1) = Q K(t+1)^T and O_tmp = P(t) V(t) in one turn
//     on the tensor cores, then computes softmax(S(t+1)) while P(t) V(t) still runs; the O
//     rescale for t+1 waits for P(t) V(t). P is converted to FP8 after that wait, so one P buffer.
// Each float operation is the vendored kernel's (O = fma(O, exp2(m(t-1) - m(t)), O_tmp(t)), its
// rescale and sum as ptxas contracts them; d and P as `update_mdo`), so the output should stay
// bit-equal (sage_ab.py checks `bit_equal`).
#include "sage_ws.cuh"   // the kernel this one extends: its barrier helpers ws_bar_sync, ws_bar_arrive, ws_mbar_arrive

// keep registers an asynchronous wgmma writes or reads where they are until its wait (CUTLASS's
// warpgroup_fence_operand): an empty asm that "rewrites" each one, ordered after the wait
__device__ __forceinline__ void fence_regs(float &x) { asm volatile("" : "+f"(x) :: "memory"); }
__device__ __forceinline__ void fence_regs(int32_t &x) { asm volatile("" : "+r"(x) :: "memory"); }
__device__ __forceinline__ void fence_regs(uint32_t &x) { asm volatile("" : "+r"(x) :: "memory"); }
template<typename T, size_t N>
__device__ __forceinline__ void fence_regs(T (&x)[N])
{
#pragma unroll
  for (size_t i = 0; i < N; i++)
    fence_regs(x[i]);
}

template<MaskMode mask_mode, bool return_lse, int qk_quant_gran>
constexpr bool fa3_applies()
{
  return mask_mode == MaskMode::kNone && !return_lse && qk_quant_gran == static_cast<int>(QuantGranularity::kPerThread);
}

template<uint32_t CTA_Q, uint32_t CTA_K, uint32_t NUM_THREADS, uint32_t head_dim, QuantGranularity Q_GRAN, QuantGranularity K_GRAN, typename DTypeOut, MaskMode mask_mode = MaskMode::kNone, bool return_lse = false, bool fuse_v_scale=false>
__global__ void __launch_bounds__(384, 1) qk_int8_sv_f8_attn_kernel_fa3(const __grid_constant__ CUtensorMap tensorMapQ,
                                        const __grid_constant__ CUtensorMap tensorMapK,
                                        const __grid_constant__ CUtensorMap tensorMapV,
                                        float *__restrict__ Q_scale, float *__restrict__ K_scale, float *__restrict__ V_scale,
                                        DTypeOut* O, float *__restrict__ Lse, uint32_t stride_bz_o, uint32_t stride_h_o, uint32_t stride_seq_o,
                                        const uint32_t qo_len, const uint32_t kv_len, const uint32_t num_kv_groups,
                                        float sm_scale)
{
  // CTA_Q, CTA_K, NUM_THREADS are the vendored kernel's (64, 128, 128), kept so both kernels have
  // one signature; this one's query block is 2 x 64 rows and its block 384 threads
  static_assert(CTA_Q == 64 && CTA_K == 128 && NUM_THREADS == 128 && fuse_v_scale);
  static_assert(mask_mode == MaskMode::kNone && !return_lse);
  static_assert(Q_GRAN == QuantGranularity::kPerThread && K_GRAN == QuantGranularity::kPerThread);
  constexpr uint32_t num_tiles_q = 1;            // per consumer warpgroup
  constexpr uint32_t num_tiles_k = CTA_K / 16;
  constexpr uint32_t num_tiles_qk_inner = head_dim / 32;
  constexpr uint32_t num_tiles_v = head_dim / 16;
  constexpr uint32_t num_tiles_pv_inner = CTA_K / 32;
  constexpr uint32_t TILE = CTA_K * head_dim;    // bytes of one K or V tile (INT8 / FP8)

  const uint32_t wg = threadIdx.x / 128;
  const uint32_t warp_idx = (threadIdx.x % 128) / 32;
  const uint32_t lane_id = threadIdx.x % 32;
  const uint32_t batch_id = blockIdx.z;
  const uint32_t bx = blockIdx.x;
  const uint32_t head_id = blockIdx.y;
  const uint32_t num_qo_heads = gridDim.y;
  const uint32_t kv_head_id = head_id / num_kv_groups;
  const uint32_t n = div_ceil(kv_len, CTA_K);

  sm_scale *= math::log2e;

  extern __shared__ __align__(128) int8_t smem_[];
  int8_t *sQ = smem_;                            // 128 x head_dim: rows 0-63 consumer 0's
  int8_t *sK = sQ + 2 * CTA_Q * head_dim;        // K tile t in buffer t % 2
  int8_t *sV = sK + 2 * TILE;                    // V tile t in buffer t % 2

  __shared__ __align__(8) uint64_t bar_Q;
  __shared__ __align__(8) uint64_t full_K[2], full_V[2], empty_K[2], empty_V[2];
  if (threadIdx.x == 0)
  {
    init_barrier(&bar_Q, 1);
#pragma unroll
    for (int s = 0; s < 2; s++)
    {
      init_barrier(&full_K[s], 1);
      init_barrier(&full_V[s], 1);
      init_barrier(&empty_K[s], 256);            // every consumer thread arrives
      init_barrier(&empty_V[s], 256);
    }
  }
  __syncthreads();

  if (wg == 0)                                   // the loader
  {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
    if (threadIdx.x == 0)
    {
      ws_load<CTA_Q, CTA_K, head_dim>(sQ, sK, sV, &tensorMapQ, &tensorMapK, &tensorMapV, &bar_Q, full_K, full_V,
                                      empty_K, empty_V, n, bx, head_id, kv_head_id, batch_id);
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");
  const uint32_t c = wg - 1;                     // consumer 0 or 1
  const uint32_t nqb = div_ceil(qo_len, CTA_Q);  // 64-row blocks (the Q scales' blocks)
  const uint32_t q_blk = min(bx * 2 + c, nqb - 1);   // a block past the end reads a valid scale; its rows are not written
  const uint32_t q_scale_idx = batch_id * num_qo_heads * (nqb * 32) + head_id * (nqb * 32) + q_blk * 32 + warp_idx * 8 + lane_id / 4;
  const uint32_t k_scale_idx = batch_id * (num_qo_heads / num_kv_groups) * (n * 4) + (head_id / num_kv_groups) * (n * 4) + lane_id % 4;
  int8_t *sQ_local = sQ + c * CTA_Q * head_dim;

  int32_t RS[num_tiles_q][num_tiles_k][8];
  float RO[num_tiles_q][num_tiles_v][8];
  float m[num_tiles_q][2] = {{-5000000.0f, -5000000.0f}};
  float d[num_tiles_q][2] = {{1.0f, 1.0f}};
#pragma unroll
  for (uint32_t fv = 0; fv < num_tiles_v; fv++)
  {
#pragma unroll
    for (uint32_t k = 0; k < 8; k++)
    {
      RO[0][fv][k] = 0.0f;
    }
  }

  const float q_scale = Q_scale[q_scale_idx];
  const float original_sm_scale = sm_scale;
  const uint32_t Q_idx_lane_base = bx * 2 * CTA_Q + c * CTA_Q + warp_idx * 16 + lane_id / 4;
  uint32_t RS_f8[num_tiles_q][num_tiles_pv_inner][4];
  float o_scale[2];                              // exp2(m(t) - m(t+1)), from softmax(S(t+1))
  float o_scale_t[2];                            // exp2(m(t-1) - m(t)): what O is scaled by with P(t) V(t)

  // S(t) -> P(t) in RS_f32 (exponentials, not yet FP8), m and d updated, o_scale = exp2(m(t-1) - m(t))
  // per row: `update_mdo`'s arithmetic; its O rescale goes to a dead array (removed by the compiler)
  auto softmax = [&](float (&RS_f32)[num_tiles_q][num_tiles_k][8], uint32_t t) {
    const float dequant_scale = q_scale * K_scale[k_scale_idx + t * 4];
    float m_prev[2] = {m[0][0], m[0][1]};
    float dead[num_tiles_q][num_tiles_v][8];
    if (t + 1 < n)
    {
#pragma unroll
      for (uint32_t fk = 0; fk < num_tiles_k; fk++)
#pragma unroll
        for (uint32_t k = 0; k < 8; k++)
          RS_f32[0][fk][k] = __int2float_rz(RS[0][fk][k]);
      update_mdo<num_tiles_q, num_tiles_k, num_tiles_v, false, true, false>(RS_f32, dead, m, d, original_sm_scale * dequant_scale);
    }
    else                                         // the last tile: masked, as the vendored epilogue
    {
#pragma unroll
      for (uint32_t fk = 0; fk < num_tiles_k; fk++)
      {
#pragma unroll
        for (uint32_t k = 0; k < 8; k++)
        {
          RS_f32[0][fk][k] = __int2float_rz(RS[0][fk][k]) * dequant_scale;
          const uint32_t k_idx = t * CTA_K + fk * 16 + 2 * (lane_id % 4) + 8 * (k / 4) + k % 2;
          if (k_idx >= kv_len)
          {
            RS_f32[0][fk][k] = -5000000.0f;
          }
        }
      }
      update_mdo<num_tiles_q, num_tiles_k, num_tiles_v, false, true, false>(RS_f32, dead, m, d, original_sm_scale);
    }
    o_scale[0] = math::ptx_exp2(m_prev[0] - m[0][0]);
    o_scale[1] = math::ptx_exp2(m_prev[1] - m[0][1]);
#pragma unroll
    for (uint32_t fk = 0; fk < num_tiles_k; fk++)
    {
      d[0][0] += (RS_f32[0][fk][0] + RS_f32[0][fk][1] + RS_f32[0][fk][4] + RS_f32[0][fk][5]);
      d[0][1] += (RS_f32[0][fk][2] + RS_f32[0][fk][3] + RS_f32[0][fk][6] + RS_f32[0][fk][7]);
    }
  };
  auto qk = [&](uint32_t t) {                   // S(t) = Q K(t)^T into RS, issued, not waited for
    int8_t *sKs = sK + (t & 1) * TILE;
    wgmma::wgmma_s8s8s32<CTA_K, 0, head_dim>(RS[0], sQ_local, sKs);
#pragma unroll
    for (int k_it = 1; k_it < num_tiles_qk_inner; k_it++)
      wgmma::wgmma_s8s8s32<CTA_K, 1, head_dim>(RS[0], &sQ_local[k_it * 32], &sKs[k_it * 32]);
    wgmma::warpgroup_commit_batch();
  };

  if (c == 1)
    ws_bar_arrive(1, 256);                        // consumer 0 issues first
  wait(&bar_Q, 0);

  // prologue: S(0), its softmax, P(0) in FP8 (O is zeros: exp2(m(-1) - m(0)) = 0 scales it with P(0) V(0))
  {
    wait(&full_K[0], 0);
    ws_bar_sync(1 + c, 256);
    wgmma::warpgroup_arrive();
    qk(0);
    ws_bar_arrive(2 - c, 256);                    // every consumer has n + 1 turns; consumer 1's
    wgmma::warpgroup_wait<0>();                  // last hands on nothing (see the loop)
    fence_regs(RS);
    ws_mbar_arrive(&empty_K[0]);
    float RS_f32[num_tiles_q][num_tiles_k][8];
    softmax(RS_f32, 0);
    o_scale_t[0] = o_scale[0];
    o_scale_t[1] = o_scale[1];
    RS_32_to_8<num_tiles_q, num_tiles_k>(RS_f32, RS_f8);
  }

  // iteration t; `next` (compile time: no wgmma behind a branch, which ptxas serialises) whether
  // there is a tile t + 1, true on every iteration but the last
  auto step = [&](uint32_t t, auto next_c) {
    constexpr bool next = decltype(next_c)::value;
    const uint32_t s = t & 1;
    const uint32_t ph = (t >> 1) & 1;
    if constexpr (next)
      wait(&full_K[(t + 1) & 1], ((t + 1) >> 1) & 1);
    wait(&full_V[s], ph);
    float RO_temp[num_tiles_q][num_tiles_v][8];
    ws_bar_sync(1 + c, 256);                     // my turn: both products of this iteration
    wgmma::warpgroup_arrive();
    if constexpr (next)
      qk(t + 1);
    int8_t *sVs = sV + s * TILE;
    wgmma::wgmma_f8f8f32<head_dim, 0, CTA_K>(RO_temp[0], RS_f8[0][0], &sVs[0]);
#pragma unroll
    for (uint32_t v_it = 1; v_it < num_tiles_pv_inner; v_it++)
      wgmma::wgmma_f8f8f32<head_dim, 1, CTA_K>(RO_temp[0], RS_f8[0][v_it], &sVs[v_it * 32]);
    wgmma::warpgroup_commit_batch();
    if (c == 0 || next)
      ws_bar_arrive(2 - c, 256);

    float RS_f32[num_tiles_q][num_tiles_k][8];
    if constexpr (next)                          // softmax(S(t+1)) while P(t) V(t) runs
    {
      wgmma::warpgroup_wait<1>();
      fence_regs(RS);
      ws_mbar_arrive(&empty_K[(t + 1) & 1]);
      softmax(RS_f32, t + 1);
    }
    wgmma::warpgroup_wait<0>();
    fence_regs(RO_temp);
    fence_regs(RS_f8);
    ws_mbar_arrive(&empty_V[s]);
    // O = O exp2(m(t-1) - m(t)) + P(t) V(t): one FFMA an element, as the vendored kernel's rescale
    // and sum contract to (its multiply before P(t) V(t), its add after)
#pragma unroll
    for (uint32_t fv = 0; fv < num_tiles_v; fv++)
    {
#pragma unroll
      for (uint32_t k = 0; k < 2; k++)
      {
        RO[0][fv][k * 2 + 0] = fmaf(RO[0][fv][k * 2 + 0], o_scale_t[k], RO_temp[0][fv][k * 2 + 0]);
        RO[0][fv][k * 2 + 1] = fmaf(RO[0][fv][k * 2 + 1], o_scale_t[k], RO_temp[0][fv][k * 2 + 1]);
        RO[0][fv][k * 2 + 4] = fmaf(RO[0][fv][k * 2 + 4], o_scale_t[k], RO_temp[0][fv][k * 2 + 4]);
        RO[0][fv][k * 2 + 5] = fmaf(RO[0][fv][k * 2 + 5], o_scale_t[k], RO_temp[0][fv][k * 2 + 5]);
      }
    }
    if constexpr (next)
    {
      o_scale_t[0] = o_scale[0];
      o_scale_t[1] = o_scale[1];
      RS_32_to_8<num_tiles_q, num_tiles_k>(RS_f32, RS_f8);
    }
  };
  for (uint32_t t = 0; t + 1 < n; t++)
    step(t, std::true_type{});
  step(n - 1, std::false_type{});

  ws_store_o<num_tiles_v, head_dim>(RO, m, d, V_scale, O, batch_id, head_id, num_qo_heads, num_kv_groups, lane_id,
                                    Q_idx_lane_base, qo_len, stride_bz_o, stride_h_o, stride_seq_o);
}

// what the host launches: this kernel where it applies (FA3), the vendored one else
template<bool FA3, uint32_t CTA_Q, uint32_t CTA_K, uint32_t NUM_THREADS, uint32_t head_dim, QuantGranularity Q_GRAN, QuantGranularity K_GRAN, typename DTypeOut, MaskMode mask_mode, bool return_lse, bool fuse_v_scale>
constexpr auto fa3_kernel()
{
  if constexpr (FA3)
    return &qk_int8_sv_f8_attn_kernel_fa3<CTA_Q, CTA_K, NUM_THREADS, head_dim, Q_GRAN, K_GRAN, DTypeOut, mask_mode, return_lse, fuse_v_scale>;
  else
    return &qk_int8_sv_f8_attn_kernel<CTA_Q, CTA_K, NUM_THREADS, head_dim, Q_GRAN, K_GRAN, DTypeOut, mask_mode, return_lse, fuse_v_scale>;
}
