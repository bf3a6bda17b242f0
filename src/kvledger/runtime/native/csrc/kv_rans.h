// Entropy-coded KV blocks: a static-model rANS coder (32-bit state, 16-bit words) for blocks of integer
// symbols, and the rate control that gives a block exactly the words its page has.
//
// A block is `rows` rows of `dim` coefficients, each an integer k on the block's step grid. Coefficient c is
// coded under table t = family[c] * classes + class, one of a fixed set of discretised zero-mean Gaussians and
// Laplacians whose deviation, in steps, is 2^(class / 8 - 8) (built once in Python: kv_rans_tables). A table
// codes m = |k| as high = m >> shift[t] (symbols 0 .. nsym[t] - 2; the last symbol escapes to two raw bytes
// holding high - (nsym[t] - 1)), then the low `shift` bits of m raw, then the sign raw when m != 0. Raw bits
// are rANS symbols of a uniform distribution, so one stream holds everything.
//
// Words: [state >> 16, state & 0xffff, then what the encoder emitted, last first]; the decoder reads forward
// and must end on the initial state with every word read (a corrupt block is an error, never a wrong answer).
// A block kept in a fixed slot may be decoded without its count (nwords 0): the slot's words past the ones read
// must then be zero, the padding a slot is written with.
//
// Rate control: a block's step is base * 2^((code - 128) / 8), code a byte; each code down is one class up for
// every coefficient (the deviation in steps grows by 2^(1/8)). ec_fit_blocks picks, per block, the smallest code
// at which no symbol clamps whose coded words fit the block's budget (bisection; a coded size that is not
// monotone in the step could hide a smaller fitting code, which is not searched).

#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvl_rans {

constexpr int kProbBits = 14;
constexpr uint32_t kProbScale = 1u << kProbBits;
constexpr uint32_t kLow = 1u << 16;  // the state lives in [kLow, 2^32)
constexpr int kStepCodes = 256;
constexpr int kSymbolMax = 1 << 15;  // |k| <= kSymbolMax (symbols are clamped to [-kSymbolMax, kSymbolMax - 1])
constexpr int kLutBits = 8;  // a decoder's first guess of a symbol: the top 8 bits of its slot
constexpr int kCodesPerOctave = 8;  // step codes an octave apart; a code is one model class (kv_entropy.py agrees:
                                    // it checks these constants against its own when it loads the kernels)

struct Tables {
  const int32_t* cdf;    // [T, width]: cdf[t][0] = 0 ... cdf[t][nsym[t]] = kProbScale
  const int32_t* lut;    // [T, 2^kLutBits]: the symbol whose interval holds slot j << (kProbBits - kLutBits)
  const int32_t* nsym;   // [T] symbols of table t, its escape included
  const int32_t* shift;  // [T]
  int64_t width;         // row stride of cdf
  int64_t classes;       // tables per family
};

struct Op {
  uint32_t start, freq;
};

inline Op raw_op(uint32_t v, int bits) {  // `bits` uniform bits, bits <= kProbBits
  const int s = kProbBits - bits;
  return {v << s, 1u << s};
}

class Encoder {  // ops are pushed last-decoded first
 public:
  Encoder(uint16_t* out, int64_t cap) : out_(out), cap_(cap) {}
  void put(Op op) {
    const uint64_t x_max = static_cast<uint64_t>((kLow >> kProbBits) << 16) * op.freq;
    if (x_ >= x_max) {
      if (n_ < cap_) out_[n_] = static_cast<uint16_t>(x_ & 0xffff);
      ++n_;
      x_ >>= 16;
    }
    x_ = ((x_ / op.freq) << kProbBits) + (x_ % op.freq) + op.start;
  }
  // The stream's words in decode order (state first); returns their count (which may exceed cap: then only the
  // count is meaningful).
  int64_t finish() {
    const int64_t total = n_ + 2;
    if (total <= cap_) {
      std::reverse(out_, out_ + n_);
      std::copy_backward(out_, out_ + n_, out_ + n_ + 2);
      out_[0] = static_cast<uint16_t>(x_ >> 16);
      out_[1] = static_cast<uint16_t>(x_ & 0xffff);
    }
    return total;
  }

 private:
  uint16_t* out_;
  int64_t cap_;
  int64_t n_ = 0;
  uint64_t x_ = kLow;
};

