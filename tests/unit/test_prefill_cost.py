"""Local or remote prefill by measured cost (router/prefill_cost.py): table cases.

The decode worker costs 1 ms per token; the prefill worker 0.5 ms per token, and pushing
a token's KV 0.1 ms."""

from __future__ import annotations

import pytest

from router.prefill_cost import (
    LocalPrefill,
    RemotePrefill,
    local_seconds,
    prefill_remotely,
    remote_seconds,
)


def here(uncached: int = 1000, sequences: int = 0, spt: float | None = 1e-3) -> LocalPrefill:
    return LocalPrefill(uncached, spt, sequences)


def there(
    uncached: int = 1000,
    queued: int = 0,
    spt: float | None = 5e-4,
    transfer: float | None = 1e-4,
    pushed: int = 1000,
) -> RemotePrefill:
    return RemotePrefill(uncached, queued, spt, transfer, pushed)


# fmt: off
CASES = [
    # name, local, remote, prefill remotely
    ("idle both: the faster prefill worker", here(), there(), True),
    ("busy prefill queue: local is cheaper", here(), there(queued=2000), False),
    ("queue under the break-even (800)", here(), there(queued=799), True),
    ("queue past the break-even: local", here(), there(queued=801), False),
    ("running decodes stall: remote despite a queue", here(sequences=8), there(queued=5000), True),
    ("the prefill worker lacks more of the prompt", here(uncached=100),
     there(uncached=1000, pushed=100), False),
    ("slow transfer: local", here(), there(transfer=1e-3), False),
    ("decode worker unmeasured: remote", here(spt=None), there(queued=10**6), True),
    ("prefill worker unmeasured: remote", here(), there(spt=None, queued=10**6), True),
    ("nothing pushed yet: remote", here(), there(transfer=None, queued=10**6), True),
    ("a free decode worker: local", here(spt=0.0), there(), False),
]
# fmt: on


@pytest.mark.parametrize("local, remote, expected", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_prefill_remotely(local: LocalPrefill, remote: RemotePrefill, expected: bool) -> None:
    assert prefill_remotely(local, remote) is expected


def test_the_seconds_are_the_module_formula() -> None:
    assert local_seconds(here(uncached=200, sequences=3)) == pytest.approx(200 * 1e-3 * 4)
    remote = there(uncached=300, queued=700, pushed=200)
    assert remote_seconds(remote) == pytest.approx(1000 * 5e-4 + 200 * 1e-4)
