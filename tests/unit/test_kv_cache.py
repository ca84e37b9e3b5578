"""The KV page format (kv_cache.KVLayout): head-major pages, where a token's K and V land,
and the byte figures the transfer and the compatibility hash read from it."""

from __future__ import annotations

import pytest
import torch

from cluster.engine.kernels.kv_cache import KVCache, KVLayout, gather_tokens, store_tokens

LAYOUT = KVLayout(num_layers=2, num_kv_heads=3, head_dim=8, page_size=4, dtype=torch.bfloat16)


def test_a_layer_is_pages_of_heads_of_tokens() -> None:
    cache = KVCache(LAYOUT, 5, torch.device("cpu"))
    assert cache.k.shape == cache.v.shape == (2, 5, 3, 4, 8)
    assert LAYOUT.layer_shape(5) == (5, 3, 4, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_head_of_a_page_is_one_run_of_head_bytes(dtype: torch.dtype) -> None:
    layout = KVLayout(2, 3, 8, 4, dtype)
    cache = KVCache(layout, 5, torch.device("cpu"))
    item = torch.empty((), dtype=dtype).element_size()
    assert layout.head_bytes == 4 * 8 * item and layout.page_bytes == 3 * layout.head_bytes
    assert layout.bytes_per_page == 2 * 2 * layout.page_bytes
    assert layout.bytes_per_token * layout.page_size == layout.bytes_per_page
    # Layer 1, page 3, head 2: one run of head_bytes at the offset the layout gives.
    run = cache.k[1, 3, 2]
    assert run.is_contiguous() and run.numel() * item == layout.head_bytes
    at = ((1 * 5 + 3) * layout.page_bytes) + 2 * layout.head_bytes
    assert run.data_ptr() - cache.k.data_ptr() == at


def test_a_token_s_heads_land_in_their_page_s_head_runs_at_its_offset() -> None:
    pages = torch.zeros(LAYOUT.layer_shape(5), dtype=LAYOUT.dtype)
    x = torch.randn(3, 3, 8).to(LAYOUT.dtype)
    slots = torch.tensor([13, 0, 7])  # page 3 offset 1, page 0 offset 0, page 1 offset 3
    store_tokens(pages, slots, x)
    for (page, offset), row in zip([(3, 1), (0, 0), (1, 3)], x, strict=True):
        for h in range(3):
            assert torch.equal(pages[page, h, offset], row[h])
    assert int((pages != 0).any(-1).sum()) == 3 * 3  # nothing else written
    # Read back in token order through a page list: page 1 then 3, 8 tokens.
    tokens = gather_tokens(pages, torch.tensor([1, 3]), 6)
    assert torch.equal(tokens[3], x[2]) and torch.equal(tokens[5], x[0])


def test_the_hash_input_names_the_order_and_what_tensor_parallelism_leaves_alike() -> None:
    split = KVLayout(2, 1, 8, 4, torch.bfloat16)  # a rank's share of the heads
    assert split.hash_input == LAYOUT.hash_input
    assert "kv_heads,page_size,head_dim" in LAYOUT.hash_input
    for other in (
        KVLayout(2, 3, 8, 8, torch.bfloat16),
        KVLayout(2, 3, 8, 4, torch.float32),
        KVLayout(2, 3, 16, 4, torch.bfloat16),
    ):
        assert other.hash_input != LAYOUT.hash_input


def test_head_runs_are_the_offsets_of_each_layer_and_page_s_heads() -> None:
    cache = KVCache(LAYOUT, 5, torch.device("cpu"))
    runs = LAYOUT.head_runs(5, range(1, 3))
    assert len(runs) == 2 * 5
    for layer in range(2):
        for page in range(5):
            start = cache.k[layer, page, 1].data_ptr() - cache.k.data_ptr()
            assert runs[layer * 5 + page] == start