class Decoder {
 public:
  Decoder(const uint16_t* in, int64_t n) : in_(in), n_(n) {
    if (n < 2) throw std::runtime_error("rANS block: fewer than the 2 state words");
    x_ = (static_cast<uint64_t>(in[0]) << 16) | in[1];
    pos_ = 2;
  }
  uint32_t slot() const { return static_cast<uint32_t>(x_ & (kProbScale - 1)); }
  void take(Op op) {
    x_ = op.freq * (x_ >> kProbBits) + slot() - op.start;
    if (x_ < kLow) {
      if (pos_ >= n_) throw std::runtime_error("rANS block: reads past its words (corrupt block)");
      x_ = (x_ << 16) | in_[pos_++];
    }
  }
  uint32_t raw(int bits) {
    if (bits == 0) return 0;
    const uint32_t v = slot() >> (kProbBits - bits);
    take(raw_op(v, bits));
    return v;
  }
  int symbol(const int32_t* cdf, const int32_t* lut) {
    const uint32_t s = slot();
    int lo = lut[s >> (kProbBits - kLutBits)];  // cdf[lo] <= s; step up to the interval that holds s
    while (static_cast<uint32_t>(cdf[lo + 1]) <= s) ++lo;
    take({static_cast<uint32_t>(cdf[lo]), static_cast<uint32_t>(cdf[lo + 1] - cdf[lo])});
    return lo;
  }
  bool clean() const { return x_ == kLow && pos_ == n_; }
  bool clean_padded() const {  // the initial state, and only zero words left: a slot's padding
    if (x_ != kLow) return false;
    for (int64_t p = pos_; p < n_; ++p)
      if (in_[p]) return false;
    return true;
  }

 private:
  const uint16_t* in_;
  int64_t n_, pos_;
  uint64_t x_;
};

inline int table_of(const Tables& tb, int32_t family, int32_t cls) {
  cls = std::clamp<int32_t>(cls, 0, static_cast<int32_t>(tb.classes) - 1);
  return static_cast<int>(family * tb.classes + cls);
}

// Code one block's symbols k [rows, dim] (row-major) with table ids tid [dim]; returns the word count.
inline int64_t encode_block(const int32_t* k, int64_t rows, int64_t dim, const int32_t* tid, const Tables& tb,
                            uint16_t* out, int64_t cap) {
  Encoder enc(out, cap);
  for (int64_t i = rows * dim - 1; i >= 0; --i) {
    const int t = tid[i % dim];
    const int32_t v = k[i];
    const uint32_t m = static_cast<uint32_t>(v < 0 ? -static_cast<int64_t>(v) : v);
    const int sh = tb.shift[t], esc = tb.nsym[t] - 1;
    const uint32_t high = m >> sh;
    if (m) enc.put(raw_op(v < 0 ? 1u : 0u, 1));
    if (sh) enc.put(raw_op(m & ((1u << sh) - 1), sh));
    const int32_t* cdf = tb.cdf + static_cast<int64_t>(t) * tb.width;
    if (high >= static_cast<uint32_t>(esc)) {
      const uint32_t e = high - esc;
      enc.put(raw_op(e & 0xff, 8));
      enc.put(raw_op(e >> 8, 8));
      enc.put({static_cast<uint32_t>(cdf[esc]), static_cast<uint32_t>(cdf[esc + 1] - cdf[esc])});
    } else {
      enc.put({static_cast<uint32_t>(cdf[high]), static_cast<uint32_t>(cdf[high + 1] - cdf[high])});
    }
  }
  return enc.finish();
}

inline void decode_block(const uint16_t* in, int64_t n, int64_t rows, int64_t dim, const int32_t* tid,
                         const Tables& tb, int32_t* k, bool padded = false) {
  Decoder dec(in, n);
  for (int64_t i = 0; i < rows * dim; ++i) {
    const int t = tid[i % dim];
    const int sh = tb.shift[t], esc = tb.nsym[t] - 1;
    uint32_t high = static_cast<uint32_t>(
        dec.symbol(tb.cdf + static_cast<int64_t>(t) * tb.width, tb.lut + (static_cast<int64_t>(t) << kLutBits)));
    if (high == static_cast<uint32_t>(esc)) {
      const uint32_t hi8 = dec.raw(8);
      high = esc + ((hi8 << 8) | dec.raw(8));
    }
    const uint32_t m = (high << sh) | dec.raw(sh);
    if (m > static_cast<uint32_t>(kSymbolMax)) throw std::runtime_error("rANS block: a symbol past the range");
    const bool neg = m && dec.raw(1);
    k[i] = neg ? -static_cast<int32_t>(m) : static_cast<int32_t>(m);
  }
  if (!(padded ? dec.clean_padded() : dec.clean()))
    throw std::runtime_error("rANS block: does not end on the initial state (corrupt block)");
}

