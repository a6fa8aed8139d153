// Shared by the kernels of jaxkv/cpu_kernels: the machine's vector type (load, lane sum and
// maximum, the lane sums of kLanes vectors at once, a vector kept in a register), -inf, an exp
// for x <= 0 (scalar and lane by lane), and a parallel loop over XLA's intra-op threads.

#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxkv {

namespace ffi = xla::ffi;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kLine = 64;     // bytes in a cache line (what a prefetch fetches)

// The machine's vector: kLanes floats, loaded and stored at any float alignment (Vec), and as
// many int32 lanes (IVec, what comparing two Vecs gives). A vector wider than the machine's
// would be split by the compiler through memory: an AVX2 build of 16-float vectors ran 13x
// slower.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;      // SSE, NEON
#endif
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float)), aligned(4), __may_alias__));
typedef int32_t IVec __attribute__((vector_size(kLanes * sizeof(int32_t))));

// A Vec from any float address, and the sum of a Vec's lanes (in lane order).
inline Vec load(const float* p) { return *reinterpret_cast<const Vec*>(p); }

inline float hsum(Vec v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// exp(r) for |r| <= ln2 / 2: Cephes' degree-6 polynomial, for a float or a Vec of them.
template <typename T>
inline T exp_reduced(T r) {
  T p = T{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// exp(x) for x <= 0 (a logit minus its row's running max), in a form the compiler vectorizes:
// Cephes' expf (x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r, times 2^n), within
// 2 ulp of std::exp; below -87 (where expf underflows) it returns ~1e-38 rather than 0.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = std::fma(n, 2.12194440e-4f, std::fma(-n, 0.693359375f, x));   // not reassociated
  const float p = exp_reduced(r);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;   // 2^n, n >= -126
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// exp_nonpositive lane by lane, for a block's logits at once: n = floor(x log2e + 1/2) is the
// truncation of that plus 128 (positive, as x >= -87) less 128, and r = x - n ln2 in one step
// (ln2 rounded to float: a relative error of at most |n| * 2e-9, 2e-7 at the bottom of the range).
inline Vec exp_nonpositive(Vec x) {
  const Vec lo = Vec{} - 87.0f;
  x = x < lo ? lo : x;
  const IVec n_plus = __builtin_convertvector(x * 1.44269504088896341f + 128.5f, IVec);
  const Vec n = __builtin_convertvector(n_plus, Vec) - 128.0f;
  const Vec p = exp_reduced(x - n * 0.693147180559945309f);
  const IVec bits = (n_plus - 1) << 23;                         // 2^n: (n + 127) << 23
  return p * reinterpret_cast<const Vec&>(bits);
}

// Keeps a loaded vector in a register for its next uses. GCC otherwise folds the load into every
// FMA that reads it (one vector of K met by four query rows: four loads), and the kernels' inner
// loops then wait on the load ports rather than on the FMAs.
inline void in_register(Vec& v) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+x"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#endif
}

// Lane masks as compile-time constants (a mask built in a loop is left to run time, and a
// shuffle by it then goes lane by lane): lane i holds (i / Half) * 2 * Half + i % Half + Offset
// (fold_index) or i ^ W (swap_index).
template <int Half, int Offset, int... L>
constexpr IVec fold_index(std::integer_sequence<int, L...>) {
  return IVec{((L / Half) * 2 * Half + L % Half + Offset)...};
}
template <int W, int... L>
constexpr IVec swap_index(std::integer_sequence<int, L...>) {
  return IVec{(L ^ W)...};
}
using Lanes = std::make_integer_sequence<int, kLanes>;

// 0, 1, ..., kLanes - 1.
constexpr IVec kLaneIndex = fold_index<kLanes, 0>(Lanes{});

// The largest lane of a Vec: every lane against the lane W away, then W / 2 away, ...
template <int W = kLanes / 2>
inline float hmax(Vec v) {
  constexpr IVec other = swap_index<W>(Lanes{});
  const Vec u = __builtin_shuffle(v, other);
  v = u > v ? u : v;
  if constexpr (W > 1) return hmax<W / 2>(v);
  else return v[0];
}

// Lane t of the result: the sum of v[t]'s lanes, for all kLanes vectors v[0 .. kLanes) at once
// (v is used as scratch). A transposing tree: each level adds the two halves of every token's
// partial sums and packs two vectors' tokens into one (v[k] from v[2k] and v[2k + 1]), so
// log2(kLanes) levels of shuffles and adds take the place of kLanes horizontal sums.
template <int Half = kLanes / 2>
inline Vec lane_sums(Vec* v) {
  constexpr IVec lo = fold_index<Half, 0>(Lanes{}), hi = fold_index<Half, Half>(Lanes{});
  for (int k = 0; k < Half; ++k)
    v[k] = __builtin_shuffle(v[2 * k], v[2 * k + 1], lo) +
           __builtin_shuffle(v[2 * k], v[2 * k + 1], hi);
  if constexpr (Half > 1) return lane_sums<Half / 2>(v);
  else return v[0];
}

// Calls fn(i) for i in [0, n) on this thread and helpers from XLA's intra-op pool. Workers
// take items from a shared counter; this thread waits only for helpers that started (a helper
// that starts later finds every item taken and touches nothing), so it never waits on a task
// still queued behind others.
template <typename Fn>
void parallel_for(ffi::ThreadPool& pool, int64_t n, Fn fn) {
  struct Work {
    std::atomic<int64_t> next{0};
    std::atomic<int> active{0};
    std::mutex mu;
    std::condition_variable idle;
  };
  auto work = std::make_shared<Work>();
  auto run = [work, n, fn] {
    for (int64_t i; (i = work->next.fetch_add(1)) < n;) fn(i);
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t t = 0; t < helpers; ++t) {
    pool.Schedule([work, run] {
      work->active.fetch_add(1);
      run();
      if (work->active.fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> lock(work->mu);
        work->idle.notify_all();
      }
    });
  }
  run();
  std::unique_lock<std::mutex> lock(work->mu);
  work->idle.wait(lock, [&] { return work->active.load() == 0; });
}

}  // namespace jaxkv
