// Fused dequantisation for the quantised KV formats (issue 36), included by kvledger_native.cpp inside its
// anonymous namespace after QuantCache: code converters that stay in vector registers (int8, uint8, 4-bit
// nibbles, e4m3 by bit arithmetic instead of a 256-entry table), the decode kernel that scores and
// accumulates straight from the codes, and the quantising KV write of the per-token formats.
//
// Decode never builds dequantised rows for a sealed block. Per row, a per-token format's score is
// `scale * (q . codes)` and its value contribution `(p * scale) * codes`; a per-channel key block folds its
// scales into the query once per block, `q . (c * s + m) = (q * s) . c + q . m`; 4-bit codes are read as
// their low and high nibbles against a query (and an output) kept in even/odd channel order; values stored
// turned by the Walsh-Hadamard matrix are accumulated turned and turned back once per output row
// (`sum p_i (v_i H) = (sum p_i v_i) H`). Rows of an open block (the residual page) go through the loader.

typedef uint8_t v16u8 __attribute__((vector_size(16)));

inline v16u8 ld16(const uint8_t* p) {
  v16u8 c;
  std::memcpy(&c, p, 16);
  return c;
}
// 16 bytes -> 16 floats (signed or unsigned). GCC scalarises __builtin_convertvector from bytes, so the
// widening is spelled with intrinsics where the target has them.
template <bool SIGNED>
inline vf widen(v16u8 c) {
#if defined(__AVX512F__)
  const __m128i x = reinterpret_cast<__m128i>(c);
  const __m512i w = SIGNED ? _mm512_cvtepi8_epi32(x) : _mm512_cvtepu8_epi32(x);
  return reinterpret_cast<vf>(_mm512_cvtepi32_ps(w));
#elif defined(__AVX2__)
  const __m128i x = reinterpret_cast<__m128i>(c);
  const __m128i y = _mm_srli_si128(x, 8);
  const __m256 lo = _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(x) : _mm256_cvtepu8_epi32(x));
  const __m256 hi = _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(y) : _mm256_cvtepu8_epi32(y));
  vf r;
  std::memcpy(&r, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&r) + 32, &hi, 32);
  return r;
#else
  float t[kW];
  for (int i = 0; i < kW; ++i) t[i] = SIGNED ? static_cast<float>(static_cast<int8_t>(c[i])) : static_cast<float>(c[i]);
  return loadu(t);
#endif
}
inline vi widen_u8_int(v16u8 c) {
#if defined(__AVX512F__)
  return reinterpret_cast<vi>(_mm512_cvtepu8_epi32(reinterpret_cast<__m128i>(c)));
#else
  int32_t t[kW];
  for (int i = 0; i < kW; ++i) t[i] = c[i];
  vi r;
  std::memcpy(&r, t, sizeof(r));
  return r;
#endif
}
inline vf cvt_s8(const uint8_t* p) { return widen<true>(ld16(p)); }
inline vf cvt_u8(v16u8 c) { return widen<false>(c); }

// e4m3fn codes -> fp32 by bit arithmetic: a normal code (exponent field e >= 1) is the fp32 with exponent
// e + 120 and the same 3 mantissa bits; a subnormal one (e = 0, value m * 2^-9) is the normal fp32
// 2^-6 * (1 + m/8) minus 2^-6. Exact for every finite code (the writers never store NaN: they saturate).
inline vf cvt_e4m3(const uint8_t* p) {
  const vi x = widen_u8_int(ld16(p));
  const vi mag = x & 0x7F;
  const vi sub = mag < 8;  // -1 where the exponent field is 0
  const vi bits = (mag << 20) + (120 << 23) + (sub & (1 << 23));
  vf f;
  std::memcpy(&f, &bits, sizeof(f));
  vi corr_bits = sub & 0x3C800000;  // 2^-6 where subnormal, else +0
  vf corr;
  std::memcpy(&corr, &corr_bits, sizeof(corr));
  f = f - corr;
  vi fb;
  std::memcpy(&fb, &f, sizeof(fb));
  fb |= (x & 0x80) << 24;
  std::memcpy(&f, &fb, sizeof(f));
  return f;
}

