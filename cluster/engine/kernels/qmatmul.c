// y = x @ w.T for a matrix of 4-bit or 8-bit weight groups on the CPU's byte dot products:
// 16 output rows at once, one per 32-bit lane (llama.cpp's repacked layouts do the same).
// AVX-512 VNNI (vpdpbusd over a band at once), else AVX2 (vpmaddubsw + vpmaddwd over each
// half of a band); built on the host that runs it (-march=native) by
// cluster/engine/kernels/native.py. Where the CPU has neither, qmatmul_isa() says 0 and torch's
// kernel is used.
//
// Weights: groups of 32 inputs, w = q * d + m, stored in bands of 16 output rows; a band
// holds, for each group in turn:
//   float16 d[16], float16 m[16]   (the band's rows' scales, then offsets)
//   4-bit: 4 x 64 bytes; in part k, lane r's 4 bytes hold row r's inputs 4k..4k+3 in their
//          low nibbles and 16+4k..16+4k+3 in their high nibbles (q unsigned, 0..15)
//   8-bit: int32 qsum[16] (each row's sum of q over the group), then 8 x 64 bytes; in part
//          k, lane r's 4 bytes are row r's inputs 4k..4k+3 (q signed, -128..127)
// Inputs: each row's groups in steps of dx = max|x| / 127 (int8, -127..127, as llama.cpp
// rounds them) plus the remainder in 1/FINE of a step (int8 too: ~15 bits in all), and
// the group's exact float sum for the offsets:
//   y = sum over groups of d * dx * (q . (steps + remainders / FINE)) + m * sum(x)
// Both instructions multiply unsigned by signed bytes. 4-bit weights are the unsigned
// side. With 8-bit ones, VNNI takes the inputs as the unsigned side, shifted by 128, and
// q . xq = q . (xq + 128) - 128 qsum; AVX2 (whose pairs of products must fit int16) takes
// |q| and the inputs with q's sign.
// An output row depends only on its own input row: a batch rounds as each row alone.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bfloat16.h"

#define GROUP 32
#define BAND 16  // output rows in a band: one per lane
#define TILE 4   // input rows multiplied by each band's group once it is loaded
#define FINE 254 // an input's remainder is counted in 1/FINE of its group's step

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define ISA 2
#define SHIFT8 128  // 8-bit weights: the inputs' shift (qsum takes it back)
#include <immintrin.h>

// 16 inputs in units of their group's step: the step count and the remainder in 254ths
// of a step (|remainder| <= 1/2 step, so both fit -127..127), plus `shift`, into out[0..15]
// and out[32..47].
static inline void split(__m512 v, __m512i shift, int8_t *out) {
  __m512i whole = _mm512_cvtps_epi32(v);  // to nearest even, as lrintf
  __m512 rest = _mm512_mul_ps(_mm512_sub_ps(v, _mm512_cvtepi32_ps(whole)), _mm512_set1_ps(FINE));
  __m512i fine = _mm512_cvtps_epi32(rest);
  _mm_storeu_si128((__m128i *)out, _mm512_cvtepi32_epi8(_mm512_add_epi32(whole, shift)));
  _mm_storeu_si128((__m128i *)(out + GROUP), _mm512_cvtepi32_epi8(_mm512_add_epi32(fine, shift)));
}

// x [rows, k] into xq [rows, groups, 2, GROUP] (each group's steps, then its remainders),
// dx (the step, max|x| / 127) and sums [rows, groups].
static void quantize_rows(const float *x, int64_t rows, int64_t k, int shift, int8_t *xq,
                          float *dx, float *sums) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  const __m512i add = _mm512_set1_epi32(shift);
  for (int64_t i = 0; i < rows * (k / GROUP); i++) {
    __m512 a = _mm512_loadu_ps(x + i * GROUP), b = _mm512_loadu_ps(x + i * GROUP + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a),
                                                    _mm512_andnot_ps(sign, b)));
    __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    split(_mm512_mul_ps(a, inv), add, xq + 2 * i * GROUP);
    split(_mm512_mul_ps(b, inv), add, xq + 2 * i * GROUP + 16);
    dx[i] = amax / 127.f;
    sums[i] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  }
}

