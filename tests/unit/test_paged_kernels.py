"""The Triton paged kernels against attention computed in plain float32 math: ragged
batches, page tables with holes and out of order, prefix hits, chunked prefills, GQA,
float32 and bfloat16, and padding slots that write nothing. Compiled on a GPU when there is
one (bfloat16 then multiplies in bfloat16), else under Triton's interpreter on the CPU."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from cluster.engine.kernels.kv_cache import KVCache, KVLayout, gather_tokens
from cluster.engine.kernels.layer_attention import LayerAttention
from cluster.engine.kernels.step_batch import StepBatch
from cluster.engine.model.model import rotate
from tests.helpers import scattered_pages, windowed_reference

paged_kernels = pytest.importorskip("cluster.engine.kernels.paged_kernels")
from cluster.engine.kernels.attention_triton import TritonBackend  # noqa: E402

PAGE, HEADS, KV_HEADS, DIM, NUM_PAGES = 16, 6, 2, 32, 40


def _cache(
    dtype: torch.dtype, seed: int, device: torch.device, kv_heads: int = KV_HEADS
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_PAGES, kv_heads, PAGE, DIM)
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    return k.to(device, dtype), v.to(device, dtype)


def _layout(pages: torch.Tensor) -> KVLayout:
    """The format of one layer's float pages [pages, kv_heads, page_size, head_dim]."""
    return KVLayout(1, pages.shape[1], pages.shape[3], pages.shape[2], pages.dtype)


def _tables(lens: list[int], seed: int, device: torch.device) -> torch.Tensor:
    return scattered_pages(lens, PAGE, NUM_PAGES, seed).to(device, torch.int32)


def _reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor, n: int
) -> torch.Tensor:
    """q [rows, heads, dim], the last rows of a context of n tokens, in float32 math."""
    group = q.shape[1] // k_cache.shape[1]
    keys, values = (
        gather_tokens(c, pages.long(), n).float().repeat_interleave(group, 1)
        for c in (k_cache, v_cache)
    )
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * DIM**-0.5
    rows, at = q.shape[0], q.device
    causal = torch.arange(n, device=at)[None, :] <= torch.arange(n - rows, n, device=at)[:, None]
    weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, values)


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3, 8, 20])
def test_paged_decode_matches_reference_on_a_ragged_batch(
    dtype: torch.dtype, splits: int, kernel_device: torch.device
) -> None:
    # One token, page edges, several partitions; with 8 splits of 16-token blocks the short
    # contexts leave splits empty (they store nothing) and 100 tokens use 7 of them; with
    # 20, 300 tokens use 19: the reduce merges them in three chunks (REDUCE_CHUNK 8).
    lens = [1, 17, 70, 16, 100, 300]
    k_cache, v_cache = _cache(dtype, 0, kernel_device)
    table = _tables(lens, 1, kernel_device)
    q = torch.randn(len(lens), HEADS, DIM, generator=torch.Generator().manual_seed(2))
    q = q.to(kernel_device, dtype)
    out = torch.empty_like(q)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=kernel_device)
    paged_kernels.paged_decode(
        q, k_cache, v_cache, _layout(k_cache), table, lens_t, splits, out, 16
    )
    assert out.dtype == dtype and out.shape == q.shape
    for i, n in enumerate(lens):
        ref = _reference(q[i : i + 1], k_cache, v_cache, table[i], n)[0]
        assert (out[i].float() - ref).abs().max().item() < TOLERANCE[dtype], f"row {i}"


def test_paged_decode_of_an_empty_context_is_zero(kernel_device: torch.device) -> None:
    k_cache, v_cache = _cache(torch.float32, 0, kernel_device)
    q = torch.randn(2, HEADS, DIM, device=kernel_device)
    lens = torch.tensor([0, 5], dtype=torch.int32, device=kernel_device)
    out = torch.full_like(q, float("nan"))
    table = _tables([1, 5], 3, kernel_device)
    paged_kernels.paged_decode(q, k_cache, v_cache, _layout(k_cache), table, lens, 2, out, 16)
    assert not out[0].any()
    assert out[1].isfinite().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [2, 6, 1], ids=["gqa-3", "mha", "mqa-6"])
