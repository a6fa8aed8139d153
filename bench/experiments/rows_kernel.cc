// The C++ decode-rows kernel alone (jaxkv/cpu_kernels/paged_attention.cc, attend_heads) at a
// 64-sequence decode step of SmolLM2-135M's shapes (3 kv heads x 3 query heads, head dim 64,
// blocks of 16, ~400-token rows, a 4,097-block pool): a work item per (sequence, kv head), as the
// kernel takes when there are few sequences, against one per sequence with the heads of each
// block read in turn (its default with enough sequences), on block tables that are consecutive
// (as a fresh pool hands them out) or a random permutation (a pool after much churn).
// Each timed call starts with the pool out of cache (a 256 MiB buffer is read between calls);
// 40 calls per variant, the median; GB/s = K and V bytes read / time. Both variants' outputs
// are compared (they must be equal: the same arithmetic in the same order per row).
//
//   g++ -O3 -march=native -fno-math-errno -fassociative-math -fno-signed-zeros \
//       -fno-trapping-math -std=c++17 -isystem "$(python3 -c 'import jax; print(jax.ffi.include_dir())')" \
//       bench/experiments/rows_kernel.cc -o /tmp/rows_kernel -lpthread && /tmp/rows_kernel [row length]

#include "../../jaxkv/cpu_kernels/paged_attention.cc"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>

int main(int argc, char** argv) {
  constexpr int64_t S = 64, Hkv = 3, G = 3, D = 64, bs = 16, N = 4097, W = 64;
  const int len = argc > 1 ? std::atoi(argv[1]) : 400;
  std::mt19937 rng(0);
  std::normal_distribution<float> normal;
  std::vector<float> k(N * Hkv * bs * D), v(k.size()), q(S * Hkv * G * D);
  for (auto& x : k) x = normal(rng);
  for (auto& x : v) x = normal(rng);
  const FloatPool kp{k.data(), Hkv, bs, D}, vp{v.data(), Hkv, bs, D};
  const Mask mask{0.0f, 0, 0, false};                  // causal, no window, sinks or soft cap
  for (auto& x : q) x = normal(rng) * 0.125f;
  std::vector<float> junk(64 << 20, 1.0f);
  volatile float sink = 0.0f;
  for (const bool shuffled : {false, true}) {
    std::vector<int32_t> order(N - 1), tables(S * W, 0), pos(S);
    for (int i = 0; i < N - 1; ++i) order[i] = i + 1;
    if (shuffled) std::shuffle(order.begin(), order.end(), rng);
    double bytes = 0;
    for (int s = 0, used = 0; s < S; ++s) {
      pos[s] = len - 1 - (s * 7) % 50;
      for (int b = 0; b <= pos[s] / bs; ++b) tables[s * W + b] = order[used++];
      bytes += (pos[s] / bs + 1) * bs * D * 4.0 * 2 * Hkv;
    }
    std::vector<float> outs[2], lses[2];
    for (const int threads : {1, 2}) {
      for (const int64_t heads : {int64_t{1}, Hkv}) {
        std::vector<float>& out = outs[heads > 1];
        std::vector<float>& lse = lses[heads > 1];
        out.assign(q.size(), 0.0f);
        lse.assign(S * Hkv * G, 0.0f);
        auto call = [&] {
          std::atomic<int64_t> next{0};
          auto work = [&] {
            for (int64_t i; (i = next.fetch_add(1)) < S * Hkv / heads;) {
              const int64_t s = i * heads / Hkv, h0 = i * heads % Hkv, at = s * Hkv + h0;
              attend_heads<D / kLanes>(q.data() + at * G * D, q.data() + at * G * D, kp, vp,
                                       tables.data() + s * W, W, pos.data() + s, 1, G, h0,
                                       h0 + heads, bs, D, mask, out.data() + at * G * D,
                                       lse.data() + at * G);
            }
          };
          std::vector<std::thread> helpers;
          for (int t = 1; t < threads; ++t) helpers.emplace_back(work);
          work();
          for (auto& t : helpers) t.join();
        };
        std::vector<double> times;
        for (int it = 0; it < 40; ++it) {
          float acc = 0.0f;
          for (size_t i = 0; i < junk.size(); i += 16) acc += junk[i];   // evict the pool
          sink = acc;
          const auto t0 = std::chrono::steady_clock::now();
          call();
          times.push_back(
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
        std::sort(times.begin(), times.end());
        std::printf("%s blocks, %d thread(s), %s: %.3f ms median (%.3f min), %.1f GB/s\n",
                    shuffled ? "random" : "consecutive", threads,
                    heads > 1 ? "a sequence per item" : "a (sequence, head) per item",
                    times[20] * 1e3, times[0] * 1e3, bytes / times[20] / 1e9);
      }
      bool same = outs[0] == outs[1] && lses[0] == lses[1];
      std::printf("  outputs equal: %s\n", same ? "yes" : "NO");
    }
  }
}
