// Products of float rows with quantized weights (jaxkv/model/quantized.py: a GGUF's blocks,
// or weights quantized at load), the weights dequantized in registers as they are read, as an
// XLA FFI custom call (jaxkv/model/linear.py):
//
//   x      f32 [M, K]          the activations (any number of rows)
//   per weight j (same qtype and group G for all; G a multiple of 32, or 16 for Q8_0 codes
//   (a GGUF Q6_K repacked: a scale per 16 values), S = ceil(K / G)):
//   qs_j   s8 [N_j, K]         Q8_0 codes, or
//          u8 [N_j, K / 2]     Q4_0 / Q4_1 / MXFP4: each 32 values' 16 bytes as GGUF stores a
//                              block (low nibbles its elements 0-15, high nibbles 16-31), or
//          f8e4m3 [N_j, K]     F8_E4M3 codes
//   d_j    f16 [N_j, S]        each group's scale (the last group may be partial), or f32
//                              (a GGUF Q4_K repacked as Q4_1: d x sc in float32, as ggml), or
//                              u8 (MXFP4: E8M0 exponents, 2^(d - 127), group 32)
//   m_j    f16 [N_j, S]        each group's minimum (Q4_1, f32 where d_j is; any array
//                              otherwise, unread)
//   out_j  f32 [M, N_j]        x @ w_j^T, w_j = the dequantized [N_j, K]
//
//   w = q * d (Q8_0, F8_E4M3), (q - 8) * d (Q4_0), q * d + m (Q4_1), FP4[q] * d (MXFP4,
//   e2m1 codes): as ggml's
//   dequantize_row_*, so the result equals dequantize-then-dot up to summation order (and the
//   fused q * d + m).
//
// The work items (of every weight of the call) are shared out over XLA's intra-op threads:
//
//   M <= kDirectRows (decode): an item is kItemRows weight rows against every row of x,
//              kCols weight rows at a time, walked block by block: each block's
//              scales broadcast once, each vector of codes widened to int32, converted and
//              scaled in registers, then met by every row of x (R x C accumulators, reduced by
//              lane_sums at the end). The weight is read once from memory;
//   more rows (prefill tiles): an item is kPanelRows weight rows and a span of up to
//              kSpanRows rows of x; its weight rows are dequantized once into a per-thread
//              panel [kPanelRows, K] of floats, then the same loop reads the panel as floats,
//              kChunkRows rows of x at a time (chunk and panel stay in L2: walking all rows of
//              x for every pass of C weight rows streamed x from memory, 6x slower).

#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;
using jaxkv::in_register;
using jaxkv::kLanes;
using jaxkv::lane_sums;
using jaxkv::load;
using jaxkv::parallel_for;
using jaxkv::Vec;
using jaxkv::IVec;