def test_paged_prefill_matches_reference_for_fresh_prefix_hit_and_later_chunks(
    dtype: torch.dtype, kv_heads: int, kernel_device: torch.device
) -> None:
    """A program's 16 tile rows are 5 tokens x a group of 3 heads (one row idle), 16
    tokens x 1 head, or 2 tokens x 6 heads."""
    # (new tokens, context): a fresh prompt, a prefix hit of two pages, a later chunk that
    # starts mid-page, a one-token chunk after a long context.
    chunks = [(20, 20), (9, 41), (30, 53), (1, 75)]
    lens = [c for _, c in chunks]
    k_cache, v_cache = _cache(dtype, 4, kernel_device, kv_heads)
    table = _tables(lens, 5, kernel_device)
    starts = [0]
    for n, _ in chunks:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], HEADS, DIM, generator=torch.Generator().manual_seed(6))
    q = q.to(kernel_device, dtype)
    out = torch.empty_like(q)
    ints = lambda xs: torch.tensor(xs, dtype=torch.int32, device=kernel_device)
    paged_kernels.paged_prefill(
        q,
        k_cache,
        v_cache,
        _layout(k_cache),
        table,
        ints(lens),
        ints(starts),
        max(n for n, _ in chunks),
        out,
        16,
        16,
    )
    for i, (_, context) in enumerate(chunks):
        rows = slice(starts[i], starts[i + 1])
        ref = _reference(q[rows], k_cache, v_cache, table[i], context)
        assert (out[rows].float() - ref).abs().max().item() < TOLERANCE[dtype], f"chunk {i}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_rotates_q_and_k_and_stores_k_and_v_in_their_slots_skipping_padding(
    dtype: torch.dtype, kernel_device: torch.device
) -> None:
    """q, k, v side by side in the fused qkv rows (strided), as the model hands them over:
    q rotated in place as model.rotate does, k rotated into its slot, v copied; slot -1 (a
    graph's padding row) writes nothing."""
    caches = torch.zeros(2, 4, KV_HEADS, PAGE, DIM, dtype=dtype, device=kernel_device)
    k_cache, v_cache = caches.unbind()
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(3, (HEADS + 2 * KV_HEADS) * DIM, generator=g).to(kernel_device, dtype)
    q = qkv[:, : HEADS * DIM].view(3, HEADS, DIM)
    k = qkv[:, HEADS * DIM : (HEADS + KV_HEADS) * DIM].view(3, KV_HEADS, DIM)
    v = qkv[:, (HEADS + KV_HEADS) * DIM :].view(3, KV_HEADS, DIM)
    freqs = torch.outer(torch.arange(50).float(), 1.0 / 10000 ** (torch.arange(0, DIM, 2) / DIM))
    cos = torch.cat((freqs, freqs), dim=-1).cos().to(kernel_device, dtype)
    sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1).to(kernel_device, dtype)
    positions = torch.tensor([7, 0, 49], dtype=torch.int32, device=kernel_device)
    rows = cos[positions.long()].float()[:, None], sin[positions.long()].float()[:, None]
    want_q, want_k = rotate(q.float(), *rows), rotate(k.float(), *rows)
    want_v = v.clone()
    slots = torch.tensor([37, -1, 5], dtype=torch.int32, device=kernel_device)  # -1: padding
    paged_kernels.rope_store_kv(
        q, k, v, k_cache, v_cache, _layout(k_cache), slots, positions, cos, sin
    )
    tolerance = {"atol": TOLERANCE[dtype], "rtol": TOLERANCE[dtype]}
    torch.testing.assert_close(q.float(), want_q, **tolerance)  # padding's q too
    # Slot 37 is page 2's token 5, slot 5 page 0's: each head in its page's run of that head.
    got_k, got_v = (c[[2, 0], :, [5, 5]] for c in (k_cache, v_cache))
    torch.testing.assert_close(got_k.float(), want_k[[0, 2]], **tolerance)
    assert torch.equal(got_v, want_v[[0, 2]])
    written = torch.zeros(4, PAGE, dtype=torch.bool, device=kernel_device)
    written[[2, 0], [5, 5]] = True
    for c in (k_cache, v_cache):
        assert not c.transpose(1, 2)[~written].any()


