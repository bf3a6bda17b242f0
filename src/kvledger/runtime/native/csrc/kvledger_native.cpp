// CPU kernels of the kvledger runtime: paged attention that reads K/V in place through block tables,
// and the fused elementwise steps of a Llama-family layer (RMSNorm, residual add + RMSNorm, RoPE,
// the KV-cache write).
//
// Built once by `make install` (python -m kvledger.runtime.native build) with torch's C++ extension
// tooling; kvledger.runtime falls back to pure torch when it is absent. Every kernel accumulates in
// fp32 whatever the storage dtype, parallelises with at::parallel_for (torch's OpenMP pool, so
// torch.set_num_threads governs it) and accepts strided row views (the q/k/v slices of one fused
// projection output), requiring only a unit stride on the last dimension.
//
// KV reads go through a cache policy's rows(): PlainCache converts a stored dtype, QuantCache dequantises
// the quantised formats of kvledger.core.kv_formats (fp8 / int8 with a scale per token and head, KIVI int4
// with per-channel key and per-token value scales and an unquantised residual page for open blocks).

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvledger_bf16.h"
#include "kvledger_helper_pool.h"
#include "kv_rans.h"

namespace {

// Portable SIMD through GCC/Clang vector extensions: 16 floats, one AVX-512 register (two AVX2 ones).
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
constexpr int64_t kW = 16;

inline vf loadu(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void storeu(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
inline vf splat(float x) { return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }  // one broadcast
inline float hsum(vf v) {
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
#else
  float t[kW];
  std::memcpy(t, &v, sizeof(t));
  float s = 0.f;
  for (int i = 0; i < kW; ++i) s += t[i];
  return s;
#endif
}
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
// Lane r of the result = hsum(a[r]) for sixteen vectors, with hsum's additions in hsum's order (lane i
// plus lane i + 8, then i plus i + 4, then (0 + 2) + (1 + 3)), four levels of paired shuffles.
inline vf hsum16(const vf* a) {
  vf b[8], c[4], d[2];
  for (int j = 0; j < 8; ++j)
    b[j] = __builtin_shufflevector(a[2 * j], a[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * j], a[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int j = 0; j < 4; ++j)
    c[j] = __builtin_shufflevector(b[2 * j], b[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * j], b[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int j = 0; j < 2; ++j)
    d[j] = __builtin_shufflevector(c[2 * j], c[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(c[2 * j], c[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#endif

inline float hmax(vf v) {
  float t[kW];
  std::memcpy(t, &v, sizeof(t));
  float m = t[0];
  for (int i = 1; i < kW; ++i) m = std::max(m, t[i]);
  return m;
}

inline float dot(const float* a, const float* b, int64_t n) {
  vf acc{};
  int64_t d = 0;
  for (; d + kW <= n; d += kW) acc += loadu(a + d) * loadu(b + d);
  float s = hsum(acc);
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

inline void axpy(float* y, float a, const float* x, int64_t n) {
  int64_t d = 0;
  const vf av = splat(a);
  for (; d + kW <= n; d += kW) storeu(y + d, loadu(y + d) + av * loadu(x + d));
  for (; d < n; ++d) y[d] += a * x[d];
}

// exp(x) for x <= 0 (softmax after the max is subtracted), 16 lanes: Cody-Waite range reduction and a
// degree-6 polynomial, ~1 ulp over the range; no libm call, so it stays in vector registers.
inline vf exp_neg(vf x) {
  const vf lo = splat(-87.0f);
  x = x < lo ? lo : x;
  const vf shifter = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to the nearest integer
  vf n = (x * splat(1.44269504088896341f) + shifter) - shifter;
  vf r = x - n * splat(0.693145751953125f);
  r = r - n * splat(1.428606765330187045e-06f);
  vf p = splat(1.0f / 720.0f);
  p = p * r + splat(1.0f / 120.0f);
  p = p * r + splat(1.0f / 24.0f);
  p = p * r + splat(1.0f / 6.0f);
  p = p * r + splat(0.5f);
  p = p * r + splat(1.0f);
  p = p * r + splat(1.0f);
  vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline float exp_neg(float x) {
  float t[kW] = {x};
  vf v;
  std::memcpy(&v, t, sizeof(v));
  v = exp_neg(v);
  std::memcpy(t, &v, sizeof(t));
  return t[0];
}

// s[i] = exp(s[i] - mx) for i < n; returns their sum.
inline float exp_shift_sum(float* s, int64_t n, float mx) {
  vf sum{};
  const vf m = splat(mx);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    vf e = exp_neg(loadu(s + i) - m);
    storeu(s + i, e);
    sum += e;
  }
  float total = hsum(sum);
  for (; i < n; ++i) {
    s[i] = exp_neg(s[i] - mx);
    total += s[i];
  }
  return total;
}

inline float max_of(const float* s, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  if (n >= kW) {
    vf m = loadu(s);
    for (i = kW; i + kW <= n; i += kW) {
      vf x = loadu(s + i);
      m = x > m ? x : m;
    }
    mx = hmax(m);
  }
  for (; i < n; ++i) mx = std::max(mx, s[i]);
  return mx;
}


// out[g * stride] = q[g] . k for every query head g of a KV head's group; k is read once.
inline void dots(const float* q, int64_t G, const float* k, int64_t D, float* out, int64_t stride) {
  if (D % kW == 0 && G <= 8) {
    vf acc[8] = {};
    for (int64_t d = 0; d < D; d += kW) {
      const vf kv = loadu(k + d);
      for (int64_t g = 0; g < G; ++g) acc[g] += loadu(q + g * D + d) * kv;
    }
    for (int64_t g = 0; g < G; ++g) out[g * stride] = hsum(acc[g]);
  } else {
    for (int64_t g = 0; g < G; ++g) out[g * stride] = dot(q + g * D, k, D);
  }
}

// How far ahead decode asks for a head's next rows, and where to: two blocks ahead, into L2 (prefetcht1). Measured
// on SmolLM2's shape (4 x 2,048 tokens, 30 layers, 2-core Xeon): fp32, int8 and int4 attention 6-11% faster than
// one block ahead into L1 (why is not measured); 4, 8 or 16 blocks ahead no better (docs/kv_formats.md).
constexpr int64_t kPrefetchBlocks = 2;
#define KVL_PREFETCH(p) __builtin_prefetch((p), 0, 2)
// Ask for the cache lines of one head's rows in a block (the blocks of a table are scattered).
template <typename C>
inline void prefetch_rows(const C* base, int64_t rows, int64_t row_stride, int64_t D) {
  const int64_t bytes = D * static_cast<int64_t>(sizeof(C));
  for (int64_t r = 0; r < rows; ++r) {
    const char* p = reinterpret_cast<const char*>(base + r * row_stride);
    for (int64_t off = 0; off < bytes; off += 64) KVL_PREFETCH(p + off);
  }
}

// ---- fixed-shape inner loops -----------------------------------------------------------------------
// With the group size G (query heads per KV head) and head dim D known at compile time, the G x D/16
// accumulators live in vector registers. Instantiated for D in {64, 128} and G in 1..8; other shapes
// take the generic loops.

// s[g * ld + i] = q[g] . k_i for the `rows` cached rows k_i = k + i * ks (fp32). Sixteen rows at a time
// the sixteen horizontal sums are done together (hsum16: ~2 shuffles per row instead of ~7, the same
// additions in the same order, so the scores are bit for bit those of the one-row loop).
template <int G, int D>
void block_scores(const float* q, const float* k, int64_t ks, int64_t rows, float* s, int64_t ld) {
  constexpr int NC = D / kW;
  vf qv[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) qv[g][c] = loadu(q + g * D + c * kW);
  int64_t i0 = 0;
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
  for (; i0 + kW <= rows; i0 += kW) {
    for (int g = 0; g < G; ++g) {
      vf acc[kW];
      for (int r = 0; r < kW; ++r) {
        const float* kr = k + (i0 + r) * ks;
        vf a{};
        for (int c = 0; c < NC; ++c) a += qv[g][c] * loadu(kr + c * kW);
        acc[r] = a;
      }
      storeu(s + g * ld + i0, hsum16(acc));
    }
  }
#endif
  for (int64_t i = i0; i < rows; ++i) {
    const float* kr = k + i * ks;
    vf acc[G];
    for (int g = 0; g < G; ++g) acc[g] = vf{};
    for (int c = 0; c < NC; ++c) {
      const vf kv = loadu(kr + c * kW);
      for (int g = 0; g < G; ++g) acc[g] += qv[g][c] * kv;
    }
    for (int g = 0; g < G; ++g) s[g * ld + i] = hsum(acc[g]);
  }
}

// acc[g] += sum_i p[g * ld + i] * v_i for the `rows` cached rows v_i = v + i * vs (fp32).
template <int G, int D>
void block_accumulate(float* acc, const float* p, int64_t ld, const float* v, int64_t vs, int64_t rows) {
  constexpr int NC = D / kW;
  vf a[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) a[g][c] = loadu(acc + g * D + c * kW);
  for (int64_t i = 0; i < rows; ++i) {
    const float* vr = v + i * vs;
    for (int c = 0; c < NC; ++c) {
      const vf x = loadu(vr + c * kW);
      for (int g = 0; g < G; ++g) a[g][c] += splat(p[g * ld + i]) * x;
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) storeu(acc + g * D + c * kW, a[g][c]);
}

void block_scores_any(int64_t G, int64_t D, const float* q, const float* k, int64_t ks, int64_t rows, float* s,
                      int64_t ld) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t g = 0; g < G; ++g) s[g * ld + i] = dot(q + g * D, k + i * ks, D);
}

void block_accumulate_any(int64_t G, int64_t D, float* acc, const float* p, int64_t ld, const float* v, int64_t vs,
                          int64_t rows) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t g = 0; g < G; ++g) axpy(acc + g * D, p[g * ld + i], v + i * vs, D);
}

struct BlockKernels {
  void (*scores)(const float*, const float*, int64_t, int64_t, float*, int64_t) = nullptr;
  void (*accumulate)(float*, const float*, int64_t, const float*, int64_t, int64_t) = nullptr;
};

template <int D, int... Gs>
BlockKernels pick_for_d(int64_t G, std::integer_sequence<int, Gs...>) {
  BlockKernels k;
  ((G == Gs + 1 ? (k.scores = &block_scores<Gs + 1, D>, k.accumulate = &block_accumulate<Gs + 1, D>, 0) : 0), ...);
  return k;
}

BlockKernels pick_kernels(int64_t G, int64_t D) {
  if (D == 64) return pick_for_d<64>(G, std::make_integer_sequence<int, 8>{});
  if (D == 128) return pick_for_d<128>(G, std::make_integer_sequence<int, 8>{});
  return {};
}

// `rows` cached rows of one KV head as fp32: the cache itself for fp32 (row stride src_stride), else
// converted into `tmp` (row stride D). Compressed KV formats would dequantise here.
template <typename C>
inline const float* load_rows(const C* src, int64_t src_stride, int64_t rows, int64_t D, float* tmp,
                              int64_t* stride) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t d = 0; d < D; ++d) tmp[i * D + d] = static_cast<float>(src[i * src_stride + d]);
  *stride = D;
  return tmp;
}
template <>
inline const float* load_rows<float>(const float* src, int64_t src_stride, int64_t, int64_t, float*,
                                     int64_t* stride) {
  *stride = src_stride;
  return src;
}
template <>
inline const float* load_rows<c10::BFloat16>(const c10::BFloat16* src, int64_t src_stride, int64_t rows, int64_t D,
                                             float* tmp, int64_t* stride) {
  for (int64_t i = 0; i < rows; ++i) kvl_bf16::to_float(src + i * src_stride, tmp + i * D, D);
  *stride = D;
  return tmp;
}

struct CacheView {  // one layer's K (or V) cache: [num_blocks, block_size, kv_heads, head_dim]
  int64_t s_block, s_slot, s_head;
};

// A plain cache of element type C: rows are converted (or, for fp32, read in place).
template <typename C>
struct PlainCache {
  const C* p;
  CacheView v;
  inline const float* rows(int64_t blk, int64_t off, int64_t h, int64_t n, int64_t D, float* tmp,
                           int64_t* stride) const {
    return load_rows<C>(p + blk * v.s_block + off * v.s_slot + h * v.s_head, v.s_slot, n, D, tmp, stride);
  }
  inline void prefetch(int64_t blk, int64_t h, int64_t bs, int64_t D) const {
    prefetch_rows(p + blk * v.s_block + h * v.s_head, bs, v.s_slot, D);
  }
};

inline float half_at(const uint8_t* p, int64_t i) {
  c10::Half h;
  std::memcpy(&h, p + 2 * i, 2);
  return static_cast<float>(h);
}

// kChanK: uint8 keys asymmetric per channel over the block (int8-channel); kInt8TokenRot: kInt8Token's codes of
// rows turned by the Walsh-Hadamard matrix (int8-channel's values), turned back on read.
// kKiviVRot: kKiviV's codes of turned rows (int4-hadamard's values; its keys are kKiviV read by turned queries).
enum QuantKind : int64_t {
  kFp8Token = 1, kInt8Token = 2, kKiviK = 3, kKiviV = 4, kChanK = 5, kInt8TokenRot = 6, kKiviVRot = 7
};
inline void fwht(float* x, int64_t n);        // kv_quant_fused.h
inline float e4m3_scalar(uint8_t c);          // kv_quant_fused.h

// One layer's K (or V) of a quantised store: the bytes of each block ([num_blocks, R]), where this
// tensor's parts sit in a block (byte offsets), and for KIVI the residual pages of open blocks.
struct QuantCache {
  const uint8_t* base;
  int64_t R, kind, codes_off, scale_off, min_off, H, D, bs;
  const void* res;          // [pages, bs, H, D] of res_type, or null
  int64_t res_type;         // 0 fp32, 1 bf16, 2 fp16
  const int32_t* res_map;   // [num_blocks]: page of an open block, -1 for a sealed one
  inline const float* rows(int64_t blk, int64_t off, int64_t h, int64_t n, int64_t, float* tmp,
                           int64_t* stride) const {
    if (res_map && res_map[blk] >= 0) {
      const int64_t row0 = ((static_cast<int64_t>(res_map[blk]) * bs + off) * H + h) * D;
      if (res_type == 0) {
        *stride = H * D;
        return static_cast<const float*>(res) + row0;
      }
      for (int64_t i = 0; i < n; ++i)
        for (int64_t d = 0; d < D; ++d) {
          const int64_t j = row0 + i * H * D + d;
          tmp[i * D + d] = res_type == 1 ? static_cast<float>(static_cast<const c10::BFloat16*>(res)[j])
                                         : static_cast<float>(static_cast<const c10::Half*>(res)[j]);
        }
      *stride = D;
      return tmp;
    }
    const uint8_t* block = base + blk * R;
    *stride = D;
    if (kind == kFp8Token || kind == kInt8Token || kind == kInt8TokenRot) {
      for (int64_t i = 0; i < n; ++i) {
        const int64_t r = (off + i) * H + h;
        const float sc = half_at(block + scale_off, r);
        const uint8_t* c = block + codes_off + r * D;
        float* o = tmp + i * D;
        if (kind == kFp8Token) {
          for (int64_t d = 0; d < D; ++d) o[d] = e4m3_scalar(c[d]) * sc;
        } else {
          for (int64_t d = 0; d < D; ++d) o[d] = static_cast<float>(static_cast<int8_t>(c[d])) * sc;
          if (kind == kInt8TokenRot) fwht(o, D);
        }
      }
      return tmp;
    }
    if (kind == kChanK) {
      const uint8_t* sp = block + scale_off + h * D * 2;
      const uint8_t* mp = block + min_off + h * D * 2;
      for (int64_t i = 0; i < n; ++i) {
        const uint8_t* c = block + codes_off + ((off + i) * H + h) * D;
        float* o = tmp + i * D;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<float>(c[d]) * half_at(sp, d) + half_at(mp, d);
      }
      return tmp;
    }
    const int64_t half = D / 2;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = (off + i) * H + h;
      const uint8_t* c = block + codes_off + r * half;
      float* o = tmp + i * D;
      if (kind == kKiviK) {  // per channel: the block's scale and minimum of each channel
        const uint8_t* sp = block + scale_off + h * D * 2;
        const uint8_t* mp = block + min_off + h * D * 2;
        for (int64_t j = 0; j < half; ++j) {
          o[2 * j] = static_cast<float>(c[j] & 15) * half_at(sp, 2 * j) + half_at(mp, 2 * j);
          o[2 * j + 1] = static_cast<float>(c[j] >> 4) * half_at(sp, 2 * j + 1) + half_at(mp, 2 * j + 1);
        }
      } else {  // per token: one scale and minimum for the row
        const float sc = half_at(block + scale_off, r), mn = half_at(block + min_off, r);
        for (int64_t j = 0; j < half; ++j) {
          o[2 * j] = static_cast<float>(c[j] & 15) * sc + mn;
          o[2 * j + 1] = static_cast<float>(c[j] >> 4) * sc + mn;
        }
        if (kind == kKiviVRot) fwht(o, D);
      }
    }
    return tmp;
  }
  // The next block's code rows of head h (rows of several heads interleave; the hardware prefetcher sees
  // a 1-in-H stride across a block's bytes and block tables jump between blocks).
  inline void prefetch(int64_t blk, int64_t h, int64_t n, int64_t D_) const {
    const int64_t rb = (kind == kKiviK || kind == kKiviV || kind == kKiviVRot) ? D_ / 2 : D_;
    const char* p = reinterpret_cast<const char*>(base + blk * R + codes_off + h * rb);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t o = 0; o < rb; o += 64) KVL_PREFETCH(p + i * H * rb + o);
  }
  // The block's metadata lines a head reads: per-channel scales and minimums (D fp16 each), or the per-token scales
  // (and minimums) of its rows.
  inline void prefetch_meta(int64_t blk, int64_t h) const {
    const char* b = reinterpret_cast<const char*>(base + blk * R);
    if (kind == kChanK || kind == kKiviK) {
      for (int64_t o = 0; o < D * 2; o += 64) {
        KVL_PREFETCH(b + scale_off + h * D * 2 + o);
        KVL_PREFETCH(b + min_off + h * D * 2 + o);
      }
    } else {
      for (int64_t o = 0; o < bs * H * 2; o += 64) {
        KVL_PREFETCH(b + scale_off + o);
        if (kind == kKiviV || kind == kKiviVRot) KVL_PREFETCH(b + min_off + o);
      }
    }
  }
};

// A decode step whose whole attention is a few tens of microseconds (token x KV-head rows below this) runs on
// the calling thread, unsplit: waking torch's sleeping OpenMP workers (OMP_WAIT_POLICY=PASSIVE) costs more
// than a second thread saves there, and on a loaded machine a woken worker waits for a core (SmolLM2 at
// batch 1 x 256 tokens: ~1.2 ms a call inside a step, against ~20 us of work).
constexpr int64_t kInlineDecodeRows = 2048;

// Whether paged decode runs inline (see kInlineDecodeRows); *partition becomes one part when it was automatic.
inline bool decode_inline(const int32_t* lens, int64_t B, int64_t KVH, int64_t window, int64_t* partition) {
  int64_t rows = 0, max_len = 1;
  for (int64_t b = 0; b < B; ++b) {
    rows += (window > 0 ? std::min<int64_t>(lens[b], window) : lens[b]) * KVH;
    max_len = std::max<int64_t>(max_len, lens[b]);
  }
  if (rows >= kInlineDecodeRows) return false;
  if (*partition < 0) *partition = max_len;
  return true;
}

// Flash-decoding's split of long contexts, shared by the decode over plain caches and the fused decode over
// quantised ones: how long each partition is (contexts are split only when there are too few (sequence, KV
// head) items to keep every thread busy, and partitions stay >= 64 tokens to amortise their merge), each work
// item's partial state (running max, sum of exponentials, unnormalised output) and their merge.
struct SplitContexts {
  int64_t part_len = 1, P = 1, G, D;
  std::vector<float> m, l, acc;

  SplitContexts(const int32_t* lens, int64_t B, int64_t KVH, int64_t G_, int64_t D_, int64_t partition)
      : G(G_), D(D_) {
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; ++b) max_len = std::max<int64_t>(max_len, lens[b]);
    part_len = max_len;
    if (partition > 0) {
      part_len = partition;
    } else if (partition < 0) {
      const int64_t want = 4 * static_cast<int64_t>(at::get_num_threads()), items = B * KVH;
      if (items < want) {
        const int64_t parts = (want + items - 1) / items;
        part_len = std::max<int64_t>(64, (max_len + parts - 1) / parts);
      }
    }
    part_len = std::max<int64_t>(1, part_len);
    P = std::max<int64_t>(1, (max_len + part_len - 1) / part_len);
    if (P > 1) {
      m.assign(B * KVH * P * G, -std::numeric_limits<float>::infinity());
      l.assign(B * KVH * P * G, 0.f);
      acc.assign(B * KVH * P * G * D, 0.f);
    }
  }

  // Work item ``item`` (sequence b, KV head h, partition p, in that nesting) and the token range [lo, hi) it
  // attends over: its partition of the context, cut to the last ``window`` tokens when window > 0 (empty: lo >= hi).
  struct Item { int64_t b, h, p, lo, hi; };
  Item item_range(int64_t item, const int32_t* lens, int64_t KVH, int64_t window) const {
    const int64_t p = item % P, h = (item / P) % KVH, b = item / (P * KVH);
    const int64_t len = lens[b];
    const int64_t lo = std::max<int64_t>(window > 0 ? std::max<int64_t>(0, len - window) : 0, p * part_len);
    const int64_t hi = std::min<int64_t>(len, (p + 1) * part_len);
    return {b, h, p, lo, hi};
  }

  // One work item's result: its output rows when the context is whole, else its partial state.
  template <typename Q>
  void finish(Q* op, const int64_t* row_idx, int64_t o_s0, int64_t o_s1, int64_t KVH, int64_t b, int64_t h,
              int64_t p, const float* item_acc, const float* item_m, const float* item_l) {
    if (P == 1) {
      Q* orow = op + row_idx[b] * o_s0 + h * G * o_s1;
      for (int64_t g = 0; g < G; ++g) {
        const float inv = 1.f / item_l[g];
        for (int64_t d = 0; d < D; ++d) orow[g * o_s1 + d] = static_cast<Q>(item_acc[g * D + d] * inv);
      }
      return;
    }
    const int64_t base = ((b * KVH + h) * P + p) * G;
    for (int64_t g = 0; g < G; ++g) {
      m[base + g] = item_m[g];
      l[base + g] = item_l[g];
      std::memcpy(&acc[(base + g) * D], item_acc + g * D, D * sizeof(float));
    }
  }

  // The partitions' partial states merged into the output rows (nothing to do when no context was split).
  template <typename Q>
  void merge(Q* op, const int64_t* row_idx, int64_t o_s0, int64_t o_s1, int64_t B, int64_t KVH) const {
    if (P == 1) return;
    at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> out(D);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t h = item % KVH, b = item / KVH;
        Q* orow = op + row_idx[b] * o_s0 + h * G * o_s1;
        for (int64_t g = 0; g < G; ++g) {
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t p = 0; p < P; ++p) mx = std::max(mx, m[(item * P + p) * G + g]);
          float sum = 0.f;
          std::fill(out.begin(), out.end(), 0.f);
          for (int64_t p = 0; p < P; ++p) {
            const int64_t idx = (item * P + p) * G + g;
            if (l[idx] == 0.f) continue;
            const float w = exp_neg(m[idx] - mx);
            sum += l[idx] * w;
            axpy(out.data(), w, &acc[idx * D], D);
          }
          const float inv = 1.f / sum;
          for (int64_t d = 0; d < D; ++d) orow[g * o_s1 + d] = static_cast<Q>(out[d] * inv);
        }
      }
    });
  }
};

