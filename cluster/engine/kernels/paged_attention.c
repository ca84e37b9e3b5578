// Paged attention on the CPU, reading K and V where they lie in their pages: no gather
// copy, no mask. Decode rows here; prefill chunks (`paged_prefill`) below. Built on the host
// that runs it (-march=native) by cluster/engine/kernels/native.py.
//
// Each decode row attends to the first `len` tokens of its sequence, whose page ids are a
// row of `tables`: token t lies in page tables[t / page_size], slot t % page_size. A decode
// row's len is its context (its own K and V already stored).
// Cache: runs of (page, KV head), each page_size tokens of dim values, float32, bfloat16
// or 8-bit codes with a scale a token (kv_pages.h; `kind` says which); q and out [rows,
// heads, dim] float32. The query heads of one KV head share its loads (GQA). The softmax
// is in float32: the scores, their max, their exponentials (within 2 ulp of expf), then the
// weighted sum of V. An 8-bit token's scale multiplies its scores and its weights.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_pages.h"
#include "lanes.h"

// The kernels below specialized per page format: CALL(kind) with kind a constant.
#define BY_KIND(CALL)                 \
  switch (kind) {                     \
    case KV_F32: CALL(KV_F32); break;   \
    case KV_BF16: CALL(KV_BF16); break; \
    case KV_E4M3: CALL(KV_E4M3); break; \
    case KV_E5M2: CALL(KV_E5M2); break; \
    default: CALL(KV_I8);               \
  }

// SPLIT_PAGES: a decode task's pages. The prefill's BLOCK and TILE are below; LANES (floats
// in a vector register) is lanes.h's.
#ifdef __AVX512F__
enum { SPLIT_PAGES = 16, BLOCK = 16, TILE = 8 };
#else
enum { SPLIT_PAGES = 16, BLOCK = 16, TILE = 4 };
#endif

// A score soft-capped (Gemma 2's attention): softcap * tanh(s / softcap); 0: as it is.
static inline float capped(float s, float softcap) {
  return softcap > 0.f ? softcap * tanhf(s / softcap) : s;
}

// Query heads [kvh * group, (kvh + 1) * group) of one row over its tokens [begin, end),
// begin a page's first, those before `lo` masked (a sliding window's start): out gets each
// head's sum of e^(score - top) V, not yet divided by `total`, the sum of those weights;
// `scores` holds group * (end - begin) rounded up to LANES. Inlined where kind and dim are
// constants, so the loops over dim unroll.
static inline __attribute__((always_inline)) void attend(
    const float *q, const void *k_cache, const void *v_cache, int kind, int64_t kv_heads,
    int64_t dim, int64_t page_size, const int64_t *pages, int64_t begin, int64_t end,
    int64_t lo, int64_t kvh, int64_t group, float scale, float softcap, float *scores,
    float *row, float *out, float *top, float *total) {
  int64_t len = end - begin, stride = (len + LANES - 1) / LANES * LANES;
  int64_t skip = lo > begin ? lo - begin : 0;  // masked tokens at the start
  for (int64_t g = 0; g < group; g++) top[g] = -INFINITY, total[g] = 0.f;
  for (int64_t t0 = begin, p = begin / page_size; t0 < end; t0 += page_size, p++) {
    const uint8_t *run = kv_run(k_cache, kind, pages[p] * kv_heads + kvh, page_size, dim);
    if (t0 + page_size < end)
      prefetch_run(k_cache, kind, pages[p + 1] * kv_heads + kvh, page_size, dim);
    int64_t n = end - t0 < page_size ? end - t0 : page_size;
    for (int64_t j = 0; j < n; j++) {
      const float *k = kv_token(run, kind, j, dim, row);
      for (int64_t g = 0; g < group; g++) {
        const float *qg = q + g * dim;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < dim; d++) s += qg[d] * k[d];
        s = capped(s * scale * kv_read_scale(run, kind, j, page_size, dim), softcap);
        scores[g * stride + t0 - begin + j] = s;
        if (t0 + j >= lo) top[g] = s > top[g] ? s : top[g];
      }
    }
  }
  lanes index;
  for (int l = 0; l < LANES; l++) index[l] = (float)l;
  for (int64_t g = 0; g < group; g++) {
    float *sg = scores + g * stride;
    lanes sum = (lanes){0};
    for (int64_t t = len; t < stride; t++) sg[t] = top[g];  // finite; weighs 0 below
    for (int64_t t = 0; t < skip; t++) sg[t] = top[g];
    for (int64_t t = 0; t < stride; t += LANES) {
      lanes w = exp_nonpositive(load(sg + t) - top[g]);
      w = pick(index + (float)t < (float)len, w, (lanes){0});
      if (skip) w = pick(index + (float)t < (float)skip, (lanes){0}, w);
      store(sg + t, w);
      sum += w;
    }
    for (int l = 0; l < LANES; l++) total[g] += sum[l];
    memset(out + g * dim, 0, (size_t)dim * sizeof(float));
  }
  for (int64_t t0 = begin, p = begin / page_size; t0 < end; t0 += page_size, p++) {
    const uint8_t *run = kv_run(v_cache, kind, pages[p] * kv_heads + kvh, page_size, dim);
    if (t0 + page_size < end)
      prefetch_run(v_cache, kind, pages[p + 1] * kv_heads + kvh, page_size, dim);
    int64_t n = end - t0 < page_size ? end - t0 : page_size;
    for (int64_t j = 0; j < n; j++) {
      const float *v = kv_token(run, kind, j, dim, row);
      float v_scale = kv_read_scale(run, kind, j, page_size, dim);
      for (int64_t g = 0; g < group; g++) {
        float w = scores[g * stride + t0 - begin + j] * v_scale, *og = out + g * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) og[d] += w * v[d];
      }
    }
  }
}

