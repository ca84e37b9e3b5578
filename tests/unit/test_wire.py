"""The KV wire format: round trips, refusals with clear errors, and page-run coalescing."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest
import torch

from cluster.engine.kernels.kv_cache import KVLayout
from cluster.engine.model.checkpoint import ModelSpec
from cluster.transfer.endpoint import side_indices, side_rows
from cluster.transfer.wire import (
    Handshake,
    IncompatiblePeerError,
    Notice,
    NoticeKind,
    RankPages,
    WireError,
    compat_hash,
)
from cluster.types import PageId, RequestId, SampledToken

SPEC = ModelSpec(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position=128,
    tie_embeddings=True,
    qkv_bias=False,
    eos_token_ids=(2,),
    name="tiny",
)
OURS = compat_hash(SPEC, "float32", "auto", 16, "none")


def rank(agent: str, heads: range) -> RankPages:
    return RankPages(
        agent, b"\x00opaque\xff", 100, 1024 * len(heads), 2**40, 2**41, False, 0, heads
    )


def handshake(compat: bytes = OURS) -> Handshake:
    return Handshake(compat, 2, (rank("decode-0", range(2)),))


def test_a_handshake_round_trips_with_each_rank_and_its_heads() -> None:
    hs = handshake()
    assert Handshake.decode(hs.encode()) == hs
    two = Handshake(OURS, 2, (rank("decode-0", range(0, 1)), rank("decode-0-rank1", range(1, 2))))
    back = Handshake.decode(two.encode())
    assert back == two and back.agent == "decode-0"
    assert [r.heads for r in back.ranks] == [range(0, 1), range(1, 2)]


def test_a_handshake_without_ranks_is_refused() -> None:
    with pytest.raises(WireError, match="no rank"):
        Handshake.decode(Handshake(OURS, 2, ()).encode())


@pytest.mark.parametrize(
    "change",
    [
        {"name": "other-model"},
        {"num_layers": 3},
        {"num_kv_heads": 1},
    ],
)
def test_a_different_model_changes_the_compatibility_hash(change: dict[str, object]) -> None:
    assert compat_hash(dataclasses.replace(SPEC, **change), "float32", "auto", 16, "none") != OURS  # type: ignore[arg-type]


def test_dtype_and_page_size_change_the_compatibility_hash() -> None:
    assert compat_hash(SPEC, "bfloat16", "auto", 16, "none") != OURS
    assert compat_hash(SPEC, "float32", "auto", 16, "int4") != OURS
    assert compat_hash(SPEC, "float32", "auto", 32, "none") != OURS
    assert compat_hash(SPEC, "float32", "int8", 16, "none") != OURS  # the KV dtype
    assert compat_hash(SPEC, "float32", "fp8_e4m3", 16, "none") != compat_hash(
        SPEC, "float32", "fp8_e5m2", 16, "none"
    )
    assert compat_hash(SPEC, "float32", "float32", 16, "none") == OURS  # auto: the dtype's


def test_a_peer_with_the_token_major_page_layout_is_refused() -> None:
    """A layer's pages were [pages, page_size, kv_heads, head_dim] before they became
    head-major (kv_cache.KVLayout): a peer built before hashes that layout, and is refused."""
    s = SPEC
    key = (
        f"{s.name}|{s.num_layers}|{s.num_kv_heads}|{s.head_dim}|{s.vocab_size}|float32|none|16|"
        "layers,pages,page_size,kv_heads,head_dim;k,v"
    )
    token_major = hashlib.blake2b(key.encode(), digest_size=16).digest()
    with pytest.raises(IncompatiblePeerError, match="KV layout differ"):
        handshake(token_major).check(OURS)


def test_a_peer_with_another_hash_is_refused_with_a_clear_error() -> None:
    hs = handshake(compat_hash(SPEC, "float32", "auto", 32, "none"))
    with pytest.raises(IncompatiblePeerError, match=r"decode-0.*page size"):
        hs.check(OURS)
    handshake().check(OURS)


@pytest.mark.parametrize("kind", list(NoticeKind))
def test_notices_round_trip(kind: NoticeKind) -> None:
    first = SampledToken(42, -0.5)
    n = Notice(kind, RequestId("req-é"), 3, 9, (PageId(4), PageId(70000)), 123, 7, first)
    assert Notice.decode(n.encode()) == n
    started = Notice(kind, RequestId("r"), handshake=handshake().encode())  # as STARTED has
    assert Notice.decode(started.encode()) == started
    done = Notice(kind, RequestId("r"), first=SampledToken(5, -0.75, ((5, -0.25), (9, -2.5))))
    assert Notice.decode(done.encode()) == done  # as DONE has, when asked for
    unasked = Notice(kind, RequestId("r"), first=SampledToken(5, None))
    assert Notice.decode(unasked.encode()) == unasked  # no logprob asked for: none comes


def test_truncated_bytes_are_refused() -> None:
    data = Notice(NoticeKind.DONE, RequestId("r"), num_writes=3).encode()
    for cut in (0, 3, 6, len(data) - 1):
        with pytest.raises(WireError, match="notice"):
            Notice.decode(data[:cut])


def test_bad_magic_version_kind_and_trailing_bytes_are_refused() -> None:
    data = Notice(NoticeKind.DONE, RequestId("r")).encode()
    with pytest.raises(WireError, match="magic"):
        Notice.decode(b"XXXX" + data[4:])
    with pytest.raises(WireError, match="version 9"):
        Notice.decode(data[:4] + (9).to_bytes(2, "little") + data[6:])
    with pytest.raises(WireError, match="kind 77"):
        Notice.decode(data[:6] + bytes([77]) + data[7:])
    with pytest.raises(WireError, match="trailing"):
        Notice.decode(data + b"\x00")
    with pytest.raises(WireError, match="handshake"):
        Handshake.decode(handshake().encode()[:-2])


def test_a_length_field_past_the_end_is_refused() -> None:
    data = bytearray(Notice(NoticeKind.DONE, RequestId("r")).encode())
    data[7:11] = (10**6).to_bytes(4, "little")  # the request id's length prefix
    with pytest.raises(WireError, match="runs past the end"):
        Notice.decode(bytes(data))


def pids(*ids: int) -> list[PageId]:
    return [PageId(i) for i in ids]


def _entries(at: np.ndarray, num_layers: int, num_pages: int) -> list[tuple[int, int, int]]:
    """(K 0 or V 1, layer, page) of each index into a side_rows list."""
    return [(int(i) // num_pages // num_layers, int(i) // num_pages % num_layers,
             int(i) % num_pages) for i in at]  # fmt: skip


def test_a_write_picks_exactly_its_layers_and_pages_on_both_sides_in_step() -> None:
    # Entry i of one side goes to entry i of the other: K or V, layer, src page -> dst page.
    src, dst = pids(4, 5, 9, 10, 11, 12), pids(0, 1, 2, 3, 7, 8)
    local = _entries(side_indices(range(1, 3), src, 4, 20), 4, 20)
    remote = _entries(side_indices(range(1, 3), dst, 4, 9), 4, 9)
    assert local == [(t, layer, p) for t in (0, 1) for layer in (1, 2) for p in src]
    assert remote == [(t, layer, p) for t in (0, 1) for layer in (1, 2) for p in dst]


def test_pages_consecutive_on_both_sides_are_consecutive_contiguous_entries() -> None:
    """What NIXL merges into one descriptor: consecutive entries whose runs touch on both
    sides. A run of pages consecutive on both sides is one such stretch per (K/V, layer);
    a break on either side starts a new one."""
    layout = KVLayout(2, 3, 64, 16, torch.float32)  # 4 KiB a head, 12 KiB a page
    every = range(3)
    rows = side_rows(1 << 30, 1 << 40, layout.head_runs(20, every), layout.page_bytes, 0)
    far = side_rows(1 << 31, 1 << 41, layout.head_runs(9, every), layout.page_bytes, 0)

    def stretches(src: list[PageId], dst: list[PageId]) -> list[int]:
        a = rows[side_indices(range(2), src, 2, 20)]
        b = far[side_indices(range(2), dst, 2, 9)]
        joined = (a[1:, 0] == a[:-1, 0] + a[:-1, 1]) & (b[1:, 0] == b[:-1, 0] + b[:-1, 1])
        lengths, n = [], 1
        for j in joined:
            lengths, n = (lengths, n + 1) if j else ([*lengths, n], 1)
        return [*lengths, n]

    assert stretches(pids(4, 5, 6, 7), pids(0, 1, 2, 3)) == [4] * 4  # K, V x 2 layers
    assert stretches(pids(4, 5, 9, 10, 11, 12), pids(0, 1, 2, 3, 7, 8)) == [2, 2, 2] * 4
    assert stretches(pids(3, 2, 1), pids(1, 2, 3)) == [1, 1, 1] * 4


def test_a_head_range_of_a_page_is_one_run_at_its_heads_offset() -> None:
    # A rank holding all 3 heads (12 KiB pages, 4 KiB a head) sends head 2 to a rank
    # holding head 2 only: each entry of its side is 4 KiB, 8 KiB into the page.
    layout = KVLayout(2, 3, 64, 16, torch.float32)
    rows = side_rows(1 << 30, 1 << 40, layout.head_runs(10, range(2, 3)), 4096, 0)
    (k_at, k_len, _), (v_at, _, _) = rows[side_indices(range(1, 2), pids(7), 2, 10)]
    assert k_at == (1 << 30) + (1 * 10 + 7) * 3 * 4096 + 2 * 4096 and k_len == 4096
    assert v_at == (1 << 40) + (1 * 10 + 7) * 3 * 4096 + 2 * 4096