namespace {

constexpr int kBlock = 32;                  // values per block
constexpr int kParts = kBlock / kLanes;     // vectors per block
constexpr int kHalfParts = kParts / 2;      // vectors per half block (group 16's scale)
// Rows of x and weight rows per pass: R x C accumulators, C weight vectors and one of x in
// registers (8 x 2 of AVX-512's 32, 4 x 3 of AVX2's 16; 8 x 2 measured 5-15% faster than 4 x 3
// at 8 rows on AVX-512, a decode step's padded rows, on a busy 2-core Xeon).
constexpr int kRows = kLanes >= 16 ? 8 : 4;
constexpr int kCols = kLanes >= 16 ? 2 : 3;
constexpr int64_t kItemRows = 16;           // weight rows per work item
constexpr int64_t kDirectRows = kRows;      // rows of x up to which codes are scaled in registers
constexpr int64_t kPanelRows = 64;          // more rows: weight rows per work item (the panel)
constexpr int64_t kSpanRows = 512;          // more rows: rows of x per work item
constexpr int64_t kChunkRows = 32;          // rows of x per walk over the panel

// kPanel: dequantized floats
enum QType : int { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kF8 = 3, kPanel = 4, kMxfp4 = 5 };
// How a weight's scales are stored.
enum Scales : int { kF16, kF32, kE8M0 };

// kLanes bytes from p as int32 lanes, sign- or zero-extended (one vpmov[sz]xbd: GCC 12 builds
// a widened byte vector of its own lane by lane).
template <bool Signed>
inline IVec widen(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (IVec)(Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return (IVec)(Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#else
  IVec v;
  for (int i = 0; i < kLanes; ++i) v[i] = Signed ? static_cast<int8_t>(p[i]) : p[i];
  return v;
#endif
}

// An IEEE half as a float (F16C where the build has it, else by its bits).
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  float f;
  if (exp == 0) {                                   // zero or subnormal: man * 2^-24
    f = static_cast<float>(man) * 5.9604644775390625e-8f;
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    bits |= sign;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  const uint32_t bits = sign | (exp == 31 ? 0x7f800000u | (man << 13)
                                          : ((exp + 112) << 23) | (man << 13));
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// kLanes float8 e4m3 codes (zero-extended bytes) as floats: a normal code's exponent and
// mantissa bits moved into a float's (bias 7 -> 127), a subnormal's mantissa times 2^-9, then
// the sign. (0x7f / 0xff, e4m3's NaN, read as +-480: quantizing never writes them.)
inline Vec fp8_to_float(IVec c) {
  const IVec mag = c & 0x7f;
  const IVec moved = (mag << 20) + (120 << 23);
  const Vec normal = reinterpret_cast<const Vec&>(moved);
  const Vec small = __builtin_convertvector(mag, Vec) * (1.0f / 512);
  const Vec v = mag < 8 ? small : normal;
  const IVec sign = (c & 0x80) != 0;                              // -1 where negative
  const IVec bits = reinterpret_cast<const IVec&>(v) | (sign & (IVec{} + INT32_MIN));
  return reinterpret_cast<const Vec&>(bits);
}

// kLanes e2m1 codes (0..15, zero-extended) as floats: a code's exponent and mantissa bits
// moved into a float's (bias 1 -> 127), zero and the subnormal 0.5 by hand, then the sign.
inline Vec fp4_to_float(IVec c) {
  const IVec mag = c & 7;
  const IVec moved = (mag << 22) + (126 << 23);
  const Vec normal = reinterpret_cast<const Vec&>(moved);
  const Vec small = __builtin_convertvector(mag, Vec) * 0.5f;
  const Vec v = mag < 2 ? small : normal;
  const IVec sign = (c & 8) != 0;                                 // -1 where negative
  const IVec bits = reinterpret_cast<const IVec&>(v) | (sign & (IVec{} + INT32_MIN));
  return reinterpret_cast<const Vec&>(bits);
}

// MXFP4 where a vector has 8 lanes or more: a block's scale vector is the e2m1 magnitudes
// times its scale, lane l holding magnitude l % 8, so a code decodes as one lane shuffle and
// its sign (fp4_to_float's arithmetic took 1.9x Q4_0's time at 1-4 rows, this 1.1-1.3x on
// Zen 3; both exact: the scale is a power of two).
constexpr float kFp4Magnitudes[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
constexpr bool kFp4Shuffle = kLanes >= 8;

// The vector a block of QT scales its codes by: the scale broadcast (MXFP4: the scaled
// magnitudes, kFp4Shuffle).
template <int QT>
inline Vec scale_vec(float scale) {
  if constexpr (QT == kMxfp4 && kFp4Shuffle) {
    Vec v;
    for (int i = 0; i < kLanes; ++i) v[i] = kFp4Magnitudes[i % 8];
    return v * scale;
  } else {
    return Vec{} + scale;
  }
}

// Scale i of scales p (of kind k): f16, f32, or E8M0's 2^(e - 127) (e = 0: 2^-127).
inline float scale_at(const void* p, int64_t i, Scales k) {
  if (k == kF32) return static_cast<const float*>(p)[i];
  if (k == kF16) return half_to_float(static_cast<const uint16_t*>(p)[i]);
  const uint32_t e = static_cast<const uint8_t*>(p)[i];
  const uint32_t bits = e ? e << 23 : 0x00400000u;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
// p advanced by i scales (of kind k).
inline const void* scales_from(const void* p, int64_t i, Scales k) {
  return static_cast<const char*>(p) + i * (k == kF32 ? 4 : k == kF16 ? 2 : 1);
}
// One weight of a call, as the kernel reads it.
struct Weight {
  const uint8_t* qs;
  const void* d;          // of kind `kind`
  const void* m;
  Scales kind;
  float* out;
  int64_t N;
  int64_t row_bytes;      // bytes of qs per weight row
  int64_t scales;         // scales per weight row: ceil(K / G)
  int64_t gb;             // blocks per scale: G / 32 (1 where `halves`)
  bool halves;            // G = 16: two scales per block
  int64_t blocks;         // work items along N (weight rows kItemRows or kPanelRows each)
  int64_t items;          // blocks x the spans of x's rows
};

// Weight rows [n, n + C) of one qtype: pointers to each row's codes and scales; for kPanel the
// floats of a dequantized panel (row stride K).
template <int QT, int C>
struct Rows {
  const uint8_t* q[C];
  const void* d[C];       // each row's scales (and minima), one per gb blocks
  const void* m[C];
  const float* f[C];
  int64_t gb;             // blocks per scale (a panel: all of them)
  Scales kind;
  bool halves;            // two scales per block (G = 16, Q8_0 codes)
};

// The kLanes weights of part s of block b of one row (d, m: that block's scale and minimum).
template <int QT>
inline Vec weights(const uint8_t* q, const float* f, int64_t b, int s, Vec d, Vec m) {
  if constexpr (QT == kPanel) {
    return load(f + b * kBlock + s * kLanes);
  } else if constexpr (QT == kQ8_0) {
    return __builtin_convertvector(widen<true>(q + b * kBlock + s * kLanes), Vec) * d;
  } else if constexpr (QT == kF8) {
    return fp8_to_float(widen<false>(q + b * kBlock + s * kLanes)) * d;
  } else {
    constexpr int kHalf = kParts / 2;              // parts per nibble half
    const IVec c = widen<false>(q + b * (kBlock / 2) + (s % kHalf) * kLanes);
    const IVec i = s < kHalf ? (c & 0xF) : (c >> 4);
    if constexpr (QT == kQ4_0) return __builtin_convertvector(i - 8, Vec) * d;
    else if constexpr (QT == kMxfp4 && kFp4Shuffle) {
      const Vec mag = __builtin_shuffle(d, i);          // lane: magnitude (i mod kLanes) % 8
      const IVec bits = reinterpret_cast<const IVec&>(mag) ^ ((i & 8) << 28);
      return reinterpret_cast<const Vec&>(bits);
    } else if constexpr (QT == kMxfp4) return fp4_to_float(i) * d;
    else return __builtin_convertvector(i, Vec) * d + m;
  }
}

// out[r, n + c] = x[r] . w[n + c] for R rows of x (stride K) and C weight rows: R * C vector
// accumulators walk the K / 32 blocks, each vector of weights made once (in registers) for its
// R products, each vector of x loaded once for its C; lane_sums reduce them at the end.
// The scales broadcast once per group of w.gb blocks (or per half block: `halves`).
template <int QT, int R, int C>
void rows_q(const float* x, int64_t K, const Rows<QT, C>& w, float* out, int64_t N,
            int64_t n) {
  Vec acc[R * C];
  for (Vec& a : acc) a = Vec{};
  const int64_t blocks = K / kBlock;
  Vec d[C], m[C];
  for (int64_t b = 0; b < blocks; ++b) {
    if (!w.halves && b % w.gb == 0)
      for (int c = 0; c < C; ++c) {
        if constexpr (QT != kPanel) d[c] = scale_vec<QT>(scale_at(w.d[c], b / w.gb, w.kind));
        if constexpr (QT == kQ4_1) m[c] = Vec{} + scale_at(w.m[c], b / w.gb, w.kind);
      }
    for (int s = 0; s < kParts; ++s) {
      if constexpr (QT == kQ8_0)
        if (w.halves && s % kHalfParts == 0)
          for (int c = 0; c < C; ++c)
            d[c] = Vec{} + scale_at(w.d[c], 2 * b + s / kHalfParts, kF32);
      Vec wv[C];
      for (int c = 0; c < C; ++c) {
        wv[c] = weights<QT>(w.q[c], w.f[c], b, s, d[c], m[c]);
        in_register(wv[c]);
      }
      for (int r = 0; r < R; ++r) {
        Vec xr = load(x + r * K + b * kBlock + s * kLanes);
        in_register(xr);
        for (int c = 0; c < C; ++c) acc[r * C + c] += xr * wv[c];
      }
    }
  }
  for (int g = 0; g < R * C; g += kLanes) {
    Vec v[kLanes];
    for (int i = 0; i < kLanes; ++i) v[i] = g + i < R * C ? acc[g + i] : Vec{};
    const Vec sums = lane_sums(v);
    for (int i = 0; i < kLanes && g + i < R * C; ++i)
      out[((g + i) / C) * N + n + (g + i) % C] = sums[i];
  }
}

// All M rows of x against weight rows [n, n + C), R rows of x at a time (then fewer).
template <int QT, int C, int R = kRows>
void rows_all(const float* x, int64_t M, int64_t K, const Rows<QT, C>& w, float* out,
              int64_t N, int64_t n) {
  int64_t r = 0;
  for (; r + R <= M; r += R) rows_q<QT, R, C>(x + r * K, K, w, out + r * N, N, n);
  if constexpr (R > 1)
    if (r < M) rows_all<QT, C, R - 1>(x + r * K, M - r, K, w, out + r * N, N, n);
}

// Weight rows [n, n + C) of p: their codes and scales (QT) or their panel rows (kPanel, the
// panel's row 0 being weight row n0).
template <int QT, int C>
Rows<QT, C> rows_of(const Weight& p, int64_t K, int64_t n, const float* panel, int64_t n0) {
  Rows<QT, C> w{};
  w.gb = panel ? K / kBlock : p.gb;
  w.kind = p.kind;
  w.halves = !panel && p.halves;
  for (int c = 0; c < C; ++c) {
    w.q[c] = p.qs + (n + c) * p.row_bytes;
    w.d[c] = scales_from(p.d, (n + c) * p.scales, p.kind);
    w.m[c] = scales_from(p.m, (n + c) * p.scales, p.kind);
    w.f[c] = panel ? panel + (n + c - n0) * K : nullptr;
  }
  return w;
}

// x [M, K] against weight rows [n0, n1) of p into out [M, N], C weight rows at a time (then
// fewer); the panel's row 0 (if any) is weight row `first`.
template <int QT, int C = kCols>
void item_rows(const float* x, int64_t M, int64_t K, const Weight& p, int64_t n0, int64_t n1,
               const float* panel, int64_t first, float* out) {
  int64_t n = n0;
  for (; n + C <= n1; n += C)
    rows_all<QT, C>(x, M, K, rows_of<QT, C>(p, K, n, panel, first), out, p.N, n);
  if constexpr (C > 1)
    if (n < n1) item_rows<QT, C - 1>(x, M, K, p, n, n1, panel, first, out);
}

// panel [n1 - n0, K] = the dequantized weight rows [n0, n1) of p.
template <int QT>
void dequantize_rows(const Weight& p, int64_t K, int64_t n0, int64_t n1, float* panel) {
  const int64_t blocks = K / kBlock, gb = p.gb;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* q = p.qs + n * p.row_bytes;
    float* f = panel + (n - n0) * K;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t g = n * p.scales + b / gb;
      Vec d = scale_vec<QT>(scale_at(p.d, g, p.kind));
      const Vec m = QT == kQ4_1 ? Vec{} + scale_at(p.m, g, p.kind) : Vec{};
      for (int s = 0; s < kParts; ++s) {
        if (p.halves && s % kHalfParts == 0)
          d = Vec{} + scale_at(p.d, n * p.scales + 2 * b + s / kHalfParts, kF32);
        *reinterpret_cast<Vec*>(f + b * kBlock + s * kLanes) =
            weights<QT>(q, nullptr, b, s, d, m);
      }
    }
  }
}

// One work item: weight rows [n0, n1) of p against rows [m0, m1) of x. Few rows: in
// registers; more: the weight rows dequantized into a panel, met by the rows of x kChunkRows at
// a time (the chunk and the panel both in L2 while every pass of C panel rows walks the chunk).
template <int QT>
void item(const float* x, int64_t M, int64_t K, const Weight& p, int64_t n0, int64_t n1,
          int64_t m0, int64_t m1) {
  if (M <= kDirectRows) return item_rows<QT>(x, M, K, p, n0, n1, nullptr, n0, p.out);
  thread_local std::vector<float> panel;
  panel.resize(kPanelRows * K);
  dequantize_rows<QT>(p, K, n0, n1, panel.data());
  for (int64_t m = m0; m < m1; m += kChunkRows)
    item_rows<kPanel>(x + m * K, std::min(kChunkRows, m1 - m), K, p, n0, n1, panel.data(), n0,
                      p.out + m * p.N);
}

ffi::Error QuantMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args,
                           ffi::RemainingRets outs, int64_t qtype, int64_t group) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("quant_matmul: x must be 2-D");
  const int64_t M = xd[0], K = xd[1];
  if (K % kBlock) return ffi::Error::InvalidArgument("quant_matmul: K must be a multiple of 32");
  const bool halves = group == kBlock / 2 && qtype == kQ8_0;
  if (group <= 0 || (group % kBlock && !halves))
    return ffi::Error::InvalidArgument(
        "quant_matmul: the group must be a multiple of 32 (or 16 with Q8_0 codes)");
  const int64_t scales = (K + group - 1) / group;
  if (qtype < kQ8_0 || qtype > kMxfp4 || qtype == kPanel || (qtype == kMxfp4 && group != kBlock))
    return ffi::Error::InvalidArgument(
        "quant_matmul: qtype must be 0 (Q8_0), 1 (Q4_0), 2 (Q4_1), 3 (F8_E4M3) or 5 (MXFP4, "
        "group 32)");
  if (args.size() == 0 || args.size() != 3 * outs.size())
    return ffi::Error::InvalidArgument("quant_matmul: three arrays (qs, d, m) per output");
  const int64_t row_bytes = qtype == kQ8_0 || qtype == kF8 ? K : K / 2;
  const bool direct = M <= kDirectRows;
  const int64_t per_item = direct ? kItemRows : kPanelRows;        // weight rows per item
  const int64_t spans = direct ? 1 : (M + kSpanRows - 1) / kSpanRows;
  std::vector<Weight> weights;
  std::vector<int64_t> first_item{0};
  for (size_t j = 0; j < outs.size(); ++j) {
    auto qs = args.get<ffi::AnyBuffer>(3 * j), d = args.get<ffi::AnyBuffer>(3 * j + 1),
         m = args.get<ffi::AnyBuffer>(3 * j + 2);
    auto out = outs.get<ffi::Buffer<ffi::F32>>(j);
    if (!qs.has_value() || !d.has_value() || !m.has_value() || !out.has_value())
      return ffi::Error::InvalidArgument("quant_matmul: bad operand");
    const auto qd = qs->dimensions(), dd = d->dimensions(), md = m->dimensions();
    const auto dt = d->element_type();
    const Scales kind = dt == ffi::DataType::F32 ? kF32 : dt == ffi::DataType::U8 ? kE8M0 : kF16;
    const bool m_ok = qtype != kQ4_1 || (md.size() == 2 && md[0] == dd[0] && md[1] == dd[1] &&
                                         m->element_type() == dt);
    const bool kind_ok = (kind == kE8M0) == (qtype == kMxfp4) &&
                         (kind != kF16 || dt == ffi::DataType::F16) && (!halves || kind == kF32);
    if (qd.size() != 2 || qd[1] != row_bytes || dd.size() != 2 || dd[0] != qd[0] ||
        dd[1] != scales || !m_ok || !kind_ok)
      return ffi::Error::InvalidArgument("quant_matmul: a weight's arrays do not match x's K "
                                         "(or its scales are not f16, f32 or MXFP4's u8)");
    Weight w{static_cast<const uint8_t*>(qs->untyped_data()), d->untyped_data(),
             m->untyped_data(), kind, (*out)->typed_data(), qd[0],
             row_bytes, scales, halves ? 1 : group / kBlock, halves,
             (qd[0] + per_item - 1) / per_item, 0};
    w.items = w.blocks * spans;
    weights.push_back(w);
    first_item.push_back(first_item.back() + w.items);
  }
  const float* xp = x.typed_data();
  parallel_for(pool, first_item.back(), [&](int64_t i) {
    size_t j = 0;
    while (i >= first_item[j + 1]) ++j;
    const Weight& p = weights[j];
    const int64_t block = (i - first_item[j]) % p.blocks, span = (i - first_item[j]) / p.blocks;
    const int64_t n0 = block * per_item, n1 = std::min(p.N, n0 + per_item);
    const int64_t m0 = span * kSpanRows, m1 = std::min(M, m0 + kSpanRows);
    switch (qtype) {
      case kQ8_0: item<kQ8_0>(xp, M, K, p, n0, n1, m0, m1); break;
      case kQ4_0: item<kQ4_0>(xp, M, K, p, n0, n1, m0, m1); break;
      case kF8: item<kF8>(xp, M, K, p, n0, n1, m0, m1); break;
      case kMxfp4: item<kMxfp4>(xp, M, K, p, n0, n1, m0, m1); break;
      default: item<kQ4_1>(xp, M, K, p, n0, n1, m0, m1);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvQuantMatmul, QuantMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()     // x
                                  .RemainingArgs()                  // (qs, d, m) per weight
                                  .RemainingRets()                  // one output each
                                  .Attr<int64_t>("qtype")
                                  .Attr<int64_t>("group"));
