// Matrix products of a few rows (a decode step's activations) with a weight, as an XLA FFI
// custom call (jaxkv/model/linear.py):
//
//   x    f32 [M, K]       a few rows (M small: decode tokens, sampled rows)
//   w_j  f32 [K, N_j]     one or more weights, row-major (transposed_w = false), or
//        f32 [N_j, K]     their transposes (transposed_w = true: the tied lm_head, the embedding)
//   out_j f32 [M, N_j]    x @ w_j (x @ w_j^T with transposed_w), one output per weight
//
// Several weights that multiply the same x (a layer's q, k and v; gate and up) go in one call,
// whose work items cover them all.
//
// With few rows the product is a stream over the weight: XLA's and torch's GEMMs reach only
// 23-26 GFLOP/s at 8 rows on a 2-core AVX2 EPYC, a fifth of what they reach at 512 rows, while
// reading the weight once per step is the real cost. Here each work item owns a block of the
// weight and reads it once from memory:
//
//   w [K, N], up to kSliceRows rows of x (the product streams the weight): a slice of
//              consecutive rows k0 .. k1 (one contiguous run of the weight), read in column
//              chunks whose partial sums for all M rows take 8 KB of L1 (32 KB chunks, the
//              whole L1 at 8 rows, were 5-20% slower), four weight rows at a time;
//              each slice's partial products [M, N] go to a buffer, and a second pass adds a
//              weight's slices up. Slicing by rows rather than by columns took a standalone
//              stream of 8 rows over 60 weights of [576, 1536] from 11.6 to 18-20 GB/s on the
//              2-core EPYC (the machine reads 26 GB/s), and a decode step of 8 sequences from
//              64-68 to 47-51 ms;
//   w [K, N], more rows (the FMAs, not the stream, the limit; slices were 3-8% slower at 16
//              and 32 rows): a block of 64-256 columns walked down the K rows four at a time,
//              into the partial sums of all M rows in a per-thread buffer [M, cols] in L1;
//   both:      two rows of x per register block, their four broadcasts held in registers
//              (bench/experiments/dot_throughput.py: a strip of two vectors walked down K, one cache line
//              per row 6 KB apart, was slower than XLA);
//   w [N, K]:  three weight rows at a time, each a run of K floats, against kRows rows of x at
//              a time, the rows a pass ahead prefetched.
//
// The work items (of every weight of the call) are shared out over XLA's intra-op threads.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"

namespace ffi = xla::ffi;
using jaxkv::in_register;
using jaxkv::kLanes;
using jaxkv::kLine;
using jaxkv::lane_sums;
using jaxkv::load;
using jaxkv::parallel_for;
using jaxkv::Vec;

namespace {

constexpr int kRows = 4;                  // rows of x per pass over a block of w [N, K]
constexpr int kCols = 3;                  // rows of w [N, K] per pass
constexpr int64_t kAheadRows = kCols;     // rows of w [N, K] between a pass and its prefetch
constexpr int64_t kLineFloats = kLine / sizeof(float);   // floats in a cache line
constexpr int64_t kItemCols = 64;         // rows of w [N, K] per work item
constexpr int kPassRows = 4;              // rows of w [K, N] per pass
constexpr int64_t kChunkFloats = 2048;    // a slice's partial sums per column chunk (8 KB)
constexpr int64_t kSliceRows = 8;         // rows of x up to which w [K, N] is cut in slices

// acc[r, 0 .. cols) += x[r, k .. k + KB) @ w[k .. k + KB, n0 .. n0 + cols) for two rows of x
// (R = 2, or 1 for an odd last row) and KB (kPassRows, or 1 in the tail) rows of w [K, N]: the
// KB weight rows' vectors are loaded once per row pair, each row's KB broadcasts held in
// registers. Meanwhile the first `fetch` rows of the next pass (k + kPassRows on) are prefetched
// over the same columns (non-temporal), a line of each per line of this pass, by every row pair:
// with the hardware prefetcher alone the stream waited on memory (8 rows of x from memory,
// with 8 KB chunks: [576, 1536] 16.3 -> 18.8 GB/s, [1536, 576] 13.4 -> 17.4 GB/s; prefetching
// two passes ahead, or from the first row pair only, measured slower; session 31).
template <int R, int KB>
inline void panel_nn(const float* x, int64_t K, const float* w, int64_t N, int64_t k,
                     int64_t n0, int64_t cols, float* acc, int64_t acc_stride, int64_t fetch) {
  Vec xb[R][KB];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < KB; ++i) xb[r][i] = Vec{} + x[r * K + k + i];
  for (int64_t c = 0; c < cols; c += kLanes) {
    if (c % kLineFloats == 0)
      for (int64_t i = 0; i < fetch; ++i)
        __builtin_prefetch(w + (k + kPassRows + i) * N + n0 + c, 0, 0);
    Vec wv[KB];
    for (int i = 0; i < KB; ++i) wv[i] = load(w + (k + i) * N + n0 + c);
    for (int r = 0; r < R; ++r) {
      Vec a = load(acc + r * acc_stride + c);
      for (int i = 0; i < KB; ++i) a += xb[r][i] * wv[i];
      *reinterpret_cast<Vec*>(acc + r * acc_stride + c) = a;
    }
  }
}

