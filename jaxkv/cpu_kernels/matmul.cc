// Matrix products of a few rows (a decode step's activations) with a weight, as an XLA FFI
// custom call (jaxkv/model/linear.py):
//
//   x    f32 [M, K]       a few rows (M small: decode tokens, sampled rows)
//   w    f32 [K, N]       the weight, row-major (transposed_w = false), or
//        f32 [N, K]       its transpose (transposed_w = true: the tied lm_head, the embedding)
//   out  f32 [M, N]       x @ w (x @ w^T with transposed_w)
//
// With few rows the product is a stream over the weight: XLA's and torch's GEMMs reach only
// 23-26 GFLOP/s at 8 rows on a 2-core AVX2 EPYC, a fifth of what they reach at 512 rows, while
// reading the weight once per step is the real cost. Here each work item owns a block of the
// weight and reads it once from memory:
//
//   w [K, N]:  a block of 64-256 columns, walked down the K rows four at a time (each row a
//              contiguous run), into the partial sums of all M rows kept in a per-thread
//              buffer [M, cols] that stays in L1; two rows of x per register block, their
//              four broadcasts held in registers (bench/dot_throughput.py: a strip of two
//              vectors walked down K, one cache line per row 6 KB apart, was slower than XLA);
//   w [N, K]:  two weight rows at a time, each a run of K floats, against kRows rows of x.
//
// The work items are shared out over XLA's intra-op threads.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"

namespace ffi = xla::ffi;
using jaxkv::kLanes;
using jaxkv::parallel_for;
using jaxkv::Vec;

namespace {

constexpr int kRows = 4;                  // rows of x per pass over a block of w [N, K]
constexpr int64_t kItemCols = 64;         // rows of w [N, K] per work item

inline Vec load(const float* p) { return *reinterpret_cast<const Vec*>(p); }

inline float hsum(Vec v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// acc[r, 0 .. cols) += x[r, k .. k + KB) @ w[k .. k + KB, n0 .. n0 + cols) for two rows of x
// (R = 2, or 1 for an odd last row) and KB (4, or 1 in the tail) rows of w [K, N]: the KB weight
// rows' vectors are loaded once per row pair, each row's KB broadcasts held in registers.
template <int R, int KB>
inline void panel_nn(const float* x, int64_t K, const float* w, int64_t N, int64_t k,
                     int64_t n0, int64_t cols, float* acc) {
  Vec xb[R][KB];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < KB; ++i) xb[r][i] = Vec{} + x[r * K + k + i];
  for (int64_t c = 0; c < cols; c += kLanes) {
    Vec wv[KB];
    for (int i = 0; i < KB; ++i) wv[i] = load(w + (k + i) * N + n0 + c);
    for (int r = 0; r < R; ++r) {
      Vec a = load(acc + r * cols + c);
      for (int i = 0; i < KB; ++i) a += xb[r][i] * wv[i];
      *reinterpret_cast<Vec*>(acc + r * cols + c) = a;
    }
  }
}

// out[0 .. M, n0 .. n0 + cols) = x @ w[:, n0 .. n0 + cols) (w [K, N], cols a multiple of
// kLanes): w is read row by row, each row's run of cols floats once, into partial sums of all
// M rows kept in a per-thread buffer [M, cols] (in L1 for M <= 16 and cols <= 256).
void columns_nn(const float* x, int64_t M, int64_t K, const float* w, int64_t N, int64_t n0,
                int64_t cols, float* out) {
  thread_local std::vector<float> acc;
  acc.assign(M * cols, 0.0f);
  auto rows = [&](auto r_tag, auto kb_tag, int64_t k) {
    constexpr int R = decltype(r_tag)::value, KB = decltype(kb_tag)::value;
    for (int64_t m = 0; m + R <= M; m += 2)
      panel_nn<R, KB>(x + m * K, K, w, N, k, n0, cols, acc.data() + m * cols);
  };
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  using Four = std::integral_constant<int, 4>;
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    rows(Two{}, Four{}, k);
    if (M % 2) panel_nn<1, 4>(x + (M - 1) * K, K, w, N, k, n0, cols, acc.data() + (M - 1) * cols);
  }
  for (; k < K; ++k) {
    rows(Two{}, One{}, k);
    if (M % 2) panel_nn<1, 1>(x + (M - 1) * K, K, w, N, k, n0, cols, acc.data() + (M - 1) * cols);
  }
  for (int64_t m = 0; m < M; ++m)
    std::memcpy(out + m * N + n0, acc.data() + m * cols, cols * sizeof(float));
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

// out[r, n .. n + C) = x[r] . w[n + c] for R rows of x and C (1 or 2) rows of w [N, K].
template <int R, int C>
void rows_nt(const float* x, int64_t K, const float* w, int64_t N, int64_t n, float* out) {
  Vec acc[R][C] = {};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    Vec wc[C];
    for (int c = 0; c < C; ++c) wc[c] = load(w + (n + c) * K + k);
    for (int r = 0; r < R; ++r) {
      const Vec xr = load(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] += xr * wc[c];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float s = hsum(acc[r][c]);
      for (int64_t t = k; t < K; ++t) s += x[r * K + t] * w[(n + c) * K + t];
      out[r * N + n + c] = s;
    }
  }
}

