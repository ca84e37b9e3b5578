"""Generate messages that do not parse become Unparsable; their log lines are rate-bounded."""

from __future__ import annotations

import logging

import pytest
from google.protobuf.internal.encoder import _VarintBytes

from router.unparsable import RateLimitedLog, Unparsable, parse_generate
from splitserve_api.v1 import splitserve_pb2 as pb

TEXT = pb.GenerateRequest.DESCRIPTOR.fields_by_name["text"].number


def nested_groups(depth: int) -> bytes:
    """An unknown field 99 as `depth` groups, one inside the other."""
    return _VarintBytes(99 << 3 | 3) * depth + _VarintBytes(99 << 3 | 4) * depth


CORRUPT = {
    "corrupt wire data": b"\xff\xff\xff\xff",
    "invalid UTF-8 in a string field": bytes([TEXT << 3 | 2, 2, 0xFF, 0xFE]),
    "groups nested past the parser's limit": nested_groups(101),
}


@pytest.mark.parametrize("data", CORRUPT.values(), ids=CORRUPT.keys())
def test_a_message_that_does_not_parse_is_unparsable_not_an_exception(data: bytes) -> None:
    got = parse_generate(data)
    assert isinstance(got, Unparsable)
    assert got.num_bytes == len(data) and "GenerateRequest" in got.why


def test_a_message_that_parses_is_the_request() -> None:
    msg = pb.GenerateRequest(text="Hello", request_id="r1")
    assert parse_generate(msg.SerializeToString()) == msg
    assert isinstance(parse_generate(nested_groups(50)), pb.GenerateRequest)  # within the limit


def test_one_line_per_interval_and_the_next_counts_those_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    limited = RateLimitedLog(logging.getLogger("test.unparsable"), 60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.unparsable"):
        logged = []
        for t in (0.0, 1.0, 30.0, 59.9, 60.0, 61.0, 200.0):
            now[0] = t
            logged.append(limited.warning("bad"))
    assert logged == [True, False, False, False, True, False, True]
    assert [r.getMessage() for r in caplog.records] == [
        "bad",
        "bad (3 more since the last such line)",
        "bad (1 more since the last such line)",
    ]
