"""Generate messages that do not parse: refused as INVALID_ARGUMENT, logged at a bounded rate.

grpc answers a call whose request deserializer raises with UNKNOWN and logs a traceback
for each one; a fuzzer sends thousands (corrupt wire data, bad UTF-8 in a string field,
groups nested past the parser's limit). `parse_generate` never raises: what does not
parse becomes an Unparsable for the servicer to refuse, and `RateLimitedLog` reports
such calls in at most one line per interval, counting those it left out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from splitserve_api.v1 import splitserve_pb2 as pb


@dataclass(frozen=True)
class Unparsable:
    """A request body that is not a GenerateRequest: why, and how many bytes it had."""

    why: str
    num_bytes: int


def parse_generate(data: bytes) -> pb.GenerateRequest | Unparsable:
    """The GenerateRequest in `data`, or why there is none."""
    try:
        return pb.GenerateRequest.FromString(data)
    except DecodeError as e:
        return Unparsable(str(e), len(data))


class RateLimitedLog:
    """Warnings on `log`, at most one per `every_s` seconds of `clock`; the next line
    says how many were left out since the last one."""

    def __init__(
        self, log: logging.Logger, every_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.log = log
        self.every_s = every_s
        self.clock = clock
        self._last: float | None = None
        self._left_out = 0

    def warning(self, message: str) -> bool:
        """Log `message` unless a line went out less than every_s ago; True if logged."""
        now = self.clock()
        if self._last is not None and now - self._last < self.every_s:
            self._left_out += 1
            return False
        more = f" ({self._left_out} more since the last such line)" if self._left_out else ""
        self.log.warning("%s%s", message, more)
        self._last, self._left_out = now, 0
        return True
