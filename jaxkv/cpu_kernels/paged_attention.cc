// Paged attention for the CPU path (jaxkv/attention/grouped.py), as XLA FFI custom calls, one
// layer per call, over a pool of any of these element types (k and v alike):
//
//   f32                   [N, Hkv, bs, D]   head-major (jaxkv.kvcache.pools.HNDPages), read in
//   place bf16, f16             [N, Hkv, bs, D]   head-major (HNDPages of a 16-bit cache)
//   int8, fp8 e4m3fn/e5m2 [N, bs, Hkv, D]   token-major codes (jaxkv.kvcache.pools.QuantizedPages) times
//                                           one bf16 scale per token and head [N, bs, Hkv, 1],
//                                           or one fixed scale for the whole pool
//
// A coded block is decoded into a [bs, D] float buffer, value = code * scale as
// jaxkv.kvcache.quant.dequantize computes it, and then attended exactly as a float block.
//
// JaxkvPagedRows: the rows, the last R query tokens of each sequence (a decode token, or a
// speculative step's token and its drafts), G query heads per kv head:
//
//   q        f32 [S, Hkv, R * G, D]  row queries, already scaled (row r, head g at r * G + g)
//   q_sinks  f32 like q              the queries that score the sink positions (see Mask)
//   k, v     [N, ...] (see above)    one layer's pools (block 0 is the null block)
//   k_scale, v_scale  bf16 [N, bs, Hkv, 1]   the codes' scales (int8/fp8; ignored otherwise)
//   tables   s32 [S, W]              physical block of each logical block (0: dropped)
//   row_pos  s32 [S, R]              kv position of each row query (-1: no query)
//   out      f32 [S, Hkv, R * G, D]  softmax(q k^T) v over positions <= row_pos, kept blocks
//   lse      f32 [S, Hkv, R * G]     log-sum-exp of the logits (-inf for a row that saw none)
//
// Each sequence walks its blocks once, in order, keeping an online softmax for the R * G rows
// of each kv head, so a block's K and V are read from memory once for all of them. A row scores
// kLanes keys at a time: where D is a whole 4, 8 or 16 vectors its query stays in registers,
// each key's products are one vector of partial sums, and one transposing tree of shuffles
// adds up all kLanes of them (RowOps::scores); the softmax then runs on those vectors, and the
// outputs of a few rows at a time (8-16 accumulators) stay in registers while the block's
// values stream by, each value vector loaded once for them (RowOps::accumulate_rows).
//
// JaxkvPagedTiles: the tiles, the first body[s] query tokens of each sequence s in the step's
// flat token layout (a prefill chunk's tokens before its last), causal over the sequence's
// kept blocks (bs == 16, D == 64 or 128):
//
//   q, q_sinks f32 [T, Hkv, G, D]    every token's queries (and sink queries), already scaled
//   k, v, k_scale, v_scale, tables   as above
//   qsl      s32 [S + 1]             first token of each sequence in q
//   seq_lens s32 [S]                 kv length of each sequence (its last token's position + 1)
//   body     s32 [S]                 leading tokens of each sequence computed here
//   out      f32 [T, Hkv, G, D]      (0 for tokens not computed here)
//   lse      f32 [T, Hkv, G]         (-inf for tokens not computed here)
//
// A work item is one kv head of kTileTokens consecutive tokens of one sequence: its K blocks
// are transposed once into [D, bs] so that kGroup query rows at a time (8 with AVX-512, 4
// without) score a whole block with bs-wide vector FMAs, their softmax runs on those vectors,
// and P V runs two of the rows' output vectors at a time (2 * kGroup accumulators), each
// value vector loaded once for the kGroup rows.
//
// Both take the attributes soft_cap, window, num_sinks, rescore (what a query sees: Mask) and
// k_fixed_scale, v_fixed_scale (> 0: the codes' fixed scale instead of k_scale, v_scale), and
// spread their work items over XLA's intra-op threads.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.h"

namespace ffi = xla::ffi;
using jaxkv::exp_nonpositive;
using jaxkv::hmax;
using jaxkv::hsum;
using jaxkv::in_register;
using jaxkv::IVec;
using jaxkv::kLaneIndex;
using jaxkv::lane_sums;
using jaxkv::kLanes;
using jaxkv::kLine;
using jaxkv::load;
using jaxkv::kNegInf;
using jaxkv::parallel_for;
using jaxkv::Vec;