inline float e4m3_scalar(uint8_t c) {
  const int32_t mag = c & 0x7F;
  const bool sub = mag < 8;
  const int32_t bits = (mag << 20) + (120 << 23) + (sub ? (1 << 23) : 0);
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  if (sub) f -= 0.015625f;
  return (c & 0x80) ? -f : f;
}

// In-place normalised fast Walsh-Hadamard transform of n (a power of two) floats: x <- x H, H symmetric
// with entries +-1/sqrt(n) (kv_quant.hadamard's matrix, Sylvester's order).
inline void fwht(float* x, int64_t n) {
  for (int64_t len = 1; len < n; len <<= 1)
    for (int64_t i = 0; i < n; i += 2 * len)
      for (int64_t j = i; j < i + len; ++j) {
        const float a = x[j], b = x[j + len];
        x[j] = a + b;
        x[j + len] = a - b;
      }
  const float norm = 1.f / std::sqrt(static_cast<float>(n));
  for (int64_t i = 0; i < n; ++i) x[i] *= norm;
}

// out[i] = the sum of the 16 lanes of row i of v ([16][16] floats), for all 16 rows at once: a transposing
// tree of lane shuffles (46 vector operations) in place of 16 horizontal sums.
inline void hsum16(const float* v, float* out) {
#if defined(__AVX512F__)
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = _mm512_loadu_ps(v + 32 * i), b = _mm512_loadu_ps(v + 32 * i + 16);
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // Lane 4k + j of f holds row k + 4j.
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(idx, f));
#else
  for (int i = 0; i < kW; ++i) out[i] = hsum(loadu(v + i * kW));
#endif
}

// ---- fused block kernels ----------------------------------------------------------------------------
// One KV head's `n` rows of one sealed block starting at row `off`. q: G x D scaled fp32 queries.

template <int G, int D>
struct Fused {
  static constexpr int NC = D / kW;  // 16-float chunks per row
  static constexpr int HC = D / 32;  // 16-byte chunks of a 4-bit row (D / 2 bytes)