// acc[0 .. M, 0 .. cols) += x[:, k0 .. k1) @ w[k0 .. k1, n0 .. n0 + cols) (w [K, N], cols a
// multiple of kLanes, acc's rows acc_stride floats apart): the weight's rows four at a time
// (then one by one), each met by the rows of x in pairs (and an odd last row alone).
void accumulate_nn(const float* x, int64_t M, int64_t K, const float* w, int64_t N, int64_t k0,
                   int64_t k1, int64_t n0, int64_t cols, float* acc, int64_t acc_stride) {
  auto pass = [&](auto kb_tag, int64_t k) {
    constexpr int KB = decltype(kb_tag)::value;
    const int64_t fetch = std::clamp<int64_t>(k1 - k - kPassRows, 0, kPassRows);
    int64_t m = 0;
    for (; m + 2 <= M; m += 2)
      panel_nn<2, KB>(x + m * K, K, w, N, k, n0, cols, acc + m * acc_stride, acc_stride, fetch);
    if (m < M)
      panel_nn<1, KB>(x + m * K, K, w, N, k, n0, cols, acc + m * acc_stride, acc_stride, fetch);
  };
  int64_t k = k0;
  for (; k + kPassRows <= k1; k += kPassRows) pass(std::integral_constant<int, kPassRows>{}, k);
  for (; k < k1; ++k) pass(std::integral_constant<int, 1>{}, k);
}

// out[0 .. M, n0 .. n0 + cols) = x @ w[:, n0 .. n0 + cols) (w [K, N], cols a multiple of
// kLanes): w is read row by row, each row's run of cols floats once, into partial sums of all
// M rows kept in a per-thread buffer [M, cols] (in L1 for M <= 16 and cols <= 256).
void columns_nn(const float* x, int64_t M, int64_t K, const float* w, int64_t N, int64_t n0,
                int64_t cols, float* out) {
  thread_local std::vector<float> acc;
  acc.assign(M * cols, 0.0f);
  accumulate_nn(x, M, K, w, N, 0, K, n0, cols, acc.data(), cols);
  for (int64_t m = 0; m < M; ++m)
    std::memcpy(out + m * N + n0, acc.data() + m * cols, cols * sizeof(float));
}

// part[0 .. M, 0 .. cols) = x[:, k0 .. k1) @ w[k0 .. k1, 0 .. cols) (w [K, N], cols a multiple
// of kLanes): the slice's rows are read one column chunk at a time, the chunk's partial sums of
// all M rows (at most kChunkFloats of them) staying in L1 while its rows go by.
void slice_nn(const float* x, int64_t M, int64_t K, const float* w, int64_t N, int64_t k0,
              int64_t k1, int64_t cols, float* part) {
  std::fill(part, part + M * cols, 0.0f);
  const int64_t chunk = std::clamp<int64_t>(kChunkFloats / M / kLanes * kLanes, kLanes, cols);
  for (int64_t c0 = 0; c0 < cols; c0 += chunk)
    accumulate_nn(x, M, K, w, N, k0, k1, c0, std::min(chunk, cols - c0), part + c0, cols);
}

// out[r, n] = x[r] @ w[:, n] for every row of x and one column n (the columns past the vectors).
void column_nn(const float* x, int64_t M, int64_t K, const float* w, int64_t N, int64_t n,
               float* out) {
  for (int64_t m = 0; m < M; ++m) {
    float s = 0.0f;
    for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * w[k * N + n];
    out[m * N + n] = s;
  }
}