// out[r] for r < rows: query row r of q attends to the first lens[r] tokens of the
// sequence whose page ids are tables[r] (width table_width), or with a `window` (> 0) to
// the last `window` of them; scores times `scale`, then soft-capped by `softcap` (> 0).
// A task is a row's KV head over SPLIT_PAGES of its pages; a row longer than that has its
// splits' sums merged (as flash-decoding does), so a small batch of long rows still has
// tasks for every thread. The splits fall at fixed pages, so a row's output does not depend
// on its batch. Returns 0, or -1 when scratch memory cannot be had.
int paged_attention(const float *q, float *out, int64_t heads, int64_t kv_heads, int64_t dim,
                    const void *k_cache, const void *v_cache, int kind, int64_t page_size,
                    const int64_t *tables, int64_t table_width, const int64_t *lens,
                    int64_t rows, float scale, int64_t window, float softcap) {
  int64_t group = heads / kv_heads, longest = 0, tasks = rows * kv_heads;
  for (int64_t r = 0; r < rows; r++) longest = lens[r] > longest ? lens[r] : longest;
  int64_t splits = ((longest + page_size - 1) / page_size + SPLIT_PAGES - 1) / SPLIT_PAGES;
  float *parts = NULL;  // each split's out, top, total: group * (dim + 2)
  if (splits > 1 && !(parts = malloc((size_t)(tasks * splits * group * (dim + 2)) * 4)))
    return -1;
  int failed = 0;
#pragma omp parallel
  {
    float *scores = malloc((size_t)(group * (longest + LANES) + dim) * sizeof(float));
    if (!scores) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < tasks * splits; i++) {
      if (!scores) continue;
      int64_t task = i / splits, split = i % splits, r = task / kv_heads, kvh = task % kv_heads;
      int64_t at = (r * heads + kvh * group) * dim, begin = split * SPLIT_PAGES * page_size;
      int64_t end = begin + SPLIT_PAGES * page_size;
      end = end > lens[r] ? lens[r] : end;
      int64_t lo = window > 0 && lens[r] > window ? lens[r] - window : 0;
      int64_t first = lo / page_size * page_size;  // the window's first page
      begin = begin < first ? first : begin;
      begin = begin > end ? end : begin;  // a shorter row's last splits, or before its window
      const int64_t *pages = tables + r * table_width;
      float top[group], total[group], *o = out + at;
      if (parts) o = parts + i * group * (dim + 2);
#define ATTEND(KIND, DIM)                                                                  \
  attend(q + at, k_cache, v_cache, KIND, kv_heads, DIM, page_size, pages, begin, end, lo, \
         kvh, group, scale, softcap, scores + dim, scores, o, top, total)
#define ATTEND_64(KIND) ATTEND(KIND, 64)
#define ATTEND_128(KIND) ATTEND(KIND, 128)
#define ATTEND_ANY(KIND) ATTEND(KIND, dim)
      if (dim == 64)
        BY_KIND(ATTEND_64)
      else if (dim == 128)
        BY_KIND(ATTEND_128)
      else
        BY_KIND(ATTEND_ANY)
#undef ATTEND
      if (parts) {
        memcpy(o + group * dim, top, (size_t)group * sizeof(float));
        memcpy(o + group * (dim + 1), total, (size_t)group * sizeof(float));
        continue;
      }
      for (int64_t g = 0; g < group; g++) {
        float inv = 1.f / total[g], *og = o + g * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) og[d] *= inv;
      }
    }
    free(scores);