  // Per-token scale (int8 / e4m3 codes): s[g][i] = scale_i * (q_g . codes_i).
  template <bool E4M3>
  static void scores_token(const QuantCache& kc, const float* q, int64_t blk, int64_t off, int64_t n, int64_t h,
                           float* s, int64_t ld) {
    const uint8_t* block = kc.base + blk * kc.R;
    vf qv[G][NC];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < NC; ++c) qv[g][c] = loadu(q + g * D + c * kW);
    alignas(64) float red[G][kW * kW];
    float sc[kW], sums[kW];
    for (int64_t i0 = 0; i0 < n; i0 += kW) {
      const int64_t m = std::min<int64_t>(kW, n - i0);
      for (int64_t j = 0; j < m; ++j) {
        const int64_t r = (off + i0 + j) * kc.H + h;
        const uint8_t* codes = block + kc.codes_off + r * D;
        sc[j] = half_at(block + kc.scale_off, r);
        vf acc[G];
        for (int g = 0; g < G; ++g) acc[g] = vf{};
        for (int c = 0; c < NC; ++c) {
          const vf x = E4M3 ? cvt_e4m3(codes + c * kW) : cvt_s8(codes + c * kW);
          for (int g = 0; g < G; ++g) acc[g] += qv[g][c] * x;
        }
        for (int g = 0; g < G; ++g) storeu(red[g] + j * kW, acc[g]);
      }
      for (int g = 0; g < G; ++g) {
        hsum16(red[g], sums);
        for (int64_t j = 0; j < m; ++j) s[g * ld + i0 + j] = sums[j] * sc[j];
      }
    }
  }

  // Per-channel asymmetric keys: the block's scales folded into the query, its minimums into a constant.
  // FOUR: 4-bit codes (KIVI), the query taken in [even channels | odd channels] order.
  template <bool FOUR>
  static void scores_channel(const QuantCache& kc, const float* q, int64_t blk, int64_t off, int64_t n, int64_t h,
                             float* s, int64_t ld) {
    const uint8_t* block = kc.base + blk * kc.R;
    const uint8_t* sp = block + kc.scale_off + h * D * 2;
    const uint8_t* mp = block + kc.min_off + h * D * 2;
    alignas(64) float qe[G * D];
    float qc[G];
    for (int g = 0; g < G; ++g) {
      float c0 = 0.f;
      for (int d = 0; d < D; ++d) {
        const float sc = half_at(sp, d), mn = half_at(mp, d), qd = q[g * D + d];
        c0 += qd * mn;
        const int pos = FOUR ? (d % 2) * (D / 2) + d / 2 : d;
        qe[g * D + pos] = qd * sc;
      }
      qc[g] = c0;
    }
    vf qv[G][NC];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < NC; ++c) qv[g][c] = loadu(qe + g * D + c * kW);
    alignas(64) float red[G][kW * kW];
    float sums[kW];
    for (int64_t i0 = 0; i0 < n; i0 += kW) {
      const int64_t m = std::min<int64_t>(kW, n - i0);
      for (int64_t j = 0; j < m; ++j) {
        const int64_t r = (off + i0 + j) * kc.H + h;
        vf acc[G];
        for (int g = 0; g < G; ++g) acc[g] = vf{};
        if constexpr (FOUR) {
          const uint8_t* codes = block + kc.codes_off + r * (D / 2);
          for (int c = 0; c < HC; ++c) {
            const v16u8 b = ld16(codes + c * 16);
            const vf lo = cvt_u8(b & 15), hi = cvt_u8(b >> 4);
            for (int g = 0; g < G; ++g) acc[g] += qv[g][c] * lo + qv[g][HC + c] * hi;
          }
        } else {
          const uint8_t* codes = block + kc.codes_off + r * D;
          for (int c = 0; c < NC; ++c) {
            const vf x = cvt_u8(ld16(codes + c * kW));
            for (int g = 0; g < G; ++g) acc[g] += qv[g][c] * x;
          }
        }
        for (int g = 0; g < G; ++g) storeu(red[g] + j * kW, acc[g]);
      }
      for (int g = 0; g < G; ++g) {
        hsum16(red[g], sums);
        for (int64_t j = 0; j < m; ++j) s[g * ld + i0 + j] = sums[j] + qc[g];
      }
    }
  }

  // Per-token asymmetric 4-bit keys (int4-hadamard): s = scale_i * (q . codes_i) + min_i * sum(q), with q
  // in [even | odd] channel order (qp) and qs[g] = sum of q_g.
  static void scores_token4(const QuantCache& kc, const float* qp, const float* qs, int64_t blk, int64_t off,
                            int64_t n, int64_t h, float* s, int64_t ld) {
    const uint8_t* block = kc.base + blk * kc.R;
    vf qv[G][NC];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < NC; ++c) qv[g][c] = loadu(qp + g * D + c * kW);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = (off + i) * kc.H + h;
      const uint8_t* codes = block + kc.codes_off + r * (D / 2);
      const float sc = half_at(block + kc.scale_off, r), mn = half_at(block + kc.min_off, r);
      vf acc[G];
      for (int g = 0; g < G; ++g) acc[g] = vf{};
      for (int c = 0; c < HC; ++c) {
        const v16u8 b = ld16(codes + c * 16);
        const vf lo = cvt_u8(b & 15), hi = cvt_u8(b >> 4);
        for (int g = 0; g < G; ++g) acc[g] += qv[g][c] * lo + qv[g][HC + c] * hi;
      }
      for (int g = 0; g < G; ++g) s[g * ld + i] = hsum(acc[g]) * sc + mn * qs[g];
    }
  }

  // acc[g] += sum_i (p[g][i] * scale_i) * codes_i (per-token int8 / e4m3 values; turned or not).
  template <bool E4M3>
  static void accumulate_token(const QuantCache& vc, float* acc, const float* p, int64_t ld, int64_t blk,
                               int64_t off, int64_t n, int64_t h) {
    const uint8_t* block = vc.base + blk * vc.R;
    vf a[G][NC];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < NC; ++c) a[g][c] = loadu(acc + g * D + c * kW);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = (off + i) * vc.H + h;
      const uint8_t* codes = block + vc.codes_off + r * D;
      const float sc = half_at(block + vc.scale_off, r);
      vf w[G];
      for (int g = 0; g < G; ++g) w[g] = splat(p[g * ld + i] * sc);
      for (int c = 0; c < NC; ++c) {
        const vf x = E4M3 ? cvt_e4m3(codes + c * kW) : cvt_s8(codes + c * kW);
        for (int g = 0; g < G; ++g) a[g][c] += w[g] * x;
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < NC; ++c) storeu(acc + g * D + c * kW, a[g][c]);
  }

  // KIVI values (4-bit, scale and minimum per token): acc in [even | odd] channel order; the minimums'
  // share, sum_i p_i * min_i, is the same for every channel and goes to extra[g].
  static void accumulate_kivi(const QuantCache& vc, float* acc, float* extra, const float* p, int64_t ld,
                              int64_t blk, int64_t off, int64_t n, int64_t h) {
    const uint8_t* block = vc.base + blk * vc.R;
    vf a[G][NC];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < NC; ++c) a[g][c] = loadu(acc + g * D + c * kW);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = (off + i) * vc.H + h;
      const uint8_t* codes = block + vc.codes_off + r * (D / 2);
      const float sc = half_at(block + vc.scale_off, r), mn = half_at(block + vc.min_off, r);
      vf w[G];
      for (int g = 0; g < G; ++g) {
        const float pg = p[g * ld + i];
        w[g] = splat(pg * sc);
        extra[g] += pg * mn;
      }
      for (int c = 0; c < HC; ++c) {
        const v16u8 b = ld16(codes + c * 16);
        const vf lo = cvt_u8(b & 15), hi = cvt_u8(b >> 4);
        for (int g = 0; g < G; ++g) {
          a[g][c] += w[g] * lo;
          a[g][HC + c] += w[g] * hi;
        }
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < NC; ++c) storeu(acc + g * D + c * kW, a[g][c]);
  }
};