inline Tables tables_of(const at::Tensor& cdf, const at::Tensor& lut, const at::Tensor& nsym,
                        const at::Tensor& shift) {
  TORCH_CHECK(cdf.dim() == 2 && cdf.scalar_type() == at::kInt && cdf.is_contiguous(), "cdf: [T, width] int32");
  TORCH_CHECK(lut.dim() == 2 && lut.size(0) == cdf.size(0) && lut.size(1) == (1 << kLutBits) &&
                  lut.scalar_type() == at::kInt && lut.is_contiguous(), "lut: [T, 256] int32");
  TORCH_CHECK(nsym.numel() == cdf.size(0) && shift.numel() == cdf.size(0) && nsym.scalar_type() == at::kInt &&
                  shift.scalar_type() == at::kInt && cdf.size(0) % 2 == 0,
              "nsym, shift: [T] int32, T even (two families)");
  const int32_t* ns = nsym.data_ptr<int32_t>();
  const int32_t* sh = shift.data_ptr<int32_t>();
  for (int64_t t = 0; t < cdf.size(0); ++t)
    TORCH_CHECK(ns[t] >= 2 && ns[t] < cdf.size(1) && sh[t] >= 0 && sh[t] <= kProbBits - 1 &&
                    cdf.data_ptr<int32_t>()[t * cdf.size(1) + ns[t]] == static_cast<int32_t>(kProbScale),
                "table ", t, ": bad symbol count, shift or total");
  const int32_t* c = cdf.data_ptr<int32_t>();
  const int32_t* l = lut.data_ptr<int32_t>();
  for (int64_t t = 0; t < cdf.size(0); ++t)  // each guess must lie at or below its slot's symbol
    for (int j = 0; j < (1 << kLutBits); ++j) {
      const int32_t g = l[(t << kLutBits) + j];
      TORCH_CHECK(g >= 0 && g < ns[t] && c[t * cdf.size(1) + g] <= (j << (kProbBits - kLutBits)),
                  "table ", t, ": bad lookup entry ", j);
    }
  return {c, l, ns, sh, cdf.size(1), cdf.size(0) / 2};
}

struct BlockArgs {
  int64_t n, rmax, dim;
};

inline BlockArgs check_blocks(const at::Tensor& rows, const at::Tensor& class0, const at::Tensor& family,
                              int64_t rmax) {
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kInt, "rows: [N] int32");
  TORCH_CHECK(class0.dim() == 2 && class0.size(0) == rows.size(0) && class0.scalar_type() == at::kInt &&
                  class0.is_contiguous(), "class0: [N, D] int32");
  TORCH_CHECK(family.dim() == 1 && family.size(0) == class0.size(1) && family.scalar_type() == at::kInt,
              "family: [D] int32");
  const int32_t* r = rows.data_ptr<int32_t>();
  for (int64_t b = 0; b < rows.size(0); ++b) TORCH_CHECK(r[b] >= 1 && r[b] <= rmax, "block ", b, ": bad row count");
  for (int64_t c = 0; c < family.size(0); ++c)
    TORCH_CHECK(family.data_ptr<int32_t>()[c] == 0 || family.data_ptr<int32_t>()[c] == 1, "family: 0 or 1");
  return {rows.size(0), rmax, class0.size(1)};
}

// The shapes every entry point shares: blocks (y or k) [N, R, D] of `dtype` against rows [N], class0 [N, D] and
// family [D]; codes and nwords [N] int32; words [N, cap] int32 (uint16 values).
inline BlockArgs check_coded(const at::Tensor& blocks, at::ScalarType dtype, const at::Tensor& rows,
                             const at::Tensor& class0, const at::Tensor& family, const at::Tensor& codes,
                             const at::Tensor& nwords, const at::Tensor& words) {
  TORCH_CHECK(blocks.dim() == 3 && blocks.scalar_type() == dtype && blocks.is_contiguous(), "blocks: [N, R, D] ",
              dtype);
  const BlockArgs a = check_blocks(rows, class0, family, blocks.size(1));
  TORCH_CHECK(blocks.size(0) == a.n && blocks.size(2) == a.dim, "blocks and class0 disagree");
  TORCH_CHECK(codes.numel() == a.n && nwords.numel() == a.n && codes.scalar_type() == at::kInt &&
                  nwords.scalar_type() == at::kInt, "codes, nwords: [N] int32");
  TORCH_CHECK(words.dim() == 2 && words.size(0) == a.n && words.scalar_type() == at::kInt && words.is_contiguous(),
              "words: [N, cap] int32");
  return a;
}