// ---- paged decode ------------------------------------------------------------------------------
// One work item = (sequence, kv head, context partition). With few sequences the context is split
// into partitions whose partial softmax states are merged afterwards (flash-decoding), so both cores
// have work at batch 1; at batch 32 there is one partition per sequence and results go straight out.
template <typename Q, typename KC>
void paged_decode_impl(torch::Tensor& out, const torch::Tensor& q, const KC& kc, const KC& vc, int64_t bs,
                       int64_t KVH, const torch::Tensor& block_tables,
                       const torch::Tensor& context_lens, const torch::Tensor& rows, double scale,
                       int64_t window, int64_t partition) {
  const int64_t B = block_tables.size(0), max_blocks = block_tables.size(1);
  const int64_t H = q.size(1), D = q.size(2);
  const int64_t G = H / KVH;
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
  const BlockKernels kern = pick_kernels(G, D);

  at::parallel_for(0, B * KVH * P, inline_ ? B * KVH * P : 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores, tile(bs * D);
    for (int64_t item = begin; item < end; ++item) {
      const auto [b, h, p, lo, hi] = split.item_range(item, lens, KVH, window);
      if (lo >= hi) continue;
      const int64_t n = hi - lo;
      const int32_t* table = tables + b * max_blocks;
      const Q* qrow = qp + row_idx[b] * q_s0 + h * G * q_s1;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(qrow[g * q_s1 + d]) * fscale;
      scores.resize(G * n);
      for (int64_t t = lo; t < hi;) {
        // Block by block: one head's rows of a block sit at a fixed stride; fetch the next block early.
        const int64_t blk = t / bs, stop = std::min(hi, (blk + 1) * bs), off = t % bs;
        if ((blk + kPrefetchBlocks) * bs < hi) kc.prefetch(table[blk + kPrefetchBlocks], h, bs, D);
        int64_t ks = 0;
        const float* kr = kc.rows(table[blk], off, h, stop - t, D, tile.data(), &ks);
        if (kern.scores)
          kern.scores(qf.data(), kr, ks, stop - t, scores.data() + (t - lo), n);
        else
          block_scores_any(G, D, qf.data(), kr, ks, stop - t, scores.data() + (t - lo), n);
        t = stop;
      }
      std::vector<float> m(G), l(G);
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * n;
        const float mx = max_of(s, n);
        m[g] = mx;
        l[g] = exp_shift_sum(s, n, mx);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = lo; t < hi;) {
        const int64_t blk = t / bs, stop = std::min(hi, (blk + 1) * bs), off = t % bs;
        if ((blk + kPrefetchBlocks) * bs < hi) vc.prefetch(table[blk + kPrefetchBlocks], h, bs, D);
        int64_t vs = 0;
        const float* vr = vc.rows(table[blk], off, h, stop - t, D, tile.data(), &vs);
        if (kern.accumulate)
          kern.accumulate(acc.data(), scores.data() + (t - lo), n, vr, vs, stop - t);
        else
          block_accumulate_any(G, D, acc.data(), scores.data() + (t - lo), n, vr, vs, stop - t);
        t = stop;
      }
      split.finish(op, row_idx, o_s0, o_s1, KVH, b, h, p, acc.data(), m.data(), l.data());
    }
  });
  split.merge(op, row_idx, o_s0, o_s1, B, KVH);
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1, name, " must be [rows, heads, dim] with unit stride on dim");
}

