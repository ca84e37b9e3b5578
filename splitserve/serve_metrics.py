"""What `splitserve bench serve` measures, computed from per-request records (no I/O).

All client times are seconds on one monotonic clock (time.perf_counter), taken by the load
generator: `send_s` just before the call, one time per streamed message that carries tokens,
`end_s` when the stream has ended (or failed). From them, for a request that succeeded:
- TTFT = first token message - send.
- E2E = end - send.
- TPOT = (E2E - TTFT) / (output tokens - 1): the mean time per token after the first;
  undefined for a one-token reply.
- ITL, the gaps between consecutive tokens: a message is timed when it arrives, so a
  message of k tokens contributes its gap from the previous message once and k - 1 zero
  gaps (its tokens arrived together); the first message's extra tokens are zero gaps too.
  A reply of n tokens has n - 1 gaps and they sum to last message - first message.
  (The router's Prometheus ITL instead spreads a message's gap evenly over its tokens.)
Summaries are mean, p50, p90 and p99 over the requests that succeeded, percentiles by
linear interpolation between closest ranks (numpy's default method).

Throughput is over the run's span, first send to last end, counting completed requests and
their output tokens. SLO attainment is over ALL requests: one that failed misses. Goodput
follows DistServe: the highest request rate at which at least 90% of requests meet both
the TTFT and the TPOT SLO.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

OK = "OK"
GOODPUT_ATTAINMENT = 0.9  # DistServe's attainment goal


@dataclass(frozen=True)
class ServerTiming:
    """The server's own view of one request, in ms (the proto's Timing)."""

    queue_ms: float  # arrival -> KV pages reserved
    prefill_ms: float  # reserved -> first token sampled
    transfer_ms: float  # first token -> decode worker holds all KV (0: local prefill)
    first_token_ms: float  # arrival -> first token sent
    total_ms: float  # arrival -> last token sent


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it. `messages`: (arrival time, token count) for each
    streamed message that carried tokens, in order. `status`: "OK" or the failure's name
    (bench/serve_backend.py: a gRPC status name, or HTTP_<code> and the like).
    `timing` comes with the last message of a request that succeeded."""

    send_s: float
    end_s: float
    messages: tuple[tuple[float, int], ...]
    prompt_tokens: int
    status: str = OK
    cached_prompt_tokens: int = 0
    timing: ServerTiming | None = None

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def output_tokens(self) -> int:
        return sum(k for _, k in self.messages)

    @property
    def ttft(self) -> float | None:
        return self.messages[0][0] - self.send_s if self.messages else None

    @property
    def e2e(self) -> float:
        return self.end_s - self.send_s

    @property
    def tpot(self) -> float | None:
        ttft, n = self.ttft, self.output_tokens
        return None if ttft is None or n < 2 else (self.e2e - ttft) / (n - 1)

    def itl(self) -> list[float]:
        gaps: list[float] = []
        for i, (t, k) in enumerate(self.messages):
            if i > 0:
                gaps.append(t - self.messages[i - 1][0])
            gaps += [0.0] * (k - 1)
        return gaps


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float

    def met_by(self, r: RequestRecord) -> bool:
        """Succeeded, TTFT within its SLO, and TPOT too (trivially, for one token)."""
        ttft, tpot = r.ttft, r.tpot
        if not r.ok or ttft is None or ttft > self.ttft_s:
            return False
        return tpot is None or tpot <= self.tpot_s


@dataclass(frozen=True)
class Stats:
    mean: float
    p50: float
    p90: float
    p99: float


@dataclass(frozen=True)
class RunSummary:
    """One run at one offered rate. Latency stats (seconds) are None when no request
    succeeded; server_ms averages the server's timings over requests that succeeded."""

    requests: int
    completed: int
    failures: dict[str, int]  # RequestRecord.status -> count
    duration_s: float
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens of completed requests / s
    cached_prompt_tokens: int  # prompt tokens the server's prefix cache served
    ttft_s: Stats | None
    tpot_s: Stats | None
    itl_s: Stats | None
    e2e_s: Stats | None
    slo_attainment: float
    server_ms: dict[str, float]


def percentile(xs: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100) by linear interpolation between closest ranks."""
    assert xs and 0 <= p <= 100
    s = sorted(xs)
    rank = p / 100 * (len(s) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (rank - lo)


def stats(xs: Sequence[float]) -> Stats | None:
    if not xs:
        return None
    return Stats(sum(xs) / len(xs), *(percentile(xs, p) for p in (50, 90, 99)))


def slo_attainment(records: Sequence[RequestRecord], slo: Slo) -> float:
    """The fraction of all requests, failures included (as misses), meeting both SLOs."""
    assert records
    return sum(slo.met_by(r) for r in records) / len(records)


def failures(records: Sequence[RequestRecord]) -> dict[str, int]:
    return dict(Counter(r.status for r in records if not r.ok))


def summarize(records: Sequence[RequestRecord], slo: Slo) -> RunSummary:
    assert records
    done = [r for r in records if r.ok]
    span = max(r.end_s for r in records) - min(r.send_s for r in records)
    timings = [r.timing for r in done if r.timing is not None]
    fields = ("queue_ms", "prefill_ms", "transfer_ms", "first_token_ms", "total_ms")
    server = {f: sum(getattr(t, f) for t in timings) / len(timings) for f in fields if timings}
    return RunSummary(
        requests=len(records),
        completed=len(done),
        failures=failures(records),
        duration_s=span,
        request_throughput=len(done) / span if span > 0 else 0.0,
        output_throughput=sum(r.output_tokens for r in done) / span if span > 0 else 0.0,
        cached_prompt_tokens=sum(r.cached_prompt_tokens for r in done),
        ttft_s=stats([t for r in done if (t := r.ttft) is not None]),
        tpot_s=stats([t for r in done if (t := r.tpot) is not None]),
        itl_s=stats([g for r in done for g in r.itl()]),
        e2e_s=stats([r.e2e for r in done]),
        slo_attainment=slo_attainment(records, slo),
        server_ms=server,
    )


def highest_rate_meeting(
    attainment: Mapping[float, float], goal: float = GOODPUT_ATTAINMENT
) -> float | None:
    """The highest swept rate whose attainment is at least `goal`; None if none is."""
    assert all(0 < r < math.inf for r in attainment), "rates must be finite and positive"
    meeting = [r for r, a in attainment.items() if a >= goal]
    return max(meeting) if meeting else None


def interpolated_goodput(
    attainment: Mapping[float, float], goal: float = GOODPUT_ATTAINMENT
) -> float | None:
    """Goodput as reported: from the highest swept rate meeting `goal`, linear
    interpolation of attainment towards the next swept rate (which misses it) to where
    it crosses `goal`. The highest rate itself when no higher rate was swept (no
    extrapolation); None when no rate meets `goal`."""
    lo = highest_rate_meeting(attainment, goal)
    if lo is None:
        return None
    higher = [r for r in attainment if r > lo]
    if not higher:
        return lo
    hi = min(higher)
    a_lo, a_hi = attainment[lo], attainment[hi]
    return lo + (hi - lo) * (a_lo - goal) / (a_lo - a_hi)
