// A decoder layer's elementwise steps on the CPU, one call each where PyTorch takes
// several ops (and a few microseconds of dispatch per op): the residual add with the
// RMSNorm after it, rotate-half RoPE of q and k together, in place, and silu(gate) * up
// (or GELU(gate) * up, Gemma's).
// The CPU twin of layer_kernels.py's Triton kernels, with the same arithmetic: float32 inside, the
// residual rounded to its dtype before it is normed. Tensors are float32 or bfloat16
// (`bf16`); rows may be strided, a row's elements are contiguous. Built on the host by
// cluster/engine/kernels/native.py; loops left to the compiler to vectorize.

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bfloat16.h"
#include "lanes.h"

static inline __attribute__((always_inline)) void add_rms_norm_rows(
    void *x, const void *delta, const void *weight, void *h, int64_t rows, int64_t hidden,
    int64_t stride_x, int64_t stride_d, int64_t stride_h, float eps, int bf16) {
#pragma omp parallel for schedule(static) if (rows > 16)
  for (int64_t r = 0; r < rows; r++) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < hidden; i++) {
      float v = rounded(get(x, r * stride_x + i, bf16) + get(delta, r * stride_d + i, bf16), bf16);
      put(x, r * stride_x + i, v, bf16);
      sum += v * v;
    }
    float inv = 1.f / sqrtf(sum / (float)hidden + eps);
#pragma omp simd
    for (int64_t i = 0; i < hidden; i++)
      put(h, r * stride_h + i, get(x, r * stride_x + i, bf16) * inv * get(weight, i, bf16), bf16);
  }
}

// x += delta (rounded to x's dtype), h = RMSNorm(x) * weight; x, delta, h [rows, hidden].
void add_rms_norm(void *x, const void *delta, const void *weight, void *h, int64_t rows,
                  int64_t hidden, int64_t stride_x, int64_t stride_d, int64_t stride_h,
                  float eps, int bf16) {
  if (bf16)
    add_rms_norm_rows(x, delta, weight, h, rows, hidden, stride_x, stride_d, stride_h, eps, 1);
  else
    add_rms_norm_rows(x, delta, weight, h, rows, hidden, stride_x, stride_d, stride_h, eps, 0);
}

static inline __attribute__((always_inline)) void rms_norm_heads_rows(
    void *x, const void *weight, int64_t tokens, int64_t heads, int64_t dim, int64_t stride_t,
    float eps, int bf16) {
#pragma omp parallel for schedule(static) if (tokens > 16)
  for (int64_t t = 0; t < tokens; t++) {
    for (int64_t hd = 0; hd < heads; hd++) {
      int64_t row = t * stride_t + hd * dim;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < dim; i++) {
        float v = get(x, row + i, bf16);
        sum += v * v;
      }
      float inv = 1.f / sqrtf(sum / (float)dim + eps);
#pragma omp simd
      for (int64_t i = 0; i < dim; i++)
        put(x, row + i, get(x, row + i, bf16) * inv * get(weight, i, bf16), bf16);
    }
  }
}

// Each head of x [tokens, heads, dim] (rows stride_t apart) = RMSNorm(head) * weight [dim],
// in place: Qwen3's norm over each q and each k head before RoPE.
void rms_norm_heads(void *x, const void *weight, int64_t tokens, int64_t heads, int64_t dim,
                    int64_t stride_t, float eps, int bf16) {
  if (bf16)
    rms_norm_heads_rows(x, weight, tokens, heads, dim, stride_t, eps, 1);
  else
    rms_norm_heads_rows(x, weight, tokens, heads, dim, stride_t, eps, 0);
}

static inline __attribute__((always_inline)) void rope_rows(
    void *x, const int64_t *positions, const void *cos, const void *signed_sin, int64_t tokens,
    int64_t heads, int64_t dim, int64_t stride_t, int64_t stride_h, int64_t stride_c,
    int bf16) {
  int64_t half = dim / 2;
#pragma omp parallel for schedule(static) if (tokens > 16)
  for (int64_t t = 0; t < tokens; t++) {
    int64_t table = positions[t] * stride_c;
    for (int64_t hd = 0; hd < heads; hd++) {
      int64_t row = t * stride_t + hd * stride_h;
#pragma omp simd
      for (int64_t i = 0; i < half; i++) {
        float x1 = get(x, row + i, bf16), x2 = get(x, row + half + i, bf16);
        float y1 = x1 * get(cos, table + i, bf16) + x2 * get(signed_sin, table + i, bf16);
        float y2 = x2 * get(cos, table + half + i, bf16) +
                   x1 * get(signed_sin, table + half + i, bf16);
        put(x, row + i, y1, bf16);
        put(x, row + half + i, y2, bf16);
      }
    }
  }
}