// Rows m0 .. m0 + R of x against rows [n0, n1) of w [N, K].
template <int R>
void block_nt(const float* x, int64_t K, const float* w, int64_t N, int64_t n0, int64_t n1,
              float* out) {
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) rows_nt<R, 2>(x, K, w, N, n, out);
  if (n < n1) rows_nt<R, 1>(x, K, w, N, n, out);
}

using BlockFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, float*);
constexpr BlockFn kBlocksNT[kRows + 1] = {nullptr, block_nt<1>, block_nt<2>, block_nt<3>,
                                          block_nt<4>};

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      bool transposed_w, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2)
    return ffi::Error::InvalidArgument("matmul: x and w must be 2-D");
  const int64_t M = xd[0], K = xd[1], N = transposed_w ? wd[0] : wd[1];
  if ((transposed_w ? wd[1] : wd[0]) != K)
    return ffi::Error::InvalidArgument("matmul: x's columns and w's contracted axis differ");
  const float *xp = x.typed_data(), *wp = w.typed_data();
  float* op = out->typed_data();
  if (transposed_w) {                                   // items of kItemCols weight rows
    const int64_t items = (N + kItemCols - 1) / kItemCols;
    parallel_for(pool, items, [=](int64_t i) {
      const int64_t n0 = i * kItemCols, n1 = std::min(N, n0 + kItemCols);
      for (int64_t m = 0; m < M; m += kRows) {
        const int64_t R = std::min<int64_t>(kRows, M - m);
        kBlocksNT[R](xp + m * K, K, wp, N, n0, n1, op + m * N);
      }
    });
    return ffi::Error::Success();
  }
  // items of columns: a few per thread, each a run of at least 64 and at most 256 floats per
  // weight row, so the row-to-row jumps stay few and the partial sums stay in L1
  const int64_t vec_cols = N / kLanes * kLanes;
  const int64_t want = (vec_cols / (2 * pool.num_threads()) + kLanes - 1) / kLanes * kLanes;
  const int64_t cols = std::clamp<int64_t>(want, std::min<int64_t>(64, vec_cols), 256);
  const int64_t items = cols ? (vec_cols + cols - 1) / cols : 0;
  parallel_for(pool, items, [=](int64_t i) {
    const int64_t n0 = i * cols;
    columns_nn(xp, M, K, wp, N, n0, std::min(cols, vec_cols - n0), op);
  });
  for (int64_t n = vec_cols; n < N; ++n) column_nn(xp, M, K, wp, N, n, op);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()     // x
                                  .Arg<ffi::Buffer<ffi::F32>>()     // w
                                  .Attr<bool>("transposed_w")
                                  .Ret<ffi::Buffer<ffi::F32>>());
