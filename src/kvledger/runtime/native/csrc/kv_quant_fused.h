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

// fp16 -> fp32 for n values.
inline void halves(const uint8_t* p, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * i))));
#endif
  for (; i < n; ++i) out[i] = half_at(p, i);
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
    alignas(64) float qe[G * D], scs[D], mns[D];
    halves(sp, scs, D);
    halves(mp, mns, D);
    float qc[G];
    for (int g = 0; g < G; ++g) {
      float c0 = 0.f;
      for (int d = 0; d < D; ++d) {
        const float sc = scs[d], mn = mns[d], qd = q[g * D + d];
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

// ---- integer dot products (AVX-512 VNNI) --------------------------------------------------------------
// Where the build has AVX-512 VNNI (the binary is compiled per machine with -march=native), decode over
// int8-channel / int4 keys and int8 / 4-bit per-token values runs on integer dot products instead of
// widening every code to fp32:
// - keys: the block's per-channel scales are folded into the query (q' = q * s), q' is quantised to two
//   int8 terms per channel (Q = 128 * hi + lo, |Q| <= 127 * 128, q' ~ a * Q: 15 bits, far finer than the
//   8- or 4-bit keys), and 16 rows at a time are transposed by 4-byte columns so vpdpbusd (u8 codes x s8
//   query) sums every token's dot in its own lane. The rounding left over, sum_d (q'_d - a Q_d) c_d, is
//   taken at the codes' centre (c_d ~ 127.5, or 7.5 for nibbles): exact in the mean, off by
//   sum_d r_d (c_d - centre) with |r_d| <= a / 2.
// - values: the weights p_i * scale_i of one block are quantised per query head to int16 (w ~ b * W,
//   W <= 32767) and pairs of rows are interleaved so vpdpwssd (s16 x s16) accumulates two tokens at once;
//   each block's int32 sums are scaled by b into fp32. Accumulators sit in a fixed permutation of the
//   channels (unpermuted once per work item, by permuted_pos).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define KVL_INT_DOT 1
#else
#define KVL_INT_DOT 0
#endif

// On by default where built; off: the float kernels (their exactness tests, and comparisons).
inline std::atomic<bool>& int_dot_on() {
  static std::atomic<bool> on{KVL_INT_DOT == 1};
  return on;
}

// Where lane l of value accumulator v (16 lanes each, D / 16 of them) sits in the float accumulator's order
// (natural channels; [even | odd] channels for 4-bit codes).
inline int64_t permuted_pos(bool four, int64_t D, int64_t v, int64_t l) {
  const int64_t L = l / 4, m = l % 4;
  if (four) return ((v % 4) >= 2 ? D / 2 : 0) + 32 * (v / 4) + 8 * L + 4 * (v % 2) + m;
  return 32 * (v / 2) + 8 * L + 4 * (v % 2) + m;
}

#if KVL_INT_DOT
template <int G, int D>
struct IntDot {
  static constexpr int NC = D / 16;

  struct Query {  // q' ~ a * (128 * hi + lo); score = a * (codes . Q) + c
    alignas(64) int8_t hi[G][D];
    alignas(64) int8_t lo[G][D];
    float a[G], c[G];
  };

  // qe: G x D floats in the codes' channel order; c[g] = q_g . mn (mn null: 0) + centre * sum_d (qe - a Q).
  static void quantise(const float* qe, const float* q, const float* mn, float centre, Query& Q) {
    for (int g = 0; g < G; ++g) {
      __m512 mx = _mm512_setzero_ps();
      for (int c = 0; c < NC; ++c) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(qe + g * D + 16 * c)));
      const float amax = _mm512_reduce_max_ps(mx);
      const float a = amax / 16256.f, inv = amax > 0.f ? 16256.f / amax : 0.f;
      __m512 t = _mm512_setzero_ps();
      for (int c = 0; c < NC; ++c) {
        const __m512 x = _mm512_loadu_ps(qe + g * D + 16 * c);
        const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(x, _mm512_set1_ps(inv)));
        const __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(qi, _mm512_set1_epi32(64)), 7);
        const __m512i lo = _mm512_sub_epi32(qi, _mm512_slli_epi32(hi, 7));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(Q.hi[g] + 16 * c), _mm512_cvtepi32_epi8(hi));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(Q.lo[g] + 16 * c), _mm512_cvtepi32_epi8(lo));
        const __m512 r = _mm512_fnmadd_ps(_mm512_set1_ps(a), _mm512_cvtepi32_ps(qi), x);
        t = _mm512_fmadd_ps(r, _mm512_set1_ps(centre), t);
        if (mn) t = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + 16 * c), _mm512_loadu_ps(mn + 16 * c), t);
      }
      Q.a[g] = a;
      Q.c[g] = _mm512_reduce_add_ps(t);
    }
  }

  // s[g * ld + i] = a_g * (codes_i . Q_g) + c_g for the n rows at codes0 + i * stride (u8 codes, or FOUR:
  // two nibbles a byte, low = even channel, against [even | odd] query bytes).
  // SIGNED: s8 codes read as u8 (c + 128, by flipping the top bit; Q's constant takes the 128 back) and the
  // scores times each row's scale tok[i].
  template <bool FOUR, bool SIGNED = false>
  static void scores(const uint8_t* codes0, int64_t stride, int64_t n, const Query& Q, float* s, int64_t ld,
                     const float* tok = nullptr) {
    constexpr int RB = FOUR ? D / 2 : D;  // bytes a row
    constexpr bool HALF = RB == 32;       // two rows to a 64-byte register
    constexpr int CH = HALF ? 1 : RB / 64;
    constexpr int NA = HALF ? 2 : 4;      // groups of 4 registers
    constexpr int NT = FOUR ? 4 : 2;      // query terms: hi, lo (even, odd)
    alignas(64) __m512i qv[G][CH][4][NT];
    for (int g = 0; g < G; ++g)
      for (int k = 0; k < CH; ++k)
        for (int t = 0; t < NT; ++t) {
          const int8_t* src = (t % 2 == 0 ? Q.hi[g] : Q.lo[g]) + (FOUR ? (t / 2) * (D / 2) : 64 * k);
          const __m512i z = HALF ? _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)))
                                 : _mm512_loadu_si512(src);
          qv[g][k][0][t] = _mm512_shuffle_epi32(z, _MM_PERM_AAAA);
          qv[g][k][1][t] = _mm512_shuffle_epi32(z, _MM_PERM_BBBB);
          qv[g][k][2][t] = _mm512_shuffle_epi32(z, _MM_PERM_CCCC);
          qv[g][k][3][t] = _mm512_shuffle_epi32(z, _MM_PERM_DDDD);
        }
    const __m512i nib = _mm512_set1_epi8(0x0F);
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
      const int64_t m = std::min<int64_t>(16, n - i0);
      auto row = [&](int64_t t) { return codes0 + (i0 + std::min<int64_t>(t, m - 1)) * stride; };
      __m512i acc[G][NA];
      for (int a = 0; a < NA; ++a) {
        __m512i h[G], l[G];
        for (int g = 0; g < G; ++g) h[g] = l[g] = _mm512_setzero_si512();
        for (int k = 0; k < CH; ++k) {
          __m512i r[4];
          for (int j = 0; j < 4; ++j) {
            if constexpr (HALF) {
              const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row(4 * a + j)));
              const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row(4 * a + j + 8)));
              r[j] = _mm512_inserti64x4(_mm512_castsi256_si512(x0), x1, 1);
            } else {
              r[j] = _mm512_loadu_si512(row(4 * a + j) + 64 * k);
            }
          }
          // 4 x 4 transpose of 4-byte columns within each 128-bit lane: u[c] lane L dword j = register j's
          // column 4L + c.
          const __m512i t0 = _mm512_unpacklo_epi32(r[0], r[1]), t1 = _mm512_unpackhi_epi32(r[0], r[1]);
          const __m512i t2 = _mm512_unpacklo_epi32(r[2], r[3]), t3 = _mm512_unpackhi_epi32(r[2], r[3]);
          __m512i u[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
                          _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
          if constexpr (SIGNED)
            for (int c = 0; c < 4; ++c) u[c] = _mm512_xor_si512(u[c], _mm512_set1_epi8(static_cast<char>(0x80)));
          for (int c = 0; c < 4; ++c) {
            if constexpr (FOUR) {
              const __m512i lo = _mm512_and_si512(u[c], nib);
              const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(u[c], 4), nib);
              for (int g = 0; g < G; ++g) {
                h[g] = _mm512_dpbusd_epi32(h[g], lo, qv[g][k][c][0]);
                l[g] = _mm512_dpbusd_epi32(l[g], lo, qv[g][k][c][1]);
                h[g] = _mm512_dpbusd_epi32(h[g], hi, qv[g][k][c][2]);
                l[g] = _mm512_dpbusd_epi32(l[g], hi, qv[g][k][c][3]);
              }
            } else {
              for (int g = 0; g < G; ++g) {
                h[g] = _mm512_dpbusd_epi32(h[g], u[c], qv[g][k][c][0]);
                l[g] = _mm512_dpbusd_epi32(l[g], u[c], qv[g][k][c][1]);
              }
            }
          }
        }
        for (int g = 0; g < G; ++g) acc[g][a] = _mm512_add_epi32(_mm512_slli_epi32(h[g], 7), l[g]);
      }
      const __mmask16 mask = static_cast<__mmask16>((1u << m) - 1u);
      for (int g = 0; g < G; ++g) {
        __m512i f;
        if constexpr (HALF) {  // lanes of acc[a]: 0, 1 -> tokens 4a.., 2, 3 -> tokens 4a + 8..
          const __m512i p = _mm512_add_epi32(_mm512_shuffle_i32x4(acc[g][0], acc[g][1], 0x88),
                                             _mm512_shuffle_i32x4(acc[g][0], acc[g][1], 0xDD));
          f = _mm512_shuffle_i32x4(p, p, 0xD8);
        } else {  // every lane of acc[a] -> tokens 4a..4a+3
          const __m512i p = _mm512_add_epi32(_mm512_shuffle_i32x4(acc[g][0], acc[g][1], 0x44),
                                             _mm512_shuffle_i32x4(acc[g][0], acc[g][1], 0xEE));
          const __m512i q = _mm512_add_epi32(_mm512_shuffle_i32x4(acc[g][2], acc[g][3], 0x44),
                                             _mm512_shuffle_i32x4(acc[g][2], acc[g][3], 0xEE));
          f = _mm512_add_epi32(_mm512_shuffle_i32x4(p, q, 0x88), _mm512_shuffle_i32x4(p, q, 0xDD));
        }
        __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(f), _mm512_set1_ps(Q.a[g]), _mm512_set1_ps(Q.c[g]));
        if constexpr (SIGNED) v = _mm512_mul_ps(v, _mm512_loadu_ps(tok + i0));
        _mm512_mask_storeu_ps(s + g * ld + i0, mask, v);
      }
    }
  }

  // Per-channel keys of one sealed block (int8-channel: u8; FOUR: KIVI nibbles) scored by integer dots.
  template <bool FOUR>
  static void scores_channel(const QuantCache& kc, const float* q, int64_t blk, int64_t off, int64_t n, int64_t h,
                             float* s, int64_t ld) {
    const uint8_t* block = kc.base + blk * kc.R;
    alignas(64) float sc[D], mn[D], qe[G * D];
    halves(block + kc.scale_off + h * D * 2, sc, D);
    halves(block + kc.min_off + h * D * 2, mn, D);
    for (int g = 0; g < G; ++g) {
      if constexpr (FOUR) {
        const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        const __m512i od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
        for (int c = 0; c < NC; c += 2) {
          const __m512 x0 = _mm512_mul_ps(_mm512_loadu_ps(q + g * D + 16 * c), _mm512_loadu_ps(sc + 16 * c));
          const __m512 x1 =
              _mm512_mul_ps(_mm512_loadu_ps(q + g * D + 16 * c + 16), _mm512_loadu_ps(sc + 16 * c + 16));
          _mm512_storeu_ps(qe + g * D + 8 * c, _mm512_permutex2var_ps(x0, ev, x1));
          _mm512_storeu_ps(qe + g * D + D / 2 + 8 * c, _mm512_permutex2var_ps(x0, od, x1));
        }
      } else {
        for (int c = 0; c < NC; ++c)
          _mm512_storeu_ps(qe + g * D + 16 * c,
                           _mm512_mul_ps(_mm512_loadu_ps(q + g * D + 16 * c), _mm512_loadu_ps(sc + 16 * c)));
      }
    }
    Query Q;
    quantise(qe, q, mn, FOUR ? 7.5f : 127.5f, Q);
    constexpr int64_t RB = FOUR ? D / 2 : D;
    scores<FOUR>(block + kc.codes_off + (off * kc.H + h) * RB, kc.H * RB, n, Q, s, ld);
  }

  // Per-token int8 keys (int8, int8-hadamard): the query quantised once per work item (quantise_token).
  static void quantise_token(const float* q, Query& Q) {
    alignas(64) float m128[D];
    for (int d = 0; d < D; ++d) m128[d] = -128.f;
    quantise(q, q, m128, 128.f, Q);  // c = -128 sum(q) + 128 sum(q - a Q) = -128 a sum(Q)
  }
  static void scores_token(const QuantCache& kc, const Query& Q, int64_t blk, int64_t off, int64_t n, int64_t h,
                           float* s, int64_t ld) {
    const uint8_t* block = kc.base + blk * kc.R;
    alignas(64) float tok[16 * ((256 + 15) / 16)];
    for (int64_t i0 = 0; i0 < n; i0 += 256) {
      const int64_t m = std::min<int64_t>(256, n - i0);
      for (int64_t i = 0; i < m; ++i) tok[i] = half_at(block + kc.scale_off, (off + i0 + i) * kc.H + h);
      scores<false, true>(block + kc.codes_off + ((off + i0) * kc.H + h) * D, kc.H * D, m, Q, s + i0, ld, tok);
    }
  }

  // facc (G x D, permuted_pos order) += sum_i (p_i * scale_i) * codes_i over one sealed block's n rows of
  // per-token values: s8 codes, or FOUR: KIVI nibbles (minimums' share, and the codes' centre, into extra[g]).
  template <bool FOUR>
  static void accumulate(const QuantCache& vc, float* facc, float* extra, const float* p, int64_t ld, int64_t blk,
                         int64_t off, int64_t n, int64_t h) {
    constexpr int RB = FOUR ? D / 2 : D;
    constexpr int NV = D / 16;
    const uint8_t* block = vc.base + blk * vc.R;
    const int64_t stride = vc.H * RB;
    const uint8_t* codes0 = block + vc.codes_off + (off * vc.H + h) * RB;
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
      const int64_t m = std::min<int64_t>(16, n - i0);
      const __mmask16 mask = static_cast<__mmask16>((1u << m) - 1u);
      alignas(64) float scv[16] = {}, mnv[16] = {};
      for (int64_t i = 0; i < m; ++i) {
        const int64_t r = (off + i0 + i) * vc.H + h;
        scv[i] = half_at(block + vc.scale_off, r);
        if constexpr (FOUR) mnv[i] = half_at(block + vc.min_off, r);
      }
      alignas(64) int32_t wp[G][8];
      float b[G];
      for (int g = 0; g < G; ++g) {
        const __m512 pv = _mm512_maskz_loadu_ps(mask, p + g * ld + i0);
        const __m512 w = _mm512_mul_ps(pv, _mm512_load_ps(scv));
        // 4-bit codes enter centred (c - 8): their weights' rounding then has no common part in every channel
        // (which turned values would gather into one channel); the 8 * sum(w) taken out is exact.
        if constexpr (FOUR)
          extra[g] += _mm512_reduce_add_ps(_mm512_fmadd_ps(pv, _mm512_load_ps(mnv), _mm512_mul_ps(w, _mm512_set1_ps(8.f))));
        const float wmax = _mm512_reduce_max_ps(w);
        b[g] = wmax / 32767.f;
        const float inv = wmax > 0.f ? 32767.f / wmax : 0.f;
        const __m512i W = _mm512_cvtps_epi32(_mm512_mul_ps(w, _mm512_set1_ps(inv)));
        _mm256_store_si256(reinterpret_cast<__m256i*>(wp[g]), _mm512_cvtepi32_epi16(W));
      }
      __m512i ia[G][NV];
      for (int g = 0; g < G; ++g)
        for (int v = 0; v < NV; ++v) ia[g][v] = _mm512_setzero_si512();
      const __m512i low4 = _mm512_set1_epi16(0x0F), eight = _mm512_set1_epi16(8);
      for (int64_t j = 0; 2 * j < m; ++j) {
        const uint8_t* r0 = codes0 + (i0 + 2 * j) * stride;
        const uint8_t* r1 = 2 * j + 1 < m ? r0 + stride : r0;  // its weight is 0
        __m512i wv[G];
        for (int g = 0; g < G; ++g) wv[g] = _mm512_set1_epi32(wp[g][j]);
        for (int c = 0; c < RB / 32; ++c) {
          const __m256i y0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + 32 * c));
          const __m256i y1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + 32 * c));
          if constexpr (FOUR) {
            const __m512i x0 = _mm512_cvtepu8_epi16(y0), x1 = _mm512_cvtepu8_epi16(y1);
            const __m512i l0 = _mm512_sub_epi16(_mm512_and_si512(x0, low4), eight);
            const __m512i l1 = _mm512_sub_epi16(_mm512_and_si512(x1, low4), eight);
            const __m512i h0 = _mm512_sub_epi16(_mm512_srli_epi16(x0, 4), eight);
            const __m512i h1 = _mm512_sub_epi16(_mm512_srli_epi16(x1, 4), eight);
            const __m512i z[4] = {_mm512_unpacklo_epi16(l0, l1), _mm512_unpackhi_epi16(l0, l1),
                                  _mm512_unpacklo_epi16(h0, h1), _mm512_unpackhi_epi16(h0, h1)};
            for (int g = 0; g < G; ++g)
              for (int k = 0; k < 4; ++k) ia[g][4 * c + k] = _mm512_dpwssd_epi32(ia[g][4 * c + k], z[k], wv[g]);
          } else {
            const __m512i x0 = _mm512_cvtepi8_epi16(y0), x1 = _mm512_cvtepi8_epi16(y1);
            const __m512i z0 = _mm512_unpacklo_epi16(x0, x1), z1 = _mm512_unpackhi_epi16(x0, x1);
            for (int g = 0; g < G; ++g) {
              ia[g][2 * c] = _mm512_dpwssd_epi32(ia[g][2 * c], z0, wv[g]);
              ia[g][2 * c + 1] = _mm512_dpwssd_epi32(ia[g][2 * c + 1], z1, wv[g]);
            }
          }
        }
      }
      for (int g = 0; g < G; ++g)
        for (int v = 0; v < NV; ++v) {
          float* dst = facc + g * D + 16 * v;
          _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[g][v]), _mm512_set1_ps(b[g]),
                                                _mm512_loadu_ps(dst)));
        }
    }
  }
};
#endif  // KVL_INT_DOT