// out[r, n .. n + C) = x[r] . w[n + c] for R rows of x and C rows of w [N, K]: R * C
// accumulators walk the K floats, each vector of x and of w loaded once (pinned in a register)
// for its C or R products; then transposing trees (lane_sums) reduce them, kLanes at a time.
// Four rows by three (twelve chains, enough to cover the FMAs' latency) measured 84 GFLOP/s
// on one core of the 2-core EPYC from cache, against 42 for the same product with four by two
// and the loads folded into the FMAs (a scratch harness, session 31).
// While it computes, the next pass's C weight rows are prefetched (non-temporal), a line of
// each per line of the current ones: the weight is one linear stream, yet with the hardware
// prefetcher alone the product waited on memory (the tied head at 8 rows: 12.7 -> 20-21 GB/s;
// two passes ahead, or once per block of x's rows, measured slower).
template <int R, int C>
void rows_nt(const float* x, int64_t K, const float* w, int64_t N, int64_t n, float* out) {
  Vec acc[R * C];
  for (Vec& a : acc) a = Vec{};
  const float* wn = w + n * K;
  const int64_t ahead = std::min<int64_t>(C, N - n - kAheadRows);   // rows left to prefetch
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    if (k % kLineFloats == 0)
      for (int c = 0; c < ahead; ++c) __builtin_prefetch(wn + (kAheadRows + c) * K + k, 0, 0);
    Vec wc[C];
    for (int c = 0; c < C; ++c) {
      wc[c] = load(wn + c * K + k);
      in_register(wc[c]);
    }
    for (int r = 0; r < R; ++r) {
      Vec xr = load(x + r * K + k);
      in_register(xr);
      for (int c = 0; c < C; ++c) acc[r * C + c] += xr * wc[c];
    }
  }
  for (int g = 0; g < R * C; g += kLanes) {
    Vec v[kLanes];
    for (int i = 0; i < kLanes; ++i) v[i] = g + i < R * C ? acc[g + i] : Vec{};
    const Vec sums = lane_sums(v);
    for (int i = 0; i < kLanes && g + i < R * C; ++i) {
      const int r = (g + i) / C, c = (g + i) % C;
      float s = sums[i];
      for (int64_t t = k; t < K; ++t) s += x[r * K + t] * wn[c * K + t];   // K's tail
      out[r * N + n + c] = s;
    }
  }
}

using RowsFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*);
template <int C>
constexpr RowsFn kRowsOf[kRows + 1] = {nullptr, rows_nt<1, C>, rows_nt<2, C>, rows_nt<3, C>,
                                       rows_nt<4, C>};
constexpr const RowsFn* kRowsNT[kCols + 1] = {nullptr, kRowsOf<1>, kRowsOf<2>, kRowsOf<3>};

// All M rows of x against rows [n0, n1) of w [N, K]: kCols weight rows
// at a time, met by every group of kRows rows of x while they are in L1 (the weight is read
// from memory once).
void block_nt(const float* x, int64_t M, int64_t K, const float* w, int64_t N, int64_t n0,
              int64_t n1, float* out) {
  for (int64_t n = n0; n < n1; n += kCols) {
    const int64_t C = std::min<int64_t>(kCols, n1 - n);
    for (int64_t m = 0; m < M; m += kRows)
      kRowsNT[C][std::min<int64_t>(kRows, M - m)](x + m * K, K, w, N, n, out + m * N);
  }
}