namespace {

// ---- pools ---------------------------------------------------------------------------------

// A run of memory [first, second): the part of a block a work item reads (see touch).
using Run = std::pair<const void*, const void*>;

// A head-major float pool [N, Hkv, bs, D]: a block's head is read in place.
struct FloatPool {
  const float* data;
  int64_t Hkv, bs, D;
  // the [bs, D] floats of block phys, kv head h (its first n positions are the ones read)
  const float* block(int64_t phys, int64_t h, int64_t /*n*/, float* /*buf*/) const {
    return data + (phys * Hkv + h) * bs * D;
  }
  // the memory of block phys that kv heads h0 .. h1 - 1 read: one run [first, second)
  Run run(int64_t phys, int64_t h0, int64_t h1) const {
    return {data + (phys * Hkv + h0) * bs * D, data + (phys * Hkv + h1) * bs * D};
  }
};

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// A minifloat with E exponent and M mantissa bits (sign on top) to float, exactly: the
// exponent and mantissa moved to float's fields and rebiased (normals), the mantissa times
// the smallest subnormal (subnormals; float subnormals are avoided since XLA's threads flush
// them), and the top exponent as inf/NaN (IEEE formats) or NaN at all ones (e4m3fn, which has
// no inf). Branch-free, so a block's decode loop vectorizes.
template <int E, int M, bool kFiniteOnly>
inline float minifloat(uint32_t c) {
  constexpr int kBias = (1 << (E - 1)) - 1;
  constexpr uint32_t kMag = (1u << (E + M)) - 1, kExpMax = (1u << E) - 1;
  const uint32_t mag = c & kMag, e = mag >> M, m = mag & ((1u << M) - 1);
  const float normal = bits_to_float((mag << (23 - M)) + (uint32_t(127 - kBias) << 23));
  const float sub = static_cast<float>(m) * bits_to_float(uint32_t(127 - kBias - M + 1) << 23);
  float x = e == 0 ? sub : normal;
  if (kFiniteOnly) {
    x = mag == kMag ? std::numeric_limits<float>::quiet_NaN() : x;
  } else {
    x = e == kExpMax ? (m ? std::numeric_limits<float>::quiet_NaN()
                          : std::numeric_limits<float>::infinity()) : x;
  }
  return (c >> (E + M)) & 1 ? -x : x;
}

enum class Code { kBF16, kF16, kInt8, kE4M3, kE5M2 };

template <Code C>
inline float decode(uint32_t c) {
  if constexpr (C == Code::kBF16) return bits_to_float(c << 16);
  if constexpr (C == Code::kF16) return minifloat<5, 10, false>(c);
  if constexpr (C == Code::kInt8) return static_cast<float>(static_cast<int8_t>(c));
  if constexpr (C == Code::kE4M3) return minifloat<4, 3, true>(c);
  if constexpr (C == Code::kE5M2) return minifloat<5, 2, false>(c);
}

// A pool of coded elements T (uint16_t: bf16/f16 bits; uint8_t: int8/fp8 codes), head-major or
// token-major, with one bf16 scale per (block, position, head) (token-major only) or a fixed
// scale. block() decodes the first n positions of a block's head into buf [bs, D] (the rest
// zero, so a weight of 0 never meets a stale NaN).
template <typename T, Code C>
struct CodedPool {
  const T* data;
  const uint16_t* scale;       // bf16 [N, bs, Hkv] or nullptr
  float fixed_scale;           // used when scale is nullptr
  int64_t Hkv, bs, D;
  bool token_major;
  const float* block(int64_t phys, int64_t h, int64_t n, float* buf) const {
    for (int64_t t = 0; t < n; ++t) {
      const int64_t at = token_major ? (phys * bs + t) * Hkv + h : (phys * Hkv + h) * bs + t;
      const T* c = data + at * D;
      const float sc = scale ? bits_to_float(uint32_t(scale[at]) << 16) : fixed_scale;
      float* o = buf + t * D;
      for (int64_t d = 0; d < D; ++d) o[d] = decode<C>(c[d]) * sc;
    }
    std::fill(buf + n * D, buf + bs * D, 0.0f);
    return buf;
  }
  // the codes of block phys that kv heads h0 .. h1 - 1 read, within one run [first, second)
  // (token-major: the whole block)
  Run run(int64_t phys, int64_t h0, int64_t h1) const {
    if (token_major) return {data + phys * bs * Hkv * D, data + (phys + 1) * bs * Hkv * D};
    return {data + (phys * Hkv + h0) * bs * D, data + (phys * Hkv + h1) * bs * D};
  }
};

// The cache lines of a run of memory (whole lines from its start).
inline int64_t lines(Run r) {
  return (static_cast<const char*>(r.second) - static_cast<const char*>(r.first)) / kLine;
}

// Reads one byte of every 64-byte line of two runs of memory (a block's K and V), alternating
// between them, and does nothing with it: the loads have no consumers, so dozens of them are in
// flight at once. The rows kernel computes little per byte of K and V, and without this the
// lines of a block arrived a few at a time as its loops reached them (the hardware prefetcher
// does not cross a 4 KiB page, one head's K of a block at SmolLM2's shapes): a 64-sequence
// decode step's rows went from 3.6 to 3.0 ms (bench/experiments/attention_kernels.py, session 29). Touching
// the next block instead (one block ahead) or prefetching it all at once measured no faster;
// what does is Ahead below, the next block prefetched a share at a time.
inline void touch(Run a, Run b) {
  auto at = [](Run r, int64_t i) {
    return static_cast<const volatile char*>(r.first) + i * kLine;
  };
  const int64_t na = lines(a), nb = lines(b), both = std::min(na, nb);
  for (int64_t i = 0; i < both; ++i) {
    (void)*at(a, i);
    (void)*at(b, i);
  }
  for (int64_t i = both; i < na; ++i) (void)*at(a, i);
  for (int64_t i = both; i < nb; ++i) (void)*at(b, i);
}

// Prefetches two runs of memory of one length (the next block's K and V, pools of one type),
// alternating between them as the touch does, over `slots` calls of step(): a share of the
// lines a call, spread over the current block's rows so that the next block's lines arrive
// while this one computes.
// Non-temporal (prefetchnta): each line is read during one block only. A 64-sequence decode
// step of 512-token rows (bench/experiments/attention_kernels.py, two threads): 2.9-3.0 -> 2.1-2.2 ms in
// pool order, 3.0-3.1 -> 2.4-2.6 ms shuffled; as a plain prefetch (T0) only -4 to -8%, and
// prefetching the next block all at once measured no faster (session 29).
class Ahead {
 public:
  Ahead() = default;
  Ahead(Run a, Run b, int64_t slots)
      : a_(static_cast<const char*>(a.first)), b_(static_cast<const char*>(b.first)),
        left_(lines(a)), share_((left_ + slots - 1) / slots) {}
  void step() {
    for (int64_t i = 0; i < share_ && left_ > 0; ++i, --left_, a_ += kLine, b_ += kLine) {
      __builtin_prefetch(a_, 0, 0);
      __builtin_prefetch(b_, 0, 0);
    }
  }

