// sage_ab.py variant `lazy`: the vendored update_mdo (attn_utils.cuh) for the FP32 accumulator with
// the offset exponents, the O rescale skipped while no row of a warp has a max LAZY_TAU (log2 units)
// past the one its exponents use (FA4-style lazy rescaling); LAZY_TAU is defined by the variant.
// The offset is S_FP8_OFFSET - LAZY_TAU, so P = exp2(s - m) stays <= 2^8.807 = 448, e4m3's largest,
// until the rescale; P V is accumulated by the tensor cores into O (sage_ab.py NOACC): no FP32 add.
template <uint32_t num_tiles_q, uint32_t num_tiles_k, uint32_t num_tiles_v>
__device__ __forceinline__ void update_mdo_lazy(float RS[][num_tiles_k][8], float RO[][num_tiles_v][8], float m[][2], float d[][2], const float &sm_scale)
{
#pragma unroll
  for (uint32_t fq = 0; fq < num_tiles_q; fq++)
  {
    float m_new[2];
#pragma unroll
    for (uint32_t k = 0; k < 2; k++)
    {
      float m_temp = -5000000.0f;
#pragma unroll
      for (uint32_t fk = 0; fk < num_tiles_k; fk++)
      {
        float m_local = max(max(RS[fq][fk][k * 2 + 0], RS[fq][fk][k * 2 + 1]),
                            max(RS[fq][fk][k * 2 + 4], RS[fq][fk][k * 2 + 5]));
        m_temp = max(m_temp, m_local);
      }
      m_temp = fmaf(m_temp, sm_scale, -(S_FP8_OFFSET - LAZY_TAU));
      m_temp = max(m_temp, __shfl_xor_sync(0xffffffff, m_temp, 0x1));
      m_temp = max(m_temp, __shfl_xor_sync(0xffffffff, m_temp, 0x2));
      m_new[k] = max(m[fq][k], m_temp);
    }
    const bool grow = (m_new[0] > m[fq][0] + LAZY_TAU) || (m_new[1] > m[fq][1] + LAZY_TAU);
    if (__any_sync(0xffffffff, grow))
    {
#pragma unroll
      for (uint32_t k = 0; k < 2; k++)
      {
        float o_scale = math::ptx_exp2(m[fq][k] - m_new[k]);
        m[fq][k] = m_new[k];
        d[fq][k] *= o_scale;
#pragma unroll
        for (uint32_t fv = 0; fv < num_tiles_v; fv++)
        {
          RO[fq][fv][k * 2 + 0] *= o_scale;
          RO[fq][fv][k * 2 + 1] *= o_scale;
          RO[fq][fv][k * 2 + 4] *= o_scale;
          RO[fq][fv][k * 2 + 5] *= o_scale;
        }
      }
    }
#pragma unroll
    for (uint32_t k = 0; k < 2; k++)
    {
      float negative_m = -m[fq][k];
#pragma unroll
      for (uint32_t fk = 0; fk < num_tiles_k; fk++)
      {
        RS[fq][fk][k * 2 + 0] = math::ptx_exp2(fmaf(RS[fq][fk][k * 2 + 0], sm_scale, negative_m));
        RS[fq][fk][k * 2 + 1] = math::ptx_exp2(fmaf(RS[fq][fk][k * 2 + 1], sm_scale, negative_m));
        RS[fq][fk][k * 2 + 4] = math::ptx_exp2(fmaf(RS[fq][fk][k * 2 + 4], sm_scale, negative_m));
        RS[fq][fk][k * 2 + 5] = math::ptx_exp2(fmaf(RS[fq][fk][k * 2 + 5], sm_scale, negative_m));
      }
    }
  }
}