#pragma omp for
    for (int64_t task = 0; task < (parts ? tasks : 0); task++) {
      const float *part = parts + task * splits * group * (dim + 2);
      int64_t r = task / kv_heads, kvh = task % kv_heads;
      for (int64_t g = 0; g < group; g++) {
        float best = -INFINITY, sum = 0.f, *og = out + (r * heads + kvh * group + g) * dim;
        for (int64_t s = 0; s < splits; s++) {
          float t = part[s * group * (dim + 2) + group * dim + g];
          best = t > best ? t : best;
        }
        memset(og, 0, (size_t)dim * sizeof(float));
        for (int64_t s = 0; s < splits; s++) {
          const float *ps = part + s * group * (dim + 2);
          float t = ps[group * dim + g], w = t == -INFINITY ? 0.f : expf(t - best);
          sum += w * ps[group * (dim + 1) + g];
#pragma omp simd
          for (int64_t d = 0; d < dim; d++) og[d] += w * ps[g * dim + d];
        }
        float inv = 1.f / sum;
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) og[d] *= inv;
      }
    }
  }
  free(parts);
  return failed ? -1 : 0;
}

// One prefill chunk's attention, after cached context or not, reading the pages in place
// (the chunk's own K and V written there first): query row i (of n) is the sequence's token
// context - n + i and attends to tokens [0, that one], whose page ids are `pages`. Rows go
// in blocks of BLOCK; each block passes once over its pages with an online softmax (as
// flash attention does): a page's K and V tile of one KV head is made float32 once per
// block and serves the block's rows times the head's query group, K transposed so that a
// query's scores for the page's tokens are one vector. TILE query
// vectors' scores are summed at once, each in registers: with 16-token pages, 8 of
// AVX-512's 32 vector registers, or 4 pairs of AVX2's 16.
//
// Unlike the decode kernel above, this part lets the compiler fuse a * b + c (FMA): it
// halves the arithmetic of its two products; its sums round differently from SDPA's anyway.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")

// s[u][j] = qs[u] . K[j] for TILE query vectors and each of a page's tokens, K as
// kt[d * page_size + j]; a row of s is `width` long.
static inline __attribute__((always_inline)) void tile_scores(const float *restrict kt,
                                                              const float **qs, int64_t dim,
                                                              int64_t page_size, int64_t width,
                                                              float *s) {
  if (page_size == 16) {
    enum { PARTS = 16 / LANES };
    lanes acc[TILE][PARTS];
    for (int u = 0; u < TILE; u++)
      for (int c = 0; c < PARTS; c++) acc[u][c] = (lanes){0};
    for (int64_t d = 0; d < dim; d++)
      for (int c = 0; c < PARTS; c++) {
        lanes col = load(kt + d * 16 + c * LANES);
        for (int u = 0; u < TILE; u++) acc[u][c] += qs[u][d] * col;
      }
    for (int u = 0; u < TILE; u++)
      for (int c = 0; c < PARTS; c++) store(s + u * width + c * LANES, acc[u][c]);
    return;
  }
  for (int64_t x = 0; x < TILE * width; x++) s[x] = 0.f;
  for (int64_t d = 0; d < dim; d++)
    for (int u = 0; u < TILE; u++) {
      float x = qs[u][d];
#pragma omp simd
      for (int64_t j = 0; j < page_size; j++) s[u * width + j] += x * kt[d * page_size + j];
    }
}

// One query vector's scores for a page (`width` of them, a multiple of LANES, those before
// `from` (a sliding window's start) and from `valid` on masked), times `scale` and
// soft-capped, become its softmax weights against the running max `*top`: the sum `*total`
// and the output so far `o` shrink where the max grows; the weights' sum is added.
static inline __attribute__((always_inline)) void weigh(float *s, int64_t width, int64_t from,
                                                        int64_t valid, float scale,
                                                        float softcap, float *top,
                                                        float *total, float *o, int64_t dim) {
  lanes index, big = (lanes){0} - INFINITY;
  for (int l = 0; l < LANES; l++) index[l] = (float)l;
  for (int64_t j = 0; j < width; j += LANES) {
    lanes x = load(s + j) * scale;
    if (softcap > 0.f)
      for (int l = 0; l < LANES; l++) x[l] = capped(x[l], softcap);
    x = pick(index + (float)j < (float)valid, x, (lanes){0} - INFINITY);
    if (from > 0) x = pick(index + (float)j < (float)from, (lanes){0} - INFINITY, x);
    store(s + j, x);
    big = pick(x > big, x, big);
  }
  float best = big[0];
  for (int l = 1; l < LANES; l++) best = big[l] > best ? big[l] : best;
  if (best > *top) {
    float shrink = expf(*top - best);
    *total *= shrink;
#pragma omp simd
    for (int64_t d = 0; d < dim; d++) o[d] *= shrink;
    *top = best;
  }
  lanes sum = (lanes){0};
  for (int64_t j = 0; j < width; j += LANES) {
    lanes w = exp_nonpositive(load(s + j) - *top);
    w = pick(index + (float)j < (float)valid, w, (lanes){0});
    if (from > 0) w = pick(index + (float)j < (float)from, (lanes){0}, w);
    store(s + j, w);
    sum += w;
  }
  for (int l = 0; l < LANES; l++) *total += sum[l];
}

