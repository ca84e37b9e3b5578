// bfloat16 <-> float32 as torch converts: widening is exact; narrowing rounds to nearest
// even, and a NaN stays a (quiet) NaN. Shared by the C kernels beside it; native.py hashes
// the headers here into each kernel's build key.
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
