// A warp-specialised form of the vendored sm90 INT8/FP8 attention kernel (an experiment:
// `benchmarks/sage_ab.py variants=base,ws` builds it in place of the kernel the job uses).
// Measured (H200, 2026-11-28, benchmarks/2026-11-28-suite-2xh200-alone-kernel-variants.md):
// bit-equal to the vendored kernel on every shape, 0.75-0.82x its speed; not kept.
//
// Why: ncu on the vendored kernel (Wan 1.3B shape, H200, 2026-11-28) shows the CUDA-core softmax
// and the tensor-core products of each CTA one after the other (issue slots 53 %, tensor pipe
// 47 %), L2 at 67.5 % (every 64-row CTA streams all of K and V), K and V single-buffered. An
// overlap inside one warpgroup (benchmarks/sage_pipe.cuh) needed 199 registers and lost more
// across CTAs than it won (0.95x). FlashAttention-3's layout instead, in its simplest form:
//   - one CTA of 3 warpgroups an SM (384 threads x 168 registers = 64,512 of 65,536): warpgroup 0
//     loads (one thread issues the TMA copies), warpgroups 1 and 2 each own 64 query rows of a
//     128-row block and share every K and V tile (half the L2 traffic);
//   - K and V double-buffered, with full (TMA) and empty (256 consumer threads) mbarriers;
//   - the two consumers take turns issuing Q K^T (named barriers 1 and 2, FA3's "warp scheduler
//     barriers"), so one's softmax runs while the other's products use the tensor cores.
// Each consumer's per-tile arithmetic is the vendored kernel's, call for call (`update_mdo`, the
// FP32 second accumulator, the masking after dequantisation): its output should be bit-equal to
// the vendored kernel's, which sage_ab.py checks (`bit_equal`).
// No setmaxnreg yet (the loader keeps 168 registers it does not need), no overlap inside a
// warpgroup: the next steps if this one pays.

__device__ __forceinline__ void ws_bar_sync(uint32_t id, uint32_t count)
{
  asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(count) : "memory");
}

__device__ __forceinline__ void ws_bar_arrive(uint32_t id, uint32_t count)
{
  asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(count) : "memory");
}

__device__ __forceinline__ void ws_mbar_arrive(uint64_t* bar)
{
  uint32_t p = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(p) : "memory");
}

template<MaskMode mask_mode, bool return_lse, int qk_quant_gran>
constexpr bool ws_applies()
{
  return mask_mode == MaskMode::kNone && !return_lse && qk_quant_gran == static_cast<int>(QuantGranularity::kPerThread);
}

// the loader's work (one thread): Q's 2 x 64 rows, then each K and V tile into buffer t % 2 once
// the consumers have released the tile two before it (double-buffered, full / empty mbarriers)
template<uint32_t CTA_Q, uint32_t CTA_K, uint32_t head_dim>
__device__ __forceinline__ void ws_load(int8_t *sQ, int8_t *sK, int8_t *sV, const CUtensorMap *mapQ, const CUtensorMap *mapK,
                                        const CUtensorMap *mapV, uint64_t *bar_Q, uint64_t *full_K, uint64_t *full_V,
                                        uint64_t *empty_K, uint64_t *empty_V, uint32_t n, uint32_t bx, uint32_t head_id,
                                        uint32_t kv_head_id, uint32_t batch_id)
{
  constexpr uint32_t TILE = CTA_K * head_dim;    // bytes of one K or V tile (INT8 / FP8)
  expect_bytes<2 * CTA_Q * head_dim>(bar_Q);
  load_async_4D(sQ, mapQ, bar_Q, 0, bx * 2 * CTA_Q, head_id, batch_id);
  for (uint32_t t = 0; t < n; t++)
  {
    const uint32_t s = t & 1;
    if (t >= 2)                                  // the consumers are done with tile t - 2's K
      wait(&empty_K[s], ((t >> 1) - 1) & 1);
    expect_bytes<TILE>(&full_K[s]);
    load_async_4D(sK + s * TILE, mapK, &full_K[s], 0, t * CTA_K, kv_head_id, batch_id);
    if (t >= 2)
      wait(&empty_V[s], ((t >> 1) - 1) & 1);
    expect_bytes<TILE>(&full_V[s]);
    load_async_4D(sV + s * TILE, mapV, &full_V[s], t * CTA_K, 0, kv_head_id, batch_id);
  }
}