// Paged decode over a quantised layer with the fused block kernels: paged_decode_impl's work split
// (sequence, KV head, context partition; flash-decoding merge when partitioned), its softmax, its loader
// for open blocks. Requires D in {64, 128} and 1 <= G <= 8 (fused_decode picks it only then).
template <typename Q, int G, int D>
void fused_decode_impl(torch::Tensor& out, const torch::Tensor& q, const QuantCache& kc, const QuantCache& vc,
                       int64_t bs, int64_t KVH, const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                       const torch::Tensor& rows, double scale, int64_t window, int64_t partition) {
  using F = Fused<G, D>;
  const int64_t B = block_tables.size(0), max_blocks = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int64_t* row_idx = rows.data_ptr<int64_t>();
  const Q* qp = q.data_ptr<Q>();
  Q* op = out.data_ptr<Q>();
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1);
  const int64_t o_s0 = out.stride(0), o_s1 = out.stride(1);

  SplitContexts split(lens, B, KVH, G, D, partition);
  const int64_t P = split.P, part_len = split.part_len;
  const float fscale = static_cast<float>(scale);
  const BlockKernels plain = pick_kernels(G, D);

  at::parallel_for(0, B * KVH * P, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), qperm(G * D), acc(G * D), accp(G * D), scores, tile(bs * D), outv(D);
    float qsum[G];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t p = item % P, h = (item / P) % KVH, b = item / (P * KVH);
      const int64_t len = lens[b];
      int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      int64_t hi = len;
      lo = std::max(lo, p * part_len);
      hi = std::min(hi, (p + 1) * part_len);
      if (lo >= hi) continue;
      const int64_t n = hi - lo;
      const int32_t* table = tables + b * max_blocks;
      const Q* qrow = qp + row_idx[b] * q_s0 + h * G * q_s1;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(qrow[g * q_s1 + d]) * fscale;
      if (kc.kind == kKiviV)  // per-token 4-bit keys: the query in [even | odd] order and its sum
        for (int64_t g = 0; g < G; ++g) {
          float sum = 0.f;
          for (int64_t d = 0; d < D; ++d) {
            qperm[g * D + (d % 2) * (D / 2) + d / 2] = qf[g * D + d];
            sum += qf[g * D + d];
          }
          qsum[g] = sum;
        }
      scores.resize(G * n);
      for (int64_t t = lo; t < hi;) {
        const int64_t blk = t / bs, stop = std::min(hi, (blk + 1) * bs), off = t % bs, cnt = stop - t;
        if (stop < hi) kc.prefetch(table[blk + 1], h, bs, D);
        const int64_t id = table[blk];
        float* s = scores.data() + (t - lo);
        if (kc.res_map && kc.res_map[id] >= 0) {
          int64_t ks = 0;
          const float* kr = kc.rows(id, off, h, cnt, D, tile.data(), &ks);
          plain.scores(qf.data(), kr, ks, cnt, s, n);
        } else if (kc.kind == kInt8Token) {
          F::template scores_token<false>(kc, qf.data(), id, off, cnt, h, s, n);
        } else if (kc.kind == kFp8Token) {
          F::template scores_token<true>(kc, qf.data(), id, off, cnt, h, s, n);
        } else if (kc.kind == kChanK) {
          F::template scores_channel<false>(kc, qf.data(), id, off, cnt, h, s, n);
        } else if (kc.kind == kKiviV) {
          F::scores_token4(kc, qperm.data(), qsum, id, off, cnt, h, s, n);
        } else {
          F::template scores_channel<true>(kc, qf.data(), id, off, cnt, h, s, n);
        }
        t = stop;
      }
      float m[G], l[G], extra[G];
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * n;
        m[g] = max_of(s, n);
        l[g] = exp_shift_sum(s, n, m[g]);
        extra[g] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(accp.begin(), accp.end(), 0.f);
      bool any_plain = false;
      for (int64_t t = lo; t < hi;) {
        const int64_t blk = t / bs, stop = std::min(hi, (blk + 1) * bs), off = t % bs, cnt = stop - t;
        if (stop < hi) vc.prefetch(table[blk + 1], h, bs, D);
        const int64_t id = table[blk];
        const float* pr = scores.data() + (t - lo);
        if (vc.res_map && vc.res_map[id] >= 0) {
          int64_t vs = 0;
          const float* vr = vc.rows(id, off, h, cnt, D, tile.data(), &vs);
          plain.accumulate(accp.data(), pr, n, vr, vs, cnt);
          any_plain = true;
        } else if (vc.kind == kFp8Token) {
          F::template accumulate_token<true>(vc, acc.data(), pr, n, id, off, cnt, h);
        } else if (vc.kind == kKiviV || vc.kind == kKiviVRot) {
          F::accumulate_kivi(vc, acc.data(), extra, pr, n, id, off, cnt, h);
        } else {  // kInt8Token, kInt8TokenRot
          F::template accumulate_token<false>(vc, acc.data(), pr, n, id, off, cnt, h);
        }
        t = stop;
      }
      // acc (the sealed blocks, in the codes' order and space) -> natural channels, plus the open rows.
      for (int64_t g = 0; g < G; ++g) {
        float* a = acc.data() + g * D;
        if (vc.kind == kKiviV || vc.kind == kKiviVRot) {
          for (int64_t j = 0; j < D / 2; ++j) {
            outv[2 * j] = a[j] + extra[g];
            outv[2 * j + 1] = a[D / 2 + j] + extra[g];
          }
          std::memcpy(a, outv.data(), D * sizeof(float));
        }
        if (vc.kind == kInt8TokenRot || vc.kind == kKiviVRot) fwht(a, D);
        if (any_plain)
          for (int64_t d = 0; d < D; ++d) a[d] += accp[g * D + d];
      }
      split.finish(op, row_idx, o_s0, o_s1, KVH, b, h, p, acc.data(), m, l);
    }
  });
  split.merge(op, row_idx, o_s0, o_s1, B, KVH);
}

