// bfloat16 <-> float32 as torch converts: widening is exact; narrowing rounds to nearest
// even, and a NaN stays a (quiet) NaN. Values, arrays, and an element of a tensor of
// either dtype (`bf16`). Shared by the C kernels beside it; native.py hashes the headers
// here into each kernel's build key.
#pragma once

#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  uint16_t rounded = (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
  return (u & 0x7fffffff) > 0x7f800000 ? (uint16_t)((u >> 16) | 0x40) : rounded;
}

static inline void widen(const uint16_t *from, float *to, int64_t count) {
#pragma omp simd
  for (int64_t i = 0; i < count; i++) to[i] = bf16_to_float(from[i]);
}

static inline void narrow(const float *from, uint16_t *to, int64_t count) {
#pragma omp simd
  for (int64_t i = 0; i < count; i++) to[i] = float_to_bf16(from[i]);
}

static inline float get(const void *p, int64_t i, int bf16) {  // element i as float32
  return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void put(void *p, int64_t i, float f, int bf16) {  // f into element i
  if (bf16)
    ((uint16_t *)p)[i] = float_to_bf16(f);
  else
    ((float *)p)[i] = f;
}

static inline float rounded(float f, int bf16) {  // f as its dtype holds it
  return bf16 ? bf16_to_float(float_to_bf16(f)) : f;
}