template <typename C>
PlainCache<C> plain_cache(const torch::Tensor& t) {
  return PlainCache<C>{t.data_ptr<C>(), CacheView{t.stride(0), t.stride(1), t.stride(2)}};
}

template <typename Q>
void dispatch_cache(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                    const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                    const torch::Tensor& context_lens, const torch::Tensor& rows, double scale,
                    int64_t window, int64_t partition) {
  switch (k_cache.scalar_type()) {
#define KVL_CASE(ST, CT)                                                                                    \
  case ST:                                                                                                  \
    paged_decode_impl<Q, PlainCache<CT>>(out, q, plain_cache<CT>(k_cache), plain_cache<CT>(v_cache),        \
                                         k_cache.size(1), k_cache.size(2), block_tables, context_lens, rows, \
                                         scale, window, partition);                                         \
    break;
    KVL_CASE(at::kFloat, float)
    KVL_CASE(at::kBFloat16, c10::BFloat16)
    KVL_CASE(at::kHalf, c10::Half)
    KVL_CASE(at::kFloat8_e4m3fn, c10::Float8_e4m3fn)
    KVL_CASE(at::kFloat8_e5m2, c10::Float8_e5m2)
#undef KVL_CASE
    default:
      TORCH_CHECK(false, "paged_decode: unsupported KV cache dtype ", k_cache.scalar_type());
  }
}

