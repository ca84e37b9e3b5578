"""Triton kernels that read and write KV pages where they lie, through the page table.

Layout (cluster/engine/kernels/kv_cache.py's KVLayout): one layer's cache is [pages,
kv_heads, page_size, head_dim] (head-major), so one KV head's tokens of a page are one run
of page_size * head_dim contiguous values; 8-bit pages are the same runs as bytes, each
codes and then a scale byte a token. Keys are found through `table[seq, pos // page_size]`:
no gather copy, no mask tensor. 8-bit codes are read in place and widened exactly to the
matmuls' dtype, and a token's scale multiplies its score (K) and its weight (V), not each
element, as paged_attention.c does. Scores, softmax and accumulators are float32 whatever the
input dtype; float32 inputs multiply in IEEE float32 (no TF32), so a float32 engine
matches the CPU one. Scores are kept in base-2 units (scaled by log2 e once) so the
softmax takes exp2, and only the blocks that hold the context's end (decode) or the
causal diagonal (prefill) are masked; the blocks before them load and score unmasked.

A layer's LayerAttention (Gemma's): its score scale; soft-capping, cap tanh(score / cap)
before the softmax (a constexpr, so plain layers compile without it); a sliding window,
whose keys before it are skipped: a decode's partitions split the window alone, and a
prefill tile masks the blocks at its rows' window starts.

- `rope_store_kv`: RoPE of the step's q (in place) and new K, and the new K/V into their
  slots, in one launch; a slot of -1 (a padding row of a captured graph) writes nothing.
- `paged_decode`: one query token per sequence. A program takes one sequence, one KV
  head (its query heads as the rows of one matrix: GQA shares every key load) and one
  of `num_splits` partitions of the context (split-K, so a single long sequence still
  fills the GPU); each sequence's partition length follows from its own length, so a
  split count fixed by a CUDA graph fits any context, and a partition past the end
  returns at once, storing nothing. `_decode_reduce` merges the partitions a sequence
  used, REDUCE_CHUNK at a time. A sequence of length 0 yields zeros.
- `paged_prefill`: a chunk of queries attends to the pages before it (prefix hits,
  earlier chunks) and to itself causally; its own K/V are already in the cache. A
  program takes a run of tokens and one KV head, its GQA group's query heads as rows
  of the tile, so the group shares every key load.

On a CPU tensor they run under Triton's interpreter (TRITON_INTERPRET=1), as the tests do.

Triton compiles a variant of a kernel per specialisation of its arguments (an integer
== 1 or divisible by 16, a pointer 16-byte aligned). The arguments that change from step
to step (the page table's width, the split count, and the pointers into a step's packed
int32 buffer, at any 4-byte offset) are not specialised: each new combination would
compile a variant, 0.5-2 s, on the engine thread while it serves.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from cluster.engine.kernels.kv_cache import QMAX, SHIFT, KVLayout
from cluster.engine.kernels.layer_attention import PLAIN, LayerAttention
from cluster.engine.kernels.layer_kernels import rotated

LOG2E = math.log2(math.e)  # scores times this: exp(x) = exp2(x * log2 e)
# Each 8-bit dtype as the kernels take it: its Triton type, and how its codes round in
# float32: to steps of 2^(max(b, MIN_EXP) - MBITS) for a value in [2^b, 2^(b+1)) (fp8's
# subnormals below 2^MIN_EXP; int8 steps of 1 throughout, as if every code were subnormal).
CODES = {
    torch.float8_e4m3fn: (tl.float8e4nv, 3, -6),
    torch.float8_e5m2: (tl.float8e5, 2, -14),
    torch.int8: (tl.int8, 7, 7),
}


def _runs(layout: KVLayout) -> tuple[int, tl.dtype | None]:
    """A layout as its kernels take it: (RUN, CODE), a head run's length in the cache
    tensor's elements and (8-bit) the codes' Triton type; None for float pages."""
    code = CODES[layout.dtype][0] if layout.scaled else None
    return layout.head_bytes // layout.tensor_dtype.itemsize, code


def _dot_types(x: torch.Tensor) -> tuple[tl.dtype, str]:
    """The dtype the matmuls take and their float32 precision. Triton's interpreter (a CPU
    tensor) computes bfloat16 arithmetic wrongly (measured: garbage from tl.dot), so there
    bfloat16 values are widened to float32 once loaded; on a GPU they stay bfloat16."""
    if x.dtype == torch.float32 or x.device.type == "cpu":
        return tl.float32, "ieee"
    return tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16, "tf32"


@triton.jit
def _token_scale(amax, SHIFT: tl.constexpr):
    """A token-head's scale from its largest magnitude, as KVLayout.store sets it: (2^-e,
    its byte 127 + e) for e = clamp(k - SHIFT, -127, 127), amax = m 2^k with m in [0.5, 1)
    (k = 0 for 0; a subnormal amax clamps to -127 as frexp's k would)."""
    k = tl.where(amax > 0, ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126, 0)
    e = tl.minimum(tl.maximum(k - SHIFT, -127), 127)
    return ((127 - e) << 23).to(tl.float32, bitcast=True), (e + 127).to(tl.uint8)


@triton.jit
def _codes(
    x, CODE: tl.constexpr, QMAX: tl.constexpr, MBITS: tl.constexpr, MIN_EXP: tl.constexpr
):  # fmt: skip
    """float32 values (over their scale) as the bytes of their nearest codes, ties to even
    (KVLayout._code). Rounded here, (x + c) - c with c 1.5 x 2^23 of x's steps (float32's
    own round to nearest even), so the cast after is exact: Triton's interpreter's fp8
    cast does not round to even."""
    x = tl.minimum(tl.maximum(x, -QMAX), QMAX)
    binade = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, MIN_EXP)
    c = (((binade - MBITS + 150) << 23) | 0x400000).to(tl.float32, bitcast=True)
    return ((x + c) - c).to(CODE).to(tl.uint8, bitcast=True)


