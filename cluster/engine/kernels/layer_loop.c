// The decoder layers of one CPU step in one call: the sequence model.py's forward runs,
// layer by layer, on the same kernels (qmatmul.c, paged_attention.c, layer_ops.c), called
// through pointers the caller takes from their loaded builds. A step's numbers are
// therefore the eager step's, bit for bit; what goes is the Python and PyTorch dispatch
// between the kernels (about 20 calls a layer). Built on the host by native.py.
//
// Every matrix is one of qmatmul.c's (quantized groups); activations are float32 or
// bfloat16 (`bf16`), the KV cache the same or 8-bit (`kv_kind`, kv_pages.h). Rows run
// decodes first, then prefill chunks, as attention_cpu.py lays them out.

#include <stdint.h>
#include <string.h>

#include "bfloat16.h"
#include "kv_pages.h"

typedef int (*qmatmul_fn)(const void *, int, int64_t, int64_t, const uint8_t *, int64_t, int,
                          void *, int);
typedef int (*decode_fn)(const float *, float *, int64_t, int64_t, int64_t, const void *,
                         const void *, int, int64_t, const int64_t *, int64_t, const int64_t *,
                         int64_t, float, int64_t, float);
typedef int (*prefill_fn)(const float *, float *, int64_t, int64_t, int64_t, const void *,
                          const void *, int, int64_t, const int64_t *, int64_t, int64_t, float,
                          int64_t, float);
typedef void (*norm_fn)(void *, const void *, const void *, void *, int64_t, int64_t, int64_t,
                        int64_t, int64_t, float, int);
typedef void (*rope_fn)(void *, const int64_t *, const void *, const void *, int64_t, int64_t,
                        int64_t, int64_t, int64_t, int64_t, int);
typedef void (*silu_fn)(const void *, void *, int64_t, int64_t, int);
typedef void (*heads_norm_fn)(void *, const void *, int64_t, int64_t, int64_t, int64_t, float,
                              int);

typedef struct {  // y [n, rows] = x @ w.T (+ bias)
  const uint8_t *packed;  // qmatmul.c's bands
  int64_t rows, bits;
  const void *bias;  // [rows] or NULL
} Matrix;

typedef struct {
  const void *input_norm, *post_norm;
  Matrix qkv, o, gate_up, down;
  void *k_cache, *v_cache;  // runs of (page, KV head) (kv_pages.h)
  const void *q_norm, *k_norm;  // Qwen3's [dim] each, or NULL
  // Gemma 2's and 3's: attention's and the MLP's outputs RMSNorm'd before they are added
  // ([hidden] each, or NULL), the layer's own RoPE tables (NULL: the model's)
  const void *attn_out_norm, *mlp_out_norm, *cos, *signed_sin;
  double scale, softcap;  // q . k times scale, then soft-capped (0: not)
  int64_t window;  // the last `window` tokens only (0: all)
} Layer;

typedef struct {
  int64_t hidden, heads, kv_heads, dim, inner, page_size, bf16, kv_kind;
  double eps;  // RMSNorm's epsilon
  const void *cos, *signed_sin;  // RoPE tables [positions, dim]
  qmatmul_fn qmatmul;
  decode_fn paged_attention;
  prefill_fn paged_prefill;
  norm_fn add_rms_norm;
  rope_fn rope;
  silu_fn act_mul;  // silu(gate) * up, or Gemma's GELU
  heads_norm_fn rms_norm_heads;
  const Layer *layers;
} Model;

typedef struct {
  int64_t n;  // rows
  const int64_t *positions, *slots;  // [n]
  int64_t decodes;  // rows [0, decodes) are decodes, over these pages and lengths
  const int64_t *decode_pages, *decode_lens;
  int64_t decode_width;
  int64_t chunks;  // then prefill chunks: each (first row, rows, context, its pages' address)
  const int64_t *chunk;
  // The residual [n, hidden], in place; `h` holds layer `first`'s input norm on entry
  // when first is 0, and `delta` the MLP output of layer first - 1 otherwise; on return
  // `delta` holds the last layer's. The rest is scratch.
  void *x, *h, *delta, *qkv, *a, *gate_up, *act;
  float *qf, *af;  // [n, heads * dim] queries and attention's output, float32
} Step;

static int project(const Model *m, const Matrix *w, const void *x, int64_t n, int64_t k,
                   void *y) {
  int bf16 = (int)m->bf16;
  if (m->qmatmul(x, bf16, n, k, w->packed, w->rows, (int)w->bits, y, bf16)) return -1;
  if (w->bias)  // as PyTorch's y + bias: the sum rounded to the dtype
    for (int64_t r = 0; r < n; r++)
      for (int64_t j = 0; j < w->rows; j++)
        put(y, r * w->rows + j, get(y, r * w->rows + j, bf16) + get(w->bias, j, bf16), bf16);
  return 0;
}