// Paged decode over a quantised layer with the fused block kernels: paged_decode_impl's work split
// (sequence, KV head, context partition; flash-decoding merge when partitioned), its softmax, its loader
// for open blocks. Requires D in {64, 128} and 1 <= G <= 8 (fused_decode picks it only then).
template <typename Q, int G, int D>
void fused_decode_impl(torch::Tensor& out, const torch::Tensor& q, const QuantCache& kc, const QuantCache& vc,
                       int64_t bs, int64_t KVH, const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                       const torch::Tensor& rows, double scale, int64_t window, int64_t partition) {
  using F = Fused<G, D>;
#if KVL_INT_DOT
  using I = IntDot<G, D>;
  const bool idot = int_dot_on().load(std::memory_order_relaxed);
#else
  constexpr bool idot = false;
#endif
  const bool v_int = idot && (vc.kind == kInt8Token || vc.kind == kInt8TokenRot || vc.kind == kKiviV ||
                              vc.kind == kKiviVRot);
  const bool v_four = vc.kind == kKiviV || vc.kind == kKiviVRot;
  const int64_t B = block_tables.size(0), max_blocks = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int64_t* row_idx = rows.data_ptr<int64_t>();
  const Q* qp = q.data_ptr<Q>();
  Q* op = out.data_ptr<Q>();
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1);
  const int64_t o_s0 = out.stride(0), o_s1 = out.stride(1);

  const bool inline_ = decode_inline(lens, B, KVH, window, &partition);
  SplitContexts split(lens, B, KVH, G, D, partition);
  const int64_t P = split.P, part_len = split.part_len;
  const float fscale = static_cast<float>(scale);
  const BlockKernels plain = pick_kernels(G, D);

  at::parallel_for(0, B * KVH * P, inline_ ? B * KVH * P : 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), qperm(G * D), acc(G * D), accp(G * D), facc(G * D), scores, tile(bs * D),
        outv(D);
    float qsum[G];
    for (int64_t item = begin; item < end; ++item) {
      const auto [b, h, p, lo, hi] = split.item_range(item, lens, KVH, window);
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
#if KVL_INT_DOT
      typename I::Query qtok;
      const bool k_tok = idot && kc.kind == kInt8Token;
      if (k_tok) I::quantise_token(qf.data(), qtok);
#endif
      for (int64_t t = lo; t < hi;) {
        const int64_t blk = t / bs, stop = std::min(hi, (blk + 1) * bs), off = t % bs, cnt = stop - t;
        if ((blk + kPrefetchBlocks) * bs < hi) {
          kc.prefetch(table[blk + kPrefetchBlocks], h, bs, D);
          kc.prefetch_meta(table[blk + kPrefetchBlocks], h);
        }
        const int64_t id = table[blk];
        float* s = scores.data() + (t - lo);
        if (kc.res_map && kc.res_map[id] >= 0) {
          int64_t ks = 0;
          const float* kr = kc.rows(id, off, h, cnt, D, tile.data(), &ks);
          plain.scores(qf.data(), kr, ks, cnt, s, n);
        } else if (kc.kind == kInt8Token) {
#if KVL_INT_DOT
          if (k_tok) I::scores_token(kc, qtok, id, off, cnt, h, s, n);
          else
#endif
          F::template scores_token<false>(kc, qf.data(), id, off, cnt, h, s, n);
        } else if (kc.kind == kFp8Token) {
          F::template scores_token<true>(kc, qf.data(), id, off, cnt, h, s, n);
        } else if (kc.kind == kChanK) {
#if KVL_INT_DOT
          if (idot) I::template scores_channel<false>(kc, qf.data(), id, off, cnt, h, s, n);
          else
#endif
          F::template scores_channel<false>(kc, qf.data(), id, off, cnt, h, s, n);
        } else if (kc.kind == kKiviV) {
          F::scores_token4(kc, qperm.data(), qsum, id, off, cnt, h, s, n);
        } else {
#if KVL_INT_DOT
          if (idot) I::template scores_channel<true>(kc, qf.data(), id, off, cnt, h, s, n);
          else
#endif
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
      if (v_int) std::fill(facc.begin(), facc.end(), 0.f);
      bool any_plain = false;
      for (int64_t t = lo; t < hi;) {
        const int64_t blk = t / bs, stop = std::min(hi, (blk + 1) * bs), off = t % bs, cnt = stop - t;
        if ((blk + kPrefetchBlocks) * bs < hi) {
          vc.prefetch(table[blk + kPrefetchBlocks], h, bs, D);
          vc.prefetch_meta(table[blk + kPrefetchBlocks], h);
        }
        const int64_t id = table[blk];
        const float* pr = scores.data() + (t - lo);
        if (vc.res_map && vc.res_map[id] >= 0) {
          int64_t vs = 0;
          const float* vr = vc.rows(id, off, h, cnt, D, tile.data(), &vs);
          plain.accumulate(accp.data(), pr, n, vr, vs, cnt);
          any_plain = true;
#if KVL_INT_DOT
        } else if (v_int && v_four) {
          I::template accumulate<true>(vc, facc.data(), extra, pr, n, id, off, cnt, h);
        } else if (v_int) {
          I::template accumulate<false>(vc, facc.data(), extra, pr, n, id, off, cnt, h);
#endif
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
        if (v_int)  // the integer kernels' accumulators -> the codes' order
          for (int64_t v = 0; v < D / 16; ++v)
            for (int64_t l = 0; l < 16; ++l) a[permuted_pos(v_four, D, v, l)] = facc[g * D + 16 * v + l];
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