struct StepTable {  // a code's step in base steps
  double at[kStepCodes];
  StepTable() {
    for (int c = 0; c < kStepCodes; ++c) at[c] = std::exp2((c - kStepCodes / 2) / double(kCodesPerOctave));
  }
};

// One block at one code: its symbols (y on the step's grid, clamped) and each coefficient's table.
inline void block_setup(const double* y, int64_t rows, int64_t dim, double step, const int32_t* fam,
                        const int32_t* class0, int code, const Tables& tb, int32_t* k, int32_t* tid) {
  for (int64_t i = 0; i < rows * dim; ++i) {
    const double q = std::nearbyint(y[i] / step);
    k[i] = static_cast<int32_t>(std::clamp(q, -double(kSymbolMax), double(kSymbolMax - 1)));
  }
  for (int64_t c = 0; c < dim; ++c) tid[c] = table_of(tb, fam[c], class0[c] - (code - kStepCodes / 2));
}

// Per block b: the smallest step code whose words fit budget[b], its words (uint16 in int32) and count.
// y [N, R, D] float64: the block's coefficients in units of the base step. class0 [N, D]: each coefficient's
// class at code 128. Blocks that fit at no code keep code 255 (their count then exceeds the budget).
inline void ec_fit_blocks(const at::Tensor& y, const at::Tensor& rows, const at::Tensor& class0,
                          const at::Tensor& family, const at::Tensor& cdf, const at::Tensor& lut,
                          const at::Tensor& nsym, const at::Tensor& shift, const at::Tensor& budget,
                          at::Tensor codes, at::Tensor nwords, at::Tensor words) {
  const BlockArgs a = check_coded(y, at::kDouble, rows, class0, family, codes, nwords, words);
  TORCH_CHECK(budget.numel() == a.n && budget.scalar_type() == at::kInt, "budget: [N] int32 words");
  const Tables tb = tables_of(cdf, lut, nsym, shift);
  const int64_t cap = words.size(1);
  for (int64_t b = 0; b < a.n; ++b)
    TORCH_CHECK(budget.data_ptr<int32_t>()[b] >= 2 && budget.data_ptr<int32_t>()[b] <= cap, "block ", b,
                ": budget outside [2, cap]");
  const StepTable step;
  const double* yp = y.data_ptr<double>();
  const int32_t* rp = rows.data_ptr<int32_t>();
  const int32_t* c0 = class0.data_ptr<int32_t>();
  const int32_t* fam = family.data_ptr<int32_t>();
  const int32_t* bud = budget.data_ptr<int32_t>();
  int32_t* cp = codes.data_ptr<int32_t>();
  int32_t* np = nwords.data_ptr<int32_t>();
  int32_t* wp = words.data_ptr<int32_t>();
  at::parallel_for(0, a.n, 1, [&](int64_t lo_b, int64_t hi_b) {
    std::vector<int32_t> k(a.rmax * a.dim), tid(a.dim);
    std::vector<uint16_t> buf(cap);
    for (int64_t b = lo_b; b < hi_b; ++b) {
      const int64_t r = rp[b];
      auto size_at = [&](int code, uint16_t* out) {
        block_setup(yp + b * a.rmax * a.dim, r, a.dim, step.at[code], fam, c0 + b * a.dim, code, tb, k.data(),
                    tid.data());
        return encode_block(k.data(), r, a.dim, tid.data(), tb, out, bud[b]);
      };
      // No code at which a symbol would clamp: at fine enough steps every symbol clamps and the block fits
      // anyway (a clamped symbol costs an escape like any far one), but it would decode wrong.
      const double* yb = yp + b * a.rmax * a.dim;
      double peak = 0;
      for (int64_t i = 0; i < r * a.dim; ++i) peak = std::max(peak, std::fabs(yb[i]));
      int lo = 0, hi = kStepCodes - 1;
      while (lo < hi && peak / step.at[lo] > kSymbolMax - 1) ++lo;
      const bool in_range = peak / step.at[lo] <= kSymbolMax - 1;
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (size_at(mid, buf.data()) <= bud[b]) hi = mid; else lo = mid + 1;
      }
      const int64_t n = in_range ? size_at(lo, buf.data()) : bud[b] + 1;  // out of range at every code: no fit
      cp[b] = lo;
      np[b] = static_cast<int32_t>(n);
      int32_t* row = wp + b * cap;
      std::fill(row, row + cap, 0);
      if (n <= bud[b])
        for (int64_t i = 0; i < n; ++i) row[i] = buf[i];
    }
  });
}