 private:
  const char *a_ = nullptr, *b_ = nullptr;
  int64_t left_ = 0, share_ = 0;
};

// ---- what a query sees ---------------------------------------------------------------------

// The logits' options (jaxkv.attention.reference.visible, cap_logits): a query at position p sees
// kv position j <= p, with a window only p - j < window or j < sinks (the attention sinks), and
// with rescore the sink positions are scored by the query's second set (StreamingLLM's sink
// queries) instead of its own.
struct Mask {
  float soft_cap;   // > 0: logits become soft_cap * tanh(logit / soft_cap)
  int64_t window;   // 0: none
  int64_t sinks;    // with a window: positions 0 .. sinks - 1 stay visible
  bool rescore;     // sink positions scored by the sink queries
  bool sees(int64_t p, int64_t j) const {
    return j <= p && (window == 0 || p - j < window || j < sinks);
  }
  // the same, lane by lane, for query positions p and kv positions j (all lanes -1 or 0)
  IVec sees(IVec p, IVec j) const {
    const IVec before = j <= p;
    if (window == 0) return before;
    return before & ((p - j < static_cast<int32_t>(window)) | (j < static_cast<int32_t>(sinks)));
  }
  // whether a block of positions [first, first + bs) holds a position some query at p0..p1
  // (p0 <= p1) sees
  bool block_seen(int64_t first, int64_t bs, int64_t p0, int64_t p1) const {
    return first <= p1 && (window == 0 || first + bs - 1 > p0 - window || first < sinks);
  }
  float cap(float x) const { return soft_cap > 0.0f ? soft_cap * std::tanh(x / soft_cap) : x; }
  // the same, lane by lane
  Vec cap(Vec x) const {
    if (soft_cap > 0.0f)
      for (int t = 0; t < kLanes; ++t) x[t] = cap(x[t]);
    return x;
  }
};

// The factor on a row's sums so far when its running max moves from m_old to m_new (online
// softmax): 1 when it stays put (mostly: an early sink holds it), 0 before the row saw any.
inline float rescale(float m_old, float m_new) {
  return m_old == m_new ? 1.0f : m_old == kNegInf ? 0.0f : exp_nonpositive(m_old - m_new);
}

// ---- rows ----------------------------------------------------------------------------------

// A row of D floats as NV vectors (NV = D / kLanes), or, with NV = 0, a plain loop over any D.
// Scores one query row (and its sink query) against up to kLanes keys at a time, its vectors
// loaded once per block.
template <int NV>
struct RowOps {
  const float *q = nullptr, *qs = nullptr;
  Vec qv[NV > 0 ? NV : 1], qsv[NV > 0 ? NV : 1];
  void load_queries(const float* query, const float* sink_query, bool sinks) {
    q = query;
    qs = sink_query;
    for (int c = 0; c < NV; ++c) qv[c] = load(q + c * kLanes);
    if (sinks)
      for (int c = 0; c < NV; ++c) qsv[c] = load(qs + c * kLanes);
  }
  // lane t < m: (the sink query with sink = true) . k[t] for keys k [m, D]; lanes >= m: 0.
  // With NV > 0 every key's products are a vector of partial sums, and one transposing tree
  // (lane_sums) adds up all m of them.
  Vec scores(const float* k, int m, int64_t D, bool sink) const {
    Vec out = {};
    if constexpr (NV == 0) {
      const float* qr = sink ? qs : q;
      for (int t = 0; t < m; ++t) {
        float d = 0.0f;
        for (int64_t i = 0; i < D; ++i) d += qr[i] * k[t * D + i];
        out[t] = d;
      }
    } else {
      const Vec* qr = sink ? qsv : qv;
      Vec part[kLanes];
      for (int t = 0; t < kLanes; ++t) part[t] = Vec{};
      if (m == kLanes) {
        for (int c = 0; c < NV; ++c)
          for (int t = 0; t < kLanes; ++t) part[t] += qr[c] * load(k + t * D + c * kLanes);
      } else {
        for (int c = 0; c < NV; ++c)
          for (int t = 0; t < m; ++t) part[t] += qr[c] * load(k + t * D + c * kLanes);
      }
      out = lane_sums(part);
    }
    return out;
  }
  // Rows r < M at once: acc[r * D .. r * D + D) += sum over t < n of p[r * bsp + t]
  // v[t, 0 .. D), t in order, the rows' accumulators held in registers; a key no row weighs is
  // skipped. Each value vector is loaded once for the M rows, and the M * NV accumulators are
  // independent FMA chains: one row alone has NV of them (4 with AVX-512 at D = 64), too few
  // to cover the FMA's latency, so its P V waited on it.
  template <int M>
  static void accumulate(const float* p, int64_t bsp, const float* vb, int64_t n, int64_t D,
                         float* acc) {
    if constexpr (NV == 0) {
      for (int r = 0; r < M; ++r)
        for (int64_t t = 0; t < n; ++t) {
          const float w = p[r * bsp + t];
          if (w == 0.0f) continue;
          for (int64_t d = 0; d < D; ++d) acc[r * D + d] += w * vb[t * D + d];
        }
    } else {
      Vec a[M][NV];
      for (int r = 0; r < M; ++r)
        for (int c = 0; c < NV; ++c) a[r][c] = load(acc + r * D + c * kLanes);
      for (int64_t t = 0; t < n; ++t) {
        float w[M];
        bool any = false;
        for (int r = 0; r < M; ++r) {
          w[r] = p[r * bsp + t];
          any |= w[r] != 0.0f;
        }
        if (!any) continue;
        for (int c = 0; c < NV; ++c) {
          const Vec x = load(vb + t * D + c * kLanes);
          for (int r = 0; r < M; ++r) a[r][c] += w[r] * x;
        }
      }
      for (int r = 0; r < M; ++r)
        for (int c = 0; c < NV; ++c) *reinterpret_cast<Vec*>(acc + r * D + c * kLanes) = a[r][c];
    }
  }
  // Rows per accumulate call: enough for 8-16 accumulators (one row where NV >= 8).
  static constexpr int kRowsPV = NV == 0 || NV >= 8 ? 1 : 12 / NV;
  // The same for `rows` rows (p's bsp apart, acc's D apart), kRowsPV at a time.
  static void accumulate_rows(const float* p, int64_t bsp, int64_t rows, const float* vb,
                              int64_t n, int64_t D, float* acc) {
    int64_t r = 0;
    for (; r + kRowsPV <= rows; r += kRowsPV)
      accumulate<kRowsPV>(p + r * bsp, bsp, vb, n, D, acc + r * D);
    for (; r < rows; ++r) accumulate<1>(p + r * bsp, bsp, vb, n, D, acc + r * D);
  }
};

// One sequence's kv heads h0 .. h1 - 1: rows [RG] of queries q [h1 - h0, RG, D] per head (qs:
// the sink queries, alike; read only with mask.rescore) over the sequence's blocks. Blocks are
// the outer loop and heads the inner one, so a block's K (then its V) is read as one run of
// (h1 - h0) * bs * D floats: the hardware prefetcher follows a run that long, and a sequence's
// blocks are mostly consecutive in the pool (a 64-sequence decode step of ~400-token rows:
// 26 GB/s over two threads against 13-14 GB/s a head at a time).
template <int NV, class Pool>
void attend_heads(const float* q, const float* qs, const Pool& k, const Pool& v,
                  const int32_t* table, int64_t width, const int32_t* row_pos, int64_t R,
                  int64_t G, int64_t h0, int64_t h1, int64_t bs, int64_t D, const Mask& mask,
                  float* out, float* lse) {
  const int64_t RG = R * G, HRG = (h1 - h0) * RG;
  int32_t last = -1, first_row = std::numeric_limits<int32_t>::max();
  for (int64_t r = 0; r < R; ++r) {
    last = std::max(last, row_pos[r]);
    if (row_pos[r] >= 0) first_row = std::min(first_row, row_pos[r]);
  }
  // running max, sum, unnormalized output of every (head, row), a block's logits and weights:
  // one set of buffers per thread, reused by every item it takes (not allocated per call)
  thread_local std::vector<float> m, l, acc, s, p, kbuf, vbuf;
  const int64_t bsp = (bs + kLanes - 1) / kLanes * kLanes;      // bs in whole vectors
  m.assign(HRG, kNegInf);
  l.assign(HRG, 0.0f);
  acc.assign(HRG * D, 0.0f);
  s.resize(bsp);
  p.resize(RG * bsp);
  kbuf.resize(bs * D);                                          // a coded pool's decoded block
  vbuf.resize(bs * D);
  const int64_t blocks = last < 0 ? 0 : std::min<int64_t>(width, last / bs + 1);
  RowOps<NV> ops;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t phys = table[b];
    const int64_t first = b * bs;
    if (phys == 0 || !mask.block_seen(first, bs, first_row, last)) continue;   // dropped,
    const int64_t n = std::min<int64_t>(bs, last - first + 1);   // padding, or out of window
    const bool sink_block = mask.rescore && first < mask.sinks;
    touch(k.run(phys, h0, h1), v.run(phys, h0, h1));             // all of the block's lines
    const int64_t next = b + 1 < blocks ? table[b + 1] : 0;      // and the next block's, over
    Ahead ahead = next == 0 ? Ahead() :                          // this block's rows
                  Ahead(k.run(next, h0, h1), v.run(next, h0, h1), HRG);
    for (int64_t h = h0; h < h1; ++h) {
      const float* kb = k.block(phys, h, n, kbuf.data());        // [bs, D]
      const float* vb = v.block(phys, h, n, vbuf.data());
      const int64_t hr = (h - h0) * RG;                          // this head's first row
      for (int64_t rg = 0; rg < RG; ++rg) {
        const IVec pos = IVec{} + row_pos[rg / G];
        float* pr = p.data() + rg * bsp;
        ops.load_queries(q + (hr + rg) * D, qs + (hr + rg) * D, sink_block);
        ahead.step();
        // the logits the row sees (-inf elsewhere), kLanes keys at a time
        Vec top = Vec{} + kNegInf;
        for (int64_t t0 = 0; t0 < n; t0 += kLanes) {
          const int mk = static_cast<int>(std::min<int64_t>(kLanes, n - t0));
          const IVec j = kLaneIndex + static_cast<int32_t>(first + t0);
          Vec x = ops.scores(kb + t0 * D, mk, D, false);
          if (sink_block)
            x = j < static_cast<int32_t>(mask.sinks) ? ops.scores(kb + t0 * D, mk, D, true) : x;
          x = (mask.sees(pos, j) & (kLaneIndex < mk)) ? mask.cap(x) : Vec{} + kNegInf;
          *reinterpret_cast<Vec*>(&s[t0]) = x;
          top = x > top ? x : top;
        }
        const float block_max = hmax(top);
        if (block_max == kNegInf) {                              // sees none of the block
          std::fill(pr, pr + bsp, 0.0f);
          continue;
        }
        float& mr = m[hr + rg];
        const float m_new = std::max(mr, block_max);
        const float alpha = rescale(mr, m_new);
        Vec sum = {};
        for (int64_t t0 = 0; t0 < n; t0 += kLanes) {
          const Vec x = load(&s[t0]);
          const Vec w = x > Vec{} + kNegInf ? exp_nonpositive(x - m_new) : Vec{};
          *reinterpret_cast<Vec*>(pr + t0) = w;
          sum += w;
        }
        l[hr + rg] = alpha * l[hr + rg] + hsum(sum);
        mr = m_new;
        if (alpha != 1.0f) {
          float* ar = acc.data() + (hr + rg) * D;
          for (int64_t d = 0; d < D; ++d) ar[d] *= alpha;
        }
      }
      RowOps<NV>::accumulate_rows(p.data(), bsp, RG, vb, n, D, acc.data() + hr * D);  // += p v
    }
  }
  for (int64_t r = 0; r < HRG; ++r) {
    const bool seen = l[r] > 0.0f;
    for (int64_t d = 0; d < D; ++d) out[r * D + d] = seen ? acc[r * D + d] / l[r] : 0.0f;
    lse[r] = seen ? m[r] + std::log(l[r]) : kNegInf;
  }
}