// a consumer's epilogue (the vendored kernel's, for its 64 rows): O / d, times V's per-channel
// scales, stored in the output dtype
template<uint32_t num_tiles_v, uint32_t head_dim, typename DTypeOut>
__device__ __forceinline__ void ws_store_o(float (&RO)[1][num_tiles_v][8], float (&m)[1][2], float (&d)[1][2],
                                           float *__restrict__ V_scale, DTypeOut *O, uint32_t batch_id, uint32_t head_id,
                                           uint32_t num_qo_heads, uint32_t num_kv_groups, uint32_t lane_id,
                                           uint32_t Q_idx_lane_base, uint32_t qo_len, uint32_t stride_bz_o,
                                           uint32_t stride_h_o, uint32_t stride_seq_o)
{
  constexpr uint32_t num_tiles_q = 1;
  normalize_d<num_tiles_q, num_tiles_v, ComputeUnit::kCudaCore>(RO, m, d);

  float v_scale[4];
  float *V_scale_base_ptr = V_scale + batch_id * (num_qo_heads / num_kv_groups) * head_dim + (head_id / num_kv_groups) * head_dim + (lane_id % 4) * 2;
#pragma unroll
  for (uint32_t fv = 0; fv < num_tiles_v; fv++)
  {
    ((float2*)v_scale)[0] = *((float2*)(V_scale_base_ptr + fv * 16));
    ((float2*)v_scale)[1] = *((float2*)(V_scale_base_ptr + fv * 16 + 8));
    RO[0][fv][0] *= v_scale[0];
    RO[0][fv][1] *= v_scale[1];
    RO[0][fv][2] *= v_scale[0];
    RO[0][fv][3] *= v_scale[1];
    RO[0][fv][4] *= v_scale[2];
    RO[0][fv][5] *= v_scale[3];
    RO[0][fv][6] *= v_scale[2];
    RO[0][fv][7] *= v_scale[3];
  }

  DTypeOut *O_lane_ptr = O + batch_id * stride_bz_o + head_id * stride_h_o + Q_idx_lane_base * stride_seq_o + (lane_id % 4) * 2;
#pragma unroll
  for (uint32_t fv = 0; fv < num_tiles_v; fv++)
  {
    if (Q_idx_lane_base < qo_len)
    {
      if constexpr (std::is_same<DTypeOut, half>::value)
      {
        ((half2*)(O_lane_ptr + fv * 16))[0] = __float22half2_rn(((float2*)(RO[0][fv]))[0]);
        ((half2*)(O_lane_ptr + fv * 16 + 8))[0] = __float22half2_rn(((float2*)(RO[0][fv]))[2]);
      }
      else
      {
        ((nv_bfloat162*)(O_lane_ptr + fv * 16))[0] = __float22bfloat162_rn(((float2*)(RO[0][fv]))[0]);
        ((nv_bfloat162*)(O_lane_ptr + fv * 16 + 8))[0] = __float22bfloat162_rn(((float2*)(RO[0][fv]))[2]);
      }
    }
    if (Q_idx_lane_base + 8 < qo_len)
    {
      if constexpr (std::is_same<DTypeOut, half>::value)
      {
        ((half2*)(O_lane_ptr + fv * 16 + 8 * stride_seq_o))[0] = __float22half2_rn(((float2*)(RO[0][fv]))[1]);
        ((half2*)(O_lane_ptr + fv * 16 + 8 + 8 * stride_seq_o))[0] = __float22half2_rn(((float2*)(RO[0][fv]))[3]);
      }
      else
      {
        ((nv_bfloat162*)(O_lane_ptr + fv * 16 + 8 * stride_seq_o))[0] = __float22bfloat162_rn(((float2*)(RO[0][fv]))[1]);
        ((nv_bfloat162*)(O_lane_ptr + fv * 16 + 8 + 8 * stride_seq_o))[0] = __float22bfloat162_rn(((float2*)(RO[0][fv]))[3]);
      }
    }
  }
}

