// Paged decode attention for the rows of a CPU step, as an XLA FFI custom call.
//
// The rows of jaxkv/attention_grouped.py: the last R query tokens of each sequence (a decode
// token, or a speculative step's token and its drafts), G query heads per kv head, against
// the sequence's paged KV in a head-major float pool (jaxkv.cache.HNDPages):
//
//   q        f32 [S, Hkv, R * G, D]  row queries, already scaled (row r, head g at r * G + g)
//   k, v     f32 [N, Hkv, bs, D]     one layer's pools (block 0 is the null block)
//   tables   s32 [S, W]              physical block of each logical block (0: dropped)
//   row_pos  s32 [S, R]              kv position of each row query (-1: no query)
//   out      f32 [S, Hkv, R * G, D]  softmax(q k^T) v over positions <= row_pos, kept blocks
//   lse      f32 [S, Hkv, R * G]     log-sum-exp of the logits (-inf for a row that saw none)
//
// Each (sequence, kv head) pair walks its blocks once, in order, keeping an online softmax
// for its R * G rows, so a block's K and V are read from memory once for all of them. The
// pairs are spread over XLA's intra-op threads. With soft_cap > 0 the logits are capped as
// soft_cap * tanh(logit / soft_cap) (jaxkv.attention.cap_logits).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 (a logit minus its row's running max), in a form the compiler vectorizes:
// Cephes' expf (x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r, times 2^n), within
// 2 ulp of std::exp; below -87 (where expf underflows) it returns ~1e-38 rather than 0.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = std::fma(n, 2.12194440e-4f, std::fma(-n, 0.693359375f, x));   // not reassociated
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;   // 2^n, n >= -126
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// One (sequence, kv head): rows [RG] of queries q [RG, D] over the sequence's blocks.
void attend_pair(const float* q, const float* k, const float* v, const int32_t* table,
                 int64_t width, const int32_t* row_pos, int64_t R, int64_t G, int64_t Hkv,
                 int64_t h, int64_t bs, int64_t D, float soft_cap, float* out, float* lse) {
  const int64_t RG = R * G;
  int32_t last = -1;
  for (int64_t r = 0; r < R; ++r) last = std::max(last, row_pos[r]);
  // running max, sum, unnormalized output, a block's logits and weights: one set of buffers
  // per thread, reused by every pair it takes (not allocated per pair and layer)
  thread_local std::vector<float> m, l, acc, s, p;
  m.assign(RG, kNegInf);
  l.assign(RG, 0.0f);
  acc.assign(RG * D, 0.0f);
  s.resize(bs);
  p.resize(RG * bs);
  const int64_t blocks = last < 0 ? 0 : std::min<int64_t>(width, last / bs + 1);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t phys = table[b];
    if (phys == 0) continue;                                    // dropped or padding
    const float* kb = k + (phys * Hkv + h) * bs * D;             // [bs, D]
    const float* vb = v + (phys * Hkv + h) * bs * D;
    const int64_t first = b * bs;
    const int64_t n = std::min<int64_t>(bs, last - first + 1);   // positions up to the last row
    for (int64_t rg = 0; rg < RG; ++rg) {
      const int64_t visible = std::min<int64_t>(n, row_pos[rg / G] - first + 1);
      float* pr = p.data() + rg * bs;
      if (visible <= 0) {
        std::fill(pr, pr + bs, 0.0f);
        continue;
      }
      const float* qr = q + rg * D;
      float block_max = kNegInf;
      for (int64_t t = 0; t < visible; ++t) {
        const float* kt = kb + t * D;
        float dot = 0.0f;
        for (int64_t d = 0; d < D; ++d) dot += qr[d] * kt[d];
        if (soft_cap > 0.0f) dot = soft_cap * std::tanh(dot / soft_cap);
        s[t] = dot;
        block_max = std::max(block_max, dot);
      }
      const float m_new = std::max(m[rg], block_max);
      const float alpha = m[rg] == kNegInf ? 0.0f : exp_nonpositive(m[rg] - m_new);
      float sum = 0.0f;
      for (int64_t t = 0; t < visible; ++t) {
        pr[t] = exp_nonpositive(s[t] - m_new);
        sum += pr[t];
      }
      std::fill(pr + visible, pr + bs, 0.0f);
      l[rg] = alpha * l[rg] + sum;
      m[rg] = m_new;
      float* ar = acc.data() + rg * D;
      for (int64_t d = 0; d < D; ++d) ar[d] *= alpha;
    }
    for (int64_t t = 0; t < n; ++t) {                           // acc += p v, V read once
      const float* vt = vb + t * D;
      for (int64_t rg = 0; rg < RG; ++rg) {
        const float w = p[rg * bs + t];
        if (w == 0.0f) continue;
        float* ar = acc.data() + rg * D;
        for (int64_t d = 0; d < D; ++d) ar[d] += w * vt[d];
      }
    }
  }
  for (int64_t rg = 0; rg < RG; ++rg) {
    const bool seen = l[rg] > 0.0f;
    for (int64_t d = 0; d < D; ++d) out[rg * D + d] = seen ? acc[rg * D + d] / l[rg] : 0.0f;
    lse[rg] = seen ? m[rg] + std::log(l[rg]) : kNegInf;
  }
}

ffi::Error PagedRowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                         ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> tables,
                         ffi::Buffer<ffi::S32> row_pos, float soft_cap,
                         ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse) {
  const auto qd = q.dimensions(), kd = k.dimensions(), td = tables.dimensions(),
             pd = row_pos.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2 || pd.size() != 2)
    return ffi::Error::InvalidArgument("paged_rows: q, k, v must be 4-D, tables, row_pos 2-D");
  const int64_t S = qd[0], Hkv = qd[1], RG = qd[2], D = qd[3];
  const int64_t bs = kd[2], width = td[1], R = pd[1];
  if (kd[1] != Hkv || kd[3] != D || td[0] != S || pd[0] != S || R == 0 || RG % R != 0)
    return ffi::Error::InvalidArgument("paged_rows: inconsistent shapes");
  const int64_t G = RG / R;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const int32_t *tp = tables.typed_data(), *pp = row_pos.typed_data();
  float *op = out->typed_data(), *lp = lse->typed_data();
  const int64_t pairs = S * Hkv;
  // Workers take (sequence, kv head) pairs from a shared counter: this thread, and helpers on
  // XLA's intra-op pool. This thread waits only for helpers that started (a helper that starts
  // later finds every pair taken and touches nothing), so it never waits on a queued task.
  struct Work {
    std::atomic<int64_t> next{0};
    std::atomic<int> active{0};
    std::mutex mu;
    std::condition_variable idle;
  };
  auto work = std::make_shared<Work>();
  auto run = [=] {
    for (int64_t i; (i = work->next.fetch_add(1)) < pairs;) {
      const int64_t s = i / Hkv, h = i % Hkv;
      attend_pair(qp + i * RG * D, kp, vp, tp + s * width, width, pp + s * R, R, G, Hkv, h,
                  bs, D, soft_cap, op + i * RG * D, lp + i * RG);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), pairs) - 1;
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
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvPagedRows, PagedRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