// x [tokens, heads, dim] rotated in place by the cos and signed-sin (cat(-sin, sin)) table
// rows of each token's position: x * cos + roll(x, dim / 2) * signed_sin.
void rope(void *x, const int64_t *positions, const void *cos, const void *signed_sin,
          int64_t tokens, int64_t heads, int64_t dim, int64_t stride_t, int64_t stride_h,
          int64_t stride_c, int bf16) {
  if (bf16)
    rope_rows(x, positions, cos, signed_sin, tokens, heads, dim, stride_t, stride_h, stride_c, 1);
  else
    rope_rows(x, positions, cos, signed_sin, tokens, heads, dim, stride_t, stride_h, stride_c, 0);
}

// silu(g) = g / (1 + e^-g), from e = e^-|g| (never overflows): g / (1 + e) for g >= 0,
// g e / (1 + e) below.
static inline __attribute__((always_inline)) lanes silu(lanes g) {
  lanes e = exp_nonpositive(pick(g < 0.f, g, -g));
  return g * pick(g < 0.f, e, (lanes){0} + 1.f) / (1.f + e);
}

// GELU's tanh approximation (Gemma's), 0.5 g (1 + tanh(u)) with u = sqrt(2 / pi) (g +
// 0.044715 g^3): as 0.5 (1 + tanh(u)) = sigmoid(2u), g sigmoid(2u), from e = e^-|2u| as silu.
static inline __attribute__((always_inline)) lanes gelu_tanh(lanes g) {
  lanes z = 1.5957691216f * (g + 0.044715f * g * g * g);  // 2u
  lanes e = exp_nonpositive(pick(z < 0.f, z, -z));
  return g * pick(z < 0.f, e, (lanes){0} + 1.f) / (1.f + e);
}

static inline __attribute__((always_inline)) lanes act(lanes g, int gelu) {
  return gelu ? gelu_tanh(g) : silu(g);
}

typedef uint16_t halves __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t words __attribute__((vector_size(LANES * sizeof(uint32_t))));

static inline __attribute__((always_inline)) lanes widen_lanes(halves h) {  // bf16_to_float's
  return (lanes)(__builtin_convertvector(h, words) << 16);
}

static inline __attribute__((always_inline)) halves narrow_lanes(lanes f) {  // float_to_bf16's
  words u = (words)f;
  words nearest = (u + 0x7fff + ((u >> 16) & 1)) >> 16, nan = (u >> 16) | 0x40;
  words picked = (words)pick((mask)((u & 0x7fffffff) > 0x7f800000), (lanes)nan, (lanes)nearest);
  return __builtin_convertvector(picked, halves);
}

// act(gate) * up for LANES of each, as PyTorch's F.silu(gate) * up (or F.gelu's): the
// activation rounded to the dtype, then the product.
static inline __attribute__((always_inline)) void act_mul_lanes(const void *gate,
                                                                const void *up, void *out,
                                                                int bf16, int gelu) {
  if (bf16) {
    halves g, u;
    memcpy(&g, gate, sizeof g);
    memcpy(&u, up, sizeof u);
    halves s =
        narrow_lanes(widen_lanes(narrow_lanes(act(widen_lanes(g), gelu))) * widen_lanes(u));
    memcpy(out, &s, sizeof s);
  } else {
    store(out, act(load(gate), gelu) * load(up));
  }
}

static inline __attribute__((always_inline)) void act_mul_rows(const void *gate_up, void *out,
                                                               int64_t rows, int64_t inner,
                                                               int bf16, int gelu) {
  int64_t item = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (rows > 4)
  for (int64_t r = 0; r < rows; r++) {
    const char *gate = (const char *)gate_up + r * 2 * inner * item, *up = gate + inner * item;
    char *o = (char *)out + r * inner * item;
    int64_t i = 0;
    for (; i + LANES <= inner; i += LANES)
      act_mul_lanes(gate + i * item, up + i * item, o + i * item, bf16, gelu);
    if (i < inner) {  // the last, partial: through a zero-padded copy
      char g[LANES * 4] = {0}, u[LANES * 4] = {0}, y[LANES * 4];
      memcpy(g, gate + i * item, (size_t)((inner - i) * item));
      memcpy(u, up + i * item, (size_t)((inner - i) * item));
      act_mul_lanes(g, u, y, bf16, gelu);
      memcpy(o + i * item, y, (size_t)((inner - i) * item));
    }
  }
}

// out [rows, inner] = silu(gate) * up of gate_up [rows, 2 * inner] (gate first), contiguous.
void silu_mul(const void *gate_up, void *out, int64_t rows, int64_t inner, int bf16) {
  if (bf16)
    act_mul_rows(gate_up, out, rows, inner, 1, 0);
  else
    act_mul_rows(gate_up, out, rows, inner, 0, 0);
}

// out = gelu_tanh(gate) * up, as silu_mul (Gemma's MLP).
void gelu_mul(const void *gate_up, void *out, int64_t rows, int64_t inner, int bf16) {
  if (bf16)
    act_mul_rows(gate_up, out, rows, inner, 1, 1);
  else
    act_mul_rows(gate_up, out, rows, inner, 0, 1);
}
