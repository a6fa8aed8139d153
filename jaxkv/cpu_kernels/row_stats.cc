// The sampler's per-row statistics of a step's logits (jaxkv/sample/sampler.py), as an XLA FFI
// custom call, one row per work item:
//
//   x        f32 [S, V]  logits
//   first    s32 [S]     the first index of the row's maximum (V - 1 if the row has a NaN)
//   top      f32 [S]     the row's maximum (NaN if the row has a NaN)
//   log_norm f32 [S]     log(sum(exp(x - top))): the raw logprob of token j is x[j] - top - it
//                        (NaN where top is NaN or infinite)
//
// As jaxkv.sample.sampler.first_argmax and the max and log-sum-exp around it, which XLA's CPU
// backend runs as separate passes over [S, V]; here a row is read three times while it sits in cache.

#include <cmath>
#include <cstdint>
#include <limits>

#include "common.h"

namespace ffi = xla::ffi;

namespace {

using jaxkv::IVec;
using jaxkv::kLanes;
using jaxkv::Vec;

constexpr int64_t kChunk = 256;    // terms per partial sum of the log-sum-exp

void row_stats(const float* x, int64_t V, int32_t* first, float* top, float* log_norm) {
  const int64_t body = V / kLanes * kLanes;
  float m = jaxkv::kNegInf;
  bool nan = false;
  if (body > 0) {                                    // the maximum, kLanes columns at a time
    Vec vm = *reinterpret_cast<const Vec*>(x);
    IVec bad = vm != vm;                             // lanes that met a NaN
    for (int64_t j = kLanes; j < body; j += kLanes) {
      const Vec xj = *reinterpret_cast<const Vec*>(x + j);
      vm = xj > vm ? xj : vm;
      bad |= xj != xj;
    }
    for (int c = 0; c < kLanes; ++c) {
      m = std::max(m, vm[c]);
      nan |= bad[c] != 0;
    }
  }
  for (int64_t j = body; j < V; ++j) {
    nan |= !(x[j] == x[j]);
    m = std::max(m, x[j]);
  }
  if (nan) {
    *first = static_cast<int32_t>(V - 1);
    *top = *log_norm = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  int64_t at = 0;
  while (x[at] != m) ++at;                           // the first column holding it
  *first = static_cast<int32_t>(at);
  *top = m;
  if (!std::isfinite(m)) {
    *log_norm = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  // summed in chunks: one float running over 49K terms would lose the small ones against it
  // (a sum ~4e-6 low); a chunk's terms are summed apart, then the chunks
  float sum = 0.0f;
  for (int64_t j0 = 0; j0 < V; j0 += kChunk) {
    float part = 0.0f;
    for (int64_t j = j0; j < std::min(j0 + kChunk, V); ++j)
      part += jaxkv::exp_nonpositive(x[j] - m);
    sum += part;
  }
  *log_norm = std::log(sum);
}

ffi::Error RowStatsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                        ffi::ResultBuffer<ffi::S32> first, ffi::ResultBuffer<ffi::F32> top,
                        ffi::ResultBuffer<ffi::F32> log_norm) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || xd[1] == 0)
    return ffi::Error::InvalidArgument("row_stats: x must be [S, V] with V > 0");
  const int64_t V = xd[1];
  const float* xp = x.typed_data();
  int32_t* fp = first->typed_data();
  float *tp = top->typed_data(), *lp = log_norm->typed_data();
  jaxkv::parallel_for(pool, xd[0], [=](int64_t s) {
    row_stats(xp + s * V, V, fp + s, tp + s, lp + s);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvRowStats, RowStatsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