def _unspecialised(kernel: Any) -> tuple[set[str], set[str]]:
    """(integers, pointers' alignment) a kernel compiles no variant for."""
    if hasattr(kernel, "params"):  # compiled Triton
        ints = {p.name for p in kernel.params if p.do_not_specialize}
        return ints, {p.name for p in kernel.params if p.do_not_specialize_on_alignment}
    flags = kernel.kwargs  # Triton's interpreter keeps the decorator's arguments
    ints, pointers = flags["do_not_specialize"], flags["do_not_specialize_on_alignment"]
    return set(ints or ()), set(pointers or ())


def test_what_changes_from_step_to_step_compiles_no_new_variant() -> None:
    """The page table's width and the split count vary by step, and the step's packed
    int32 buffer (attention_triton.prepare) puts the slots, positions, table, lengths and
    query offsets at any 4-byte offset: none of them may pick a compiled variant."""
    assert _unspecialised(paged_kernels._decode_kernel) == (
        {"stride_table", "num_splits"},
        {"table", "lens"},
    )
    assert _unspecialised(paged_kernels._decode_reduce) == ({"num_splits"}, {"lens"})
    assert _unspecialised(paged_kernels._prefill_kernel) == (
        {"stride_table"},
        {"table", "lens", "query_start"},
    )
    assert _unspecialised(paged_kernels._rope_store_kernel) == (set(), {"slots", "positions"})


KV8 = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]
KV8_IDS = ["fp8_e4m3", "fp8_e5m2", "int8"]


