"""Where a conversation's KV lives: session placements kept in Redis as a routing hint.

A placement is a Redis hash of text fields under `prefix + session_id`, with a TTL. Nothing
is unpickled or evaluated: fields are parsed strictly and anything else reads as a miss.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

log = logging.getLogger(__name__)

# KEYS[1]: the session's key. ARGV[1]: TTL in ms, ARGV[2]: last_use, ARGV[3..]: field, value...
# Newest last_use wins: writes (and returns 1) unless the stored placement is newer. A key of
# another type, or a hash without a readable last_use, is overwritten.
_PUT_IF_NOT_OLDER = """
if redis.call('TYPE', KEYS[1]).ok == 'hash' then
  local stored = tonumber(redis.call('HGET', KEYS[1], 'last_use'))
  if stored and stored > tonumber(ARGV[2]) then
    return 0
  end
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""

_REQUIRED = frozenset({"decode_worker", "decode_epoch", "cached_tokens", "last_use"})
_OPTIONAL = frozenset({"prefill_worker"})


@dataclass(frozen=True)
class Placement:
    decode_worker: str  # worker id (Ray actor name)
    decode_epoch: str  # changes when that worker restarts; a stale epoch means the KV is gone
    prefill_worker: str | None
    cached_tokens: int  # tokens of the conversation whose KV the decode worker holds
    last_use: float  # unix time of the last turn

    def to_fields(self) -> dict[str, str]:
        """The Redis hash fields; prefill_worker is absent when None."""
        fields = {
            "decode_worker": self.decode_worker,
            "decode_epoch": self.decode_epoch,
            "cached_tokens": str(self.cached_tokens),
            "last_use": repr(self.last_use),
        }
        if self.prefill_worker is not None:
            fields["prefill_worker"] = self.prefill_worker
        return fields

    @classmethod
    def from_fields(cls, raw: Mapping[bytes, bytes]) -> Placement | None:
        """Parse a hash written by `to_fields`; None for anything else (missing, extra or
        unparsable fields)."""
        try:
            fields = {k.decode(): v.decode() for k, v in raw.items()}
            names = fields.keys()
            if not _REQUIRED <= names <= _REQUIRED | _OPTIONAL:
                raise ValueError(f"fields {sorted(names)}")
            cached_tokens = int(fields["cached_tokens"])
            last_use = float(fields["last_use"])
            if cached_tokens < 0 or not math.isfinite(last_use):
                raise ValueError(f"cached_tokens {cached_tokens}, last_use {last_use}")
            if not fields["decode_worker"] or not fields["decode_epoch"]:
                raise ValueError("empty decode worker or epoch")
        except (UnicodeDecodeError, ValueError) as e:
            log.debug("malformed placement %r: %s", raw, e)
            return None
        return cls(
            decode_worker=fields["decode_worker"],
            decode_epoch=fields["decode_epoch"],
            prefill_worker=fields.get("prefill_worker"),
            cached_tokens=cached_tokens,
            last_use=last_use,
        )


class PlacementStore:
    """Session placements in Redis with a TTL. Redis is only a hint on the request path:
    every call has a short timeout and, when Redis is unreachable, get returns None and put
    returns False (fail open) -- no exception ever reaches the caller.

    After a failure Redis counts as down and is left alone for `retry_s`; the next call
    after that tries it again (on `clock`, seconds). Stores sharing one Redis see each
    other's placements.
    """

    def __init__(
        self,
        url: str,
        ttl_s: float = 3600.0,
        timeout_s: float = 0.05,
        retry_s: float = 1.0,
        prefix: str = "splitserve:session:",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._redis = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # pinned, not left to the version's default: fail at once
        )
        self._put_script = self._redis.register_script(_PUT_IF_NOT_OLDER)
        self._where = _without_credentials(url)
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._retry_s = retry_s
        self._prefix = prefix
        self._clock = clock
        self._failures = 0
        self._available = True
        self._retry_at = 0.0  # the clock's time before which a down Redis is not tried

    @property
    def failures(self) -> int:
        """Redis calls that failed (timeouts, refused connections, errors)."""
        return self._failures

    @property
    def available(self) -> bool:
        """False while Redis is considered down."""
        return self._available

    async def get(self, session_id: str) -> Placement | None:
        """The session's placement; None on a miss, a malformed value or Redis down."""
        if self._resting():
            return None
        key = self._prefix + session_id
        try:
            raw = await self._redis.hgetall(key)
        except ResponseError as e:  # Redis answered: the key holds something else
            self._up()
            log.debug("unreadable placement at %s: %s", key, e)
            return None
        except (RedisError, OSError) as e:
            self._down(e)
            return None
        self._up()
        # decode_responses is off: field names and values come back as bytes
        return Placement.from_fields(cast(dict[bytes, bytes], raw)) if raw else None

    async def put(self, session_id: str, placement: Placement) -> bool:
        """Store the placement unless a newer one (by last_use) is stored; True if stored."""
        if self._resting():
            return False
        args: list[str | int] = [self._ttl_ms, repr(placement.last_use)]
        for name, value in placement.to_fields().items():
            args += [name, value]
        try:
            stored = await self._put_script(keys=[self._prefix + session_id], args=args)
        except (RedisError, OSError) as e:
            self._down(e)
            return False
        self._up()
        return stored == 1

    async def close(self) -> None:
        await self._redis.aclose()

    def _resting(self) -> bool:
        return not self._available and self._clock() < self._retry_at

    def _down(self, error: Exception) -> None:
        self._failures += 1
        self._retry_at = self._clock() + self._retry_s
        if self._available:
            self._available = False
            log.warning(
                "Redis at %s unreachable (%s: %s); routing without session affinity",
                self._where,
                type(error).__name__,
                error,
            )

    def _up(self) -> None:
        if not self._available:
            self._available = True
            log.info("Redis at %s reachable again; routing with session affinity", self._where)


def _without_credentials(url: str) -> str:
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.rpartition('@')[2]}"
