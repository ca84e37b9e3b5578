"""What `splitserve bench chaos` found, from its records alone (pure: no server, no clock).

Inputs: each request's outcome as the client saw it (the idle run's, one request at a
time, and the loaded run's), the faults injected (when, what, how long until the server
had replaced it) and each worker's free pages at the end. Output: one summary (plain
data, the JSON's `summary`) and its table.

A loaded request is compared with the idle run of the same mix item: completed with
other tokens is a wrong-token request (the index of the first token that differs is
kept); a failed one whose streamed tokens already differ is counted too, since it
streamed wrong tokens before failing. A request is "at a kill" when a worker was killed
between its start and its end; its extra latency is its latency minus its idle one.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from splitserve.serve_metrics import OK, percentile

DETAIL_CHARS = 80


@dataclass(frozen=True)
class Outcome:
    """One request's end: `status` OK or the gRPC code's name, `detail` the class of the
    status message (message_class), the tokens streamed before the end."""

    item: int  # index into the mix
    start: float  # monotonic seconds
    end: float
    tokens: tuple[int, ...]
    status: str = OK
    detail: str = ""

    @property
    def latency_s(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Fault:
    """One kill -9: of a worker (`target` its phase) or of the embedded valkey-server
    (`target` "redis"). `recovered_s`: from the kill until a replacement served (the
    pool's new worker listed by the router; valkey answering PING); None if not in time."""

    target: str
    pid: int
    at: float  # monotonic seconds
    gone: str  # the worker the router dropped ("" for redis)
    replacement: str  # the worker that took its place ("" for redis, or none in time)
    recovered_s: float | None


@dataclass(frozen=True)
class WorkerPages:
    worker: str
    free: int
    total: int


def message_class(detail: str) -> str:
    """A status message with its numbers, ids and hex strings masked, cut to DETAIL_CHARS,
    so that failures of one kind count together."""
    masked = re.sub(r"[0-9a-f]{8,}|\d+(\.\d+)?", "#", detail)
    return masked[:DETAIL_CHARS]


def divergence(expected: Sequence[int], got: Sequence[int]) -> int | None:
    """The first index where `got` differs from `expected` (a shorter or longer `got`
    differs where it ends); None when they are equal."""
    for i, (a, b) in enumerate(zip(expected, got, strict=False)):
        if a != b:
            return i
    return None if len(expected) == len(got) else min(len(expected), len(got))


def _stats(xs: Sequence[float]) -> dict[str, float] | None:
    if not xs:
        return None
    return {"n": len(xs), "p50": percentile(xs, 50), "p99": percentile(xs, 99), "max": max(xs)}


def _at_kill(o: Outcome, kills: Sequence[float]) -> bool:
    return any(o.start <= t <= o.end for t in kills)


def _recovery(faults: Sequence[Fault], target: str) -> dict[str, Any]:
    mine = [f for f in faults if f.target == target]
    times = [f.recovered_s for f in mine if f.recovered_s is not None]
    return {
        "kills": len(mine),
        "not_recovered": len(mine) - len(times),
        "recovery_s": _stats(times),
    }


def summarize(
    idle: Sequence[Outcome],
    run: Sequence[Outcome],
    faults: Sequence[Fault],
    pages: Sequence[WorkerPages] | None,
) -> dict[str, Any]:
    """The loaded run `run` against the idle run `idle` (one OK outcome per mix item)."""
    expected = {o.item: o for o in idle}
    assert all(o.status == OK for o in idle), "the idle run is the reference: it must succeed"
    done = [o for o in run if o.status == OK]
    failed = Counter(f"{o.status}: {o.detail}" for o in run if o.status != OK)
    wrong = [
        {"item": o.item, "first_divergence": d}
        for o in done
        if (d := divergence(expected[o.item].tokens, o.tokens)) is not None
    ]
    wrong_prefix = [
        o for o in run if o.status != OK and expected[o.item].tokens[: len(o.tokens)] != o.tokens
    ]
    kills = [f.at for f in faults if f.target != "redis"]
    extra = {True: list[float](), False: list[float]()}
    for o in done:
        extra[_at_kill(o, kills)].append(o.latency_s - expected[o.item].latency_s)
    recovery = {t: _recovery(faults, t) for t in sorted({f.target for f in faults})}
    return {
        "sent": len(run),
        "completed": len(done),
        "failed": sum(failed.values()),
        "failed_by_status": dict(failed.most_common()),
        "wrong_tokens": len(wrong),
        "wrong_token_requests": wrong,
        "failed_after_wrong_tokens": len(wrong_prefix),
        "recovery": recovery,
        "extra_latency_s": {
            "at_a_kill": _stats(extra[True]),
            "not_at_a_kill": _stats(extra[False]),
        },
        "pages": None if pages is None else [asdict(p) for p in pages],
        "pages_all_free": None if pages is None else all(p.free == p.total for p in pages),
    }


def _s(stats: dict[str, float] | None, key: str) -> str:
    return "-" if stats is None else f"{stats[key]:.2f}"


def table(title: str, s: dict[str, Any]) -> str:
    """The summary as the lines the benchmark prints."""
    lines = [
        f"{title}: sent {s['sent']}, completed {s['completed']}, failed {s['failed']}, "
        f"wrong tokens {s['wrong_tokens']} (+{s['failed_after_wrong_tokens']} failed after "
        "streaming wrong tokens)",
    ]
    lines += [f"  failed {n:4d}  {why}" for why, n in s["failed_by_status"].items()]
    if s["wrong_token_requests"]:
        first = sorted(w["first_divergence"] for w in s["wrong_token_requests"])
        lines.append(f"  first divergence at token {first[:20]}")
    for target, r in s["recovery"].items():
        rec = r["recovery_s"]
        lines.append(
            f"  kill -9 {target}: {r['kills']}, recovered p50 {_s(rec, 'p50')} s, "
            f"max {_s(rec, 'max')} s, not recovered {r['not_recovered']}"
        )
    for key, what in (("at_a_kill", "in flight at a kill"), ("not_at_a_kill", "the others")):
        e = s["extra_latency_s"][key]
        n = 0 if e is None else e["n"]
        lines.append(
            f"  extra latency vs idle, {what} ({n}): p50 {_s(e, 'p50')} s, p99 {_s(e, 'p99')} s"
        )
    if s["pages"] is not None:
        held = [f"{p['worker']} {p['free']}/{p['total']}" for p in s["pages"]]
        verdict = "all free" if s["pages_all_free"] else "NOT all free"
        lines.append(f"  pages at the end (free/total): {verdict}: {', '.join(held)}")
    return "\n".join(lines)
