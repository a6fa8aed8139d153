// Paged attention for the CPU path (jaxkv/attention_grouped.py), as XLA FFI custom calls over
// head-major float pools (jaxkv.cache.HNDPages), one layer per call.
//
// JaxkvPagedRows: the rows, the last R query tokens of each sequence (a decode token, or a
// speculative step's token and its drafts), G query heads per kv head:
//
//   q        f32 [S, Hkv, R * G, D]  row queries, already scaled (row r, head g at r * G + g)
//   k, v     f32 [N, Hkv, bs, D]     one layer's pools (block 0 is the null block)
//   tables   s32 [S, W]              physical block of each logical block (0: dropped)
//   row_pos  s32 [S, R]              kv position of each row query (-1: no query)
//   out      f32 [S, Hkv, R * G, D]  softmax(q k^T) v over positions <= row_pos, kept blocks
//   lse      f32 [S, Hkv, R * G]     log-sum-exp of the logits (-inf for a row that saw none)
//
// Each sequence walks its blocks once, in order, keeping an online softmax for the R * G rows
// of each kv head, so a block's K and V are read from memory once for all of them.
//
// JaxkvPagedTiles: the tiles, the first body[s] query tokens of each sequence s in the step's
// flat token layout (a prefill chunk's tokens before its last), causal over the sequence's
// kept blocks (bs == 16, D == 64 or 128):
//
//   q        f32 [T, Hkv, G, D]      every token's queries, already scaled
//   k, v, tables                     as above
//   qsl      s32 [S + 1]             first token of each sequence in q
//   seq_lens s32 [S]                 kv length of each sequence (its last token's position + 1)
//   body     s32 [S]                 leading tokens of each sequence computed here
//   out      f32 [T, Hkv, G, D]      (0 for tokens not computed here)
//   lse      f32 [T, Hkv, G]         (-inf for tokens not computed here)
//
// A work item is one kv head of kTileTokens consecutive tokens of one sequence: its K blocks
// are transposed once into [D, bs] so that kGroup query rows at a time (8 with AVX-512, 4
// without) score a whole block with bs-wide vector FMAs, and P V runs as kGroup rows of D-wide
// FMAs per key.
//
// Both spread their work items over XLA's intra-op threads. With soft_cap > 0 the logits are
// capped as soft_cap * tanh(logit / soft_cap) (jaxkv.attention.cap_logits).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

namespace ffi = xla::ffi;
using jaxkv::exp_nonpositive;
using jaxkv::kLanes;
using jaxkv::kNegInf;
using jaxkv::parallel_for;
using jaxkv::Vec;