// out[rows[b]] = softmax(q[rows[b]] . K_b^T * scale) V_b for every sequence b, where K_b / V_b are
// the first context_lens[b] positions of sequence b read through block_tables[b] (int32, padded),
// restricted to the last `window` of them when window > 0. `partition`: context tokens per work item
// (0: whole contexts; < 0: automatic, split only when sequences are too few for the threads).
void check_decode(const torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                  const torch::Tensor& v_cache, const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                  const torch::Tensor& rows) {
  check_rows(q, "q");
  check_rows(out, "out");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "out and q must have one dtype");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "caches must be [blocks, block_size, kv_heads, dim] with unit stride on dim");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches must have one dtype");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "K and V caches must have one shape");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "head dim of q and cache differ");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.is_contiguous(),
              "block_tables must be a contiguous int32 [seqs, blocks] tensor");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.is_contiguous() &&
                  context_lens.numel() == block_tables.size(0),
              "context_lens must be a contiguous int32 tensor, one entry per sequence");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.numel() == block_tables.size(0),
              "rows must be a contiguous int64 tensor, one entry per sequence");
  const int64_t B = block_tables.size(0), bs = k_cache.size(1), nb = k_cache.size(0);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {  // bounds: a bad table must be an error, never a wild read
    TORCH_CHECK(lens[b] >= 1 && (lens[b] + bs - 1) / bs <= block_tables.size(1),
                "sequence ", b, ": context of ", lens[b], " tokens does not fit its block table");
    TORCH_CHECK(r[b] >= 0 && r[b] < q.size(0) && r[b] < out.size(0), "sequence ", b, ": row out of range");
    for (int64_t i = 0, used = (lens[b] + bs - 1) / bs; i < used; ++i) {
      const int32_t blk = tables[b * block_tables.size(1) + i];
      TORCH_CHECK(blk >= 0 && blk < nb, "sequence ", b, ": block ", blk, " outside the ", nb, "-block cache");
    }
  }
}

void paged_decode(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor block_tables, torch::Tensor context_lens, torch::Tensor rows, double scale,
                  int64_t window, int64_t partition) {
  check_decode(out, q, k_cache, v_cache, block_tables, context_lens, rows);
  switch (q.scalar_type()) {
    case at::kFloat:
      dispatch_cache<float>(out, q, k_cache, v_cache, block_tables, context_lens, rows, scale, window, partition);
      break;
    case at::kBFloat16:
      dispatch_cache<c10::BFloat16>(out, q, k_cache, v_cache, block_tables, context_lens, rows, scale, window,
                                    partition);
      break;
    case at::kHalf:
      dispatch_cache<c10::Half>(out, q, k_cache, v_cache, block_tables, context_lens, rows, scale, window,
                                partition);
      break;
    default:
      TORCH_CHECK(false, "paged_decode: unsupported query dtype ", q.scalar_type());
  }
}

#include "kvledger_bf16_decode.h"

// paged_decode, with bf16 queries over a bf16 cache on the AVX-512 BF16 kernels of kvledger_bf16_decode.h where
// this binary has them (HAS_BF16_DOTS) and they cover the shape (head dim 64 or 128, at most 8 query heads per
// KV head); anything else goes to paged_decode. Python picks it by the CPU's bf16 path (cpu_features).
void paged_decode_bf16(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                       torch::Tensor block_tables, torch::Tensor context_lens, torch::Tensor rows, double scale,
                       int64_t window, int64_t partition) {
#ifdef KVL_BF16_DOTS
  const auto bf16 = at::kBFloat16;
  if (q.scalar_type() == bf16 && out.scalar_type() == bf16 && k_cache.scalar_type() == bf16 &&
      v_cache.scalar_type() == bf16 && q.dim() == 3 && k_cache.dim() == 4 && k_cache.size(2) > 0 &&
      q.size(1) % k_cache.size(2) == 0) {
    if (const auto kernel = kvl_bf16dp::pick(q.size(1) / k_cache.size(2), q.size(2))) {
      check_decode(out, q, k_cache, v_cache, block_tables, context_lens, rows);
      kernel(out, q, k_cache, v_cache, block_tables, context_lens, rows, scale, window, partition);
      return;
    }
  }
#endif
  paged_decode(out, q, k_cache, v_cache, block_tables, context_lens, rows, scale, window, partition);
}

// ---- paged prefill -------------------------------------------------------------------------------
// Causal attention for chunks of several new tokens per sequence, K/V read through the block table
// (the chunk's own K/V already written). One work item = (sequence, KV head, tile of kQTile queries);
// its G * kQTile query rows are kept transposed (row index fastest), so scores for 16 rows come out of
// one vector FMA per head-dim element and key, with no horizontal sums. Online softmax over key
// blocks; items are handed out longest first from a shared counter, as causal tiles differ in cost.
constexpr int64_t kQTile = 32;
constexpr int64_t kRowsAlign = 2 * kW;  // score loops take row chunks in pairs

struct PrefillSeq {
  int64_t start, qlen, offset, seq;
};

template <int NC, typename Q, typename KC>
void prefill_item(const PrefillSeq& ps, int64_t h, int64_t tile, const Q* qp, int64_t q_s0, int64_t q_s1, Q* op,
                  int64_t o_s0, int64_t o_s1, const KC& kc, const KC& vc, const int32_t* table, int64_t bs, int64_t G, float scale, int64_t window, std::vector<float>& buf) {
  constexpr int64_t D = NC * kW;
  const int64_t i0 = tile * kQTile, i1 = std::min(ps.qlen, i0 + kQTile), nq = i1 - i0;
  const int64_t R = nq * G, RP = (R + kRowsAlign - 1) / kRowsAlign * kRowsAlign, NCH = RP / kW;
  // buf: Qt [D][RP] | St [16][RP] | O [RP][D] | m [RP] | l [RP] | qpos [RP] | tiles [2][16][D]
  buf.resize(D * RP + kW * RP + RP * D + 3 * RP + 2 * bs * D);
  float* qt = buf.data();
  float* st = qt + D * RP;
  float* o = st + kW * RP;
  float* m = o + RP * D;
  float* l = m + RP;
  float* qpos = l + RP;
  float* ktile = qpos + RP;
  float* vtile = ktile + bs * D;
  // Query rows (scaled, fp32) into o's space first, then transposed into qt one head-dim row at a time.
  for (int64_t r = 0; r < RP; ++r) {
    const int64_t i = r / G, g = r % G;
    qpos[r] = r < R ? static_cast<float>(ps.start + i0 + i) : -1.f;  // padded rows: see no key
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
    float* dst = o + r * D;
    if (r >= R) {
      std::fill(dst, dst + D, 0.f);
      continue;
    }
    const Q* qrow = qp + (ps.offset + i0 + i) * q_s0 + (h * G + g) * q_s1;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(qrow[d]) * scale;
  }
  for (int64_t d = 0; d < D; ++d)
    for (int64_t r = 0; r < RP; ++r) qt[d * RP + r] = o[r * D + d];
  std::fill(o, o + RP * D, 0.f);
  const int64_t last = ps.start + i1 - 1;  // last query position of the tile: keys up to it
  int64_t first = 0;
  if (window > 0) first = std::max<int64_t>(0, ps.start + i0 - window + 1);
  const vf neg_inf = splat(-std::numeric_limits<float>::infinity());
  for (int64_t t0 = first; t0 <= last;) {
    const int64_t blk = t0 / bs, t1 = std::min(last + 1, (blk + 1) * bs), nk = t1 - t0;
    for (int64_t c = 0; c < nk; c += kW) {
      const int64_t kcount = std::min<int64_t>(kW, nk - c);  // keys of this sub-block (<= 16)
      const int64_t tb = t0 + c;
      int64_t ks = 0, vs = 0;
      const float* kr = kc.rows(table[blk], tb % bs, h, kcount, D, ktile, &ks);
      const float* vr = vc.rows(table[blk], tb % bs, h, kcount, D, vtile, &vs);
      // Scores St[key][row] for 16-row chunks, two chunks by four keys in registers.
      for (int64_t ch = 0; ch < NCH; ch += 2) {
        const float* q0p = qt + ch * kW;
        const float* q1p = q0p + kW;
        int64_t k0 = 0;
        for (; k0 + 4 <= kcount; k0 += 4) {
          const float* k0p = kr + k0 * ks;
          vf a00{}, a01{}, a02{}, a03{}, a10{}, a11{}, a12{}, a13{};
          for (int64_t d = 0; d < D; ++d) {
            const vf q0 = loadu(q0p + d * RP), q1 = loadu(q1p + d * RP);
            const vf x0 = splat(k0p[d]), x1 = splat(k0p[ks + d]), x2 = splat(k0p[2 * ks + d]),
                     x3 = splat(k0p[3 * ks + d]);
            a00 += q0 * x0; a01 += q0 * x1; a02 += q0 * x2; a03 += q0 * x3;
            a10 += q1 * x0; a11 += q1 * x1; a12 += q1 * x2; a13 += q1 * x3;
          }
          float* sp = st + k0 * RP + ch * kW;
          storeu(sp, a00); storeu(sp + RP, a01); storeu(sp + 2 * RP, a02); storeu(sp + 3 * RP, a03);
          storeu(sp + kW, a10); storeu(sp + RP + kW, a11); storeu(sp + 2 * RP + kW, a12);
          storeu(sp + 3 * RP + kW, a13);
        }
        for (; k0 < kcount; ++k0) {
          const float* kp0 = kr + k0 * ks;
          vf a0{}, a1{};
          for (int64_t d = 0; d < D; ++d) {
            const vf x = splat(kp0[d]);
            a0 += loadu(q0p + d * RP) * x;
            a1 += loadu(q1p + d * RP) * x;
          }
          storeu(st + k0 * RP + ch * kW, a0);
          storeu(st + k0 * RP + ch * kW + kW, a1);
        }
      }
      // Mask (causal, window), online softmax, rescale and accumulate, 16 rows at a time.
      for (int64_t ch = 0; ch < NCH; ++ch) {
        const vf qv = loadu(qpos + ch * kW);
        vf mx = loadu(m + ch * kW);
        const vf m_old = mx;
        for (int64_t kk = 0; kk < kcount; ++kk) {
          const vf kpos = splat(static_cast<float>(tb + kk));
          vf sv = loadu(st + kk * RP + ch * kW);
          sv = kpos > qv ? neg_inf : sv;
          if (window > 0) sv = kpos <= qv - splat(static_cast<float>(window)) ? neg_inf : sv;
          storeu(st + kk * RP + ch * kW, sv);
          mx = sv > mx ? sv : mx;
        }
        storeu(m + ch * kW, mx);
        // Rows with no visible key yet keep m = -inf: their weights and scale factors are 0 and 1.
        const vf live = mx > neg_inf ? splat(1.f) : vf{};
        const vf safe_m = mx > neg_inf ? mx : vf{};
        const vf alpha = m_old > neg_inf ? exp_neg(m_old - safe_m) : splat(1.f);
        vf lsum = loadu(l + ch * kW) * alpha;
        for (int64_t kk = 0; kk < kcount; ++kk) {
          const vf sv = loadu(st + kk * RP + ch * kW);
          const vf p = sv > neg_inf ? exp_neg(sv - safe_m) * live : vf{};
          storeu(st + kk * RP + ch * kW, p);
          lsum += p;
        }
        storeu(l + ch * kW, lsum);
        float al[kW];
        storeu(al, alpha);
        for (int64_t rr = 0; rr < kW; rr += 2) {
          const int64_t r = ch * kW + rr;
          vf acc0[NC], acc1[NC];
          for (int c2 = 0; c2 < NC; ++c2) {
            acc0[c2] = loadu(o + r * D + c2 * kW) * splat(al[rr]);
            acc1[c2] = loadu(o + (r + 1) * D + c2 * kW) * splat(al[rr + 1]);
          }
          for (int64_t kk = 0; kk < kcount; ++kk) {
            const vf p0 = splat(st[kk * RP + r]), p1 = splat(st[kk * RP + r + 1]);
            const float* vrow = vr + kk * vs;
            for (int c2 = 0; c2 < NC; ++c2) {
              const vf x = loadu(vrow + c2 * kW);
              acc0[c2] += p0 * x;
              acc1[c2] += p1 * x;
            }
          }
          for (int c2 = 0; c2 < NC; ++c2) {
            storeu(o + r * D + c2 * kW, acc0[c2]);
            storeu(o + (r + 1) * D + c2 * kW, acc1[c2]);
          }
        }
      }
    }
    t0 = t1;
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = r / G, g = r % G;
    Q* orow = op + (ps.offset + i0 + i) * o_s0 + (h * G + g) * o_s1;
    const float inv = 1.f / l[r];
    for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<Q>(o[r * D + d] * inv);
  }
}

