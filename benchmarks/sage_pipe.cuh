// A software-pipelined main loop for the vendored sm90 INT8/FP8 attention kernel (an experiment:
// `benchmarks/sage_ab.py variants=base,pipe` builds it in place of the kernel the job uses).
//
// Why: ncu on the vendored kernel (Wan 1.3B shape, H200, 2026-11-28) shows 573 warp instructions a
// 64 x 128 tile issued at 53 % of the issue slots and the tensor pipe ~47 % busy: the CUDA-core
// softmax and the tensor-core products run one after the other inside each CTA (Q K^T, wait,
// softmax, P V, wait), and 3 resident CTAs an SM overlap them only partly. Here each tile's
// softmax runs while the previous tile's P V is on the tensor cores:
//
//   tile 0: Q K0^T, wait, softmax -> P0
//   for t = 1 .. n-1:  issue Q Kt^T; issue O += P(t-1) V(t-1); wait for Q Kt^T only;
//                      load K(t+1); softmax of tile t -> Pt (new registers; P(t-1) is in flight);
//                      wait for the P V; load V(t+1) into the buffer it freed; O *= exp2(m_old - m)
//   last: O += P(n-1) V(n-1)
//
// The arithmetic is the vendored kernel's (same scales, offsets, exp2 and FP8 rounding) but for
// two changes: P V accumulates into O on the tensor cores (FP32 accumulator, scale-d 1) instead of
// into a zeroed second accumulator added on the CUDA cores (sage_ab's `noacc`: relative error
// 0.0395 vs 0.0391 against fp32 attention), and masked keys get -inf before the scaling. Measured
// on an H200 (2026-11-28): correct on every shape, 0.95x the vendored kernel (199 registers, 2 CTAs
// an SM against its 3): not wired in.
// V is double-buffered (its load has a whole tile to land); K single (loaded as soon as Q K^T has
// read it). Head dim 64 or 128, CTA_Q 64, CTA_K 128, no mask, no LSE: what the job launches.

template <uint32_t num_tiles_k, bool masked>
__device__ __forceinline__ void pipe_softmax(int32_t RS[][8], float m[2], float d[2], float o_scale[2],
                                             uint32_t P[][4], const float sm_scale, const uint32_t key0,
                                             const uint32_t kv_len, const uint32_t lane_id)
{
  float S[1][num_tiles_k][8];
#pragma unroll
  for (uint32_t fk = 0; fk < num_tiles_k; fk++)
  {
#pragma unroll
    for (uint32_t k = 0; k < 8; k++)
    {
      S[0][fk][k] = __int2float_rz(RS[fk][k]);
      if constexpr (masked)
      {
        // the wgmma accumulator layout: thread (lane) holds keys 2 (lane % 4) + k % 2 (+ 8 for k >= 4)
        const uint32_t key = key0 + fk * 16 + 2 * (lane_id % 4) + 8 * (k / 4) + k % 2;
        if (key >= kv_len)
        {
          // -inf, not the vendored kernel's -5e6: here the score is still unscaled (INT32), and
          // -5e6 times a small dequantisation scale would leave masked keys a non-zero P
          S[0][fk][k] = -INFINITY;
        }
      }
    }
  }
#pragma unroll
  for (uint32_t k = 0; k < 2; k++)   // the thread's two rows: lane / 4 and lane / 4 + 8
  {
    float mt = -5000000.0f;
#pragma unroll
    for (uint32_t fk = 0; fk < num_tiles_k; fk++)
    {
      mt = max(mt, max(max(S[0][fk][k * 2 + 0], S[0][fk][k * 2 + 1]), max(S[0][fk][k * 2 + 4], S[0][fk][k * 2 + 5])));
    }
    mt = fmaf(mt, sm_scale, -S_FP8_OFFSET);    // P scaled by 2^S_FP8_OFFSET (448): FP8's range
    mt = max(mt, __shfl_xor_sync(0xffffffff, mt, 0x1));
    mt = max(mt, __shfl_xor_sync(0xffffffff, mt, 0x2));
    const float mn = max(m[k], mt);
    o_scale[k] = math::ptx_exp2(m[k] - mn);
    d[k] *= o_scale[k];
    m[k] = mn;
    const float nm = -mn;
#pragma unroll
    for (uint32_t fk = 0; fk < num_tiles_k; fk++)
    {
      S[0][fk][k * 2 + 0] = math::ptx_exp2(fmaf(S[0][fk][k * 2 + 0], sm_scale, nm));
      S[0][fk][k * 2 + 1] = math::ptx_exp2(fmaf(S[0][fk][k * 2 + 1], sm_scale, nm));
      S[0][fk][k * 2 + 4] = math::ptx_exp2(fmaf(S[0][fk][k * 2 + 4], sm_scale, nm));
      S[0][fk][k * 2 + 5] = math::ptx_exp2(fmaf(S[0][fk][k * 2 + 5], sm_scale, nm));
    }
  }
#pragma unroll
  for (uint32_t fk = 0; fk < num_tiles_k; fk++)
  {
    d[0] += (S[0][fk][0] + S[0][fk][1] + S[0][fk][4] + S[0][fk][5]);
    d[1] += (S[0][fk][2] + S[0][fk][3] + S[0][fk][6] + S[0][fk][7]);
  }
  RS_32_to_8<1, num_tiles_k>(S, reinterpret_cast<uint32_t (*)[num_tiles_k / 2][4]>(P));
}

