// The KV cache's page formats, as kv_cache.py's KVLayout defines them, for the C kernels
// beside it: a layer's pages are runs, one per (page, KV head) (run r = page * kv_heads +
// head), each page_size tokens of dim values: float32, bfloat16, or 8-bit codes followed
// by a scale byte a token (padded to a multiple of 16): an 8-bit value is its code's value
// times 2^(byte - 127). Readers apply a token's scale to its score or its weight, not to
// each element. Stores follow KVLayout.store bit for bit. native.py hashes the headers here
// into each kernel's build key.
#pragma once

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bfloat16.h"

enum { KV_F32 = 0, KV_BF16 = 1, KV_E4M3 = 2, KV_E5M2 = 3, KV_I8 = 4 };  // kv_cache.py's KIND
static inline int64_t kv_run_bytes(int kind, int64_t page_size, int64_t dim) {
  int64_t item = kind == KV_F32 ? 4 : kind == KV_BF16 ? 2 : 1;
  return page_size * dim * item + (kind >= KV_E4M3 ? (page_size + 15) / 16 * 16 : 0);
}

static inline __attribute__((always_inline)) const uint8_t *kv_run(const void *cache, int kind,
                                                                   int64_t run,
                                                                   int64_t page_size,
                                                                   int64_t dim) {
  return (const uint8_t *)cache + run * kv_run_bytes(kind, page_size, dim);
}

// The next run a reader takes, asked of memory ahead: a run is one short stream (1-4 KiB),
// too short for the hardware's prefetchers to learn before it ends.
static inline __attribute__((always_inline)) void prefetch_run(const void *cache, int kind,
                                                              int64_t run, int64_t page_size,
                                                              int64_t dim) {
  const uint8_t *at = kv_run(cache, kind, run, page_size, dim);
  for (int64_t b = 0; b < kv_run_bytes(kind, page_size, dim); b += 64)
    __builtin_prefetch(at + b);
}

static inline __attribute__((always_inline)) float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// An fp8 code's value (mbits mantissa bits, exponent bias `bias`): a normal one by moving
// its bits into a float32's and re-biasing, a subnormal one as its mantissa times the
// smallest step, so that no float32 subnormal is ever made (slow on x86).
static inline __attribute__((always_inline)) float fp8_value(uint8_t b, int mbits, int bias) {
  uint32_t mag = b & 0x7fu;
  float normal = bits_float((mag << (23 - mbits)) + ((uint32_t)(127 - bias) << 23));
  float step = bits_float((uint32_t)(127 + 1 - bias - mbits) << 23);
  float v = (mag >> mbits) ? normal : (float)(mag & ((1u << mbits) - 1)) * step;
  uint32_t u;
  memcpy(&u, &v, 4);
  return bits_float(u | (uint32_t)(b & 0x80u) << 24);
}

// x (|x| within the largest code) as the nearest fp8 code, ties to even.
static inline uint8_t fp8_code(float x, int mbits, int bias) {
  uint32_t u;
  memcpy(&u, &x, 4);
  uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
  u &= 0x7fffffffu;
  if (bits_float(u) < bits_float((uint32_t)(127 + 1 - bias) << 23))  // subnormal steps
    return sign | (uint8_t)nearbyintf(bits_float(u) *
                                      bits_float((uint32_t)(127 - 1 + bias + mbits) << 23));
  int shift = 23 - mbits;
  uint32_t r = u + ((1u << (shift - 1)) - 1) + ((u >> shift) & 1u);
  int e = (int)(r >> 23) - 127 + bias;
  return sign | (uint8_t)((e << mbits) | ((r >> shift) & ((1u << mbits) - 1)));
}

// fp8 codes as float16 bits, which F16C widens exactly (subnormals too): e5m2 is float16's
// top byte; e4m3 is that shifted one bit down (its sign put back), which is its value over
// 256. `codes << 8` a 16-bit lane each: zero bytes interleaved below them.
#if defined(__AVX512F__) || defined(__F16C__)
static inline __attribute__((always_inline)) __m128i fp8_halves(__m128i high, int e4m3) {
  if (!e4m3) return high;
  return _mm_and_si128(_mm_srai_epi16(high, 1), _mm_set1_epi16((short)0xbfff));
}
#endif