template <int NC, typename Q, typename C>
void paged_prefill_impl(torch::Tensor& out, const torch::Tensor& q, const C& kc, const C& vc, int64_t bs,
                        int64_t KVH, const torch::Tensor& block_tables, const std::vector<PrefillSeq>& seqs,
                        double scale, int64_t window) {
  const int64_t G = q.size(1) / KVH, max_blocks = block_tables.size(1);
  struct Item {
    int64_t seq, h, tile, cost;
  };
  std::vector<Item> items;
  for (int64_t s = 0; s < static_cast<int64_t>(seqs.size()); ++s) {
    const int64_t tiles = (seqs[s].qlen + kQTile - 1) / kQTile;
    for (int64_t t = 0; t < tiles; ++t)
      for (int64_t h = 0; h < KVH; ++h) {
        const int64_t keys = seqs[s].start + std::min(seqs[s].qlen, (t + 1) * kQTile);
        items.push_back({s, h, t, window > 0 ? std::min(keys, window + kQTile) : keys});
      }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(items.size());
  const Q* qp = q.data_ptr<Q>();
  Q* op = out.data_ptr<Q>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t workers = std::min<int64_t>(n, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> buf;
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      const Item& it = items[i];
      const PrefillSeq& ps = seqs[it.seq];
      prefill_item<NC, Q, C>(ps, it.h, it.tile, qp, q.stride(0), q.stride(1), op, out.stride(0), out.stride(1), kc, vc,
                             tables + ps.seq * max_blocks, bs, G, static_cast<float>(scale), window, buf);
    }
  });
}

template <typename Q, typename KC>
void prefill_dispatch_policy(torch::Tensor& out, const torch::Tensor& q, const KC& kc, const KC& vc, int64_t bs,
                             int64_t KVH, const torch::Tensor& block_tables, const std::vector<PrefillSeq>& seqs,
                             double scale, int64_t window) {
  switch (q.size(2)) {
    case 64: paged_prefill_impl<4, Q, KC>(out, q, kc, vc, bs, KVH, block_tables, seqs, scale, window); break;
    case 128: paged_prefill_impl<8, Q, KC>(out, q, kc, vc, bs, KVH, block_tables, seqs, scale, window); break;
    default: TORCH_CHECK(false, "paged_prefill: head dim ", q.size(2), " is not supported (64 or 128)");
  }
}

template <typename Q, typename C>
void prefill_dispatch_d(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                        const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                        const std::vector<PrefillSeq>& seqs, double scale, int64_t window) {
  prefill_dispatch_policy<Q, PlainCache<C>>(out, q, plain_cache<C>(k_cache), plain_cache<C>(v_cache), k_cache.size(1),
                                            k_cache.size(2), block_tables, seqs, scale, window);
}

template <typename Q>
void prefill_dispatch_cache(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                            const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                            const std::vector<PrefillSeq>& seqs, double scale, int64_t window) {
  switch (k_cache.scalar_type()) {
    case at::kFloat: prefill_dispatch_d<Q, float>(out, q, k_cache, v_cache, block_tables, seqs, scale, window); break;
    case at::kBFloat16:
      prefill_dispatch_d<Q, c10::BFloat16>(out, q, k_cache, v_cache, block_tables, seqs, scale, window);
      break;
    case at::kHalf: prefill_dispatch_d<Q, c10::Half>(out, q, k_cache, v_cache, block_tables, seqs, scale, window); break;
    case at::kFloat8_e4m3fn:
      prefill_dispatch_d<Q, c10::Float8_e4m3fn>(out, q, k_cache, v_cache, block_tables, seqs, scale, window);
      break;
    case at::kFloat8_e5m2:
      prefill_dispatch_d<Q, c10::Float8_e5m2>(out, q, k_cache, v_cache, block_tables, seqs, scale, window);
      break;
    default: TORCH_CHECK(false, "paged_prefill: unsupported KV cache dtype ", k_cache.scalar_type());
  }
}

// For each sequence b: rows [offsets[b], offsets[b] + query_lens[b]) of q are its new tokens at
// positions starts[b]...; they attend causally (within `window` when > 0) to positions
// [0, starts[b] + query_lens[b]) read through block_tables[b]. Results go to the same rows of out.
void paged_prefill(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor block_tables, torch::Tensor starts, torch::Tensor query_lens, torch::Tensor offsets,
                   double scale, int64_t window) {
  check_rows(q, "q");
  check_rows(out, "out");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && out.size(0) == q.size(0), "out and q must match");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1 &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "caches must be two [blocks, block_size, kv_heads, dim] tensors of one dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0, "q and caches disagree on heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.is_contiguous(),
              "block_tables must be a contiguous int32 [seqs, blocks] tensor");
  const int64_t B = block_tables.size(0), bs = k_cache.size(1), nb = k_cache.size(0);
  for (auto* t : {&starts, &query_lens, &offsets})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == B,
                "starts, query_lens and offsets must be int64, one per sequence");
  std::vector<PrefillSeq> seqs;
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* ql = query_lens.data_ptr<int64_t>();
  const int64_t* of = offsets.data_ptr<int64_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(st[b] >= 0 && ql[b] >= 1 && of[b] >= 0 && of[b] + ql[b] <= q.size(0), "sequence ", b, ": bad rows");
    const int64_t used = (st[b] + ql[b] + bs - 1) / bs;
    TORCH_CHECK(used <= block_tables.size(1), "sequence ", b, ": context does not fit its block table");
    for (int64_t i = 0; i < used; ++i) {
      const int32_t blk = tables[b * block_tables.size(1) + i];
      TORCH_CHECK(blk >= 0 && blk < nb, "sequence ", b, ": block ", blk, " outside the ", nb, "-block cache");
    }
    seqs.push_back({st[b], ql[b], of[b], b});
  }
  switch (q.scalar_type()) {
    case at::kFloat: prefill_dispatch_cache<float>(out, q, k_cache, v_cache, block_tables, seqs, scale, window); break;
    case at::kBFloat16:
      prefill_dispatch_cache<c10::BFloat16>(out, q, k_cache, v_cache, block_tables, seqs, scale, window);
      break;
    case at::kHalf: prefill_dispatch_cache<c10::Half>(out, q, k_cache, v_cache, block_tables, seqs, scale, window); break;
    default: TORCH_CHECK(false, "paged_prefill: unsupported query dtype ", q.scalar_type());
  }
}