// Per block b: its words at the given step code (count in nwords; words written only where they fit the cap).
inline void ec_encode_blocks(const at::Tensor& y, const at::Tensor& rows, const at::Tensor& class0,
                             const at::Tensor& family, const at::Tensor& cdf, const at::Tensor& lut,
                             const at::Tensor& nsym, const at::Tensor& shift, const at::Tensor& codes,
                             at::Tensor nwords, at::Tensor words) {
  const BlockArgs a = check_coded(y, at::kDouble, rows, class0, family, codes, nwords, words);
  const Tables tb = tables_of(cdf, lut, nsym, shift);
  const int64_t cap = words.size(1);
  const StepTable step;
  for (int64_t b = 0; b < a.n; ++b)
    TORCH_CHECK(codes.data_ptr<int32_t>()[b] >= 0 && codes.data_ptr<int32_t>()[b] < kStepCodes, "block ", b,
                ": step code outside [0, 255]");
  at::parallel_for(0, a.n, 1, [&](int64_t lo_b, int64_t hi_b) {
    std::vector<int32_t> k(a.rmax * a.dim), tid(a.dim);
    std::vector<uint16_t> buf(cap);
    for (int64_t b = lo_b; b < hi_b; ++b) {
      const int code = codes.data_ptr<int32_t>()[b];
      const int64_t r = rows.data_ptr<int32_t>()[b];
      block_setup(y.data_ptr<double>() + b * a.rmax * a.dim, r, a.dim, step.at[code], family.data_ptr<int32_t>(),
                  class0.data_ptr<int32_t>() + b * a.dim, code, tb, k.data(), tid.data());
      const int64_t n = encode_block(k.data(), r, a.dim, tid.data(), tb, buf.data(), cap);
      nwords.data_ptr<int32_t>()[b] = static_cast<int32_t>(n);
      int32_t* row = words.data_ptr<int32_t>() + b * cap;
      std::fill(row, row + cap, 0);
      if (n <= cap)
        for (int64_t i = 0; i < n; ++i) row[i] = buf[i];
    }
  });
}

// The symbols of coded blocks: k [N, R, D] int32 (rows past a block's count left 0).
inline void ec_decode_blocks(const at::Tensor& words, const at::Tensor& nwords, const at::Tensor& codes,
                             const at::Tensor& rows, const at::Tensor& class0, const at::Tensor& family,
                             const at::Tensor& cdf, const at::Tensor& lut, const at::Tensor& nsym,
                             const at::Tensor& shift, at::Tensor k) {
  const BlockArgs a = check_coded(k, at::kInt, rows, class0, family, codes, nwords, words);
  const Tables tb = tables_of(cdf, lut, nsym, shift);
  const int64_t cap = words.size(1);
  const int32_t* wp = words.data_ptr<int32_t>();
  const int32_t* np = nwords.data_ptr<int32_t>();
  const int32_t* cp = codes.data_ptr<int32_t>();
  const int32_t* rp = rows.data_ptr<int32_t>();
  const int32_t* c0 = class0.data_ptr<int32_t>();
  const int32_t* fam = family.data_ptr<int32_t>();
  int32_t* kp = k.data_ptr<int32_t>();
  std::string error;
  at::parallel_for(0, a.n, 1, [&](int64_t lo_b, int64_t hi_b) {
    std::vector<uint16_t> buf(cap);
    std::vector<int32_t> tid(a.dim);
    for (int64_t b = lo_b; b < hi_b; ++b) {
      const bool padded = np[b] == 0;  // a slot: every word of the cap, the unread ones zero
      const int64_t n = padded ? cap : np[b];
      if (n < 2 || n > cap || cp[b] < 0 || cp[b] >= kStepCodes) {
#pragma omp critical
        error = "block " + std::to_string(b) + ": word count or step code out of range";
        continue;
      }
      for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<uint16_t>(wp[b * cap + i]);
      for (int64_t c = 0; c < a.dim; ++c)
        tid[c] = table_of(tb, fam[c], c0[b * a.dim + c] - (cp[b] - kStepCodes / 2));
      int32_t* out = kp + b * a.rmax * a.dim;
      std::fill(out, out + a.rmax * a.dim, 0);
      try {
        decode_block(buf.data(), n, rp[b], a.dim, tid.data(), tb, out, padded);
      } catch (const std::exception& e) {
#pragma omp critical
        error = "block " + std::to_string(b) + ": " + e.what();
      }
    }
  });
  TORCH_CHECK(error.empty(), error);
}

}  // namespace kvl_rans