static inline __m512i bcast(const int8_t *p) {  // 4 input bytes into every lane
  int32_t v;
  memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// One band (16 output rows) against input rows [m0, m0 + tile); inlined where `bits` and
// `tile` are constants, so the loops over them unroll and the sums stay in registers.
static inline __attribute__((always_inline)) void band(const uint8_t *b, int64_t groups, int bits, const int8_t *xq,
                 const float *dx, const float *sums, int64_t m0, int tile, float *y,
                 int64_t ldy, int64_t n0, int64_t n) {
  const int parts = bits == 4 ? 4 : 8;
  const __m512i nib = _mm512_set1_epi8(0x0f);
  __m512 acc[TILE];
  for (int t = 0; t < TILE; t++) acc[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b));
    __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 32)));
    const uint8_t *q = b + (bits == 4 ? 64 : 128);
    __m512i dot[TILE], fine[TILE];  // q . steps and q . remainders
    for (int t = 0; t < TILE; t++) dot[t] = fine[t] = _mm512_setzero_si512();
    for (int p = 0; p < parts; p++) {
      __m512i w = _mm512_loadu_si512((const void *)(q + 64 * p));
      if (bits == 4) {
        __m512i lo = _mm512_and_si512(w, nib);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nib);
        for (int t = 0; t < tile; t++) {
          const int8_t *xg = xq + 2 * ((m0 + t) * groups + g) * GROUP;
          dot[t] = _mm512_dpbusd_epi32(dot[t], lo, bcast(xg + 4 * p));
          dot[t] = _mm512_dpbusd_epi32(dot[t], hi, bcast(xg + 16 + 4 * p));
          fine[t] = _mm512_dpbusd_epi32(fine[t], lo, bcast(xg + GROUP + 4 * p));
          fine[t] = _mm512_dpbusd_epi32(fine[t], hi, bcast(xg + GROUP + 16 + 4 * p));
        }
      } else {
        for (int t = 0; t < tile; t++) {
          const int8_t *xg = xq + 2 * ((m0 + t) * groups + g) * GROUP;
          dot[t] = _mm512_dpbusd_epi32(dot[t], bcast(xg + 4 * p), w);
          fine[t] = _mm512_dpbusd_epi32(fine[t], bcast(xg + GROUP + 4 * p), w);
        }
      }
    }
    // -128 (FINE + 1) qsum: the shift of both inputs taken back (8-bit weights)
    __m512i unshift = _mm512_setzero_si512();
    if (bits == 8)
      unshift = _mm512_mullo_epi32(_mm512_loadu_si512((const void *)(b + 64)),
                                   _mm512_set1_epi32(128 * (FINE + 1)));
    for (int t = 0; t < tile; t++) {
      int64_t i = (m0 + t) * groups + g;
      __m512i sum = _mm512_add_epi32(_mm512_mullo_epi32(dot[t], _mm512_set1_epi32(FINE)), fine[t]);
      __m512 scaled = _mm512_mul_ps(d, _mm512_set1_ps(dx[i] / FINE));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum, unshift)), scaled, acc[t]);
      acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(sums[i]), acc[t]);
    }
    b = q + 64 * parts;
  }
  __mmask16 keep = n - n0 >= BAND ? 0xffff : (__mmask16)((1u << (n - n0)) - 1);
  for (int t = 0; t < tile; t++) _mm512_mask_storeu_ps(y + (m0 + t) * ldy + n0, keep, acc[t]);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ISA 1
#define SHIFT8 0
#include <immintrin.h>

static void quantize_rows(const float *x, int64_t rows, int64_t k, int shift, int8_t *xq,
                          float *dx, float *sums) {
  (void)shift;
  for (int64_t i = 0; i < rows * (k / GROUP); i++) {
    const float *g = x + i * GROUP;
    float amax = 0.f, sum = 0.f;
    for (int j = 0; j < GROUP; j++) amax = fmaxf(amax, fabsf(g[j])), sum += g[j];
    float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int j = 0; j < GROUP; j++) {
      float v = g[j] * inv, whole = rintf(v);
      xq[2 * i * GROUP + j] = (int8_t)whole;
      xq[2 * i * GROUP + GROUP + j] = (int8_t)rintf((v - whole) * FINE);
    }
    dx[i] = amax / 127.f;
    sums[i] = sum;
  }
}

static inline __m256i bcast(const int8_t *p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

static inline __m256i pairs(__m256i u, __m256i s) {  // vpdpbusd's sums, from int16 pairs
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// Half h (8 lanes) of one band against input rows [m0, m0 + tile).
static inline __attribute__((always_inline)) void half(const uint8_t *b, int h,
                                                       int64_t groups, int bits,
                                                       const int8_t *xq, const float *dx,
                                                       const float *sums, int64_t m0,
                                                       int tile, float *y, int64_t ldy,
                                                       int64_t n0, int64_t n) {
  const int parts = bits == 4 ? 4 : 8;
  const __m256i nib = _mm256_set1_epi8(0x0f);
  __m256 acc[TILE];
  for (int t = 0; t < TILE; t++) acc[t] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 16 * h)));
    __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 32 + 16 * h)));
    const uint8_t *q = b + (bits == 4 ? 64 : 128);
    __m256i dot[TILE], fine[TILE];
    for (int t = 0; t < TILE; t++) dot[t] = fine[t] = _mm256_setzero_si256();
    for (int p = 0; p < parts; p++) {
      __m256i w = _mm256_loadu_si256((const __m256i *)(q + 64 * p + 32 * h));
      for (int t = 0; t < tile; t++) {
        const int8_t *xg = xq + 2 * ((m0 + t) * groups + g) * GROUP;
        if (bits == 4) {  // two products of <= 15 * 127 a pair: int16 holds their sum
          __m256i lo = _mm256_and_si256(w, nib);
          __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nib);
          __m256i one = _mm256_set1_epi16(1);
          dot[t] = _mm256_add_epi32(dot[t], _mm256_madd_epi16(
              _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast(xg + 4 * p)),
                               _mm256_maddubs_epi16(hi, bcast(xg + 16 + 4 * p))), one));
          fine[t] = _mm256_add_epi32(fine[t], _mm256_madd_epi16(
              _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast(xg + GROUP + 4 * p)),
                               _mm256_maddubs_epi16(hi, bcast(xg + GROUP + 16 + 4 * p))), one));
        } else {
          __m256i wa = _mm256_abs_epi8(w);
          dot[t] = _mm256_add_epi32(dot[t], pairs(wa, _mm256_sign_epi8(bcast(xg + 4 * p), w)));
          fine[t] = _mm256_add_epi32(
              fine[t], pairs(wa, _mm256_sign_epi8(bcast(xg + GROUP + 4 * p), w)));
        }
      }
    }
    for (int t = 0; t < tile; t++) {
      int64_t i = (m0 + t) * groups + g;
      __m256i sum = _mm256_add_epi32(_mm256_mullo_epi32(dot[t], _mm256_set1_epi32(FINE)), fine[t]);
      __m256 scaled = _mm256_mul_ps(d, _mm256_set1_ps(dx[i] / FINE));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scaled, acc[t]);
      acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(sums[i]), acc[t]);
    }
    b = q + 64 * parts;
  }
  int64_t first = n0 + 8 * h;
  __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - first)), lane);
  for (int t = 0; t < tile; t++) _mm256_maskstore_ps(y + (m0 + t) * ldy + first, keep, acc[t]);
}

