/* The host's memory read bandwidth: an AVX-512 sum over 1 GiB of floats, on 1 and 2 threads
 * (3 rounds each), the ceiling that decode-step products (BENCHMARKS.md, Generation) read
 * against. Build and run: cc -O3 -march=native -pthread benchmarks/stream_read.c -o /tmp/stream
 * && /tmp/stream. Measure alone. */
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define N (256L * 1024 * 1024)
static float *a;
typedef struct {
  long lo, hi;
  float s;
} part;

static void *sum(void *p) {
  part *g = p;
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (long i = g->lo; i < g->hi; i += 64) {
    s0 = _mm512_add_ps(s0, _mm512_loadu_ps(a + i));
    s1 = _mm512_add_ps(s1, _mm512_loadu_ps(a + i + 16));
    s2 = _mm512_add_ps(s2, _mm512_loadu_ps(a + i + 32));
    s3 = _mm512_add_ps(s3, _mm512_loadu_ps(a + i + 48));
  }
  g->s = _mm512_reduce_add_ps(s0 + s1 + s2 + s3);
  return 0;
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
  a = aligned_alloc(64, N * sizeof(float));
  for (long i = 0; i < N; i++) a[i] = 1;
  for (int threads = 1; threads <= 2; threads++) {
    for (int r = 0; r < 3; r++) {
      pthread_t th[2];
      part g[2];
      double t = now();
      for (int i = 0; i < threads; i++) {
        g[i].lo = N / threads * i;
        g[i].hi = N / threads * (i + 1);
        pthread_create(th + i, 0, sum, g + i);
      }
      for (int i = 0; i < threads; i++) pthread_join(th[i], 0);
      t = now() - t;
      printf("{\"threads\": %d, \"gb_s\": %.1f}\n", threads, N * sizeof(float) / t / 1e9);
    }
  }
  return 0;
}
