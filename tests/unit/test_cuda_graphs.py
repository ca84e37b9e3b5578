"""CUDA graphs' logic on the CPU: which bucket a batch runs in, how a step is padded into
the static buffer, that padding rows run through the kernels without touching a page, and
that the piecewise graphs' pieces around eager attention compute the model's step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from cluster.engine.cuda_graphs import (
    PADDING_SLOT,
    DecodeGraphs,
    PiecewiseGraphs,
    Segments,
    Staging,
    bucket_for,
    bucket_sizes,
    cuda_capture,
    fill,
    token_buckets,
)
from cluster.engine.kernels.attention_triton import (
    MAX_SPLITS,
    TritonBackend,
    TritonMetadata,
    decode_splits,
)
from cluster.engine.kernels.kv_cache import KVCache, KVLayout, gather_tokens
from cluster.engine.kernels.step_batch import StepBatch


def test_buckets_are_powers_of_two_up_to_max_num_seqs() -> None:
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert bucket_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert bucket_sizes(1) == [1]
    buckets = bucket_sizes(48)
    assert [bucket_for(n, buckets) for n in (1, 3, 8, 9, 33, 48)] == [1, 4, 8, 16, 48, 48]
    assert bucket_for(49, buckets) is None  # runs eagerly


def test_each_bucket_splits_the_context_only_as_far_as_it_fills_the_gpu() -> None:
    """Llama-3-8B (8 KV heads) on an H100 (132 SMs: 264 programs), graphs captured for
    max_model_len 131072: a split count per bucket, not one of 512 for every bucket."""
    splits = {b: decode_splits(b, 8, 131072, 264) for b in (1, 2, 4, 8, 16, 32, 64, 256)}
    assert splits == {1: MAX_SPLITS, 2: 17, 4: 9, 8: 5, 16: 3, 32: 2, 64: 1, 256: 1}
    # Eager steps size for the longest context in the step: 2k tokens, 8 partitions at most.
    assert decode_splits(1, 8, 2048, 264) == 8
    assert decode_splits(1, 8, 1, 264) == 1
    assert decode_splits(0, 8, 0, 264) == 1  # a step of prefills only


def _decode_step(lens: list[int], page_size: int) -> tuple[StepBatch, list[int]]:
    table = torch.tensor([[3, 7, 0], [5, 1, 2], [9, 0, 0]])[: len(lens)]
    pos = torch.tensor(lens) - 1
    slots = table[torch.arange(len(lens)), pos // page_size] * page_size + pos % page_size
    batch = StepBatch(len(lens), list(range(len(lens) + 1)), lens, table, slots, pos)
    return batch, [11 * (i + 1) for i in range(len(lens))]


def test_fill_pads_rows_to_the_bucket_with_no_slot_and_no_context() -> None:
    seg = Segments(rows=8, width=4)
    buffer = torch.full((seg.size,), 99, dtype=torch.int32)
    batch, ids = _decode_step([20, 40, 3], page_size=16)
    fill(buffer, seg, batch, ids, bucket=4)
    off = seg.offsets()
    part = lambda name, n: buffer[off[name] : off[name] + n].tolist()
    assert part("ids", 4) == [11, 22, 33, 0]
    assert part("positions", 4) == [19, 39, 2, 0]
    assert part("slots", 4) == [7 * 16 + 3, 2 * 16 + 7, 9 * 16 + 2, PADDING_SLOT]
    assert part("lens", 4) == [20, 40, 3, 0]
    table = buffer[off["table"] : off["table"] + 4 * seg.width].view(4, seg.width)
    assert table.tolist() == [[3, 7, 0, 0], [5, 1, 2, 0], [9, 0, 0, 0], [0, 0, 0, 0]]


def test_a_replay_copies_the_part_of_the_buffer_its_step_reads() -> None:
    """Graphs for 64 rows and a 131072-token context (8192 pages a row): a step of 3
    sequences 2k tokens long reads the 321 leading values (ids, positions, slots, lens,
    query offsets) and 2 full rows plus 128 pages of the table, not all 524,609."""
    seg = Segments(rows=64, width=8192)
    assert seg.size == 5 * 64 + 1 + 64 * 8192
    assert seg.read(3, 128) == 321 + 2 * 8192 + 128
    assert seg.read(64, 8192) == seg.size


def test_staging_copies_the_leading_values_it_is_asked_for(kernel_device: torch.device) -> None:
    staging = Staging(torch.arange(6, dtype=torch.int32))
    device_buffer = torch.zeros(6, dtype=torch.int32, device=kernel_device)
    staging.copy_to(device_buffer, 4)
    assert device_buffer.tolist() == [0, 1, 2, 3, 0, 0]
    staging.ready()[:] = 7
    staging.copy_to(device_buffer)
    assert device_buffer.tolist() == [7] * 6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_refill_waits_for_the_copy_still_reading_the_pinned_buffer() -> None:
    """A copy queued behind a long kernel has not read its pinned source when the host
    refills it: without the event the device would get the second step's values."""
    staging = Staging(torch.full((1 << 20,), 1, dtype=torch.int32).pin_memory())
    device_buffer = torch.zeros(1 << 20, dtype=torch.int32, device="cuda")
    torch.cuda._sleep(200_000_000)  # ~0.1 s of a spinning kernel ahead of the copy
    staging.copy_to(device_buffer)
    staging.ready().fill_(2)
    torch.cuda.synchronize()
    assert device_buffer.min().item() == device_buffer.max().item() == 1