static inline __attribute__((always_inline)) void band(const uint8_t *b, int64_t groups,
                                                       int bits, const int8_t *xq,
                                                       const float *dx, const float *sums,
                                                       int64_t m0, int tile, float *y,
                                                       int64_t ldy, int64_t n0, int64_t n) {
  half(b, 0, groups, bits, xq, dx, sums, m0, tile, y, ldy, n0, n);
  if (n - n0 > 8) half(b, 1, groups, bits, xq, dx, sums, m0, tile, y, ldy, n0, n);
}

#else
#define ISA 0
#endif

int qmatmul_isa(void) { return ISA; }

#if ISA
// y [rows, n] = x [rows, k] @ w.T, w in bands as above with `bits` 4 or 8; k a multiple of
// GROUP; x and y float32, or bfloat16 where x_bf16 / y_bf16 say so. Returns 0, or -1 when
// scratch memory cannot be had.
int qmatmul(const void *x, int x_bf16, int64_t rows, int64_t k, const uint8_t *w, int64_t n,
            int bits, void *y, int y_bf16) {
  int64_t groups = k / GROUP, bands = (n + BAND - 1) / BAND;
  int64_t band_bytes = groups * (bits == 4 ? 64 + 4 * 64 : 128 + 8 * 64);
  int8_t *xq = malloc((size_t)(2 * rows * k));
  float *dx = malloc((size_t)(rows * groups) * sizeof(float));
  float *sums = malloc((size_t)(rows * groups) * sizeof(float));
  float *xf = x_bf16 ? malloc((size_t)(rows * k) * sizeof(float)) : NULL;
  float *yf = y_bf16 ? malloc((size_t)(rows * n) * sizeof(float)) : NULL;
  int failed = !xq || !dx || !sums || (x_bf16 && !xf) || (y_bf16 && !yf);
  if (!failed) {
    if (x_bf16) widen(x, xf, rows * k);
    quantize_rows(x_bf16 ? xf : x, rows, k, bits == 8 ? SHIFT8 : 0, xq, dx, sums);
    float *out = y_bf16 ? yf : y;
    // Threads split the bands (torch's OpenMP runtime and thread count: there is one
    // libgomp.so.1 in the process).
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < bands; r++) {
      const uint8_t *b = w + r * band_bytes;
      for (int64_t m0 = 0; m0 < rows; m0 += TILE) {
        int64_t left = rows - m0;
#define BAND_CALL(BITS, T) band(b, groups, BITS, xq, dx, sums, m0, T, out, n, r * BAND, n)
        if (bits == 4) {
          if (left >= 4) BAND_CALL(4, 4); else if (left == 3) BAND_CALL(4, 3);
          else if (left == 2) BAND_CALL(4, 2); else BAND_CALL(4, 1);
        } else {
          if (left >= 4) BAND_CALL(8, 4); else if (left == 3) BAND_CALL(8, 3);
          else if (left == 2) BAND_CALL(8, 2); else BAND_CALL(8, 1);
        }
#undef BAND_CALL
      }
    }
    if (y_bf16) narrow(yf, y, rows * n);
  }
  free(xq);
  free(dx);
  free(sums);
  free(xf);
  free(yf);
  return failed ? -1 : 0;
}

#else

int qmatmul(const void *x, int x_bf16, int64_t rows, int64_t k, const uint8_t *w, int64_t n,
            int bits, void *y, int y_bf16) {
  (void)x, (void)x_bf16, (void)rows, (void)k, (void)w, (void)n, (void)bits, (void)y,
      (void)y_bf16;
  return -1;
}

#endif