// o += sum over j < valid of w[j] * V[j], V as vt[j * dim + d].
static inline __attribute__((always_inline)) void add_weighted(float *restrict o,
                                                               const float *w, int64_t valid,
                                                               const float *restrict vt,
                                                               int64_t dim) {
  if (dim == 64 || dim == 128) {
    lanes acc[128 / LANES];
    for (int64_t c = 0; c < dim / LANES; c++) acc[c] = load(o + c * LANES);
    for (int64_t j = 0; j < valid; j++)
      for (int64_t c = 0; c < dim / LANES; c++) acc[c] += w[j] * load(vt + j * dim + c * LANES);
    for (int64_t c = 0; c < dim / LANES; c++) store(o + c * LANES, acc[c]);
    return;
  }
  for (int64_t j = 0; j < valid; j++)
#pragma omp simd
    for (int64_t d = 0; d < dim; d++) o[d] += w[j] * vt[j * dim + d];
}

static inline __attribute__((always_inline)) void prefill_block(
    const float *restrict q, float *restrict out, int64_t heads, int64_t kv_heads, int64_t dim,
    const void *k_cache, const void *v_cache, int kind, int64_t page_size,
    const int64_t *pages, int64_t first_row, int64_t i0, int64_t i1, int64_t kvh, float scale,
    int64_t window, float softcap, float *restrict kt, float *restrict vt, float *restrict top,
    float *restrict total, float *restrict acc, const float **qs, const float *zeros) {
  int64_t group = heads / kv_heads, vectors = (i1 - i0) * group, end = first_row + i1;
  int64_t width = (page_size + LANES - 1) / LANES * LANES;
  float s[TILE * width];
  for (int64_t r = 0; r < vectors + TILE; r++)  // a query vector's row and head; then zeros
    qs[r] = r < vectors ? q + ((i0 + r / group) * heads + kvh * group + r % group) * dim : zeros;
  for (int64_t r = 0; r < vectors; r++) top[r] = -INFINITY, total[r] = 0.f;
  memset(acc, 0, (size_t)(vectors * dim) * sizeof(float));
  memset(s, 0, sizeof s);  // the padding past page_size: finite, masked
  // With a window, the pages before the block's first row's window are never read.
  int64_t lo = window > 0 && first_row + i0 + 1 > window ? first_row + i0 + 1 - window : 0;
  for (int64_t p = lo / page_size, t0 = p * page_size; t0 < end; t0 += page_size, p++) {
    int64_t n = end - t0 < page_size ? end - t0 : page_size;
    const uint8_t *k_run = kv_run(k_cache, kind, pages[p] * kv_heads + kvh, page_size, dim);
    const uint8_t *v_run = kv_run(v_cache, kind, pages[p] * kv_heads + kvh, page_size, dim);
    if (t0 + page_size < end) {
      prefetch_run(k_cache, kind, pages[p + 1] * kv_heads + kvh, page_size, dim);
      prefetch_run(v_cache, kind, pages[p + 1] * kv_heads + kvh, page_size, dim);
    }
    for (int64_t j = 0; j < n; j++) {
      float ks = kv_read_scale(k_run, kind, j, page_size, dim);
      float vs = kv_read_scale(v_run, kind, j, page_size, dim);
      const float *k = kv_token(k_run, kind, j, dim, vt + j * dim);  // vt: scratch here
      for (int64_t d = 0; d < dim; d++)
        kt[d * page_size + j] = kind < KV_E4M3 ? k[d] : k[d] * ks;
      const float *v = kv_token(v_run, kind, j, dim, vt + j * dim);
      if (kind >= KV_E4M3)
        for (int64_t d = 0; d < dim; d++) vt[j * dim + d] = v[d] * vs;
      else if (v != vt + j * dim)
        memcpy(vt + j * dim, v, (size_t)dim * sizeof(float));
    }
    for (int64_t j = n; j < page_size; j++)  // a last page's empty slots: finite, masked
      for (int64_t d = 0; d < dim; d++) kt[d * page_size + j] = 0.f;
    int64_t seen = t0 - first_row > i0 ? t0 - first_row : i0;  // rows before see none of it
    for (int64_t r0 = (seen - i0) * group; r0 < vectors; r0 += TILE) {
      tile_scores(kt, qs + r0, dim, page_size, width, s);
      for (int64_t u = 0; u < TILE && r0 + u < vectors; u++) {
        int64_t r = r0 + u, valid = first_row + i0 + r / group + 1 - t0;
        int64_t from = window > 0 ? valid - window : 0;  // this row's window, in the page
        if (from >= n) continue;  // the page lies before this row's window
        valid = valid > n ? n : valid;
        float *o = acc + r * dim, *w = s + u * width;
        weigh(w, width, from, valid, scale, softcap, top + r, total + r, o, dim);
        add_weighted(o, w, valid, vt, dim);
      }
    }
  }
  for (int64_t r = 0; r < vectors; r++) {
    float inv = 1.f / total[r], *o = (float *)qs[r] - q + out;
    const float *a = acc + r * dim;
#pragma omp simd
    for (int64_t d = 0; d < dim; d++) o[d] = a[d] * inv;
  }
}