def test_padding_rows_write_no_page_and_attend_to_nothing(kernel_device: torch.device) -> None:
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=16, page_size=16, dtype=torch.float32)
    cache = KVCache(layout, num_pages=12, device=kernel_device)
    cache.k.normal_()
    cache.v.normal_()
    before_k, before_v = cache.k.clone(), cache.v.clone()
    seg = Segments(rows=4, width=3)
    buffer = torch.zeros(seg.size, dtype=torch.int32)
    buffer[seg.offsets()["starts"] : seg.offsets()["table"]] = torch.arange(5)
    batch, ids = _decode_step([20, 40], page_size=16)
    fill(buffer, seg, batch, ids, bucket=4)
    buffer, slots = buffer.to(kernel_device), batch.slot_mapping.to(kernel_device)
    off = seg.offsets()
    metadata = TritonMetadata(
        slot_mapping=buffer[off["slots"] : off["slots"] + 4],
        positions=buffer[off["positions"] : off["positions"] + 4],
        page_table=buffer[off["table"] : off["table"] + 4 * seg.width].view(4, seg.width),
        context_lens=buffer[off["lens"] : off["lens"] + 4],
        query_start=buffer[off["starts"] : off["starts"] + 5],
        num_decodes=4,
        max_query_len=0,
        num_splits=1,
    )
    q = torch.randn(4, 4, 16, device=kernel_device)
    k, v = torch.randn(2, 4, 2, 16, device=kernel_device).unbind()
    rope = torch.ones(64, 16, device=kernel_device), torch.zeros(64, 16, device=kernel_device)
    backend = TritonBackend(kernel_device, kv_heads=2, rope=rope, block=16)  # RoPE: identity
    out = backend.forward(0, q, k, v, cache, metadata)
    every = torch.arange(12, device=kernel_device)
    k_now, k_before, v_now, v_before = (
        gather_tokens(t[0], every, 12 * 16) for t in (cache.k, before_k, cache.v, before_v)
    )  # [slot, kv_heads, head_dim]
    changed = (k_now != k_before).any(-1).any(-1).nonzero().flatten()
    assert changed.tolist() == sorted(slots.tolist())  # the real rows only
    assert torch.equal(v_now[slots], v[:2])
    untouched = torch.ones(12 * 16, dtype=torch.bool, device=kernel_device)
    untouched[slots] = False
    assert torch.equal(v_now[untouched], v_before[untouched])
    assert not out[2:].any()  # padding rows attend to nothing
    assert out[:2].abs().sum() > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_decode_graph_reads_no_tensor_freed_after_its_capture() -> None:
    """A CUDA graph holds no reference to the tensors it reads. Once the graphs are
    captured, every free small block of the allocator is taken and zeroed (as the engine's
    eager prefill took them for its logits rows, which the replay then gathered: rows past
    the bucket, a device-side assert); a decode of 3 replayed in the bucket of 4 still
    gives the model's logits, row by row."""
    from cluster.engine.model.model import LlamaModel
    from splitserve.bench.gpu import random_weights, spec_of

    device = torch.device("cuda")
    torch.manual_seed(0)
    spec = spec_of("tiny")
    model = LlamaModel(spec, random_weights(spec, torch.float32, device), torch.float32, device)
    cache = KVCache(KVLayout.of(spec, 16, torch.float32), num_pages=12, device=device)
    cache.k.normal_()
    cache.v.normal_()
    attention = TritonBackend(device, spec.num_kv_heads, (model.cos, model.signed_sin))
    graphs = DecodeGraphs(model, attention, cache, 4, 48, device)
    stats = torch.cuda.memory_stats(device)
    free = stats["reserved_bytes.small_pool.current"] - stats["allocated_bytes.small_pool.current"]
    taken = [torch.zeros(64, dtype=torch.long, device=device) for _ in range(free // 512 + 1)]
    batch, ids = _decode_step([20, 40, 3], page_size=16)
    got = graphs.run(batch, ids)
    assert got is not None
    got = got.clone()
    want = model.forward(
        torch.tensor(ids, device=device),
        batch.positions.to(device),
        attention,
        attention.prepare(batch),
        cache,
        torch.arange(3, device=device),
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.stack(taken).any()  # and the replay wrote into none of them


def test_token_buckets_pad_a_step_by_at_most_a_third() -> None:
    assert token_buckets(512) == [
        1,
        2,
        3,
        4,
        6,
        8,
        12,
        16,
        24,
        32,
        48,
        64,
        96,
        128,
        192,
        256,
        384,
        512,
    ]
    assert token_buckets(100) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 100]
    assert token_buckets(1) == [1]
    buckets = token_buckets(512)
    assert all(bucket_for(n, buckets) <= 1.5 * n for n in range(1, 513))


def _mixed_step() -> tuple[StepBatch, list[int], list[int]]:
    """Two decodes (contexts 20 and 33) and a 5-token chunk at positions 16-20 of a prompt
    whose first 16 tokens are cached: 7 rows; logits of the decodes and the chunk's last."""
    tables = [[3, 7, 0], [5, 1, 2], [9, 4, 0]]
    lens, starts = [20, 33, 21], [0, 1, 2, 7]
    positions = torch.tensor([19, 32, 16, 17, 18, 19, 20])
    owner = torch.tensor([0, 1, 2, 2, 2, 2, 2])
    table = torch.tensor(tables)
    slots = table[owner, positions // 16] * 16 + positions % 16
    ids = torch.randint(0, 512, (7,), generator=torch.Generator().manual_seed(5)).tolist()
    return StepBatch(2, starts, lens, table, slots, positions), ids, [0, 1, 6]


def _family(name: str, device: torch.device) -> Any:
    """A tiny random model of a family: Llama's shape, Qwen3's q/k norms, or Gemma's
    (2's and 3's at once: norms around each sublayer, q/k norms, a 4-token window on the
    first layer, soft-capped scores and logits, the window layer rotated at its own base)."""
    from cluster.engine.model.model import LlamaModel
    from splitserve.bench.gpu import random_weights, spec_of

    spec = spec_of("tiny")
    if name == "qwen3":
        spec = replace(spec, qk_norm=True)
    if name == "gemma":
        spec = replace(spec, qk_norm=True, gemma=True, sandwich_norms=True, query_scale=0.2,
                       windows=(4, None), attn_softcap=0.5, final_softcap=2.0,
                       local_rope_theta=1000.0)  # fmt: skip
    weights = random_weights(spec, torch.float32, device)
    norms = ["self_attn.q_norm", "self_attn.k_norm"] if spec.qk_norm else []
    if spec.sandwich_norms:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for n in range(spec.num_layers):
        for norm in norms:
            size = spec.head_dim if "_norm" in norm.split(".")[-1] else spec.hidden_size
            weights[f"model.layers.{n}.{norm}.weight"] = torch.rand(size, device=device) + 0.5
    return LlamaModel(spec, weights, torch.float32, device)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma"])
@pytest.mark.parametrize(
    ("backend", "graphs"),
    [
        ("triton", False),
        ("cpu", False),
        pytest.param(
            "triton",
            True,
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ),
    ],
)
def test_piecewise_pieces_around_eager_attention_give_the_model_steps_logits_and_kv(
    backend: str, graphs: bool, family: str, kernel_device: torch.device
) -> None:
    """A tiny random model in float32: a mixed step of 7 tokens run as the pieces of the
    8-token bucket (one padding row) around attention, then a decode step of 2 in the same
    buffers, against LlamaModel.forward on a copy of the cache: the same logits, the same
    KV written, on_layer after each layer. Triton (interpreted here) rotates q and k in
    its store; with the cpu backend (FlashInfer's case: a backend that does not) the
    pieces rotate them. The pieces run as they are, and on a GPU also captured in CUDA
    graphs and replayed. Qwen3's q/k norms and Gemma's layers take the same pieces."""
    from cluster.engine.kernels.attention import make_backend

    device = kernel_device if backend == "triton" else torch.device("cpu")
    torch.manual_seed(0)
    model = _family(family, device)
    spec = model.spec
    rope = (model.cos, model.signed_sin)
    layout = KVLayout.of(spec, 16, torch.float32)
    eager_cache = KVCache(layout, num_pages=12, device=device)
    eager_cache.k.normal_()
    eager_cache.v.normal_()
    cache = KVCache(layout, num_pages=12, device=device)
    cache.k.copy_(eager_cache.k)
    cache.v.copy_(eager_cache.v)
    captured: list[object] = []
    replay = cuda_capture() if graphs else lambda piece: piece

    def capture(piece: Callable[[], None]) -> Callable[[], None]:
        captured.append(piece)
        return replay(piece)

    layers = model.attention_layers()
    attention = make_backend(backend, layout, spec.num_heads, device, rope, layers)
    assert attention.fuses_rope == (backend == "triton")
    pieces = PiecewiseGraphs(model, attention, cache, 8, device, capture)
    assert len(captured) == len(token_buckets(8)) * (spec.num_layers + 1)
    eager = make_backend(backend, layout, spec.num_heads, device, rope, layers)
    mixed, ids, rows = _mixed_step()
    decode = StepBatch(
        2,
        [0, 1, 2],
        [21, 34],
        mixed.page_table[:2],
        torch.tensor([7 * 16 + 4, 2 * 16 + 1]),
        torch.tensor([20, 33]),
    )
    for batch, step_ids, step_rows in ((mixed, ids, rows), (decode, [7, 9], [0, 1])):
        wanted = torch.tensor(step_rows, device=device)
        want = model.forward(
            torch.tensor(step_ids, device=device),
            batch.positions.to(device),
            eager,
            eager.prepare(batch),
            eager_cache,
            wanted,
        )
        done: list[int] = []
        got = pieces.run(batch, step_ids, attention.prepare(batch), wanted, done.append)
        assert got is not None and got.shape == (len(step_rows), spec.vocab_size)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert done == list(range(spec.num_layers))
        torch.testing.assert_close(cache.k, eager_cache.k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache.v, eager_cache.v, atol=1e-5, rtol=1e-5)
    nine = list(range(9))
    assert pieces.run(mixed, nine, attention.prepare(mixed), wanted, None) is None  # 9 > 8
