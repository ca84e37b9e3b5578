"""A placement survives its trip through Redis hash fields; anything else reads as a miss."""

from __future__ import annotations

import pytest

from router.placement import Placement

PLACEMENT = Placement("decode-0", "epoch-7", "prefill-1", 1234, 1_700_000_000.123456)
GOOD = {k.encode(): v.encode() for k, v in PLACEMENT.to_fields().items()}


def test_fields_round_trip_exactly() -> None:
    assert Placement.from_fields(GOOD) == PLACEMENT


def test_no_prefill_worker_is_an_absent_field() -> None:
    local = Placement("decode-0", "epoch-7", None, 0, 1.5)
    assert "prefill_worker" not in local.to_fields()
    raw = {k.encode(): v.encode() for k, v in local.to_fields().items()}
    assert Placement.from_fields(raw) == local


@pytest.mark.parametrize(
    "change",
    [
        {b"cached_tokens": b"many"},
        {b"cached_tokens": b"-1"},
        {b"cached_tokens": b"12.5"},
        {b"last_use": b"yesterday"},
        {b"last_use": b"nan"},
        {b"last_use": b"inf"},
        {b"decode_worker": b""},
        {b"decode_epoch": b"\xff\xfe"},
        {b"pickle": b"\x80\x04\x95"},
    ],
)
def test_a_bad_or_foreign_field_is_a_miss(change: dict[bytes, bytes]) -> None:
    assert Placement.from_fields(GOOD | change) is None


@pytest.mark.parametrize(
    "missing", [b"decode_worker", b"decode_epoch", b"cached_tokens", b"last_use"]
)
def test_a_missing_field_is_a_miss(missing: bytes) -> None:
    raw = {k: v for k, v in GOOD.items() if k != missing}
    assert Placement.from_fields(raw) is None