template<uint32_t CTA_Q, uint32_t CTA_K, uint32_t NUM_THREADS, uint32_t head_dim, QuantGranularity Q_GRAN, QuantGranularity K_GRAN, typename DTypeOut, MaskMode mask_mode = MaskMode::kNone, bool return_lse = false, bool fuse_v_scale=false>
__global__ void __launch_bounds__(384, 1) qk_int8_sv_f8_attn_kernel_ws(const __grid_constant__ CUtensorMap tensorMapQ,
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
    if (threadIdx.x == 0)
    {
      ws_load<CTA_Q, CTA_K, head_dim>(sQ, sK, sV, &tensorMapQ, &tensorMapK, &tensorMapV, &bar_Q, full_K, full_V,
                                      empty_K, empty_V, n, bx, head_id, kv_head_id, batch_id);
    }
    return;
  }

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
  if (c == 1)
    ws_bar_arrive(1, 256);                       // consumer 0 issues first
  wait(&bar_Q, 0);

  for (uint32_t t = 0; t < n; t++)
  {
    const uint32_t s = t & 1;
    const uint32_t ph = (t >> 1) & 1;
    const float dequant_scale = q_scale * K_scale[k_scale_idx + t * 4];
    int8_t *sKs = sK + s * TILE;
    int8_t *sVs = sV + s * TILE;

    wait(&full_K[s], ph);
    ws_bar_sync(1 + c, 256);                     // my turn on the tensor cores
    wgmma::warpgroup_arrive();
    wgmma::wgmma_s8s8s32<CTA_K, 0, head_dim>(RS[0], sQ_local, sKs);
#pragma unroll
    for (int k_it = 1; k_it < num_tiles_qk_inner; k_it++)
    {
      wgmma::wgmma_s8s8s32<CTA_K, 1, head_dim>(RS[0], &sQ_local[k_it * 32], &sKs[k_it * 32]);
    }
    wgmma::warpgroup_commit_batch();
    if (c == 0 || t + 1 < n)                     // the other consumer's turn (consumer 1's last
      ws_bar_arrive(2 - c, 256);                 // turn hands on nothing: no arrival left at exit)
    wgmma::warpgroup_wait<0>();
    ws_mbar_arrive(&empty_K[s]);

    float RS_f32[num_tiles_q][num_tiles_k][8];
    if (t + 1 < n)
    {
#pragma unroll
      for (uint32_t fk = 0; fk < num_tiles_k; fk++)
      {
#pragma unroll
        for (uint32_t k = 0; k < 8; k++)
        {
          RS_f32[0][fk][k] = __int2float_rz(RS[0][fk][k]);
        }
      }
      update_mdo<num_tiles_q, num_tiles_k, num_tiles_v, false, true, false>(RS_f32, RO, m, d, original_sm_scale * dequant_scale);
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
      update_mdo<num_tiles_q, num_tiles_k, num_tiles_v, false, true, false>(RS_f32, RO, m, d, original_sm_scale);
    }
#pragma unroll
    for (uint32_t fk = 0; fk < num_tiles_k; fk++)
    {
      d[0][0] += (RS_f32[0][fk][0] + RS_f32[0][fk][1] + RS_f32[0][fk][4] + RS_f32[0][fk][5]);
      d[0][1] += (RS_f32[0][fk][2] + RS_f32[0][fk][3] + RS_f32[0][fk][6] + RS_f32[0][fk][7]);
    }
    uint32_t RS_f8[num_tiles_q][num_tiles_pv_inner][4];
    RS_32_to_8<num_tiles_q, num_tiles_k>(RS_f32, RS_f8);

    wait(&full_V[s], ph);
    float RO_temp[num_tiles_q][num_tiles_v][8];
    wgmma::warpgroup_arrive();
    wgmma::wgmma_f8f8f32<head_dim, 0, CTA_K>(RO_temp[0], RS_f8[0][0], &sVs[0]);
#pragma unroll
    for (uint32_t v_it = 1; v_it < num_tiles_pv_inner; v_it++)
    {
      wgmma::wgmma_f8f8f32<head_dim, 1, CTA_K>(RO_temp[0], RS_f8[0][v_it], &sVs[v_it * 32]);
    }
    wgmma::warpgroup_commit_batch();
    wgmma::warpgroup_wait<0>();
    ws_mbar_arrive(&empty_V[s]);
#pragma unroll
    for (uint32_t fv = 0; fv < num_tiles_v; fv++)
    {
#pragma unroll
      for (uint32_t k = 0; k < 8; k++)
      {
        RO[0][fv][k] += RO_temp[0][fv][k];
      }
    }
  }

  ws_store_o<num_tiles_v, head_dim>(RO, m, d, V_scale, O, batch_id, head_id, num_qo_heads, num_kv_groups, lane_id,
                                    Q_idx_lane_base, qo_len, stride_bz_o, stride_h_o, stride_seq_o);
}

// what the host launches: the warp-specialised kernel where it applies (WS), the vendored one else
template<bool WS, uint32_t CTA_Q, uint32_t CTA_K, uint32_t NUM_THREADS, uint32_t head_dim, QuantGranularity Q_GRAN, QuantGranularity K_GRAN, typename DTypeOut, MaskMode mask_mode, bool return_lse, bool fuse_v_scale>
constexpr auto ws_kernel()
{
  if constexpr (WS)
    return &qk_int8_sv_f8_attn_kernel_ws<CTA_Q, CTA_K, NUM_THREADS, head_dim, Q_GRAN, K_GRAN, DTypeOut, mask_mode, return_lse, fuse_v_scale>;
  else
    return &qk_int8_sv_f8_attn_kernel<CTA_Q, CTA_K, NUM_THREADS, head_dim, Q_GRAN, K_GRAN, DTypeOut, mask_mode, return_lse, fuse_v_scale>;
}