// ---- quantised caches ------------------------------------------------------------------------------
// One layer of a quantised store: `blocks` uint8 [num_blocks, R] (the bytes of each block), `layout` int64
// [8] = K kind, K codes / scale / min byte offsets, V kind, V codes / scale / min byte offsets (kinds:
// QuantKind), `residual` [2, pages, bs, H, D] (fp32 / bf16 / fp16; empty: none) and `res_map` int32
// [num_blocks] (the page of an open block, -1; empty: none).
struct QuantPair {
  QuantCache k, v;
  int64_t nb, pages;
  const int32_t* map;
};

QuantPair quant_caches(const torch::Tensor& blocks, const torch::Tensor& layout, int64_t bs, int64_t H, int64_t D,
                       const torch::Tensor& residual, const torch::Tensor& res_map) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                  blocks.is_contiguous(), "quantised cache must be a contiguous uint8 [blocks, bytes] tensor");
  TORCH_CHECK(layout.scalar_type() == at::kLong && layout.is_contiguous() && layout.numel() == 8,
              "layout must be 8 int64 values");
  TORCH_CHECK(bs >= 1 && H >= 1 && D >= 2 && D % 2 == 0, "bad block size / heads / head dim");
  const int64_t* L = layout.data_ptr<int64_t>();
  const int64_t R = blocks.size(1);
  QuantCache c[2];
  for (int t = 0; t < 2; ++t) {
    const int64_t kind = L[4 * t], co = L[4 * t + 1], so = L[4 * t + 2], mo = L[4 * t + 3];
    const bool kivi = kind == kKiviK || kind == kKiviV || kind == kKiviVRot, has_min = kivi || kind == kChanK;
    TORCH_CHECK(kind >= kFp8Token && kind <= kKiviVRot, "unknown quantised kind ", kind);
    TORCH_CHECK((kind != kInt8TokenRot && kind != kKiviVRot) || (D & (D - 1)) == 0,
                "turned values need a power-of-two head dim");
    const int64_t codes = kivi ? bs * H * D / 2 : bs * H * D;
    const int64_t meta = (kind == kKiviK || kind == kChanK) ? H * D * 2 : bs * H * 2;
    TORCH_CHECK(co >= 0 && co + codes <= R && so >= 0 && so + meta <= R && (!has_min || (mo >= 0 && mo + meta <= R)),
                "layout offsets outside the block");
    c[t] = QuantCache{blocks.data_ptr<uint8_t>(), R, kind, co, so, mo, H, D, bs, nullptr, 0, nullptr};
  }
  int64_t pages = 0;
  const int32_t* map = nullptr;
  if (residual.numel() > 0) {
    TORCH_CHECK(residual.device().is_cpu() && residual.dim() == 5 && residual.is_contiguous() && residual.size(0) == 2 &&
                    residual.size(2) == bs && residual.size(3) == H && residual.size(4) == D,
                "residual must be a contiguous [2, pages, block_size, heads, dim] tensor");
    TORCH_CHECK(res_map.scalar_type() == at::kInt && res_map.is_contiguous() && res_map.numel() == blocks.size(0),
                "res_map must be int32, one entry per block");
    int64_t type = 0;
    switch (residual.scalar_type()) {
      case at::kFloat: type = 0; break;
      case at::kBFloat16: type = 1; break;
      case at::kHalf: type = 2; break;
      default: TORCH_CHECK(false, "residual pages must be fp32, bf16 or fp16");
    }
    pages = residual.size(1);
    map = res_map.data_ptr<int32_t>();
    const int64_t esize = residual.element_size(), page = pages * bs * H * D;
    for (int t = 0; t < 2; ++t) {
      c[t].res = static_cast<const char*>(residual.data_ptr()) + t * page * esize;
      c[t].res_type = type;
      c[t].res_map = map;
    }
  }
  return QuantPair{c[0], c[1], blocks.size(0), pages, map};
}

// Bounds of the tables a call reads: every block inside the cache, every open block's page inside the
// residual. A bad table is an error, never a wild read.
void check_tables(const torch::Tensor& block_tables, const int64_t* needed_blocks, int64_t B, const QuantPair& qp) {
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.is_contiguous(),
              "block_tables must be a contiguous int32 [seqs, blocks] tensor");
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(needed_blocks[b] <= block_tables.size(1), "sequence ", b, ": context does not fit its block table");
    for (int64_t i = 0; i < needed_blocks[b]; ++i) {
      const int32_t blk = tables[b * block_tables.size(1) + i];
      TORCH_CHECK(blk >= 0 && blk < qp.nb, "sequence ", b, ": block ", blk, " outside the ", qp.nb, "-block cache");
      if (qp.map) TORCH_CHECK(qp.map[blk] < qp.pages, "block ", blk, ": residual page outside the residual pages");
    }
  }
}

#include "kv_quant_fused.h"

// paged_decode over a quantised layer (see paged_decode and quant_caches): the fused kernels
// (kv_quant_fused.h) where the shape has one, else the loader path.
void paged_decode_q(torch::Tensor out, torch::Tensor q, torch::Tensor blocks, torch::Tensor layout, int64_t block_size,
                    int64_t kv_heads, torch::Tensor residual, torch::Tensor res_map, torch::Tensor block_tables,
                    torch::Tensor context_lens, torch::Tensor rows, double scale, int64_t window, int64_t partition) {
  check_rows(q, "q");
  check_rows(out, "out");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "out and q must have one dtype");
  TORCH_CHECK(q.size(1) % kv_heads == 0, "query heads must be a multiple of KV heads");
  const QuantPair qp = quant_caches(blocks, layout, block_size, kv_heads, q.size(2), residual, res_map);
  const int64_t B = block_tables.size(0);
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.is_contiguous() && context_lens.numel() == B,
              "context_lens must be a contiguous int32 tensor, one entry per sequence");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.numel() == B,
              "rows must be a contiguous int64 tensor, one entry per sequence");
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int64_t* r = rows.data_ptr<int64_t>();
  std::vector<int64_t> need(B);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1, "sequence ", b, ": empty context");
    TORCH_CHECK(r[b] >= 0 && r[b] < q.size(0) && r[b] < out.size(0), "sequence ", b, ": row out of range");
    need[b] = (lens[b] + block_size - 1) / block_size;
  }
  check_tables(block_tables, need.data(), B, qp);
  bool fused = false;
#define KVL_FUSED(ST, QT)                                                                                    \
  case ST:                                                                                                   \
    fused = fused_decode<QT>(out, q, qp.k, qp.v, block_size, kv_heads, block_tables, context_lens, rows, scale, \
                             window, partition);                                                             \
    break;
  switch (q.scalar_type()) {
    KVL_FUSED(at::kFloat, float)
    KVL_FUSED(at::kBFloat16, c10::BFloat16)
    KVL_FUSED(at::kHalf, c10::Half)
    default: break;
  }
#undef KVL_FUSED
  if (fused) return;
  switch (q.scalar_type()) {
    case at::kFloat:
      paged_decode_impl<float, QuantCache>(out, q, qp.k, qp.v, block_size, kv_heads, block_tables, context_lens, rows,
                                           scale, window, partition);
      break;
    case at::kBFloat16:
      paged_decode_impl<c10::BFloat16, QuantCache>(out, q, qp.k, qp.v, block_size, kv_heads, block_tables,
                                                   context_lens, rows, scale, window, partition);
      break;
    case at::kHalf:
      paged_decode_impl<c10::Half, QuantCache>(out, q, qp.k, qp.v, block_size, kv_heads, block_tables, context_lens,
                                               rows, scale, window, partition);
      break;
    default: TORCH_CHECK(false, "paged_decode_q: unsupported query dtype ", q.scalar_type());
  }
}

// paged_prefill over a quantised layer (see paged_prefill and quant_caches).
void paged_prefill_q(torch::Tensor out, torch::Tensor q, torch::Tensor blocks, torch::Tensor layout, int64_t block_size,
                     int64_t kv_heads, torch::Tensor residual, torch::Tensor res_map, torch::Tensor block_tables,
                     torch::Tensor starts, torch::Tensor query_lens, torch::Tensor offsets, double scale,
                     int64_t window) {
  check_rows(q, "q");
  check_rows(out, "out");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && out.size(0) == q.size(0), "out and q must match");
  TORCH_CHECK(q.size(1) % kv_heads == 0, "query heads must be a multiple of KV heads");
  const QuantPair qp = quant_caches(blocks, layout, block_size, kv_heads, q.size(2), residual, res_map);
  const int64_t B = block_tables.size(0);
  for (auto* t : {&starts, &query_lens, &offsets})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == B,
                "starts, query_lens and offsets must be int64, one per sequence");
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* ql = query_lens.data_ptr<int64_t>();
  const int64_t* of = offsets.data_ptr<int64_t>();
  std::vector<PrefillSeq> seqs;
  std::vector<int64_t> need(B);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(st[b] >= 0 && ql[b] >= 1 && of[b] >= 0 && of[b] + ql[b] <= q.size(0), "sequence ", b, ": bad rows");
    need[b] = (st[b] + ql[b] + block_size - 1) / block_size;
    seqs.push_back({st[b], ql[b], of[b], b});
  }
  check_tables(block_tables, need.data(), B, qp);
  switch (q.scalar_type()) {
    case at::kFloat:
      prefill_dispatch_policy<float, QuantCache>(out, q, qp.k, qp.v, block_size, kv_heads, block_tables, seqs, scale,
                                                 window);
      break;
    case at::kBFloat16:
      prefill_dispatch_policy<c10::BFloat16, QuantCache>(out, q, qp.k, qp.v, block_size, kv_heads, block_tables, seqs,
                                                         scale, window);
      break;
    case at::kHalf:
      prefill_dispatch_policy<c10::Half, QuantCache>(out, q, qp.k, qp.v, block_size, kv_heads, block_tables, seqs,
                                                     scale, window);
      break;
    default: TORCH_CHECK(false, "paged_prefill_q: unsupported query dtype ", q.scalar_type());
  }
}