template <typename Q, int D, int... Gs>
bool fused_for_d(int64_t G, torch::Tensor& out, const torch::Tensor& q, const QuantCache& kc, const QuantCache& vc,
                 int64_t bs, int64_t KVH, const torch::Tensor& bt, const torch::Tensor& cl, const torch::Tensor& rows,
                 double scale, int64_t window, int64_t partition, std::integer_sequence<int, Gs...>) {
  bool done = false;
  ((G == Gs + 1 ? (fused_decode_impl<Q, Gs + 1, D>(out, q, kc, vc, bs, KVH, bt, cl, rows, scale, window, partition),
                   done = true, 0)
                : 0),
   ...);
  return done;
}

// The fused kernel when the shape has one (head dim 64 or 128, up to 8 query heads per KV head); false:
// the caller takes the loader path.
template <typename Q>
bool fused_decode(torch::Tensor& out, const torch::Tensor& q, const QuantCache& kc, const QuantCache& vc, int64_t bs,
                  int64_t KVH, const torch::Tensor& bt, const torch::Tensor& cl, const torch::Tensor& rows,
                  double scale, int64_t window, int64_t partition) {
  const int64_t G = q.size(1) / KVH, D = q.size(2);
  if (D == 64)
    return fused_for_d<Q, 64>(G, out, q, kc, vc, bs, KVH, bt, cl, rows, scale, window, partition,
                              std::make_integer_sequence<int, 8>{});
  if (D == 128)
    return fused_for_d<Q, 128>(G, out, q, kc, vc, bs, KVH, bt, cl, rows, scale, window, partition,
                               std::make_integer_sequence<int, 8>{});
  return false;
}

