// Paged decode attention on the CPU, reading K and V where they lie in their pages: no
// gather copy, no mask. Built on the host that runs it (-march=native) by cluster/engine/native.py;
// the loops over a head's dimensions are the compiler's to vectorize (AVX2, AVX-512).
//
// Each query row attends to the first `len` tokens of its sequence, whose page ids are a
// row of `tables`: token t lies in page tables[t / page_size], slot t % page_size. A decode
// row's len is its context (its own K and V already stored).
// Cache: [pages, page_size, kv_heads, dim] float32 or bfloat16; q and out [rows, heads,
// dim] float32. The query heads of one KV head share its loads (GQA). The
// softmax is exact in float32: the scores, their max, then the weighted sum of V.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bfloat16.h"

// One token's head vector as float32: the cache's own for float32, else converted into `to`.
static inline __attribute__((always_inline)) const float *head(const void *cache, int is_bf16,
                                                               int64_t at, int64_t dim,
                                                               float *to) {
  if (!is_bf16) return (const float *)cache + at;
  const uint16_t *c = (const uint16_t *)cache + at;
#pragma omp simd
  for (int64_t d = 0; d < dim; d++) to[d] = bf16_to_float(c[d]);
  return to;
}

// Query heads [kvh * group, (kvh + 1) * group) of one row; `scores` holds group * len.
// Inlined where is_bf16 and dim are constants, so the loops over dim unroll.
static inline __attribute__((always_inline)) void attend(
    const float *q, const void *k_cache, const void *v_cache, int is_bf16, int64_t kv_heads,
    int64_t dim, int64_t page_size, const int64_t *pages, int64_t len, int64_t kvh,
    int64_t group, float scale, float *scores, float *row, float *out) {
  float top[group], total[group];
  for (int64_t g = 0; g < group; g++) top[g] = -INFINITY, total[g] = 0.f;
  for (int64_t t0 = 0, p = 0; t0 < len; t0 += page_size, p++) {
    int64_t first = pages[p] * page_size, n = len - t0 < page_size ? len - t0 : page_size;
    for (int64_t j = 0; j < n; j++) {
      const float *k = head(k_cache, is_bf16, ((first + j) * kv_heads + kvh) * dim, dim, row);
      for (int64_t g = 0; g < group; g++) {
        const float *qg = q + g * dim;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < dim; d++) s += qg[d] * k[d];
        s *= scale;
        scores[g * len + t0 + j] = s;
        top[g] = s > top[g] ? s : top[g];
      }
    }
  }
  for (int64_t g = 0; g < group; g++) {
    float *sg = scores + g * len;
    for (int64_t t = 0; t < len; t++) total[g] += sg[t] = expf(sg[t] - top[g]);
    memset(out + g * dim, 0, (size_t)dim * sizeof(float));
  }
  for (int64_t t0 = 0, p = 0; t0 < len; t0 += page_size, p++) {
    int64_t first = pages[p] * page_size, n = len - t0 < page_size ? len - t0 : page_size;
    for (int64_t j = 0; j < n; j++) {
      const float *v = head(v_cache, is_bf16, ((first + j) * kv_heads + kvh) * dim, dim, row);
      for (int64_t g = 0; g < group; g++) {
        float w = scores[g * len + t0 + j], *og = out + g * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) og[d] += w * v[d];
      }
    }
  }
  for (int64_t g = 0; g < group; g++) {
    float inv = 1.f / total[g], *og = out + g * dim;
#pragma omp simd
    for (int64_t d = 0; d < dim; d++) og[d] *= inv;
  }
}

// out[r] for r < rows: query row r of q attends to the first lens[r] tokens of the
// sequence whose page ids are tables[r] (width table_width). Returns 0, or -1 when scratch
// memory cannot be had.
int paged_attention(const float *q, float *out, int64_t heads, int64_t kv_heads, int64_t dim,
                    const void *k_cache, const void *v_cache, int is_bf16, int64_t page_size,
                    const int64_t *tables, int64_t table_width, const int64_t *lens,
                    int64_t rows, float scale) {
  int64_t group = heads / kv_heads, longest = 0;
  for (int64_t r = 0; r < rows; r++) longest = lens[r] > longest ? lens[r] : longest;
  int failed = 0;
#pragma omp parallel
  {
    float *scores = malloc((size_t)(group * longest + dim) * sizeof(float));
    if (!scores) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < rows * kv_heads; i++) {
      if (!scores) continue;
      int64_t r = i / kv_heads, kvh = i % kv_heads, at = (r * heads + kvh * group) * dim;
      const int64_t *pages = tables + r * table_width;
#define ATTEND(BF16, DIM)                                                                \
  attend(q + at, k_cache, v_cache, BF16, kv_heads, DIM, page_size, pages, lens[r], kvh, \
         group, scale, scores + dim, scores, out + at)
      if (dim == 64)
        is_bf16 ? ATTEND(1, 64) : ATTEND(0, 64);
      else if (dim == 128)
        is_bf16 ? ATTEND(1, 128) : ATTEND(0, 128);
      else
        is_bf16 ? ATTEND(1, dim) : ATTEND(0, dim);
#undef ATTEND
    }
    free(scores);
  }
  return failed ? -1 : 0;
}
