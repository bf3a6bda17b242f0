// Paged decode for bf16 queries over a bf16 cache on AVX-512 BF16 (vdpbf16ps), included by kvledger_native.cpp
// after paged_decode_impl (it reuses SplitContexts, exp_shift_sum, max_of and hsum16 from there).
//
// Why: the portable path widens every cached K and V row to fp32 in a scratch tile before its dot products; in a
// bf16 decode step at 32 running that widening was ~40% of the attention's time with the cache in L2 (909 vs 535 us
// a layer for fp32). Here a score is 2 (D = 64) or 4 (D = 128) vdpbf16ps on the rows as stored, and V rows are
// widened in registers on their way into the fp32 accumulators. Products of two bf16 values are exact in fp32,
// so a score differs from the portable path's only in the order of its fp32 additions, and in the scale being
// applied to the sum instead of to the query (exact for D = 64: the scale is 1/8); probabilities and the
// weighted sum of V stay fp32. The caller falls back to paged_decode_impl for other dtypes and shapes.

#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512F__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12))
#define KVL_BF16_DOTS 1

namespace kvl_bf16dp {

// 32 bf16 values as one vdpbf16ps operand.
inline __m512bh load32(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }

// 16 bf16 values widened to fp32 (exact: a bf16 is the top half of a float).
inline vf widen16(const c10::BFloat16* p) {
  const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
                                      16);
  return (vf)_mm512_castsi512_ps(w);
}

// s[g * ld + i] = scale * (q[g] . k_i) for `rows` rows k_i = k + i * ks; sixteen rows' horizontal sums at once.
template <int G, int D>
void scores(const c10::BFloat16* q, int64_t q_s1, const c10::BFloat16* k, int64_t ks, int64_t rows, float scale,
            float* s, int64_t ld) {
  constexpr int NC = D / 32;
  __m512bh qv[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) qv[g][c] = load32(q + g * q_s1 + c * 32);
  const vf sc = splat(scale);
  int64_t i0 = 0;
  for (; i0 + kW <= rows; i0 += kW) {
    for (int g = 0; g < G; ++g) {
      vf acc[kW];
      for (int r = 0; r < kW; ++r) {
        const c10::BFloat16* kr = k + (i0 + r) * ks;
        __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], load32(kr));
        for (int c = 1; c < NC; ++c) a = _mm512_dpbf16_ps(a, qv[g][c], load32(kr + c * 32));
        acc[r] = (vf)a;
      }
      storeu(s + g * ld + i0, hsum16(acc) * sc);
    }
  }
  for (int64_t i = i0; i < rows; ++i) {
    const c10::BFloat16* kr = k + i * ks;
    for (int g = 0; g < G; ++g) {
      __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], load32(kr));
      for (int c = 1; c < NC; ++c) a = _mm512_dpbf16_ps(a, qv[g][c], load32(kr + c * 32));
      s[g * ld + i] = hsum((vf)a) * scale;
    }
  }
}