template <uint32_t N>
__device__ __forceinline__ void pipe_fence(float (&r)[N][8])
{
  // keep the compiler from moving accesses to the accumulator across the async products (in its
  // own register class: a move between classes next to a wgmma makes ptxas serialize them)
#pragma unroll
  for (uint32_t i = 0; i < N; i++)
  {
#pragma unroll
    for (uint32_t j = 0; j < 8; j++)
    {
      asm volatile("" : "+f"(r[i][j]) :: "memory");
    }
  }
}

template <uint32_t N>
__device__ __forceinline__ void pipe_keep(uint32_t (&r)[N][4])
{
  // a use of the in-flight P after the products are waited for: without it the compiler sees P
  // dead once the wgmma is issued and gives its registers to the next P (written during the
  // product), which ptxas answers by serializing every wgmma
#pragma unroll
  for (uint32_t i = 0; i < N; i++)
  {
#pragma unroll
    for (uint32_t j = 0; j < 4; j++)
    {
      asm volatile("" : "+r"(r[i][j]) :: "memory");
    }
  }
}

template<uint32_t CTA_Q, uint32_t CTA_K, uint32_t NUM_THREADS, uint32_t head_dim, QuantGranularity Q_GRAN, QuantGranularity K_GRAN, typename DTypeOut, MaskMode mask_mode = MaskMode::kNone, bool return_lse = false, bool fuse_v_scale=false>
__global__ void qk_int8_sv_f8_attn_kernel_pipe(const __grid_constant__ CUtensorMap tensorMapQ,
                                        const __grid_constant__ CUtensorMap tensorMapK,
                                        const __grid_constant__ CUtensorMap tensorMapV,
                                        float *__restrict__ Q_scale, float *__restrict__ K_scale, float *__restrict__ V_scale,
                                        DTypeOut* O, float *__restrict__ Lse, uint32_t stride_bz_o, uint32_t stride_h_o, uint32_t stride_seq_o,
                                        const uint32_t qo_len, const uint32_t kv_len, const uint32_t num_kv_groups,
                                        float sm_scale)
{
  static_assert(NUM_THREADS == 128 && CTA_Q == 64 && CTA_K == 128);
  static_assert(mask_mode == MaskMode::kNone && !return_lse && fuse_v_scale);
  static_assert(Q_GRAN == QuantGranularity::kPerThread && K_GRAN == QuantGranularity::kPerThread);

  const uint32_t warp_idx = (threadIdx.x % 128) / 32;
  const uint32_t lane_id = threadIdx.x % 32;

  constexpr uint32_t num_tiles_k = CTA_K / 16;
  constexpr uint32_t num_tiles_qk_inner = head_dim / 32;
  constexpr uint32_t num_tiles_v = head_dim / 16;
  constexpr uint32_t num_tiles_pv_inner = CTA_K / 32;

  const uint32_t batch_id = blockIdx.z;
  const uint32_t bx = blockIdx.x;
  const uint32_t head_id = blockIdx.y;
  const uint32_t num_qo_heads = gridDim.y;
  const uint32_t kv_head_id = head_id / num_kv_groups;

  sm_scale *= math::log2e;

  extern __shared__ __align__(128) int8_t smem_[];
  int8_t *sQ = (int8_t*)smem_;
  int8_t *sK = sQ + CTA_Q * head_dim;
  int8_t *sV0 = sK + CTA_K * head_dim;         // V double-buffered: tile t in buffer t % 2
  int8_t *sV1 = sV0 + CTA_K * head_dim;

  int32_t RS[num_tiles_k][8];
  float RO[num_tiles_v][8];
  float m[2] = {-5000000.0f, -5000000.0f};
  float d[2] = {1.0f, 1.0f};
  float o_scale[2];
  uint32_t P[num_tiles_pv_inner][4];

  const uint32_t num_warp_block_q = gridDim.x * 4;
  const uint32_t q_scale_idx = batch_id * num_qo_heads * (num_warp_block_q * 8) + head_id * (num_warp_block_q * 8) + bx * (4 * 8) + warp_idx * 8 + lane_id / 4;
  const uint32_t num_block_k = div_ceil(kv_len, CTA_K);
  const uint32_t k_scale_idx = batch_id * (num_qo_heads / num_kv_groups) * (num_block_k * 4) + (head_id / num_kv_groups) * (num_block_k * 4) + lane_id % 4;
  constexpr uint32_t k_scale_advance_offset = 4;

#pragma unroll
  for (uint32_t fv = 0; fv < num_tiles_v; fv++)
  {
#pragma unroll
    for (uint32_t k = 0; k < 8; k++)
    {
      RO[fv][k] = 0.0f;
    }
  }

  __shared__ __align__(8) uint64_t barrier_Q;
  __shared__ __align__(8) uint64_t barrier_K;
  __shared__ __align__(8) uint64_t barrier_V[2];

  const uint32_t n = num_block_k;
  if (threadIdx.x == 0)
  {
    init_barrier(&barrier_Q, 1);
    init_barrier(&barrier_K, 1);
    init_barrier(&barrier_V[0], 1);
    init_barrier(&barrier_V[1], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0)
  {
    expect_bytes<(CTA_Q * head_dim) * sizeof(int8_t)>(&barrier_Q);
    expect_bytes<(CTA_K * head_dim) * sizeof(int8_t)>(&barrier_K);
    expect_bytes<(CTA_K * head_dim) * sizeof(int8_t)>(&barrier_V[0]);
    load_async_4D(sQ, &tensorMapQ, &barrier_Q, 0, bx * CTA_Q, head_id, batch_id);
    load_async_4D(sK, &tensorMapK, &barrier_K, 0, 0, kv_head_id, batch_id);
    load_async_4D(sV0, &tensorMapV, &barrier_V[0], 0, 0, kv_head_id, batch_id);
    if (n > 1)
    {
      expect_bytes<(CTA_K * head_dim) * sizeof(int8_t)>(&barrier_V[1]);
      load_async_4D(sV1, &tensorMapV, &barrier_V[1], CTA_K, 0, kv_head_id, batch_id);
    }
  }

  const float q_scale = Q_scale[q_scale_idx];
  const float original_sm_scale = sm_scale;
  wait(&barrier_Q, 0);

  // tile 0: its scores and P
  wait(&barrier_K, 0);
  wgmma::warpgroup_arrive();
  wgmma::wgmma_s8s8s32<CTA_K, 0, head_dim>(&RS[0], sQ, sK);
#pragma unroll
  for (int k_it = 1; k_it < num_tiles_qk_inner; k_it++)
  {
    wgmma::wgmma_s8s8s32<CTA_K, 1, head_dim>(&RS[0], &sQ[k_it * 32], &sK[k_it * 32]);
  }
  wgmma::warpgroup_commit_batch();
  wgmma::warpgroup_wait<0>();
  if (n > 1 && threadIdx.x == 0)
  {
    expect_bytes<(CTA_K * head_dim) * sizeof(int8_t)>(&barrier_K);
    load_async_4D(sK, &tensorMapK, &barrier_K, 0, CTA_K, kv_head_id, batch_id);
  }
  {
    const float s = original_sm_scale * q_scale * K_scale[k_scale_idx];
    if (n == 1)
      pipe_softmax<num_tiles_k, true>(RS, m, d, o_scale, P, s, 0, kv_len, lane_id);
    else
      pipe_softmax<num_tiles_k, false>(RS, m, d, o_scale, P, s, 0, kv_len, lane_id);
  }

  // tiles 1 .. n-1; P ping-pongs between two register sets (the loop unrolled by 2, no copies:
  // a copy into the in-flight set would make ptxas serialize the products)
  uint32_t P1[num_tiles_pv_inner][4];
  auto step = [&](const uint32_t t, uint32_t (&Pc)[num_tiles_pv_inner][4], uint32_t (&Pn)[num_tiles_pv_inner][4])
  {
    int8_t *sVp = ((t - 1) & 1) ? sV1 : sV0;     // tile t - 1's V
    wait(&barrier_K, t & 1);
    wait(&barrier_V[(t - 1) & 1], ((t - 1) >> 1) & 1);
    pipe_fence(RO);
    wgmma::warpgroup_arrive();
    wgmma::wgmma_s8s8s32<CTA_K, 0, head_dim>(&RS[0], sQ, sK);
#pragma unroll
    for (int k_it = 1; k_it < num_tiles_qk_inner; k_it++)
    {
      wgmma::wgmma_s8s8s32<CTA_K, 1, head_dim>(&RS[0], &sQ[k_it * 32], &sK[k_it * 32]);
    }
    wgmma::warpgroup_commit_batch();
#pragma unroll
    for (uint32_t v_it = 0; v_it < num_tiles_pv_inner; v_it++)
    {
      wgmma::wgmma_f8f8f32<head_dim, 1, CTA_K>(&RO[0], Pc[v_it], &sVp[v_it * 32]);
    }
    wgmma::warpgroup_commit_batch();
    wgmma::warpgroup_wait<1>();                    // Q Kt^T done; P(t-1) V(t-1) may still run
    if (t + 1 < n && threadIdx.x == 0)
    {
      expect_bytes<(CTA_K * head_dim) * sizeof(int8_t)>(&barrier_K);
      load_async_4D(sK, &tensorMapK, &barrier_K, 0, (t + 1) * CTA_K, kv_head_id, batch_id);
    }
    const float s = original_sm_scale * q_scale * K_scale[k_scale_idx + t * k_scale_advance_offset];
    if (t + 1 == n)
      pipe_softmax<num_tiles_k, true>(RS, m, d, o_scale, Pn, s, t * CTA_K, kv_len, lane_id);
    else
      pipe_softmax<num_tiles_k, false>(RS, m, d, o_scale, Pn, s, t * CTA_K, kv_len, lane_id);
    wgmma::warpgroup_wait<0>();                    // P(t-1) V(t-1) done: its V buffer and P free
    pipe_fence(RO);
    pipe_keep(Pc);
    if (t + 1 < n && threadIdx.x == 0)
    {
      expect_bytes<(CTA_K * head_dim) * sizeof(int8_t)>(&barrier_V[(t + 1) & 1]);
      load_async_4D(sVp, &tensorMapV, &barrier_V[(t + 1) & 1], (t + 1) * CTA_K, 0, kv_head_id, batch_id);
    }
#pragma unroll
    for (uint32_t fv = 0; fv < num_tiles_v; fv++)
    {
      RO[fv][0] *= o_scale[0];
      RO[fv][1] *= o_scale[0];
      RO[fv][4] *= o_scale[0];
      RO[fv][5] *= o_scale[0];
      RO[fv][2] *= o_scale[1];
      RO[fv][3] *= o_scale[1];
      RO[fv][6] *= o_scale[1];
      RO[fv][7] *= o_scale[1];
    }
  };
  uint32_t t = 1;
  for (; t + 1 < n; t += 2)
  {
    step(t, P, P1);
    step(t + 1, P1, P);
  }
  if (t < n)
  {
    step(t, P, P1);
#pragma unroll
    for (uint32_t v_it = 0; v_it < num_tiles_pv_inner; v_it++)
    {
#pragma unroll
      for (uint32_t j = 0; j < 4; j++)
      {
        P[v_it][j] = P1[v_it][j];
      }
    }
  }
  // the last tile's P V
  {
    int8_t *sVp = ((n - 1) & 1) ? sV1 : sV0;
    wait(&barrier_V[(n - 1) & 1], ((n - 1) >> 1) & 1);
    pipe_fence(RO);
    wgmma::warpgroup_arrive();
#pragma unroll
    for (uint32_t v_it = 0; v_it < num_tiles_pv_inner; v_it++)
    {
      wgmma::wgmma_f8f8f32<head_dim, 1, CTA_K>(&RO[0], P[v_it], &sVp[v_it * 32]);
    }
    wgmma::warpgroup_commit_batch();
    wgmma::warpgroup_wait<0>();
    pipe_fence(RO);
  }

  float RO2[1][num_tiles_v][8];
  float m2[1][2] = {{m[0], m[1]}};
  float d2[1][2] = {{d[0], d[1]}};
#pragma unroll
  for (uint32_t fv = 0; fv < num_tiles_v; fv++)
  {
#pragma unroll
    for (uint32_t k = 0; k < 8; k++)
    {
      RO2[0][fv][k] = RO[fv][k];
    }
  }
  normalize_d<1, num_tiles_v, ComputeUnit::kCudaCore>(RO2, m2, d2);

  float v_scale[4];
  float *V_scale_base_ptr = V_scale + batch_id * (num_qo_heads / num_kv_groups) * head_dim + (head_id / num_kv_groups) * head_dim + (lane_id % 4) * 2;
#pragma unroll
  for (uint32_t fv = 0; fv < num_tiles_v; fv++)
  {
    ((float2*)v_scale)[0] = *((float2*)(V_scale_base_ptr + fv * 16));
    ((float2*)v_scale)[1] = *((float2*)(V_scale_base_ptr + fv * 16 + 8));
    RO2[0][fv][0] *= v_scale[0];
    RO2[0][fv][1] *= v_scale[1];
    RO2[0][fv][2] *= v_scale[0];
    RO2[0][fv][3] *= v_scale[1];
    RO2[0][fv][4] *= v_scale[2];
    RO2[0][fv][5] *= v_scale[3];
    RO2[0][fv][6] *= v_scale[2];
    RO2[0][fv][7] *= v_scale[3];
  }

  const uint32_t Q_idx_lane_base = bx * CTA_Q + warp_idx * 16 + lane_id / 4;
  DTypeOut *O_lane_ptr = O + batch_id * stride_bz_o + head_id * stride_h_o + Q_idx_lane_base * stride_seq_o + (lane_id % 4) * 2;
#pragma unroll
  for (uint32_t fv = 0; fv < head_dim / 16; fv++)
  {
    if (Q_idx_lane_base < qo_len)
    {
      if constexpr (std::is_same<DTypeOut, half>::value)
      {
        ((half2*)(O_lane_ptr + fv * 16))[0] = __float22half2_rn(((float2*)(RO2[0][fv]))[0]);
        ((half2*)(O_lane_ptr + fv * 16 + 8))[0] = __float22half2_rn(((float2*)(RO2[0][fv]))[2]);
      }
      else
      {
        ((nv_bfloat162*)(O_lane_ptr + fv * 16))[0] = __float22bfloat162_rn(((float2*)(RO2[0][fv]))[0]);
        ((nv_bfloat162*)(O_lane_ptr + fv * 16 + 8))[0] = __float22bfloat162_rn(((float2*)(RO2[0][fv]))[2]);
      }
    }
    if (Q_idx_lane_base + 8 < qo_len)
    {
      if constexpr (std::is_same<DTypeOut, half>::value)
      {
        ((half2*)(O_lane_ptr + fv * 16 + 8 * stride_seq_o))[0] = __float22half2_rn(((float2*)(RO2[0][fv]))[1]);
        ((half2*)(O_lane_ptr + fv * 16 + 8 + 8 * stride_seq_o))[0] = __float22half2_rn(((float2*)(RO2[0][fv]))[3]);
      }
      else
      {
        ((nv_bfloat162*)(O_lane_ptr + fv * 16 + 8 * stride_seq_o))[0] = __float22bfloat162_rn(((float2*)(RO2[0][fv]))[1]);
        ((nv_bfloat162*)(O_lane_ptr + fv * 16 + 8 + 8 * stride_seq_o))[0] = __float22bfloat162_rn(((float2*)(RO2[0][fv]))[3]);
      }
    }
  }
}

// what the host launches: the pipelined kernel where it applies (no mask, no LSE, per-thread
// scales, V scale fused), the vendored one elsewhere
template<uint32_t CTA_Q, uint32_t CTA_K, uint32_t NUM_THREADS, uint32_t head_dim, QuantGranularity Q_GRAN, QuantGranularity K_GRAN, typename DTypeOut, MaskMode mask_mode, bool return_lse, bool fuse_v_scale>
constexpr auto pipe_kernel()
{
  if constexpr (mask_mode == MaskMode::kNone && !return_lse && fuse_v_scale && CTA_Q == 64 && CTA_K == 128 &&
                Q_GRAN == QuantGranularity::kPerThread && K_GRAN == QuantGranularity::kPerThread)
    return &qk_int8_sv_f8_attn_kernel_pipe<CTA_Q, CTA_K, NUM_THREADS, head_dim, Q_GRAN, K_GRAN, DTypeOut, mask_mode, return_lse, fuse_v_scale>;
  else
    return &qk_int8_sv_f8_attn_kernel<CTA_Q, CTA_K, NUM_THREADS, head_dim, Q_GRAN, K_GRAN, DTypeOut, mask_mode, return_lse, fuse_v_scale>;
}
