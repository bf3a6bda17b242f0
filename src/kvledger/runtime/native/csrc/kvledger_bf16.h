// bf16 <-> fp32 sixteen lanes at a time, for the kernels' bf16 paths (included by kvledger_native.cpp).
//
// The generic paths convert one element at a time through c10::BFloat16, whose fp32 -> bf16 rounding is a
// scalar branch per element: in a bf16 decode step that made SwiGLU ~10x and RMSNorm ~3x slower than the
// fp32 kernels, and every cached K/V row went through it before its dot products. These helpers are plain
// GCC/Clang vector code (AVX-512 registers where the CPU has them, pairs of AVX2 ones where not) and round
// exactly as c10::BFloat16 does: to nearest even, any NaN to the quiet NaN 0x7FC0.

#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace kvl_bf16 {

typedef float vf16 __attribute__((vector_size(64)));
typedef uint32_t vu32 __attribute__((vector_size(64)));
typedef uint16_t vu16 __attribute__((vector_size(32)));
typedef int32_t vi32 __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

// 16 bf16 values -> 16 floats (exact: a bf16 is the top half of a float).
inline vf16 load16(const c10::BFloat16* p) {
  vu16 h;
  std::memcpy(&h, p, sizeof(h));
  const vu32 w = __builtin_convertvector(h, vu32) << 16;
  vf16 f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}

// 16 floats -> 16 bf16, rounded as c10::BFloat16(float) rounds.
inline vu16 round16(vf16 f) {
  vu32 u;
  std::memcpy(&u, &f, sizeof(u));
  vu32 r = (u + ((u >> 16) & 1u) + 0x7FFFu) >> 16;
  const vi32 nan = f != f;  // all ones where f is NaN
  r = nan ? vu32{} + 0x7FC0u : r;
  return __builtin_convertvector(r, vu16);
}

inline void store16(c10::BFloat16* p, vf16 f) {
  const vu16 h = round16(f);
  std::memcpy(p, &h, sizeof(h));
}

// f rounded to bf16 and back, as static_cast<float>(static_cast<c10::BFloat16>(f)) per lane.
inline vf16 through_bf16(vf16 f) {
  const vu32 w = __builtin_convertvector(round16(f), vu32) << 16;
  vf16 out;
  std::memcpy(&out, &w, sizeof(out));
  return out;
}

// dst[0, n) = float(src[0, n)).
inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vf16 f = load16(src + i);
    std::memcpy(dst + i, &f, sizeof(f));
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

}  // namespace kvl_bf16
