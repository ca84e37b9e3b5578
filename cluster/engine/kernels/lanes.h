// Vector registers as GCC's vector types, for the C kernels beside it: LANES floats (16
// with AVX-512, else 8), loads and stores, a lane-wise choice, and e^x for x <= 0. native.py
// hashes the headers here into each kernel's build key.
#pragma once

#include <stdint.h>
#include <string.h>

#ifdef __AVX512F__
enum { LANES = 16 };
#else
enum { LANES = 8 };
#endif

typedef float lanes __attribute__((vector_size(LANES * sizeof(float))));  // a register
typedef int32_t mask __attribute__((vector_size(LANES * sizeof(int32_t))));  // a comparison's

static inline __attribute__((always_inline)) lanes load(const float *p) {
  lanes v;
  memcpy(&v, p, sizeof v);
  return v;
}

static inline __attribute__((always_inline)) void store(float *p, lanes v) {
  memcpy(p, &v, sizeof v);
}

static inline __attribute__((always_inline)) lanes pick(mask m, lanes a, lanes b) {
  return (lanes)((m & (mask)a) | (~m & (mask)b));  // a where m, else b
}

// e^x for x <= 0 (a score less its row's max): x = n ln2 + r, |r| <= ln2 / 2, e^r by
// Cephes' polynomial (within 2 ulp of expf), times 2^n made from its bits; n rounded by
// adding and taking away 1.5 * 2^23. Below -87.3 it gives 2^-126, not the 0 it rounds to.
static inline __attribute__((always_inline)) lanes exp_nonpositive(lanes x) {
  x = pick(x < -87.3f, (lanes){0} - 87.3f, x);
  lanes n = (x * 1.44269504f + 12582912.f) - 12582912.f;
  lanes r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  lanes p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * (lanes)((__builtin_convertvector(n, mask) + 127) << 23);
}