// ---- quantising write of the per-token formats ------------------------------------------------------
// kv_quant.quant_token in C++, bit for bit: s = fp16(amax / top), code = round-half-even(clamp(x / s))
// (int8) or e4m3(clamp(x / s)) (fp8-scaled), written into each row's slot of its block.
// fp16 neighbours as kv_quant._fp16_down / _fp16_up: the largest fp16 <= x, the smallest fp16 >= x.
inline c10::Half fp16_step(c10::Half h, bool up) {
  const uint16_t b = h.x;
  const bool neg = b & 0x8000, zero = (b & 0x7FFF) == 0;
  uint16_t r;
  if (zero) r = up ? 0x0001 : 0x8001;
  else r = (neg == up) ? b - 1 : b + 1;
  c10::Half out;
  out.x = r;
  return out;
}
inline c10::Half fp16_down(float x) {
  const c10::Half h(x);
  return static_cast<float>(h) > x ? fp16_step(h, false) : h;
}
inline c10::Half fp16_up(float x) {
  const c10::Half h(x);
  return static_cast<float>(h) < x ? fp16_step(h, true) : h;
}

template <typename S>
void write_token_rows(uint8_t* base, int64_t R, int64_t kind, int64_t codes_off, int64_t scale_off, int64_t min_off,
                      int64_t bs, int64_t H, int64_t D, const int64_t* slots, int64_t n, const torch::Tensor& src) {
  const S* sp = src.data_ptr<S>();
  const int64_t s0 = src.stride(0), s1 = src.stride(1);
  const float top = kind == kInt8Token ? 127.f : 448.f;
  std::vector<float> x(D);
  for (int64_t i = 0; i < n; ++i) {
    uint8_t* block = base + (slots[i] / bs) * R;
    const int64_t off = slots[i] % bs;
    for (int64_t h = 0; h < H; ++h) {
      const S* row = sp + i * s0 + h * s1;
      if (kind == kKiviV) {  // kv_quant._asym over the row: minimum down, step up, codes 0..15, two per byte
        float mn = std::numeric_limits<float>::infinity(), mx = -mn;
        for (int64_t d = 0; d < D; ++d) {
          x[d] = static_cast<float>(row[d]);
          mn = std::min(mn, x[d]);
          mx = std::max(mx, x[d]);
        }
        const c10::Half low = fp16_down(mn);
        const float lowf = static_cast<float>(low);
        const c10::Half step = fp16_up((mx - lowf) / 15.f);
        const float st = std::max(static_cast<float>(step), 1e-30f);
        const int64_t r = off * H + h;
        std::memcpy(block + scale_off + 2 * r, &step, 2);
        std::memcpy(block + min_off + 2 * r, &low, 2);
        uint8_t* codes = block + codes_off + r * (D / 2);
        for (int64_t j = 0; j < D / 2; ++j) {
          const float a = std::min(15.f, std::max(0.f, std::nearbyint((x[2 * j] - lowf) / st)));
          const float b = std::min(15.f, std::max(0.f, std::nearbyint((x[2 * j + 1] - lowf) / st)));
          codes[j] = static_cast<uint8_t>(static_cast<int>(a) | (static_cast<int>(b) << 4));
        }
        continue;
      }
      float amax = 0.f;
      for (int64_t d = 0; d < D; ++d) {
        x[d] = static_cast<float>(row[d]);
        amax = std::max(amax, std::fabs(x[d]));
      }
      const c10::Half sh(amax / top);
      const float s = std::max(static_cast<float>(sh), 1e-30f);
      const int64_t r = off * H + h;
      std::memcpy(block + scale_off + 2 * r, &sh, 2);
      uint8_t* codes = block + codes_off + r * D;
      for (int64_t d = 0; d < D; ++d) {
        const float y = std::min(top, std::max(-top, x[d] / s));
        if (kind == kInt8Token) {
          codes[d] = static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(y)));
        } else {
          const c10::Float8_e4m3fn e(y);
          codes[d] = e.x;
        }
      }
    }
  }
}