// The rows of a step over pools k, v (FloatPool or CodedPool).
template <class Pool>
ffi::Error rows(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& qs,
                const Pool& k, const Pool& v, ffi::Buffer<ffi::S32>& tables,
                ffi::Buffer<ffi::S32>& row_pos, const Mask& mask,
                ffi::ResultBuffer<ffi::F32>& out, ffi::ResultBuffer<ffi::F32>& lse) {
  const auto qd = q.dimensions(), td = tables.dimensions(), pd = row_pos.dimensions();
  if (qd.size() != 4 || td.size() != 2 || pd.size() != 2)
    return ffi::Error::InvalidArgument("paged_rows: q must be 4-D, tables, row_pos 2-D");
  if (!std::equal(qd.begin(), qd.end(), qs.dimensions().begin(), qs.dimensions().end()))
    return ffi::Error::InvalidArgument("paged_rows: q_sinks must be shaped like q");
  const int64_t S = qd[0], Hkv = qd[1], RG = qd[2], D = qd[3];
  const int64_t width = td[1], R = pd[1];
  if (k.Hkv != Hkv || k.D != D || td[0] != S || pd[0] != S || R == 0 || RG % R != 0)
    return ffi::Error::InvalidArgument("paged_rows: inconsistent shapes");
  const int64_t G = RG / R, bs = k.bs;
  const float *qp = q.typed_data(), *qsp = qs.typed_data();
  const int32_t *tp = tables.typed_data(), *pp = row_pos.typed_data();
  float *op = out->typed_data(), *lp = lse->typed_data();
  // a work item is one sequence's kv heads, all of them where there are enough sequences to
  // keep every thread busy, else one (a batch of one or two long rows still uses every thread)
  const int64_t heads = S >= 4 * pool.num_threads() ? Hkv : 1;
  auto fn = D == 8 * kLanes   ? attend_heads<8, Pool>
            : D == 16 * kLanes ? attend_heads<16, Pool>
            : D == 4 * kLanes  ? attend_heads<4, Pool>
                               : attend_heads<0, Pool>;     // any other D: plain loops
  parallel_for(pool, S * Hkv / heads, [=, &k, &v, &mask](int64_t i) {
    const int64_t s = i * heads / Hkv, h0 = i * heads % Hkv, at = s * Hkv + h0;
    fn(qp + at * RG * D, qsp + at * RG * D, k, v, tp + s * width, width, pp + s * R, R, G, h0,
       h0 + heads, bs, D, mask, op + at * RG * D, lp + at * RG);
  });
  return ffi::Error::Success();
}