// Layer i's K and V rows into their slots (each KV head into its run of the page), its
// queries into qf as float32. 8-bit pages take K and V as float32, staged in af (free
// until attention writes it).
static void store_kv(const Model *m, const Step *s, const Layer *l) {
  int64_t item = m->bf16 ? 2 : 4, q = m->heads * m->dim, kv = m->kv_heads * m->dim;
  int64_t row = l->qkv.rows, ps = m->page_size, size = m->dim * item;
  int scaled = m->kv_kind >= KV_E4M3;
  for (int64_t t = 0; t < s->n; t++) {
    const char *src = (const char *)s->qkv + t * row * item;
    if (scaled) {  // K then V of row t, float32, at af + t * 2 * kv
      float *staged = s->af + t * 2 * kv;
      for (int64_t i = 0; i < 2 * kv; i++) staged[i] = get(src, q + i, (int)m->bf16);
    }
    int64_t page = s->slots[t] / ps, offset = s->slots[t] % ps;
    for (int64_t h = 0; h < m->kv_heads && !scaled; h++) {
      int64_t at = ((page * m->kv_heads + h) * ps + offset) * size;
      memcpy((char *)l->k_cache + at, src + (q + h * m->dim) * item, (size_t)size);
      memcpy((char *)l->v_cache + at, src + (q + kv + h * m->dim) * item, (size_t)size);
    }
    if (m->bf16)
      widen((const uint16_t *)src, s->qf + t * q, q);
    else
      memcpy(s->qf + t * q, src, (size_t)(q * 4));
  }
  if (scaled) {
    kv_store_8bit(l->k_cache, (int)m->kv_kind, m->kv_heads, ps, m->dim, s->slots, s->n, s->af,
                  2 * kv);
    kv_store_8bit(l->v_cache, (int)m->kv_kind, m->kv_heads, ps, m->dim, s->slots, s->n,
                  s->af + kv, 2 * kv);
  }
}

static int attend(const Model *m, const Step *s, const Layer *l) {
  int64_t q = m->heads * m->dim;
  int bf16 = (int)m->bf16, kind = (int)m->kv_kind;
  float scale = (float)l->scale, softcap = (float)l->softcap;
  if (s->decodes && m->paged_attention(s->qf, s->af, m->heads, m->kv_heads, m->dim, l->k_cache,
                                       l->v_cache, kind, m->page_size, s->decode_pages,
                                       s->decode_width, s->decode_lens, s->decodes, scale,
                                       l->window, softcap))
    return -1;
  for (int64_t c = 0; c < s->chunks; c++) {
    const int64_t *at = s->chunk + 4 * c;  // first row, rows, context, pages
    if (m->paged_prefill(s->qf + at[0] * q, s->af + at[0] * q, m->heads, m->kv_heads, m->dim,
                         l->k_cache, l->v_cache, kind, m->page_size,
                         (const int64_t *)(intptr_t)at[3], at[2], at[1], scale, l->window,
                         softcap))
      return -1;
  }
  if (bf16) narrow(s->af, (uint16_t *)s->a, s->n * q);
  return 0;
}

// Layers [first, last) of the step. Returns 0, or -1 when a kernel had no scratch memory.
int layer_loop(const Model *m, const Step *s, int64_t first, int64_t last) {
  int64_t n = s->n, hidden = m->hidden, q = m->heads * m->dim;
  int bf16 = (int)m->bf16;
  float eps = (float)m->eps;
  void *a = bf16 ? s->a : (void *)s->af;
  for (int64_t i = first; i < last; i++) {
    const Layer *l = &m->layers[i];
    if (i > 0)
      m->add_rms_norm(s->x, s->delta, l->input_norm, s->h, n, hidden, hidden, hidden, hidden,
                      eps, bf16);
    if (project(m, &l->qkv, s->h, n, hidden, s->qkv)) return -1;
    if (l->q_norm) {  // Qwen3: each q head, then each k head, RMSNorm'd before RoPE
      char *k = (char *)s->qkv + q * (bf16 ? 2 : 4);
      m->rms_norm_heads(s->qkv, l->q_norm, n, m->heads, m->dim, l->qkv.rows, eps, bf16);
      m->rms_norm_heads(k, l->k_norm, n, m->kv_heads, m->dim, l->qkv.rows, eps, bf16);
    }
    const void *cos = l->cos ? l->cos : m->cos;
    const void *sin = l->cos ? l->signed_sin : m->signed_sin;
    m->rope(s->qkv, s->positions, cos, sin, n, m->heads + m->kv_heads, m->dim, l->qkv.rows,
            m->dim, m->dim, bf16);
    store_kv(m, s, l);
    if (attend(m, s, l)) return -1;
    if (project(m, &l->o, a, n, q, s->delta)) return -1;
    if (l->attn_out_norm)  // each row as one head of hidden, as the eager step norms it
      m->rms_norm_heads(s->delta, l->attn_out_norm, n, 1, hidden, hidden, eps, bf16);
    m->add_rms_norm(s->x, s->delta, l->post_norm, s->h, n, hidden, hidden, hidden, hidden, eps,
                    bf16);
    if (project(m, &l->gate_up, s->h, n, hidden, s->gate_up)) return -1;
    m->act_mul(s->gate_up, s->act, n, m->inner, bf16);
    if (project(m, &l->down, s->act, n, m->inner, s->delta)) return -1;
    if (l->mlp_out_norm)
      m->rms_norm_heads(s->delta, l->mlp_out_norm, n, 1, hidden, hidden, eps, bf16);
  }
  return 0;
}