// The work of one weight of a call: x [M, K] @ w, into out [M, N].
struct Product {
  const float* w;
  float* out;
  int64_t N;
  int64_t rows;       // weight rows per item (a slice of w [K, N], a block of w [N, K]), or
                      // columns per item (w [K, N] in column blocks)
  int64_t vec_cols;   // w [K, N]: the columns the items cover (a multiple of kLanes)
  int64_t items;
  float* parts;       // w [K, N]: the slices' partial products [items, M, vec_cols]
};

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws,
                      ffi::RemainingRets outs, bool transposed_w) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("matmul: x must be 2-D");
  if (ws.size() == 0 || ws.size() != outs.size())
    return ffi::Error::InvalidArgument("matmul: one output per weight, at least one weight");
  const int64_t M = xd[0], K = xd[1];
  const float* xp = x.typed_data();
  // few rows: the product streams the weight, and contiguous slices of it stream fastest; more
  // rows (the FMAs, not the stream, the limit): column blocks, whose sums need no second pass
  const bool sliced = !transposed_w && M <= kSliceRows;
  std::vector<Product> products;
  std::vector<int64_t> first_item{0};          // products[j]'s items start at first_item[j]
  for (size_t j = 0; j < ws.size(); ++j) {
    auto w = ws.get<ffi::Buffer<ffi::F32>>(j);
    auto out = outs.get<ffi::Buffer<ffi::F32>>(j);
    if (!w.has_value() || !out.has_value())
      return ffi::Error::InvalidArgument("matmul: weights and outputs must be f32");
    const auto wd = w->dimensions();
    if (wd.size() != 2 || (transposed_w ? wd[1] : wd[0]) != K)
      return ffi::Error::InvalidArgument("matmul: x's columns and w's contracted axis differ");
    Product p{w->typed_data(), (*out)->typed_data(), transposed_w ? wd[0] : wd[1], 0, 0, 0,
              nullptr};
    if (transposed_w) {                                 // items of kItemCols weight rows
      p.rows = kItemCols;
      p.items = (p.N + kItemCols - 1) / kItemCols;
    } else if (sliced) {
      // slices of rows, two per thread (a slice of a [576, 1536] weight: 144 rows, 884 KB),
      // a multiple of four rows each
      p.vec_cols = p.N / kLanes * kLanes;
      const int64_t slices = 2 * pool.num_threads();
      p.rows = std::max<int64_t>(16, ((K + slices - 1) / slices + 3) / 4 * 4);
      p.items = p.vec_cols ? (K + p.rows - 1) / p.rows : 0;
    } else {
      // blocks of columns: a few per thread, each a run of at least 64 and at most 256 floats
      // per weight row, so the row-to-row jumps stay few and the partial sums stay in L1
      p.vec_cols = p.N / kLanes * kLanes;
      const int64_t want = (p.vec_cols / (2 * pool.num_threads()) + kLanes - 1) / kLanes * kLanes;
      p.rows = std::clamp<int64_t>(want, std::min<int64_t>(64, p.vec_cols), 256);
      p.items = p.rows ? (p.vec_cols + p.rows - 1) / p.rows : 0;
    }
    products.push_back(p);
    first_item.push_back(first_item.back() + p.items);
  }
  // the slices' partial products: one buffer of the calling thread, reused call after call
  thread_local std::vector<float> parts;
  if (sliced) {
    std::vector<size_t> at{0};                 // products[j]'s partial products start at at[j]
    for (const Product& p : products) at.push_back(at.back() + p.items * M * p.vec_cols);
    if (parts.size() < at.back()) parts.resize(at.back());
    for (size_t j = 0; j < products.size(); ++j) products[j].parts = parts.data() + at[j];
  }
  // one pool of items over every weight: the products of one call (q, k and v; gate and up)
  // share the threads' start-up and fill each other's idle tails
  parallel_for(pool, first_item.back(), [&](int64_t item) {
    size_t j = 0;
    while (item >= first_item[j + 1]) ++j;
    const Product& p = products[j];
    const int64_t i = item - first_item[j];
    if (transposed_w) {
      const int64_t n0 = i * p.rows;
      block_nt(xp, M, K, p.w, p.N, n0, std::min(p.N, n0 + p.rows), p.out);
    } else if (sliced) {
      slice_nn(xp, M, K, p.w, p.N, i * p.rows, std::min(K, (i + 1) * p.rows), p.vec_cols,
               p.parts + i * M * p.vec_cols);
    } else {
      const int64_t n0 = i * p.rows;
      columns_nn(xp, M, K, p.w, p.N, n0, std::min(p.rows, p.vec_cols - n0), p.out);
    }
  });
  if (transposed_w) return ffi::Error::Success();
  if (sliced) {
    // out = the sum of each weight's slices, one row of one weight's out per item
    parallel_for(pool, static_cast<int64_t>(products.size()) * M, [&](int64_t item) {
      const Product& p = products[item / M];
      const int64_t m = item % M, stride = M * p.vec_cols;
      float* o = p.out + m * p.N;
      const float* part = p.parts + m * p.vec_cols;
      std::copy(part, part + p.vec_cols, o);
      for (int64_t i = 1; i < p.items; ++i)
        for (int64_t c = 0; c < p.vec_cols; c += kLanes)
          *reinterpret_cast<Vec*>(o + c) = load(o + c) + load(part + i * stride + c);
    });
  }
  for (const Product& p : products)                  // the columns past the vectors
    for (int64_t n = p.vec_cols; n < p.N; ++n) column_nn(xp, M, K, p.w, p.N, n, p.out);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()     // x
                                  .RemainingArgs()                  // the weights
                                  .RemainingRets()                  // one output each
                                  .Attr<bool>("transposed_w"));