// Calls fn(k_pool, v_pool) with the pools of k and v's element type: f32 (a FloatPool, read in
// place) and 16-bit floats head-major [N, Hkv, bs, D], 8-bit codes token-major [N, bs, Hkv, D]
// with bf16 scales [N, bs, Hkv, 1] (a scale argument is ignored where its fixed scale is > 0,
// and for the head-major pools).
template <class Fn>
ffi::Error with_pools(const char* name, ffi::AnyBuffer& k, ffi::AnyBuffer& k_scale,
                            float k_fixed, ffi::AnyBuffer& v, ffi::AnyBuffer& v_scale,
                            float v_fixed, Fn fn) {
  const auto kd = k.dimensions();
  const ffi::DataType type = k.element_type();
  if (kd.size() != 4 || v.dimensions().size() != 4 || v.element_type() != type ||
      !std::equal(kd.begin(), kd.end(), v.dimensions().begin()))
    return ffi::Error::InvalidArgument(std::string(name) + ": k, v must be 4-D, alike");
  const bool token_major = type != ffi::DataType::F32 && type != ffi::DataType::BF16 &&
                           type != ffi::DataType::F16;
  const int64_t Hkv = token_major ? kd[2] : kd[1], bs = token_major ? kd[1] : kd[2], D = kd[3];
  const size_t scales = static_cast<size_t>(kd[0] * bs * Hkv);
  auto scale_of = [&](ffi::AnyBuffer& sc, float fixed) -> const uint16_t* {
    if (fixed > 0.0f || !token_major) return nullptr;
    return sc.element_type() == ffi::DataType::BF16 && sc.element_count() == scales
               ? static_cast<const uint16_t*>(sc.untyped_data()) : nullptr;
  };
  const uint16_t *ks = scale_of(k_scale, k_fixed), *vs = scale_of(v_scale, v_fixed);
  if (token_major && ((!ks && k_fixed <= 0.0f) || (!vs && v_fixed <= 0.0f)))
    return ffi::Error::InvalidArgument(std::string(name) + ": codes need bf16 scales "
                                       "[N, bs, Hkv, 1] or a fixed scale");
  auto run = [&](auto tag) {
    using P = decltype(tag);
    using T = std::remove_const_t<std::remove_pointer_t<decltype(P::data)>>;
    const float kf = token_major ? k_fixed : 1.0f, vf = token_major ? v_fixed : 1.0f;
    const P kp{static_cast<const T*>(k.untyped_data()), ks, kf, Hkv, bs, D, token_major};
    const P vp{static_cast<const T*>(v.untyped_data()), vs, vf, Hkv, bs, D, token_major};
    return fn(kp, vp);
  };
  switch (type) {
    case ffi::DataType::F32: {
      const FloatPool kp{static_cast<const float*>(k.untyped_data()), Hkv, bs, D};
      const FloatPool vp{static_cast<const float*>(v.untyped_data()), Hkv, bs, D};
      return fn(kp, vp);
    }
    case ffi::DataType::BF16: return run(CodedPool<uint16_t, Code::kBF16>{});
    case ffi::DataType::F16: return run(CodedPool<uint16_t, Code::kF16>{});
    case ffi::DataType::S8: return run(CodedPool<uint8_t, Code::kInt8>{});
    case ffi::DataType::F8E4M3FN: return run(CodedPool<uint8_t, Code::kE4M3>{});
    case ffi::DataType::F8E5M2: return run(CodedPool<uint8_t, Code::kE5M2>{});
    default:
      return ffi::Error::InvalidArgument(std::string(name) + ": pool element type not "
                                         "f32, bf16, f16, int8 or fp8 (e4m3fn, e5m2)");
  }
}