// dim fp8 codes' values into `to`, e4m3's over 256 (kv_read_scale makes up for it).
static inline __attribute__((always_inline)) void fp8_row(const uint8_t *c, float *to,
                                                          int64_t dim, int e4m3) {
  int64_t d = 0;
#if defined(__AVX512F__) || defined(__F16C__)
  for (; d + 16 <= dim; d += 16) {
    __m128i codes = _mm_loadu_si128((const __m128i *)(c + d)), zero = _mm_setzero_si128();
    __m128i lo = fp8_halves(_mm_unpacklo_epi8(zero, codes), e4m3);
    __m128i hi = fp8_halves(_mm_unpackhi_epi8(zero, codes), e4m3);
#if defined(__AVX512F__)
    _mm512_storeu_ps(to + d, _mm512_cvtph_ps(_mm256_set_m128i(hi, lo)));
#else
    _mm256_storeu_ps(to + d, _mm256_cvtph_ps(lo));
    _mm256_storeu_ps(to + d + 8, _mm256_cvtph_ps(hi));
#endif
  }
#endif
  for (; d < dim; d++) to[d] = e4m3 ? fp8_value(c[d], 3, 7) / 256.f : fp8_value(c[d], 2, 15);
}

// Token j's scale as readers apply it to kv_token's values (1 for float runs).
static inline __attribute__((always_inline)) float kv_read_scale(const uint8_t *run, int kind,
                                                                 int64_t j, int64_t page_size,
                                                                 int64_t dim) {
  if (kind < KV_E4M3) return 1.f;
  uint32_t e = run[page_size * dim + j];  // 2^(e - 127); e4m3 read as its value over 256
  return bits_float(e << 23) * (kind == KV_E4M3 ? 256.f : 1.f);
}

// Token j of a run as float32 (8-bit: its codes' values; e4m3's over 256): the cache's own
// for float32, else converted into `to`. Times kv_read_scale: the value.
static inline __attribute__((always_inline)) const float *kv_token(const uint8_t *run, int kind,
                                                                   int64_t j, int64_t dim,
                                                                   float *to) {
  if (kind == KV_F32) return (const float *)run + j * dim;
  if (kind == KV_BF16) {
    const uint16_t *c = (const uint16_t *)run + j * dim;
#pragma omp simd
    for (int64_t d = 0; d < dim; d++) to[d] = bf16_to_float(c[d]);
    return to;
  }
  const uint8_t *c = run + j * dim;
  if (kind == KV_I8) {
#pragma omp simd
    for (int64_t d = 0; d < dim; d++) to[d] = (float)(int8_t)c[d];
  } else {
    fp8_row(c, to, dim, kind == KV_E4M3);
  }
  return to;
}

static inline float kv_qmax(int kind) {  // the largest code (kv_cache.py's QMAX)
  return kind == KV_E4M3 ? 448.f : kind == KV_E5M2 ? 57344.f : 127.f;
}

static inline int kv_shift(int kind) {  // a token's largest over its scale: below 2^this
  return kind == KV_E4M3 ? 8 : kind == KV_E5M2 ? 15 : 7;
}

static inline __attribute__((always_inline)) uint8_t kv_code(float x, int kind) {
  float q = kv_qmax(kind);
  x = x > q ? q : x < -q ? -q : x;
  if (kind == KV_I8) return (uint8_t)(int8_t)nearbyintf(x);
  return kind == KV_E4M3 ? fp8_code(x, 3, 7) : fp8_code(x, 2, 15);
}

// Token `at` of an 8-bit run from float32 x[dim]: its scale 2^e from its largest
// magnitude alone (KVLayout.store), its codes x / 2^e (exact) rounded.
static inline void kv_store_token(uint8_t *run, int kind, int64_t page_size, int64_t dim,
                                  int64_t at, const float *x) {
  float amax = 0.f;
  for (int64_t d = 0; d < dim; d++) amax = fmaxf(amax, fabsf(x[d]));
  int k;
  frexpf(amax, &k);  // amax = m 2^k, m in [0.5, 1); 0 for 0
  int e = k - kv_shift(kind);
  e = e < -127 ? -127 : e > 127 ? 127 : e;
  for (int64_t d = 0; d < dim; d++) run[at * dim + d] = kv_code(ldexpf(x[d], -e), kind);
  run[page_size * dim + at] = (uint8_t)(e + 127);
}

// x [n, kv_heads, dim] float32 (token t's at x + t * stride) into token slots slots[n]
// (page * page_size + offset) of one layer's 8-bit pages.
static inline void kv_store_8bit(void *cache, int kind, int64_t kv_heads, int64_t page_size,
                                 int64_t dim, const int64_t *slots, int64_t n, const float *x,
                                 int64_t stride) {
#pragma omp parallel for if (n * kv_heads >= 256)
  for (int64_t i = 0; i < n * kv_heads; i++) {
    int64_t t = i / kv_heads, h = i % kv_heads, page = slots[t] / page_size;
    uint8_t *run = (uint8_t *)kv_run(cache, kind, page * kv_heads + h, page_size, dim);
    kv_store_token(run, kind, page_size, dim, slots[t] % page_size, x + t * stride + h * dim);
  }
}