@triton.jit
def _put(
    dst, x, mask, inv, CODE: tl.constexpr, QMAX: tl.constexpr, MBITS: tl.constexpr,
    MIN_EXP: tl.constexpr,
):  # fmt: skip
    """float32 values x into a run at dst: as the cache's dtype, or (8-bit) as codes of x
    times its token's 2^-e."""
    if CODE is None:
        tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)
    else:
        tl.store(dst, _codes(x * inv, CODE, QMAX, MBITS, MIN_EXP), mask=mask)


@triton.jit(do_not_specialize_on_alignment=["slots", "positions"])
def _rope_store_kernel(
    q, k, v, k_cache, v_cache, slots, positions, cos, signed_sin,
    stride_q, stride_k, stride_v, stride_c,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr,
    D_PAD: tl.constexpr, RUN: tl.constexpr, CODE: tl.constexpr, QMAX: tl.constexpr,
    SHIFT: tl.constexpr, MBITS: tl.constexpr, MIN_EXP: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)  # query heads, then KV heads
    half = tl.arange(0, D_PAD // 2)
    hmask = half < D // 2
    table = tl.load(positions + t).to(tl.int64) * stride_c
    if h < HEADS:  # a query head: rotated in place
        row = q + t * stride_q + h * D
        y1, y2 = rotated(row, cos + table, signed_sin + table, half, hmask, D // 2)
        tl.store(row + half, y1.to(q.dtype.element_ty), mask=hmask)
        tl.store(row + D // 2 + half, y2.to(q.dtype.element_ty), mask=hmask)
    else:  # a KV head: its key rotated and its value, into the token's slot
        slot = tl.load(slots + t).to(tl.int64)
        if slot >= 0:
            kv = h - HEADS
            run = (slot // PAGE * KV_HEADS + kv) * RUN
            at = slot % PAGE
            row = k + t * stride_k + kv * D
            y1, y2 = rotated(row, cos + table, signed_sin + table, half, hmask, D // 2)
            dims = tl.arange(0, D_PAD)
            dmask = dims < D
            values = tl.load(v + t * stride_v + kv * D + dims, mask=dmask, other=0)
            values = values.to(tl.float32)
            k_inv = 1.0
            v_inv = 1.0
            if CODE is not None:  # each token-head's scale, after its codes
                amax = tl.maximum(tl.max(tl.abs(y1), 0), tl.max(tl.abs(y2), 0))
                k_inv, k_byte = _token_scale(amax, SHIFT)
                v_inv, v_byte = _token_scale(tl.max(tl.abs(values), 0), SHIFT)
                tl.store(k_cache + run + PAGE * D + at, k_byte)
                tl.store(v_cache + run + PAGE * D + at, v_byte)
            dst = run + at * D
            _put(k_cache + dst + half, y1, hmask, k_inv, CODE, QMAX, MBITS, MIN_EXP)
            _put(k_cache + dst + D // 2 + half, y2, hmask, k_inv, CODE, QMAX, MBITS, MIN_EXP)
            _put(v_cache + dst + dims, values, dmask, v_inv, CODE, QMAX, MBITS, MIN_EXP)


def rope_store_kv(
    q: torch.Tensor,  # [N, heads, head_dim], rows may be strided: rotated in place
    k: torch.Tensor,  # [N, kv_heads, head_dim], before RoPE
    v: torch.Tensor,
    k_cache: torch.Tensor,  # one layer's pages (layout.layer_shape), contiguous
    v_cache: torch.Tensor,
    layout: KVLayout,
    slots: torch.Tensor,  # [N] int32 or int64; -1 writes nothing
    positions: torch.Tensor,  # [N] int32 or int64
    cos: torch.Tensor,  # [max_position, head_dim], contiguous (model.LlamaModel's tables)
    signed_sin: torch.Tensor,  # [max_position, head_dim]: cat(-sin, sin)
) -> None:
    """RoPE of q and k (model.rotate) and the rotated k and v into their slots: one launch
    where a RoPE kernel and a store kernel took two and a round trip of q and k. 8-bit:
    bit for bit KVLayout.store's bytes."""
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    for x in (q, k, v):
        assert x.stride(1) == dim and x.stride(2) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and cos.is_contiguous()
    run, code = _runs(layout)
    _, mbits, min_exp = CODES.get(layout.dtype, (None, 0, 0))
    _rope_store_kernel[(tokens, heads + kv_heads)](
        q, k, v, k_cache, v_cache, slots, positions, cos, signed_sin,
        q.stride(0), k.stride(0), v.stride(0), cos.stride(0),
        heads, kv_heads, layout.page_size, dim, max(2, triton.next_power_of_2(dim)), run, code,
        QMAX.get(layout.dtype, 0.0), SHIFT.get(layout.dtype, 0), mbits, min_exp,
    )  # fmt: skip


@triton.jit
def _key_offsets(
    table_row, kpos, kmask, kv_head, PAGE: tl.constexpr, KV_HEADS, D: tl.constexpr,
    RUN: tl.constexpr,
):  # fmt: skip
    """Offsets, in the cache tensor's elements, of keys at positions `kpos` of one KV head,
    through the page table: ([keys, D] of their values, [keys] of (8-bit) their scales)."""
    page = tl.load(table_row + kpos // PAGE, mask=kmask, other=0).to(tl.int64)
    run = (page * KV_HEADS + kv_head) * RUN
    at = kpos % PAGE
    return (run + at * D)[:, None] + tl.arange(0, D)[None, :], run + PAGE * D + at


@triton.jit
def _token_scales(cache, at, kmask):
    """8-bit: the scales of the tokens whose bytes are at `at`, 2^(byte - 127) (byte 0 as 0,
    as paged_attention.c reads it); 0 where not `kmask`."""
    byte = tl.load(cache + at, mask=kmask, other=0).to(tl.int32)
    return (byte << 23).to(tl.float32, bitcast=True)


@triton.jit
def _load_keys(cache, offs, kmask, DOT: tl.constexpr, CODE: tl.constexpr, MASKED: tl.constexpr):
    """A block's keys (or values) as the matmuls' dtype: 8-bit codes widened exactly."""
    x = tl.load(cache + offs, mask=kmask[:, None], other=0) if MASKED else tl.load(cache + offs)
    if CODE is not None:
        x = x.to(CODE, bitcast=True)
    return x.to(DOT)


@triton.jit
def _attend(
    qv, k_cache, v_cache, offs, scales, kmask, valid, m_i, l_i, acc, scale, cap,
    DOT: tl.constexpr, PRECISION: tl.constexpr, MASKED: tl.constexpr, CODE: tl.constexpr,
    SOFTCAP: tl.constexpr,
):  # fmt: skip
    """One block of keys into the running softmax (max m_i, sum l_i, weighted values acc,
    in base 2) of the query rows qv. MASKED: `kmask` [keys] limits the loads and `valid`
    [rows, keys] the scores; else every key of the block is there and visible. 8-bit
    (CODE): each key's scale (at `scales`) times its score, each value's times its weight.
    SOFTCAP: scores are cap tanh(x), where q.k scale is 2 x log2(e) (`_score_args`)."""
    kt = _load_keys(k_cache, offs, kmask, DOT, CODE, MASKED)
    s = tl.dot(qv, tl.trans(kt), input_precision=PRECISION)
    if CODE is not None:
        s = s * (scale * _token_scales(k_cache, scales, kmask))[None, :]
    else:
        s = s * scale
    if SOFTCAP:
        s = cap * _tanh_half_log2(s)
    if MASKED:
        s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    shift = m_new
    if MASKED:  # a row that sees no key yet (all below its window): weights 0, not NaN
        shift = tl.where(m_new > float("-inf"), m_new, 0.0)
    p = tl.exp2(s - shift[:, None])
    alpha = tl.exp2(m_i - shift)
    vt = _load_keys(v_cache, offs, kmask, DOT, CODE, MASKED)
    weights = p
    if CODE is not None:
        weights = p * _token_scales(v_cache, scales, kmask)[None, :]
    acc = acc * alpha[:, None] + tl.dot(weights.to(DOT), vt, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _tanh_half_log2(u):
    """tanh(x) of u = 2 x log2(e): Triton's interpreter has no tanh. From exp2(-|u|) in
    (0, 1], which never overflows."""
    e = tl.exp2(-tl.abs(u))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(u < 0, -t, t)


@triton.jit
def _window_start(length, window):
    """The first key a query at position length - 1 sees: its window's (window > 0), else 0."""
    return tl.where(window > 0, tl.maximum(length - window, 0), 0)


def _score_args(attn: LayerAttention, dim: int) -> tuple[float, float, int, bool]:
    """A layer's (scale, cap, window, SOFTCAP) as the kernels take them. Scores are in base
    2: q.k times its scale, times log2(e); soft-capped, softcap tanh(x) log2(e) for x = q.k
    scale / softcap, passed as cap = softcap log2(e) and a scale that makes q.k scale
    `_tanh_half_log2`'s u = 2 x log2(e). Window 0: the whole context."""
    scale = attn.scale_for(dim)
    if attn.softcap is None:
        return scale * LOG2E, 0.0, attn.window or 0, False
    return 2 * LOG2E * scale / attn.softcap, attn.softcap * LOG2E, attn.window or 0, True


@triton.jit
def _partition(length, num_splits, BLOCK_N: tl.constexpr):
    """Tokens per partition of a `length`-token context in `num_splits`: whole key blocks."""
    return tl.maximum(tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N), 1) * BLOCK_N


@triton.jit(
    do_not_specialize=["stride_table", "num_splits"],
    do_not_specialize_on_alignment=["table", "lens"],
)
def _decode_kernel(
    q, k_cache, v_cache, table, lens, part_acc, part_max, part_sum,
    stride_q, stride_table, scale, cap, window, num_splits, kv_heads,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr, RUN: tl.constexpr,
    CODE: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lens + b)
    first = _window_start(length, window)  # the partitions split the keys the query sees
    partition = _partition(length - first, num_splits, BLOCK_N)
    start = first + split * partition
    if start < length:  # a partition past the context stores nothing: the reduce skips it
        end = tl.minimum(length, start + partition)
        rows = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, D)
        qmask = rows < GROUP
        heads = h * GROUP + rows
        qv = tl.load(
            q + b * stride_q + heads[:, None] * D + dims[None, :], mask=qmask[:, None], other=0
        )
        qv = qv.to(DOT)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D], tl.float32)
        table_row = table + b * stride_table
        full = start + (end - start) // BLOCK_N * BLOCK_N  # blocks wholly in the context
        for n0 in range(start, full, BLOCK_N):
            kpos = n0 + tl.arange(0, BLOCK_N)
            kmask = kpos < end  # all true here: only the table's load takes it
            offs, scales = _key_offsets(table_row, kpos, kmask, h, PAGE, kv_heads, D, RUN)
            m_i, l_i, acc = _attend(
                qv, k_cache, v_cache, offs, scales, kmask, kmask[None, :], m_i, l_i, acc, scale,
                cap, DOT, PRECISION, False, CODE, SOFTCAP,
            )  # fmt: skip
        for n0 in range(full, end, BLOCK_N):  # the context's last, partial block
            kpos = n0 + tl.arange(0, BLOCK_N)
            kmask = kpos < end
            offs, scales = _key_offsets(table_row, kpos, kmask, h, PAGE, kv_heads, D, RUN)
            m_i, l_i, acc = _attend(
                qv, k_cache, v_cache, offs, scales, kmask, kmask[None, :], m_i, l_i, acc, scale,
                cap, DOT, PRECISION, True, CODE, SOFTCAP,
            )  # fmt: skip
        part = (b * (kv_heads * GROUP) + heads) * num_splits + split
        tl.store(part_acc + part[:, None] * D + dims[None, :], acc, mask=qmask[:, None])
        tl.store(part_max + part, m_i, mask=qmask)
        tl.store(part_sum + part, l_i, mask=qmask)


REDUCE_CHUNK = 8  # partitions the reduce loads at a time: its tile is [8, head_dim]


@triton.jit(do_not_specialize=["num_splits"], do_not_specialize_on_alignment=["lens"])
def _decode_reduce(
    part_acc, part_max, part_sum, out, lens, stride_out, window, num_splits, heads,
    D: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    length = tl.load(lens + b)
    seen = length - _window_start(length, window)
    used = tl.cdiv(seen, _partition(seen, num_splits, BLOCK_N))
    base = (b * heads + h) * num_splits
    chunk = tl.arange(0, CHUNK)
    # The largest partition max, then the partitions weighted by it: CHUNK at a time, so
    # the tile stays [CHUNK, D] whatever the split count.
    tops = tl.full([CHUNK], -3.0e38, tl.float32)  # finite when no partition is used: no NaN
    for s0 in range(0, used, CHUNK):
        smask = s0 + chunk < used
        tops = tl.maximum(tops, tl.load(part_max + base + s0 + chunk, mask=smask, other=-3.0e38))
    top = tl.max(tops, 0)
    dims = tl.arange(0, D)
    totals = tl.zeros([CHUNK], tl.float32)
    acc = tl.zeros([D], tl.float32)
    for s0 in range(0, used, CHUNK):
        part = base + s0 + chunk
        smask = s0 + chunk < used
        m = tl.load(part_max + part, mask=smask, other=float("-inf"))
        weight = tl.where(smask, tl.exp2(m - top), 0.0)
        totals += tl.load(part_sum + part, mask=smask, other=0.0) * weight
        tile = tl.load(part_acc + part[:, None] * D + dims[None, :], mask=smask[:, None], other=0.0)
        acc += tl.sum(tile * weight[:, None], 0)
    total = tl.sum(totals, 0)
    o = acc / tl.where(total > 0, total, 1.0)
    tl.store(out + b * stride_out + h * D + dims, o.to(out.dtype.element_ty))


def paged_decode(
    q: torch.Tensor,  # [B, heads, head_dim], heads contiguous
    k_cache: torch.Tensor,  # one layer's pages (layout.layer_shape)
    v_cache: torch.Tensor,
    layout: KVLayout,
    table: torch.Tensor,  # [B, width] page ids (int32)
    lens: torch.Tensor,  # [B] context lengths, this token included (int32)
    num_splits: int,  # partitions of each context (attention_triton.decode_splits)
    out: torch.Tensor,  # [B, heads, head_dim] contiguous, q's dtype: the attention output
    block_n: int = 64,
    attn: LayerAttention = PLAIN,
) -> None:
    batch, heads, dim = q.shape
    scale, cap, window, softcap = _score_args(attn, dim)
    kv_heads, page = layout.num_kv_heads, layout.page_size
    group = heads // kv_heads
    assert q.stride(1) == dim and q.stride(2) == 1
    part_acc = q.new_empty((batch, heads, num_splits, dim), dtype=torch.float32)
    part_max = q.new_empty((batch, heads, num_splits), dtype=torch.float32)
    part_sum = torch.empty_like(part_max)
    _decode_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, table, lens, part_acc, part_max, part_sum,
        q.stride(0), table.stride(0), scale, cap, window, num_splits, kv_heads,
        group, max(16, triton.next_power_of_2(group)), dim, page, block_n, *_dot_types(q),
        *_runs(layout), softcap,
    )  # fmt: skip
    assert out.is_contiguous()
    _decode_reduce[(batch, heads)](
        part_acc, part_max, part_sum, out, lens, out.stride(0), window, num_splits, heads,
        dim, REDUCE_CHUNK, block_n,
    )  # fmt: skip


@triton.jit(
    do_not_specialize=["stride_table"],
    do_not_specialize_on_alignment=["table", "lens", "query_start"],
)
def _prefill_kernel(
    q, k_cache, v_cache, out, table, lens, query_start,
    stride_q, stride_qh, stride_out, stride_table, scale, cap, window, kv_heads,
    GROUP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
    TOKENS: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    RUN: tl.constexpr, CODE: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0)
    kv_head = tl.program_id(1)
    first = tl.program_id(2) * TOKENS
    q0 = tl.load(query_start + s)
    num_q = tl.load(query_start + s + 1) - q0
    if first < num_q:
        length = tl.load(lens + s)
        offset = length - num_q  # cached tokens before this chunk
        # Row r is query head kv_head * GROUP + r % GROUP of token first + r // GROUP: the
        # group's heads share every key load, as in decode.
        r = tl.arange(0, BLOCK_M)
        rows = first + r // GROUP
        heads = kv_head * GROUP + r % GROUP
        rmask = (r < TOKENS * GROUP) & (rows < num_q)
        dims = tl.arange(0, D)
        tokens = (q0 + rows).to(tl.int64)
        qv = tl.load(
            q + tokens[:, None] * stride_q + heads[:, None] * stride_qh + dims[None, :],
            mask=rmask[:, None],
            other=0,
        ).to(DOT)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        table_row = table + s.to(tl.int64) * stride_table
        end = tl.minimum(length, offset + first + TOKENS)  # causal: no key past the last row
        # Keys before the tile's first token that every row's window holds (all of them
        # without a window) are unmasked blocks; those from the first row's window start up
        # to there are masked at the windows' edges, and those before it skipped.
        full = (offset + first) // BLOCK_N * BLOCK_N
        lowest = tl.where(window > 0, offset + rows + 1 - window, 0)  # each row's first key
        lo = _window_start(offset + first + 1, window) // BLOCK_N * BLOCK_N
        every = tl.minimum(tl.cdiv(_window_start(end, window), BLOCK_N) * BLOCK_N, full)
        for n0 in range(lo, every, BLOCK_N):  # the windows' starts: masks
            kpos = n0 + tl.arange(0, BLOCK_N)
            kmask = kpos < end  # all true here: only the table's load takes it
            offs, scales = _key_offsets(table_row, kpos, kmask, kv_head, PAGE, kv_heads, D, RUN)
            valid = kpos[None, :] >= lowest[:, None]
            m_i, l_i, acc = _attend(
                qv, k_cache, v_cache, offs, scales, kmask, valid, m_i, l_i, acc, scale, cap,
                DOT, PRECISION, True, CODE, SOFTCAP,
            )  # fmt: skip
        for n0 in range(every, full, BLOCK_N):
            kpos = n0 + tl.arange(0, BLOCK_N)
            kmask = kpos < end  # all true here: only the table's load takes it
            offs, scales = _key_offsets(table_row, kpos, kmask, kv_head, PAGE, kv_heads, D, RUN)
            m_i, l_i, acc = _attend(
                qv, k_cache, v_cache, offs, scales, kmask, kmask[None, :], m_i, l_i, acc, scale,
                cap, DOT, PRECISION, False, CODE, SOFTCAP,
            )  # fmt: skip
        for n0 in range(full, end, BLOCK_N):  # the diagonal: causal masks (and windows')
            kpos = n0 + tl.arange(0, BLOCK_N)
            kmask = kpos < end
            offs, scales = _key_offsets(table_row, kpos, kmask, kv_head, PAGE, kv_heads, D, RUN)
            valid = (kpos[None, :] <= (offset + rows)[:, None]) & kmask[None, :]
            valid &= kpos[None, :] >= lowest[:, None]
            m_i, l_i, acc = _attend(
                qv, k_cache, v_cache, offs, scales, kmask, valid, m_i, l_i, acc, scale, cap,
                DOT, PRECISION, True, CODE, SOFTCAP,
            )  # fmt: skip
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a padding row's window: maybe no key
        dst = out + tokens[:, None] * stride_out + heads[:, None] * D + dims[None, :]
        tl.store(dst, o.to(out.dtype.element_ty), mask=rmask[:, None])


def paged_prefill(
    q: torch.Tensor,  # [N, heads, head_dim]: the chunks' query rows, back to back
    k_cache: torch.Tensor,  # one layer's pages (layout.layer_shape), chunks' K/V stored
    v_cache: torch.Tensor,
    layout: KVLayout,
    table: torch.Tensor,  # [S, width] page ids (int32)
    lens: torch.Tensor,  # [S] context lengths, each chunk included (int32)
    query_start: torch.Tensor,  # [S + 1] chunk s is rows [query_start[s], query_start[s+1])
    max_query_len: int,
    out: torch.Tensor,  # [N, heads, head_dim], q's dtype: rows of the chunks are written
    block_m: int = 64,  # rows of a program's tile: tokens x the GQA group's query heads
    block_n: int = 64,
    attn: LayerAttention = PLAIN,
) -> None:
    heads, dim = q.shape[1], q.shape[2]
    scale, cap, window, softcap = _score_args(attn, dim)
    kv_heads, page = layout.num_kv_heads, layout.page_size
    group = heads // kv_heads
    tokens = block_m // group
    assert out.stride(1) == dim and out.stride(2) == 1 and tokens >= 1
    grid = (table.shape[0], kv_heads, triton.cdiv(max_query_len, tokens))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, table, lens, query_start,
        q.stride(0), q.stride(1), out.stride(0), table.stride(0), scale, cap, window, kv_heads,
        group, dim, page, block_m, tokens, block_n, *_dot_types(q), *_runs(layout), softcap,
    )  # fmt: skip