// acc[g] += sum_i p[g * ld + i] * v_i for `rows` bf16 rows v_i = v + i * vs, widened in registers.
template <int G, int D>
void accumulate(float* acc, const float* p, int64_t ld, const c10::BFloat16* v, int64_t vs, int64_t rows) {
  constexpr int NC = D / kW;
  vf a[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) a[g][c] = loadu(acc + g * D + c * kW);
  for (int64_t i = 0; i < rows; ++i) {
    const c10::BFloat16* vr = v + i * vs;
    for (int c = 0; c < NC; ++c) {
      const vf x = widen16(vr + c * kW);
      for (int g = 0; g < G; ++g) a[g][c] += splat(p[g * ld + i]) * x;
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) storeu(acc + g * D + c * kW, a[g][c]);
}

// The work items of paged_decode_impl (sequence, KV head, context partition) with the kernels above.
template <int G, int D>
void decode(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
            const torch::Tensor& block_tables, const torch::Tensor& context_lens, const torch::Tensor& rows,
            double scale, int64_t window, int64_t partition) {
  const int64_t B = block_tables.size(0), max_blocks = block_tables.size(1);
  const int64_t bs = k_cache.size(1), KVH = k_cache.size(2);
  const PlainCache<c10::BFloat16> kc = plain_cache<c10::BFloat16>(k_cache), vc = plain_cache<c10::BFloat16>(v_cache);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int64_t* row_idx = rows.data_ptr<int64_t>();
  const c10::BFloat16* qp = q.data_ptr<c10::BFloat16>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1);
  const int64_t o_s0 = out.stride(0), o_s1 = out.stride(1);
  SplitContexts split(lens, B, KVH, G, D, partition);
  const int64_t P = split.P, part_len = split.part_len;
  const float fscale = static_cast<float>(scale);

  // On the caller and the helper thread (kvledger_helper_pool.h): the products before and after keep it awake,
  // so no OpenMP worker is woken per layer; eight ranges balance uneven contexts.
  kvl_pool::parallel_for(B * KVH * P, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(G * D), scores_buf, m(G), l(G);
    for (int64_t item = begin; item < end; ++item) {
      const auto [b, h, p, lo, hi] = split.item_range(item, lens, KVH, window);
      if (lo >= hi) continue;
      const int64_t n = hi - lo;
      const int32_t* table = tables + b * max_blocks;
      const c10::BFloat16* qrow = qp + row_idx[b] * q_s0 + h * G * q_s1;
      scores_buf.resize(G * n);
      float* s = scores_buf.data();
      for (int64_t t = lo; t < hi;) {
        const int64_t blk = t / bs, stop = std::min(hi, (blk + 1) * bs), off = t % bs;
        if ((blk + kPrefetchBlocks) * bs < hi) kc.prefetch(table[blk + kPrefetchBlocks], h, bs, D);
        const c10::BFloat16* kr = kc.p + table[blk] * kc.v.s_block + off * kc.v.s_slot + h * kc.v.s_head;
        scores<G, D>(qrow, q_s1, kr, kc.v.s_slot, stop - t, fscale, s + (t - lo), n);
        t = stop;
      }
      for (int64_t g = 0; g < G; ++g) {
        m[g] = max_of(s + g * n, n);
        l[g] = exp_shift_sum(s + g * n, n, m[g]);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = lo; t < hi;) {
        const int64_t blk = t / bs, stop = std::min(hi, (blk + 1) * bs), off = t % bs;
        if ((blk + kPrefetchBlocks) * bs < hi) vc.prefetch(table[blk + kPrefetchBlocks], h, bs, D);
        const c10::BFloat16* vr = vc.p + table[blk] * vc.v.s_block + off * vc.v.s_slot + h * vc.v.s_head;
        accumulate<G, D>(acc.data(), s + (t - lo), n, vr, vc.v.s_slot, stop - t);
        t = stop;
      }
      split.finish(op, row_idx, o_s0, o_s1, KVH, b, h, p, acc.data(), m.data(), l.data());
    }
  });
  split.merge(op, row_idx, o_s0, o_s1, B, KVH);
}

using DecodeFn = void (*)(torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                          const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, double, int64_t, int64_t);

template <int D, int... Gs>
DecodeFn pick_for_d(int64_t G, std::integer_sequence<int, Gs...>) {
  DecodeFn f = nullptr;
  ((G == Gs + 1 ? (f = &decode<Gs + 1, D>, 0) : 0), ...);
  return f;
}

// The kernel for G query heads per KV head and head dim D, or null (the caller takes the portable path).
inline DecodeFn pick(int64_t G, int64_t D) {
  if (D == 64) return pick_for_d<64>(G, std::make_integer_sequence<int, 8>{});
  if (D == 128) return pick_for_d<128>(G, std::make_integer_sequence<int, 8>{});
  return nullptr;
}

}  // namespace kvl_bf16dp
#endif