def _identity_rope(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones(64, DIM, device=device), torch.zeros(64, DIM, device=device)


@pytest.mark.parametrize("dtype", KV8, ids=KV8_IDS)
def test_rope_store_writes_8bit_pages_bit_for_bit_as_the_layout_s_store(
    dtype: torch.dtype, kernel_device: torch.device
) -> None:
    # Values on a grid of sixteenths (many ties to even once scaled), a head a thousand
    # times smaller than the other, a token of zeros (its scale from amax 0), a padding slot;
    # RoPE the identity so that the kernel's k is the one KVLayout.store is given.
    layout = KVLayout(1, KV_HEADS, DIM, PAGE, dtype)
    ours = KVCache(layout, 4, kernel_device)
    theirs = KVCache(layout, 4, torch.device("cpu"))
    g = torch.Generator().manual_seed(7)
    k, v = (torch.randint(-4000, 4000, (6, KV_HEADS, DIM), generator=g) / 16 for _ in "kv")
    k[:, 1] *= 1e-3
    k[2], v[4] = 0.0, 0.0
    slots = torch.tensor([37, -1, 5, 6, 63, 16])
    q = torch.zeros(6, HEADS, DIM, device=kernel_device)
    on = lambda x: x.to(kernel_device)
    paged_kernels.rope_store_kv(
        q, on(k), on(v), ours.k[0], ours.v[0], layout, on(slots).int(), on(slots).int() % 64,
        *_identity_rope(kernel_device),
    )  # fmt: skip
    real = slots >= 0
    layout.store(theirs.k[0], slots[real], k[real])
    layout.store(theirs.v[0], slots[real], v[real])
    assert torch.equal(ours.k.cpu(), theirs.k) and torch.equal(ours.v.cpu(), theirs.v)


def _stored(dtype: torch.dtype, seed: int, device: torch.device) -> tuple[KVCache, KVCache]:
    """Every slot of one layer's pages of `dtype` written by KVLayout.store from normal
    noise (one head's 1e-3 as large), and float32 pages of the same values as written."""
    layout = KVLayout(1, KV_HEADS, DIM, PAGE, dtype)
    coded = KVCache(layout, NUM_PAGES, torch.device("cpu"))
    exact = KVCache(replace(layout, dtype=torch.float32), NUM_PAGES, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    every = torch.arange(NUM_PAGES * PAGE)
    for c, f in ((coded.k[0], exact.k[0]), (coded.v[0], exact.v[0])):
        x = torch.randn(NUM_PAGES * PAGE, KV_HEADS, DIM, generator=g)
        x[:, 1] *= 1e-3
        layout.store(c, every, x)
        f[every // PAGE, :, every % PAGE] = x
    moved = lambda c: KVCache(c.layout, NUM_PAGES, device)
    on_device = moved(coded)
    on_device.k.copy_(coded.k)
    on_device.v.copy_(coded.v)
    return on_device, exact


def _decoded(cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """An 8-bit cache's layer 0 as float32 pages of the values its codes and scales hold."""
    lay = cache.layout
    pages = lambda t: lay.values(t).float() * lay.scales(t)[..., None]
    return pages(cache.k[0].cpu()), pages(cache.v[0].cpu())


# Against the float pages the values were coded from (unit normal noise, each token's
# largest in [2, 4)): a step of the codes there (a half step in the values, the keys'
# errors moving the weights).
LOOSE = {torch.float8_e4m3fn: 2**-2, torch.float8_e5m2: 2**-1, torch.int8: 2**-5}


@pytest.mark.parametrize("dtype", KV8, ids=KV8_IDS)
def test_paged_decode_reads_8bit_pages_in_place(
    dtype: torch.dtype, kernel_device: torch.device
) -> None:
    lens = [1, 17, 70, 300]
    cache, exact = _stored(dtype, 8, kernel_device)
    table = _tables(lens, 9, kernel_device)
    q = torch.randn(len(lens), HEADS, DIM, generator=torch.Generator().manual_seed(10))
    q = q.to(kernel_device)
    out = torch.empty_like(q)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=kernel_device)
    k_cache, v_cache = cache.k[0], cache.v[0]
    paged_kernels.paged_decode(q, k_cache, v_cache, cache.layout, table, lens_t, 3, out, 16)
    decoded, cpu_table = _decoded(cache), table.cpu()
    for i, n in enumerate(lens):
        got = out[i].cpu()
        ref = _reference(q[i : i + 1].cpu(), *decoded, cpu_table[i], n)[0]
        assert (got - ref).abs().max().item() < 1e-5, f"row {i}"
        ref = _reference(q[i : i + 1].cpu(), exact.k[0], exact.v[0], cpu_table[i], n)[0]
        assert (got - ref).abs().max().item() < LOOSE[dtype], f"row {i}"


@pytest.mark.parametrize("dtype", KV8, ids=KV8_IDS)
def test_paged_prefill_reads_8bit_pages_in_place(
    dtype: torch.dtype, kernel_device: torch.device
) -> None:
    chunks = [(20, 20), (9, 41)]  # a fresh prompt; a chunk after a prefix hit, mid-page
    lens = [c for _, c in chunks]
    cache, exact = _stored(dtype, 11, kernel_device)
    table = _tables(lens, 12, kernel_device)
    q = torch.randn(29, HEADS, DIM, generator=torch.Generator().manual_seed(13))
    q = q.to(kernel_device)
    out = torch.empty_like(q)
    ints = lambda xs: torch.tensor(xs, dtype=torch.int32, device=kernel_device)
    paged_kernels.paged_prefill(
        q, cache.k[0], cache.v[0], cache.layout, table, ints(lens), ints([0, 20, 29]), 20, out,
        16, 16,
    )  # fmt: skip
    decoded, cpu_table = _decoded(cache), table.cpu()
    for i, rows in enumerate((slice(0, 20), slice(20, 29))):
        got = out[rows].cpu()
        ref = _reference(q[rows].cpu(), *decoded, cpu_table[i], lens[i])
        assert (got - ref).abs().max().item() < 1e-5, f"chunk {i}"
        ref = _reference(q[rows].cpu(), exact.k[0], exact.v[0], cpu_table[i], lens[i])
        assert (got - ref).abs().max().item() < LOOSE[dtype], f"chunk {i}"


def _rope_tables(theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed-sin tables of 320 positions (model.LlamaModel's), RoPE base `theta`."""
    inverse = 1.0 / theta ** (torch.arange(0, DIM, 2) / DIM)
    freqs = torch.outer(torch.arange(320).float(), inverse)
    cos = torch.cat((freqs, freqs), dim=-1).cos()
    return cos.to(device), torch.cat((-freqs.sin(), freqs.sin()), dim=-1).to(device)


@pytest.mark.parametrize(
    "attn",
    [
        LayerAttention(window=1),
        LayerAttention(window=7, scale=0.3),
        LayerAttention(window=100, softcap=5.0),
        LayerAttention(window=1000, softcap=2.0),
        LayerAttention(scale=0.2, softcap=3.0),
    ],
    ids=["window-1", "window-7-scale", "window-100-softcap", "window-past-context", "softcap"],
)
def test_the_backend_attends_as_gemma_s_layers_define(
    attn: LayerAttention, kernel_device: torch.device
) -> None:
    # Gemma's layers: a sliding window (the query's own token and the window - 1 before
    # it), scores soft-capped and scaled by query_pre_attn_scalar, the layer's own RoPE
    # tables (base 1e6; the model's 1e4). Decodes of 1, 17, 40 and 300 tokens in 3 splits
    # (the 300-token row's window of 100 split three ways, past the first 112-token third of
    # its context), a 5-token chunk after 27 cached, a 23-token one after 137 (five tiles
    # of 5 tokens x 3 heads, each row's window starting in its own place: key blocks
    # skipped, masked at the windows' edge, whole) and a fresh prompt.
    layout = KVLayout(1, KV_HEADS, DIM, PAGE, torch.float32)
    cache = KVCache(layout, NUM_PAGES, kernel_device)
    g = torch.Generator().manual_seed(21)
    for t in (cache.k[0], cache.v[0]):
        t.copy_(torch.randn(t.shape, generator=g))
    lens, news = [1, 17, 40, 300, 32, 160, 6], [1, 1, 1, 1, 5, 23, 6]
    table = scattered_pages(lens, PAGE, NUM_PAGES, seed=22)
    positions = torch.cat([torch.arange(n - new, n) for n, new in zip(lens, news, strict=True)])
    owner = torch.cat([torch.full((new,), i) for i, new in enumerate(news)])
    slots = table[owner, positions // PAGE] * PAGE + positions % PAGE
    starts = [0, *torch.tensor(news).cumsum(0).tolist()]
    batch = StepBatch(4, starts, lens, table, slots, positions)
    q, k, v = (torch.randn(starts[-1], h, DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS))
    layer = replace(attn, rope=_rope_tables(1e6, kernel_device))
    model_rope = _rope_tables(1e4, kernel_device)
    backend = TritonBackend(kernel_device, KV_HEADS, model_rope, block=16, layers=[layer])
    metadata = replace(backend.prepare(batch), num_splits=3)

    # What the layer's forward leaves: q and the new keys rotated by its tables, and the
    # new keys and values in their slots.
    cos, sin = (t.cpu()[positions][:, None] for t in layer.rope)
    want_q = rotate(q, cos, sin)
    want = KVCache(layout, NUM_PAGES, torch.device("cpu"))
    want.k.copy_(cache.k)
    want.v.copy_(cache.v)
    layout.store(want.k[0], slots, rotate(k, cos, sin))
    layout.store(want.v[0], slots, v)
    on = lambda x: x.to(kernel_device)
    out = backend.forward(0, on(q.clone()), on(k), on(v), cache, metadata)
    torch.testing.assert_close(cache.k.cpu(), want.k, rtol=0, atol=1e-5)
    assert torch.equal(cache.v.cpu(), want.v)
    ref = windowed_reference(want_q, want, batch, layer)
    torch.testing.assert_close(out.cpu(), ref, rtol=0, atol=2e-5)
