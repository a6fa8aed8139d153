// This machine's limits for bench/pass_floor.py: the fp32 FMA peak and the read bandwidth, on
// one thread and on two. Built by pass_floor.py with the system's compiler, -O3 -march=native.
//
//   fma   THREADS  -> GFLOP/s: 12 independent accumulators per thread (more than the FMA
//                     units' latency x throughput), the machine's widest float vector
//   read  THREADS  -> GB/s: each thread sums its half of a 1 GiB buffer (first touched by
//                     that thread), best of 5 passes
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__AVX512F__)
typedef __m512 V;
#define LANES 16
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define SET1(x) _mm512_set1_ps(x)
#define LOAD(p) _mm512_loadu_ps(p)
#define ADD(a, b) _mm512_add_ps(a, b)
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 V;
#define LANES 8
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define SET1(x) _mm256_set1_ps(x)
#define LOAD(p) _mm256_loadu_ps(p)
#define ADD(a, b) _mm256_add_ps(a, b)
#else
#error "pass_floor.c needs AVX2 with FMA or AVX-512"
#endif

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

enum { kAcc = 12 };
static const int64_t kIters = 40000000;  // per thread: kIters * kAcc * LANES * 2 flops

typedef struct {
  float* buf;
  int64_t n;
  float out;
} Job;

static void* fma_loop(void* arg) {
  V acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = SET1((float)i);
  const V x = SET1(1.0000001f), y = SET1(0.9999999f);
  for (int64_t n = 0; n < kIters; ++n)
    for (int i = 0; i < kAcc; ++i) acc[i] = FMA(acc[i], x, y);
  float lanes[LANES], s = 0;
  for (int i = 0; i < kAcc; ++i) {
    memcpy(lanes, &acc[i], sizeof lanes);
    for (int j = 0; j < LANES; ++j) s += lanes[j];
  }
  ((Job*)arg)->out = s;
  return NULL;
}

static void* touch(void* arg) {
  Job* j = (Job*)arg;
  for (int64_t i = 0; i < j->n; ++i) j->buf[i] = (float)(i & 7);
  return NULL;
}

static void* read_loop(void* arg) {
  Job* j = (Job*)arg;
  V a0 = SET1(0), a1 = SET1(0), a2 = SET1(0), a3 = SET1(0);
  for (int64_t i = 0; i + 4 * LANES <= j->n; i += 4 * LANES) {
    a0 = ADD(a0, LOAD(j->buf + i));
    a1 = ADD(a1, LOAD(j->buf + i + LANES));
    a2 = ADD(a2, LOAD(j->buf + i + 2 * LANES));
    a3 = ADD(a3, LOAD(j->buf + i + 3 * LANES));
  }
  float lanes[LANES], s = 0;
  a0 = ADD(ADD(a0, a1), ADD(a2, a3));
  memcpy(lanes, &a0, sizeof lanes);
  for (int k = 0; k < LANES; ++k) s += lanes[k];
  j->out = s;
  return NULL;
}

static double run(void* (*fn)(void*), Job* jobs, int threads) {
  pthread_t t[64];
  double start = now();
  for (int i = 0; i < threads; ++i) pthread_create(&t[i], NULL, fn, &jobs[i]);
  for (int i = 0; i < threads; ++i) pthread_join(t[i], NULL);
  return now() - start;
}

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  const int threads = atoi(argv[2]);
  if (threads < 1 || threads > 64) return 2;
  Job jobs[64];
  if (strcmp(argv[1], "fma") == 0) {
    const double s = run(fma_loop, jobs, threads);
    printf("%.2f\n", threads * (double)kIters * kAcc * LANES * 2 / s / 1e9);
    return 0;
  }
  if (strcmp(argv[1], "read") != 0) return 2;
  const int64_t total = (int64_t)1 << 28;  // floats: 1 GiB
  float* buf = (float*)aligned_alloc(64, total * sizeof(float));
  for (int i = 0; i < threads; ++i) jobs[i] = (Job){buf + i * (total / threads), total / threads, 0};
  run(touch, jobs, threads);
  double best = 1e30;
  for (int r = 0; r < 5; ++r) {
    const double s = run(read_loop, jobs, threads);
    if (s < best) best = s;
  }
  printf("%.2f\n", total * sizeof(float) / best / 1e9);
  free(buf);
  return 0;
}