// Rows per parallel chunk for a row-wise elementwise kernel: a decode step's few rows run inline in the
// calling thread, since waking the pool costs more than the work (and, on a shared machine, waits for a
// time slice).
inline int64_t serial_rows(int64_t row_elems) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(1, row_elems)); }

// ---- KV cache write ------------------------------------------------------------------------------
template <typename S, typename C>
void write_impl(torch::Tensor& cache, const torch::Tensor& src, const int64_t* slots, int64_t n) {
  const int64_t bs = cache.size(1), H = cache.size(2), D = cache.size(3);
  C* cp = cache.data_ptr<C>();
  const S* sp = src.data_ptr<S>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = slots[i];
    C* dst = cp + (slot / bs) * cache.stride(0) + (slot % bs) * cache.stride(1);
    const S* row = sp + i * src.stride(0);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) dst[h * cache.stride(2) + d] = static_cast<C>(static_cast<float>(row[h * src.stride(1) + d]));
  }
}

template <typename S>
void write_dispatch(torch::Tensor& cache, const torch::Tensor& src, const int64_t* slots, int64_t n) {
  switch (cache.scalar_type()) {
    case at::kFloat: write_impl<S, float>(cache, src, slots, n); break;
    case at::kBFloat16: write_impl<S, c10::BFloat16>(cache, src, slots, n); break;
    case at::kHalf: write_impl<S, c10::Half>(cache, src, slots, n); break;
    case at::kFloat8_e4m3fn: write_impl<S, c10::Float8_e4m3fn>(cache, src, slots, n); break;
    case at::kFloat8_e5m2: write_impl<S, c10::Float8_e5m2>(cache, src, slots, n); break;
    default: TORCH_CHECK(false, "kv_write: unsupported cache dtype ", cache.scalar_type());
  }
}

// cache[slot of token i] = src[i] for K and V: [n, kv_heads, dim] rows into [blocks, bs, kv_heads, dim].
void kv_write(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots, torch::Tensor k, torch::Tensor v) {
  check_rows(k, "k");
  check_rows(v, "v");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == k.size(0) &&
                  k.size(0) == v.size(0),
              "kv_write: one int64 slot per row");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "kv_write: K and V rows must have one dtype");
  for (auto* c : {&k_cache, &v_cache}) {
    TORCH_CHECK(c->dim() == 4 && c->stride(3) == 1 && c->size(2) == k.size(1) && c->size(3) == k.size(2),
                "kv_write: cache and rows disagree on [kv_heads, dim]");
  }
  const int64_t n = slots.numel(), limit = k_cache.size(0) * k_cache.size(1);
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(s[i] >= 0 && s[i] < limit, "kv_write: slot ", s[i], " out of range");
  switch (k.scalar_type()) {
    case at::kFloat: write_dispatch<float>(k_cache, k, s, n); write_dispatch<float>(v_cache, v, s, n); break;
    case at::kBFloat16:
      write_dispatch<c10::BFloat16>(k_cache, k, s, n);
      write_dispatch<c10::BFloat16>(v_cache, v, s, n);
      break;
    case at::kHalf: write_dispatch<c10::Half>(k_cache, k, s, n); write_dispatch<c10::Half>(v_cache, v, s, n); break;
    default: TORCH_CHECK(false, "kv_write: unsupported row dtype ", k.scalar_type());
  }
}

// ---- RMSNorm (optionally after a residual add) -----------------------------------------------------
// Hugging Face's Llama RMSNorm: x * rsqrt(mean(x^2) + eps) in fp32, cast back, times the weight.
template <typename T>
void rms_norm_impl(torch::Tensor& out, torch::Tensor& x, const torch::Tensor* add, const torch::Tensor& w,
                   double eps) {
  const int64_t n = x.size(0), c = x.size(1);
  T* xp = x.data_ptr<T>();
  const T* ap = add ? add->data_ptr<T>() : nullptr;
  const int64_t as = add ? add->stride(0) : 0;
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, n, serial_rows(c), [&](int64_t begin, int64_t end) {
    std::vector<float> row(c);
    for (int64_t i = begin; i < end; ++i) {
      T* xr = xp + i * xs;
      T* orow = op + i * os;
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (c % kW == 0) {  // the same roundings, sixteen lanes at a time
          const T* ar = ap ? ap + i * as : nullptr;
          for (int64_t j = 0; j < c; j += kW) {
            vf x = kvl_bf16::load16(xr + j);
            if (ar) {
              x = kvl_bf16::through_bf16(x + kvl_bf16::load16(ar + j));
              kvl_bf16::store16(xr + j, x);
            }
            storeu(row.data() + j, x);
          }
          const vf inv = splat(1.f / std::sqrt(dot(row.data(), row.data(), c) / static_cast<float>(c) +
                                               static_cast<float>(eps)));
          for (int64_t j = 0; j < c; j += kW)
            kvl_bf16::store16(orow + j, kvl_bf16::load16(wp + j) * kvl_bf16::through_bf16(loadu(row.data() + j) * inv));
          continue;
        }
      }
      if (ap) {
        const T* ar = ap + i * as;
        for (int64_t j = 0; j < c; ++j) xr[j] = static_cast<T>(static_cast<float>(xr[j]) + static_cast<float>(ar[j]));
      }
      for (int64_t j = 0; j < c; ++j) row[j] = static_cast<float>(xr[j]);
      const float ms = dot(row.data(), row.data(), c) / static_cast<float>(c);
      const float inv = 1.f / std::sqrt(ms + static_cast<float>(eps));
      for (int64_t j = 0; j < c; ++j)
        orow[j] = static_cast<T>(static_cast<float>(wp[j]) * static_cast<float>(static_cast<T>(row[j] * inv)));
    }
  });
}

void check_2d(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1, name, " must be a CPU [rows, features] tensor");
}

// out = rmsnorm(x) * w. With `residual_add` given, first x += residual_add (in place): x then holds the
// new residual stream and out its normalisation, one pass over the row.
void rms_norm(torch::Tensor out, torch::Tensor x, c10::optional<torch::Tensor> residual_add, torch::Tensor w,
              double eps) {
  check_2d(out, "out");
  check_2d(x, "x");
  TORCH_CHECK(w.is_contiguous() && w.dim() == 1 && w.size(0) == x.size(1), "weight must match the features");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type() && w.scalar_type() == x.scalar_type(),
              "out, x and weight must agree in shape and dtype");
  const torch::Tensor* add = nullptr;
  if (residual_add.has_value()) {
    check_2d(*residual_add, "residual_add");
    TORCH_CHECK(residual_add->sizes() == x.sizes() && residual_add->scalar_type() == x.scalar_type(),
                "residual_add must match x");
    add = &residual_add.value();
  }
  switch (x.scalar_type()) {
    case at::kFloat: rms_norm_impl<float>(out, x, add, w, eps); break;
    case at::kBFloat16: rms_norm_impl<c10::BFloat16>(out, x, add, w, eps); break;
    case at::kHalf: rms_norm_impl<c10::Half>(out, x, add, w, eps); break;
    default: TORCH_CHECK(false, "rms_norm: unsupported dtype ", x.scalar_type());
  }
}

// ---- RoPE, in place -------------------------------------------------------------------------------
// Hugging Face layout: x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[half:], x[:half]).
template <typename T>
void rope_impl(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t n = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, n, serial_rows(H * D), [&](int64_t begin, int64_t end) {
    std::vector<float> a(half), b(half);
    for (int64_t i = begin; i < end; ++i) {
      const T* c = cp + i * D;
      const T* s = sp + i * D;
      for (int64_t h = 0; h < H; ++h) {
        T* r = xp + i * s0 + h * s1;
        for (int64_t d = 0; d < half; ++d) {
          a[d] = static_cast<float>(r[d]);
          b[d] = static_cast<float>(r[d + half]);
        }
        for (int64_t d = 0; d < half; ++d) {
          // Rounded like torch's three separate ops: (x*cos), (rot*sin), then their sum.
          const float lo = static_cast<float>(static_cast<T>(a[d] * static_cast<float>(c[d]))) +
                           static_cast<float>(static_cast<T>(-b[d] * static_cast<float>(s[d])));
          const float hi = static_cast<float>(static_cast<T>(b[d] * static_cast<float>(c[d + half]))) +
                           static_cast<float>(static_cast<T>(a[d] * static_cast<float>(s[d + half])));
          r[d] = static_cast<T>(lo);
          r[d + half] = static_cast<T>(hi);
        }
      }
    }
  });
}

// Rotate q-like rows [n, heads, dim] in place by per-row cos/sin tables [n, dim] (contiguous).
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(2) % 2 == 0, "rope: head dim must be even");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
                  cos.size(0) == x.size(0) && cos.size(1) == x.size(2),
              "rope: cos/sin must be contiguous [rows, head_dim]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rope: cos/sin must have the rows' dtype");
  switch (x.scalar_type()) {
    case at::kFloat: rope_impl<float>(x, cos, sin); break;
    case at::kBFloat16: rope_impl<c10::BFloat16>(x, cos, sin); break;
    case at::kHalf: rope_impl<c10::Half>(x, cos, sin); break;
    default: TORCH_CHECK(false, "rope: unsupported dtype ", x.scalar_type());
  }
}