namespace {

// One sequence's kv heads h0 .. h1 - 1: rows [RG] of queries q [h1 - h0, RG, D] per head over
// the sequence's blocks. Blocks are the outer loop and heads the inner one, so a block's K (then
// its V) is read as one run of (h1 - h0) * bs * D floats: the hardware prefetcher follows a run
// that long, and a sequence's blocks are mostly consecutive in the pool (a 64-sequence decode
// step of ~400-token rows: 26 GB/s over two threads against 13-14 GB/s a head at a time).
void attend_heads(const float* q, const float* k, const float* v, const int32_t* table,
                  int64_t width, const int32_t* row_pos, int64_t R, int64_t G, int64_t Hkv,
                  int64_t h0, int64_t h1, int64_t bs, int64_t D, float soft_cap, float* out,
                  float* lse) {
  const int64_t RG = R * G, HRG = (h1 - h0) * RG;
  int32_t last = -1;
  for (int64_t r = 0; r < R; ++r) last = std::max(last, row_pos[r]);
  // running max, sum, unnormalized output of every (head, row), a block's logits and weights:
  // one set of buffers per thread, reused by every item it takes (not allocated per call)
  thread_local std::vector<float> m, l, acc, s, p;
  m.assign(HRG, kNegInf);
  l.assign(HRG, 0.0f);
  acc.assign(HRG * D, 0.0f);
  s.resize(bs);
  p.resize(RG * bs);
  const int64_t blocks = last < 0 ? 0 : std::min<int64_t>(width, last / bs + 1);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t phys = table[b];
    if (phys == 0) continue;                                    // dropped or padding
    const int64_t first = b * bs;
    const int64_t n = std::min<int64_t>(bs, last - first + 1);   // positions up to the last row
    for (int64_t h = h0; h < h1; ++h) {
      const float* kb = k + (phys * Hkv + h) * bs * D;           // [bs, D]
      const float* vb = v + (phys * Hkv + h) * bs * D;
      const int64_t hr = (h - h0) * RG;                          // this head's first row
      for (int64_t rg = 0; rg < RG; ++rg) {
        const int64_t visible = std::min<int64_t>(n, row_pos[rg / G] - first + 1);
        float* pr = p.data() + rg * bs;
        if (visible <= 0) {
          std::fill(pr, pr + bs, 0.0f);
          continue;
        }
        const float* qr = q + (hr + rg) * D;
        float block_max = kNegInf;
        for (int64_t t = 0; t < visible; ++t) {
          const float* kt = kb + t * D;
          float dot = 0.0f;
          for (int64_t d = 0; d < D; ++d) dot += qr[d] * kt[d];
          if (soft_cap > 0.0f) dot = soft_cap * std::tanh(dot / soft_cap);
          s[t] = dot;
          block_max = std::max(block_max, dot);
        }
        float& mr = m[hr + rg];
        const float m_new = std::max(mr, block_max);
        const float alpha = mr == kNegInf ? 0.0f : exp_nonpositive(mr - m_new);
        float sum = 0.0f;
        for (int64_t t = 0; t < visible; ++t) {
          pr[t] = exp_nonpositive(s[t] - m_new);
          sum += pr[t];
        }
        std::fill(pr + visible, pr + bs, 0.0f);
        l[hr + rg] = alpha * l[hr + rg] + sum;
        mr = m_new;
        float* ar = acc.data() + (hr + rg) * D;
        for (int64_t d = 0; d < D; ++d) ar[d] *= alpha;
      }
      for (int64_t t = 0; t < n; ++t) {                         // acc += p v, V read once
        const float* vt = vb + t * D;
        for (int64_t rg = 0; rg < RG; ++rg) {
          const float w = p[rg * bs + t];
          if (w == 0.0f) continue;
          float* ar = acc.data() + (hr + rg) * D;
          for (int64_t d = 0; d < D; ++d) ar[d] += w * vt[d];
        }
      }
    }
  }
  for (int64_t r = 0; r < HRG; ++r) {
    const bool seen = l[r] > 0.0f;
    for (int64_t d = 0; d < D; ++d) out[r * D + d] = seen ? acc[r * D + d] / l[r] : 0.0f;
    lse[r] = seen ? m[r] + std::log(l[r]) : kNegInf;
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
  // a work item is one sequence's kv heads, all of them where there are enough sequences to
  // keep every thread busy, else one (a batch of one or two long rows still uses every thread)
  const int64_t heads = S >= 4 * pool.num_threads() ? Hkv : 1;
  parallel_for(pool, S * Hkv / heads, [=](int64_t i) {
    const int64_t s = i * heads / Hkv, h0 = i * heads % Hkv, at = s * Hkv + h0;
    attend_heads(qp + at * RG * D, kp, vp, tp + s * width, width, pp + s * R, R, G, Hkv, h0,
                 h0 + heads, bs, D, soft_cap, op + at * RG * D, lp + at * RG);
  });
  return ffi::Error::Success();
}

// ---- tiles --------------------------------------------------------------------------------

constexpr int kBlock = 16;         // kv positions per block
constexpr int kTileTokens = 32;    // query tokens per work item

// Query rows scored together: as many as keep their logits and outputs in the machine's vector
// registers (AVX-512: 32 registers of 16 floats; AVX: 16 of 8; SSE, NEON: 4 floats).
constexpr int kGroup = kLanes == 16 ? 8 : 4;
constexpr int kBlockVecs = kBlock / kLanes;   // vectors per block of logits

// One kv head of ntok consecutive query tokens of one sequence, at kv positions pos0 ..
// pos0 + ntok - 1, G query rows each (row r = token r / G, head r % G), over the sequence's
// blocks up to the last token's position. q: the first token's [Hkv, G, D] queries, token
// stride q_stride floats (out alike); lse: token stride lse_stride.
template <int D>
void attend_tile(const float* q, int64_t q_stride, int64_t ntok, int64_t pos0, int64_t G,
                 const float* k, const float* v, const int32_t* table, int64_t Hkv, int64_t h,
                 float soft_cap, float* out, float* lse, int64_t lse_stride) {
  constexpr int NV = D / kLanes;                                // vectors per row of D
  const int64_t rows = ntok * G, padded = (rows + kGroup - 1) / kGroup * kGroup;
  // this item's queries [padded, D] (padding rows zero), running max, sum and output
  thread_local std::vector<float> Q, m, l, acc;
  thread_local std::vector<int32_t> pos;
  Q.assign(padded * D, 0.0f);
  m.assign(padded, kNegInf);
  l.assign(padded, 0.0f);
  acc.assign(padded * D, 0.0f);
  pos.assign(padded, -1);                                       // -1: a padding row
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(&Q[r * D], q + (r / G) * q_stride + (h * G + r % G) * D, D * sizeof(float));
    pos[r] = static_cast<int32_t>(pos0 + r / G);
  }
  alignas(64) float kT[D * kBlock];                             // a K block, [D, kBlock]
  const int64_t last = pos0 + ntok - 1;
  for (int64_t b = 0; b <= last / kBlock; ++b) {
    const int64_t phys = table[b];
    if (phys == 0) continue;                                    // dropped
    const float* kb = k + (phys * Hkv + h) * kBlock * D;        // [kBlock, D]
    const float* vb = v + (phys * Hkv + h) * kBlock * D;
    for (int j = 0; j < kBlock; ++j)
      for (int d = 0; d < D; ++d) kT[d * kBlock + j] = kb[j * D + d];
    const int64_t first = b * kBlock;
    // rows before the block's first position see none of it: start at the first that does
    const int64_t r0 = std::max<int64_t>(0, first - pos0) * G / kGroup * kGroup;
    for (int64_t r = r0; r < padded; r += kGroup) {
      Vec s[kGroup][kBlockVecs] = {};                           // the rows' logits
      for (int d = 0; d < D; ++d) {
        for (int c = 0; c < kBlockVecs; ++c) {
          const Vec kd = *reinterpret_cast<const Vec*>(&kT[d * kBlock + c * kLanes]);
          for (int i = 0; i < kGroup; ++i) s[i][c] += Q[(r + i) * D + d] * kd;
        }
      }
      alignas(64) float p[kGroup][kBlock];
      float alpha[kGroup];
      for (int i = 0; i < kGroup; ++i) {
        const int64_t visible = std::min<int64_t>(kBlock, pos[r + i] - first + 1);
        alpha[i] = 1.0f;
        if (visible <= 0) {                                     // padding, or before the block
          std::fill(p[i], p[i] + kBlock, 0.0f);
          continue;
        }
        float sc[kBlock];
        std::memcpy(sc, &s[i], sizeof sc);
        if (soft_cap > 0.0f)
          for (int j = 0; j < kBlock; ++j) sc[j] = soft_cap * std::tanh(sc[j] / soft_cap);
        float block_max = kNegInf;
        for (int j = 0; j < visible; ++j) block_max = std::max(block_max, sc[j]);
        const float m_old = m[r + i], m_new = std::max(m_old, block_max);
        alpha[i] = m_old == kNegInf ? 0.0f : exp_nonpositive(m_old - m_new);
        float sum = 0.0f;
        for (int j = 0; j < kBlock; ++j) {
          p[i][j] = j < visible ? exp_nonpositive(sc[j] - m_new) : 0.0f;
          sum += p[i][j];
        }
        l[r + i] = alpha[i] * l[r + i] + sum;
        m[r + i] = m_new;
      }
      Vec a[kGroup][NV];                                       // the rows' outputs, rescaled
      for (int i = 0; i < kGroup; ++i)
        for (int c = 0; c < NV; ++c)
          a[i][c] = *reinterpret_cast<const Vec*>(&acc[(r + i) * D + c * kLanes]) * alpha[i];
      for (int j = 0; j < kBlock; ++j) {                        // acc += p v
        Vec vj[NV];
        for (int c = 0; c < NV; ++c) vj[c] = *reinterpret_cast<const Vec*>(vb + j * D + c * kLanes);
        for (int i = 0; i < kGroup; ++i)
          for (int c = 0; c < NV; ++c) a[i][c] += p[i][j] * vj[c];
      }
      for (int i = 0; i < kGroup; ++i)
        for (int c = 0; c < NV; ++c)
          *reinterpret_cast<Vec*>(&acc[(r + i) * D + c * kLanes]) = a[i][c];
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + (r / G) * q_stride + (h * G + r % G) * D;
    const bool seen = l[r] > 0.0f;
    for (int d = 0; d < D; ++d) o[d] = seen ? acc[r * D + d] / l[r] : 0.0f;
    lse[(r / G) * lse_stride + h * G + r % G] = seen ? m[r] + std::log(l[r]) : kNegInf;
  }
}

ffi::Error PagedTilesImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                          ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> tables,
                          ffi::Buffer<ffi::S32> qsl, ffi::Buffer<ffi::S32> seq_lens,
                          ffi::Buffer<ffi::S32> body, float soft_cap,
                          ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse) {
  const auto qd = q.dimensions(), kd = k.dimensions(), td = tables.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2)
    return ffi::Error::InvalidArgument("paged_tiles: q, k, v must be 4-D, tables 2-D");
  const int64_t T = qd[0], Hkv = qd[1], G = qd[2], D = qd[3], S = td[0], width = td[1];
  if (kd[1] != Hkv || kd[3] != D || kd[2] != kBlock || (D != 64 && D != 128) ||
      qsl.element_count() != static_cast<size_t>(S + 1) ||
      seq_lens.element_count() != static_cast<size_t>(S) ||
      body.element_count() != static_cast<size_t>(S))
    return ffi::Error::InvalidArgument("paged_tiles: inconsistent shapes (bs 16, D 64 or 128)");
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const int32_t *tp = tables.typed_data(), *qslp = qsl.typed_data(),
                *lenp = seq_lens.typed_data(), *bodyp = body.typed_data();
  float *op = out->typed_data(), *lp = lse->typed_data();
  std::fill(op, op + T * Hkv * G * D, 0.0f);
  std::fill(lp, lp + T * Hkv * G, kNegInf);
  struct Tile { int64_t seq, tok0, ntok, pos0; };
  std::vector<Tile> tiles;                                      // last tiles (the costliest) first
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = std::min<int64_t>(bodyp[s], qslp[s + 1] - qslp[s]);
    const int64_t pos_first = lenp[s] - (qslp[s + 1] - qslp[s]);
    for (int64_t t = (n - 1) / kTileTokens * kTileTokens; n > 0 && t >= 0; t -= kTileTokens) {
      if (qslp[s] + t >= T || (t + pos_first) / kBlock >= width) continue;
      tiles.push_back({s, qslp[s] + t, std::min<int64_t>(kTileTokens, n - t), pos_first + t});
    }
  }
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const Tile& a, const Tile& b) { return a.pos0 + a.ntok > b.pos0 + b.ntok; });
  const int64_t q_stride = Hkv * G * D;
  parallel_for(pool, static_cast<int64_t>(tiles.size()) * Hkv, [=, &tiles](int64_t i) {
    const Tile& t = tiles[i / Hkv];
    const int64_t h = i % Hkv;
    const int64_t ntok = std::min<int64_t>(t.ntok, T - t.tok0);
    auto fn = D == 64 ? attend_tile<64> : attend_tile<128>;
    fn(qp + t.tok0 * q_stride, q_stride, ntok, t.pos0, G, kp, vp, tp + t.seq * width, Hkv, h,
       soft_cap, op + t.tok0 * q_stride, lp + t.tok0 * Hkv * G, Hkv * G);
  });
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvPagedTiles, PagedTilesImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