// out[i] for i < n, as above (with a `window` > 0, each row attends to its last `window`
// tokens; `softcap` as paged_attention's); q and out [n, heads, dim] float32. Returns 0, or
// -1 when scratch memory cannot be had.
int paged_prefill(const float *q, float *out, int64_t heads, int64_t kv_heads, int64_t dim,
                  const void *k_cache, const void *v_cache, int kind, int64_t page_size,
                  const int64_t *pages, int64_t context, int64_t n, float scale,
                  int64_t window, float softcap) {
  int64_t group = heads / kv_heads, blocks = (n + BLOCK - 1) / BLOCK;
  int64_t vectors = BLOCK * group;
  int failed = 0;
#pragma omp parallel
  {
    size_t floats = (size_t)(2 * page_size * dim + 2 * vectors + vectors * dim + dim);
    float *scratch = calloc(floats, sizeof(float));
    const float **qs = malloc((size_t)(vectors + TILE) * sizeof(float *));
    if (!scratch || !qs) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < blocks * kv_heads; task++) {
      if (!scratch || !qs) continue;
      // The last blocks first: they read the most pages.
      int64_t b = blocks - 1 - task / kv_heads, kvh = task % kv_heads;
      int64_t i0 = b * BLOCK, i1 = i0 + BLOCK < n ? i0 + BLOCK : n;
      float *kt = scratch, *vt = kt + page_size * dim, *top = vt + page_size * dim;
      float *total = top + vectors, *acc = total + vectors, *zeros = acc + vectors * dim;
#define BLOCK_OF(KIND, PS, DIM)                                                         \
  prefill_block(q, out, heads, kv_heads, DIM, k_cache, v_cache, KIND, PS, pages,        \
                context - n, i0, i1, kvh, scale, window, softcap, kt, vt, top, total, acc, \
                qs, zeros)
#define BLOCK_16_64(KIND) BLOCK_OF(KIND, 16, 64)
#define BLOCK_16_128(KIND) BLOCK_OF(KIND, 16, 128)
#define BLOCK_ANY(KIND) BLOCK_OF(KIND, page_size, dim)
      if (page_size == 16 && dim == 64)
        BY_KIND(BLOCK_16_64)
      else if (page_size == 16 && dim == 128)
        BY_KIND(BLOCK_16_128)
      else
        BY_KIND(BLOCK_ANY)
#undef BLOCK_OF
    }
    free(scratch);
    free(qs);
  }
  return failed ? -1 : 0;
}

#pragma GCC pop_options

// x [n, kv_heads, dim] float32 (token t's at x + t * stride) into token slots slots[n] of
// one layer's 8-bit pages (kv_pages.h: kv_store_8bit), for attention_cpu.py.
void kv_store(void *cache, int kind, int64_t kv_heads, int64_t page_size, int64_t dim,
              const int64_t *slots, int64_t n, const float *x, int64_t stride) {
  kv_store_8bit(cache, kind, kv_heads, page_size, dim, slots, n, x, stride);
}