// ---- SwiGLU ---------------------------------------------------------------------------------------
// silu(g) = g * sigmoid(g), sigmoid via e = exp(-|g|) (never overflows): g >= 0 ? 1 / (1 + e) : e / (1 + e).
inline vf silu(vf g) {
  const vf zero{};
  const vf neg_abs = g < zero ? g : -g;
  const vf e = exp_neg(neg_abs);
  const vf one = splat(1.0f);
  const vf sig = g < zero ? e / (one + e) : one / (one + e);
  return g * sig;
}

template <typename T>
void silu_mul_impl(torch::Tensor& out, const torch::Tensor& gate_up, int64_t inter) {
  const int64_t n = gate_up.size(0);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t gs = gate_up.stride(0), os = out.stride(0);
  // bf16 rows take the vector path at half fp32's bytes: a decode step's 32 rows (~15 us of work) stay
  // inline rather than wake the pool (50-150 us on a shared 2-core machine).
  const int64_t grain = serial_rows(std::is_same_v<T, c10::BFloat16> ? inter / 2 : 2 * inter);
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> g(kW), u(kW), r(kW);
    for (int64_t i = begin; i < end; ++i) {
      const T* gr = gp + i * gs;
      const T* ur = gr + inter;
      T* orow = op + i * os;
      int64_t j0 = 0;
      if constexpr (std::is_same_v<T, float>) {
        for (; j0 + kW <= inter; j0 += kW) storeu(orow + j0, silu(loadu(gr + j0)) * loadu(ur + j0));
      } else if constexpr (std::is_same_v<T, c10::BFloat16>) {  // the roundings below, sixteen lanes at a time
        for (; j0 + kW <= inter; j0 += kW)
          kvl_bf16::store16(orow + j0, kvl_bf16::through_bf16(silu(kvl_bf16::load16(gr + j0))) *
                                           kvl_bf16::load16(ur + j0));
      }
      for (int64_t j = j0; j < inter; j += kW) {
        const int64_t w = std::min<int64_t>(kW, inter - j);
        for (int64_t l = 0; l < kW; ++l) {
          g[l] = l < w ? static_cast<float>(gr[j + l]) : 0.f;
          u[l] = l < w ? static_cast<float>(ur[j + l]) : 0.f;
        }
        // Rounded like torch's two ops: silu(gate) in the compute dtype, then the product.
        vf sg = silu(loadu(g.data()));
        storeu(r.data(), sg);
        for (int64_t l = 0; l < w; ++l)
          orow[j + l] = static_cast<T>(static_cast<float>(static_cast<T>(r[l])) * u[l]);
      }
    }
  });
}

// out = silu(gate) * up for gate_up = [gate | up] rows ([n, 2 * inter], unit stride on features).
void silu_mul(torch::Tensor out, torch::Tensor gate_up, int64_t inter) {
  check_2d(gate_up, "gate_up");
  check_2d(out, "out");
  TORCH_CHECK(gate_up.size(1) == 2 * inter && out.size(0) == gate_up.size(0) && out.size(1) == inter &&
                  out.scalar_type() == gate_up.scalar_type(),
              "silu_mul: out must be [rows, inter] for gate_up [rows, 2 * inter] of one dtype");
  switch (gate_up.scalar_type()) {
    case at::kFloat: silu_mul_impl<float>(out, gate_up, inter); break;
    case at::kBFloat16: silu_mul_impl<c10::BFloat16>(out, gate_up, inter); break;
    case at::kHalf: silu_mul_impl<c10::Half>(out, gate_up, inter); break;
    default: TORCH_CHECK(false, "silu_mul: unsupported dtype ", gate_up.scalar_type());
  }
}

// Whether decode over int8-channel / int4 keys and int8 / 4-bit values takes the integer-dot kernels (AVX-512
// VNNI builds only): on < 0 asks, 0 / 1 switch them off / on. Returns the setting in force.
bool int_dot(int64_t on) {
  if (on >= 0) int_dot_on().store(KVL_INT_DOT == 1 && on > 0);
  return int_dot_on().load();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvledger CPU kernels: paged decode attention, KV write, RMSNorm, RoPE";
  m.def("paged_decode", &paged_decode, "paged decode attention reading K/V through block tables",
        py::arg("out"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("rows"), py::arg("scale"), py::arg("window"), py::arg("partition"));
  m.def("paged_decode_bf16", &paged_decode_bf16,
        "paged_decode with AVX-512 BF16 dot products for bf16 queries over a bf16 cache (else paged_decode)",
        py::arg("out"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("rows"), py::arg("scale"), py::arg("window"), py::arg("partition"));
  m.def("paged_prefill", &paged_prefill, "causal paged attention for multi-token chunks", py::arg("out"),
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("starts"),
        py::arg("query_lens"), py::arg("offsets"), py::arg("scale"), py::arg("window"));
  m.def("paged_decode_q", &paged_decode_q, "paged decode attention over a quantised KV layer", py::arg("out"),
        py::arg("q"), py::arg("blocks"), py::arg("layout"), py::arg("block_size"), py::arg("kv_heads"),
        py::arg("residual"), py::arg("res_map"), py::arg("block_tables"), py::arg("context_lens"), py::arg("rows"),
        py::arg("scale"), py::arg("window"), py::arg("partition"));
  m.def("paged_prefill_q", &paged_prefill_q, "causal paged attention over a quantised KV layer", py::arg("out"),
        py::arg("q"), py::arg("blocks"), py::arg("layout"), py::arg("block_size"), py::arg("kv_heads"),
        py::arg("residual"), py::arg("res_map"), py::arg("block_tables"), py::arg("starts"), py::arg("query_lens"),
        py::arg("offsets"), py::arg("scale"), py::arg("window"));
  m.def("kv_write_q", &kv_write_q, "quantise K/V rows of a per-token format into their slots", py::arg("blocks"),
        py::arg("layout"), py::arg("block_size"), py::arg("slots"), py::arg("k"), py::arg("v"));
  m.def("int_dot", &int_dot, "integer-dot decode kernels: query (-1) or switch them off (0) / on (1)",
        py::arg("on") = -1);
  m.def("kv_write", &kv_write, "write K/V rows into their cache slots", py::arg("k_cache"), py::arg("v_cache"),
        py::arg("slots"), py::arg("k"), py::arg("v"));
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally after an in-place residual add", py::arg("out"), py::arg("x"),
        py::arg("residual_add"), py::arg("weight"), py::arg("eps"));
  m.def("rope_", &rope_, "rotary embedding in place", py::arg("x"), py::arg("cos"), py::arg("sin"));
  m.def("silu_mul", &silu_mul, "SwiGLU: silu(gate) * up", py::arg("out"), py::arg("gate_up"), py::arg("inter"));
  m.def("ec_fit_blocks", &kvl_rans::ec_fit_blocks,
        "entropy-coded KV blocks: per block the smallest step code whose rANS words fit its budget",
        py::arg("y"), py::arg("rows"), py::arg("class0"), py::arg("family"), py::arg("cdf"), py::arg("lut"),
        py::arg("nsym"), py::arg("shift"), py::arg("budget"), py::arg("codes"), py::arg("nwords"), py::arg("words"));
  m.def("ec_encode_blocks", &kvl_rans::ec_encode_blocks, "entropy-coded KV blocks: their words at given step codes",
        py::arg("y"), py::arg("rows"), py::arg("class0"), py::arg("family"), py::arg("cdf"), py::arg("lut"),
        py::arg("nsym"), py::arg("shift"), py::arg("codes"), py::arg("nwords"), py::arg("words"));
  m.def("ec_decode_blocks", &kvl_rans::ec_decode_blocks, "entropy-coded KV blocks: their symbols",
        py::arg("words"), py::arg("nwords"), py::arg("codes"), py::arg("rows"), py::arg("class0"), py::arg("family"),
        py::arg("cdf"), py::arg("lut"), py::arg("nsym"), py::arg("shift"), py::arg("k"));
  py::class_<kvl_pool::SplitLinear>(m, "SplitLinear",
                                    "a linear layer cut by output columns, run on the caller and one helper thread")
      .def(py::init<std::vector<at::Tensor>, std::vector<c10::optional<at::Tensor>>, std::vector<int64_t>>(),
           py::arg("packed"), py::arg("bias"), py::arg("offsets"))
      .def("forward", &kvl_pool::SplitLinear::forward, py::arg("x"))
      .def_property_readonly("pieces", &kvl_pool::SplitLinear::pieces);
  m.def("helper_enabled", [](int on) {
        if (on >= 0) kvl_pool::Helper::get().set_enabled(on > 0);
        return kvl_pool::Helper::get().enabled();
      }, "the helper thread of SplitLinear: query (-1) or switch it off (0) / on (1)", py::arg("on") = -1);
  m.def("helper_pieces", [] { return kvl_pool::Helper::get().pieces_by_helper(); },
        "pieces the helper thread has run so far");
#ifdef KVL_BF16_DOTS
  m.attr("HAS_BF16_DOTS") = true;
#else
  m.attr("HAS_BF16_DOTS") = false;
#endif
  py::dict ec;  // the entropy coder's format constants, for kv_entropy.py to check against its own
  ec["prob_bits"] = kvl_rans::kProbBits;
  ec["step_codes"] = kvl_rans::kStepCodes;
  ec["codes_per_octave"] = kvl_rans::kCodesPerOctave;
  ec["symbol_max"] = kvl_rans::kSymbolMax;
  ec["lut_bits"] = kvl_rans::kLutBits;
  m.attr("EC_CONSTANTS") = ec;
  m.attr("ABI_VERSION") = 2;
}