// Quantise K and V rows ([n, kv_heads, dim]) of a per-token format (fp8-scaled, int8, int8-hadamard with
// its keys already turned) into their slots of one layer's blocks ([num_blocks, R] uint8; layout as
// quant_caches takes it).
void kv_write_q(torch::Tensor blocks, torch::Tensor layout, int64_t block_size, torch::Tensor slots, torch::Tensor k,
                torch::Tensor v) {
  check_rows(k, "k");
  check_rows(v, "v");
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                  blocks.is_contiguous(), "kv_write_q: blocks must be a contiguous uint8 [blocks, bytes] tensor");
  TORCH_CHECK(layout.scalar_type() == at::kLong && layout.is_contiguous() && layout.numel() == 8,
              "kv_write_q: layout must be 8 int64 values");
  TORCH_CHECK(k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(), "kv_write_q: K and V rows must match");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == k.size(0),
              "kv_write_q: one int64 slot per row");
  const int64_t* L = layout.data_ptr<int64_t>();
  const int64_t H = k.size(1), D = k.size(2), R = blocks.size(1), bs = block_size;
  const int64_t n = slots.numel(), limit = blocks.size(0) * bs;
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(s[i] >= 0 && s[i] < limit, "kv_write_q: slot ", s[i], " out of range");
  for (int t = 0; t < 2; ++t) {
    // Turned kinds store the same codes (the caller turns the rows first).
    const int64_t kind = L[4 * t] == kKiviVRot ? kKiviV : L[4 * t] == kInt8TokenRot ? kInt8Token : L[4 * t];
    const int64_t co = L[4 * t + 1], so = L[4 * t + 2], mo = L[4 * t + 3];
    TORCH_CHECK(kind == kInt8Token || kind == kFp8Token || kind == kKiviV, "kv_write_q: writes the per-token formats only");
    TORCH_CHECK(kind != kKiviV || D % 2 == 0, "kv_write_q: 4-bit rows need an even head dim");
    const int64_t cbytes = kind == kKiviV ? bs * H * D / 2 : bs * H * D;
    TORCH_CHECK(co >= 0 && co + cbytes <= R && so >= 0 && so + bs * H * 2 <= R &&
                    (kind != kKiviV || (mo >= 0 && mo + bs * H * 2 <= R)), "kv_write_q: layout outside the block");
    const torch::Tensor& src = t == 0 ? k : v;
    switch (src.scalar_type()) {
      case at::kFloat: write_token_rows<float>(blocks.data_ptr<uint8_t>(), R, kind, co, so, mo, bs, H, D, s, n, src); break;
      case at::kBFloat16:
        write_token_rows<c10::BFloat16>(blocks.data_ptr<uint8_t>(), R, kind, co, so, mo, bs, H, D, s, n, src);
        break;
      case at::kHalf: write_token_rows<c10::Half>(blocks.data_ptr<uint8_t>(), R, kind, co, so, mo, bs, H, D, s, n, src); break;
      default: TORCH_CHECK(false, "kv_write_q: unsupported row dtype ", src.scalar_type());
    }
  }
}