ffi::Error PagedRowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::Buffer<ffi::F32> qs, ffi::AnyBuffer k, ffi::AnyBuffer k_scale,
                              ffi::AnyBuffer v, ffi::AnyBuffer v_scale,
                              ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> row_pos,
                              float soft_cap, int64_t window, int64_t num_sinks, bool rescore,
                              float k_fixed_scale, float v_fixed_scale,
                              ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse) {
  const Mask mask{soft_cap, window, num_sinks, rescore};
  return with_pools("paged_rows", k, k_scale, k_fixed_scale, v, v_scale, v_fixed_scale,
                          [&](const auto& kp, const auto& vp) {
                            return rows(pool, q, qs, kp, vp, tables, row_pos, mask, out, lse);
                          });
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
template <int D, class Pool>
void attend_tile(const float* q, const float* qs, int64_t q_stride, int64_t ntok, int64_t pos0,
                 int64_t G, const Pool& k, const Pool& v, const int32_t* table, int64_t h,
                 const Mask& mask, float* out, float* lse, int64_t lse_stride) {
  constexpr int NV = D / kLanes;                                // vectors per row of D
  const int64_t rows = ntok * G, padded = (rows + kGroup - 1) / kGroup * kGroup;
  // this item's queries and sink queries [padded, D] (padding rows zero), running max, sum
  // and output
  thread_local std::vector<float> Q, QS, m, l, acc;             // l: a row's sum, lane by lane
  thread_local std::vector<int32_t> pos;
  Q.assign(padded * D, 0.0f);
  QS.assign(mask.rescore ? padded * D : 0, 0.0f);
  m.assign(padded, kNegInf);
  l.assign(padded * kLanes, 0.0f);
  acc.assign(padded * D, 0.0f);
  pos.assign(padded, -1);                                       // -1: a padding row
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t at = (r / G) * q_stride + (h * G + r % G) * D;
    std::memcpy(&Q[r * D], q + at, D * sizeof(float));
    if (mask.rescore) std::memcpy(&QS[r * D], qs + at, D * sizeof(float));
    pos[r] = static_cast<int32_t>(pos0 + r / G);
  }
  alignas(64) float kT[D * kBlock];                             // a K block, [D, kBlock]
  alignas(64) float kbuf[kBlock * D], vbuf[kBlock * D];         // a coded pool's decoded block
  const int64_t last = pos0 + ntok - 1;
  for (int64_t b = 0; b <= last / kBlock; ++b) {
    const int64_t phys = table[b], first = b * kBlock;
    if (phys == 0 || !mask.block_seen(first, kBlock, pos0, last)) continue;   // dropped, or
    const int64_t n = std::min<int64_t>(kBlock, last - first + 1);   // out of every window
    const float* kb = k.block(phys, h, n, kbuf);                 // [kBlock, D]
    const float* vb = v.block(phys, h, n, vbuf);
    for (int j = 0; j < kBlock; ++j)
      for (int d = 0; d < D; ++d) kT[d * kBlock + j] = kb[j * D + d];
    const bool sink_scores = mask.rescore && first < mask.sinks;
    // rows before the block's first position see none of it: start at the first that does
    const int64_t r0 = std::max<int64_t>(0, first - pos0) * G / kGroup * kGroup;
    for (int64_t r = r0; r < padded; r += kGroup) {
      auto score = [&](const std::vector<float>& queries, Vec (&s)[kGroup][kBlockVecs]) {
        for (int d = 0; d < D; ++d) {
          for (int c = 0; c < kBlockVecs; ++c) {
            Vec kd = load(&kT[d * kBlock + c * kLanes]);
            in_register(kd);
            for (int i = 0; i < kGroup; ++i) s[i][c] += queries[(r + i) * D + d] * kd;
          }
        }
      };
      Vec s[kGroup][kBlockVecs] = {}, ss[kGroup][kBlockVecs] = {};   // logits, sink logits
      score(Q, s);
      if (sink_scores) score(QS, ss);
      alignas(64) float p[kGroup][kBlock];                      // the rows' weights of the block
      float alpha[kGroup];
      // Three passes over the group's rows, each over rows independent of one another (so
      // their latencies overlap): the logits each row sees (-inf elsewhere) and their maximum;
      // the row's new running max and alpha, the factor on what it summed before; the weights.
      // A row that sees none of the block (padding, or before it) keeps its max and sum.
      IVec seen[kGroup][kBlockVecs];
      float m_new[kGroup];
      for (int i = 0; i < kGroup; ++i) {
        const IVec pos_i = IVec{} + pos[r + i];
        Vec block_max = Vec{} + kNegInf;
        // a block wholly at or before the row's position, with no window, is all seen
        const bool whole = mask.window == 0 && first + kBlock - 1 <= pos[r + i];
        for (int c = 0; c < kBlockVecs; ++c) {
          const IVec j = kLaneIndex + static_cast<int32_t>(first + c * kLanes);
          seen[i][c] = whole ? IVec{} - 1 : mask.sees(pos_i, j);
          const Vec x = sink_scores ? (j < static_cast<int32_t>(mask.sinks) ? ss[i][c] : s[i][c])
                                    : s[i][c];
          s[i][c] = seen[i][c] ? mask.cap(x) : Vec{} + kNegInf;
          block_max = s[i][c] > block_max ? s[i][c] : block_max;
        }
        m_new[i] = std::max(m[r + i], hmax(block_max));
      }
      for (int i = 0; i < kGroup; ++i) {
        alpha[i] = rescale(m[r + i], m_new[i]);
        m[r + i] = m_new[i];
      }
      for (int i = 0; i < kGroup; ++i) {
        Vec sum = load(&l[(r + i) * kLanes]) * alpha[i];
        for (int c = 0; c < kBlockVecs; ++c) {
          const Vec w = seen[i][c] ? exp_nonpositive(s[i][c] - m_new[i]) : Vec{};
          *reinterpret_cast<Vec*>(&p[i][c * kLanes]) = w;
          sum += w;
        }
        *reinterpret_cast<Vec*>(&l[(r + i) * kLanes]) = sum;
      }
      // acc = alpha acc + p v, two of a row's D / kLanes output vectors at a time: the
      // kGroup * 2 partial outputs stay in registers while the block's values stream by
      static_assert(NV % 2 == 0, "D must be a whole number of vector pairs");
      for (int c = 0; c < NV; c += 2) {
        Vec a0[kGroup], a1[kGroup];
        for (int i = 0; i < kGroup; ++i) {
          a0[i] = load(&acc[(r + i) * D + c * kLanes]) * alpha[i];
          a1[i] = load(&acc[(r + i) * D + (c + 1) * kLanes]) * alpha[i];
        }
        for (int j = 0; j < kBlock; ++j) {
          Vec v0 = load(vb + j * D + c * kLanes), v1 = load(vb + j * D + (c + 1) * kLanes);
          in_register(v0);
          in_register(v1);
          for (int i = 0; i < kGroup; ++i) {
            a0[i] += p[i][j] * v0;
            a1[i] += p[i][j] * v1;
          }
        }
        for (int i = 0; i < kGroup; ++i) {
          *reinterpret_cast<Vec*>(&acc[(r + i) * D + c * kLanes]) = a0[i];
          *reinterpret_cast<Vec*>(&acc[(r + i) * D + (c + 1) * kLanes]) = a1[i];
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + (r / G) * q_stride + (h * G + r % G) * D;
    const float sum = hsum(load(&l[r * kLanes]));
    const bool seen = sum > 0.0f;
    for (int d = 0; d < D; ++d) o[d] = seen ? acc[r * D + d] / sum : 0.0f;
    lse[(r / G) * lse_stride + h * G + r % G] = seen ? m[r] + std::log(sum) : kNegInf;
  }
}

// The tiles of a step over pools k, v (FloatPool or CodedPool).
template <class Pool>
ffi::Error tiles(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& qs,
                 const Pool& k, const Pool& v, ffi::Buffer<ffi::S32>& tables,
                 ffi::Buffer<ffi::S32>& qsl, ffi::Buffer<ffi::S32>& seq_lens,
                 ffi::Buffer<ffi::S32>& body, const Mask& mask,
                 ffi::ResultBuffer<ffi::F32>& out, ffi::ResultBuffer<ffi::F32>& lse) {
  const auto qd = q.dimensions(), td = tables.dimensions();
  if (qd.size() != 4 || td.size() != 2)
    return ffi::Error::InvalidArgument("paged_tiles: q must be 4-D, tables 2-D");
  if (!std::equal(qd.begin(), qd.end(), qs.dimensions().begin(), qs.dimensions().end()))
    return ffi::Error::InvalidArgument("paged_tiles: q_sinks must be shaped like q");
  const int64_t T = qd[0], Hkv = qd[1], G = qd[2], D = qd[3], S = td[0], width = td[1];
  if (k.Hkv != Hkv || k.D != D || k.bs != kBlock || (D != 64 && D != 128) ||
      qsl.element_count() != static_cast<size_t>(S + 1) ||
      seq_lens.element_count() != static_cast<size_t>(S) ||
      body.element_count() != static_cast<size_t>(S))
    return ffi::Error::InvalidArgument("paged_tiles: inconsistent shapes (bs 16, D 64 or 128)");
  const float *qp = q.typed_data(), *qsp = qs.typed_data();
  const int32_t *tp = tables.typed_data(), *qslp = qsl.typed_data(),
                *lenp = seq_lens.typed_data(), *bodyp = body.typed_data();
  float *op = out->typed_data(), *lp = lse->typed_data();
  std::fill(op, op + T * Hkv * G * D, 0.0f);
  std::fill(lp, lp + T * Hkv * G, kNegInf);
  struct Tile { int64_t seq, tok0, ntok, pos0; };
  std::vector<Tile> items;                                      // last tiles (the costliest) first
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = std::min<int64_t>(bodyp[s], qslp[s + 1] - qslp[s]);
    const int64_t pos_first = lenp[s] - (qslp[s + 1] - qslp[s]);
    for (int64_t t = (n - 1) / kTileTokens * kTileTokens; n > 0 && t >= 0; t -= kTileTokens) {
      if (qslp[s] + t >= T || (t + pos_first) / kBlock >= width) continue;
      items.push_back({s, qslp[s] + t, std::min<int64_t>(kTileTokens, n - t), pos_first + t});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Tile& a, const Tile& b) { return a.pos0 + a.ntok > b.pos0 + b.ntok; });
  const int64_t q_stride = Hkv * G * D;
  parallel_for(pool, static_cast<int64_t>(items.size()) * Hkv,
               [=, &items, &k, &v, &mask](int64_t i) {
    const Tile& t = items[i / Hkv];
    const int64_t h = i % Hkv;
    const int64_t ntok = std::min<int64_t>(t.ntok, T - t.tok0);
    auto fn = D == 64 ? attend_tile<64, Pool> : attend_tile<128, Pool>;
    fn(qp + t.tok0 * q_stride, qsp + t.tok0 * q_stride, q_stride, ntok, t.pos0, G, k, v,
       tp + t.seq * width, h, mask, op + t.tok0 * q_stride, lp + t.tok0 * Hkv * G, Hkv * G);
  });
  return ffi::Error::Success();
}

ffi::Error PagedTilesImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::F32> qs, ffi::AnyBuffer k, ffi::AnyBuffer k_scale,
                               ffi::AnyBuffer v, ffi::AnyBuffer v_scale,
                               ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> qsl,
                               ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> body,
                               float soft_cap, int64_t window, int64_t num_sinks, bool rescore,
                               float k_fixed_scale, float v_fixed_scale,
                               ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse) {
  const Mask mask{soft_cap, window, num_sinks, rescore};
  return with_pools("paged_tiles", k, k_scale, k_fixed_scale, v, v_scale, v_fixed_scale,
                          [&](const auto& kp, const auto& vp) {
                            return tiles(pool, q, qs, kp, vp, tables, qsl, seq_lens, body, mask,
                                         out, lse);
                          });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvPagedRows, PagedRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()     // q
                                  .Arg<ffi::Buffer<ffi::F32>>()     // q_sinks
                                  .Arg<ffi::AnyBuffer>()            // k
                                  .Arg<ffi::AnyBuffer>()            // k_scale
                                  .Arg<ffi::AnyBuffer>()            // v
                                  .Arg<ffi::AnyBuffer>()            // v_scale
                                  .Arg<ffi::Buffer<ffi::S32>>()     // tables
                                  .Arg<ffi::Buffer<ffi::S32>>()     // row_pos
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("num_sinks")
                                  .Attr<bool>("rescore")
                                  .Attr<float>("k_fixed_scale")
                                  .Attr<float>("v_fixed_scale")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvPagedTiles, PagedTilesImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()     // q
                                  .Arg<ffi::Buffer<ffi::F32>>()     // q_sinks
                                  .Arg<ffi::AnyBuffer>()            // k
                                  .Arg<ffi::AnyBuffer>()            // k_scale
                                  .Arg<ffi::AnyBuffer>()            // v
                                  .Arg<ffi::AnyBuffer>()            // v_scale
                                  .Arg<ffi::Buffer<ffi::S32>>()     // tables
                                  .Arg<ffi::Buffer<ffi::S32>>()     // query_start_loc
                                  .Arg<ffi::Buffer<ffi::S32>>()     // seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()     // body
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("num_sinks")
                                  .Attr<bool>("rescore")
                                  .Attr<float>("k_fixed_scale")
                                  .Attr<float>("v_fixed_scale")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
