"""Failures in disaggregated serving, each ending in the right tokens or a clear status,
never a hang, with every page free on every worker afterwards (the `workers` fixture
checks): a missed lease (pages kept past it until the sender's CANCEL), an unclaimed
reservation, a dead prefill worker, aborts in every state, and mismatched peers."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import ray
import torch

from cluster.engine.kernels.kv_cache import KVCache, KVLayout
from cluster.engine.model.checkpoint import read_spec
from cluster.engine.model.model_files import bundled_model_path
from cluster.transfer.endpoint import KVEndpoint
from cluster.transfer.wire import Notice, NoticeKind, compat_hash
from cluster.types import (
    FinishReason,
    InvalidRequestError,
    KVTarget,
    RequestId,
    RequestStatus,
    SamplingParams,
    Submission,
    TokenDelta,
)
from router.dispatch import Dispatcher
from tests.helpers import until
from tests.integration.conftest import WORKER_ENGINE
from tests.integration.disagg import collect, run
from tests.integration.test_disagg import GREEDY, SEEDED, long_prompt

READER = "failure-tests"  # the outbox these tests read by hand


def submission(
    rid: RequestId, prompt_ids: list[int], remote_prefill: bool, sampling: SamplingParams = GREEDY
) -> Submission:
    """The request as a router hands it over, its deltas to READER's outbox."""
    return Submission(
        request_id=rid,
        prompt_ids=prompt_ids,
        sampling=sampling,
        remote_prefill=remote_prefill,
        reader=READER,
    )


# Long enough for a claim made by a sender that is ready before the reservation (a Ray
# reply, a connect and a notice), short enough to wait out.
SHORT_LEASE = {"lease_s": 2.0, "local_prefill_tokens": 0}
# The workers' KV compatibility (WORKER_ENGINE: the bundled model, float32, pages of 16).
COMPAT = compat_hash(
    read_spec(bundled_model_path()), "float32", "auto", 16, str(WORKER_ENGINE["quantization"])
)
# One prompt at a time in small chunks: a second request stays queued for many steps.
SERIAL = {"max_num_seqs": 1, "max_num_batched_tokens": 64}


class StalledSender:
    """A KV sender in this process that claims a decode worker's pages and then stalls:
    it never WRITEs or renews, and cancels only when the test says. Its endpoint is up
    before the reservation is made, so the claim is all that runs on the lease's clock."""

    def __init__(self, name: str, compat: bytes) -> None:
        layout = KVLayout.of(read_spec(bundled_model_path()), 16, torch.float32)  # the workers'
        cache = KVCache(layout, 1, torch.device("cpu"))
        self.endpoint = KVEndpoint(name, cache, compat, "lo")
        self.heard: list[NoticeKind] = []

    def claim(self, target: KVTarget, rid: RequestId) -> None:
        self.peer, self.rid = self.endpoint.connect(target.handshake), rid
        started = Notice(NoticeKind.STARTED, rid, handshake=self.endpoint.handshake())
        self.endpoint.notify(self.peer, started)

    async def hears(self, kind: NoticeKind) -> bool:
        self.heard += [n.kind for n in self.endpoint.notices() if n.request_id == self.rid]
        return kind in self.heard

    def cancel(self) -> None:
        self.endpoint.notify(self.peer, Notice(NoticeKind.CANCEL, self.rid))


async def _outputs(d: Any, rid: RequestId, timeout_s: float = 60) -> list[TokenDelta]:
    """Every delta of rid from READER's outbox on d, up to the one that ends it."""
    cursor, started = 0, time.monotonic()
    mine: list[TokenDelta] = []
    while not mine or mine[-1].finish_reason is None:
        cursor, deltas = await d.outputs.remote(READER, cursor, 1.0)
        mine += [x for x in deltas if x.request_id == rid]
        assert time.monotonic() - started < timeout_s
    return mine


async def _stall_past_the_lease(d: Any, rid: RequestId, ids: list[int]) -> list[TokenDelta]:
    """Claim, stall until the decode worker revokes, see it keep the pages, then cancel."""
    sender = StalledSender(f"stalled-{rid}", COMPAT)
    target = await d.submit.remote(submission(rid, ids, remote_prefill=True))
    sender.claim(target, rid)
    await until(lambda: sender.hears(NoticeKind.ACK), "the claim acknowledged")
    await until(lambda: sender.hears(NoticeKind.REVOKE), "the lease revoked (its own clock)")
    assert (await d.stats.remote()).transferring == 1  # pages kept: a WRITE could still land
    sender.cancel()
    return await _outputs(d, rid)


def test_kv_that_misses_its_lease_is_recomputed_by_the_decode_worker(
    workers: Any, prompts: list[list[int]]
) -> None:
    d = workers.decode("decode-short-lease", **SHORT_LEASE)
    c = workers.decode("colocated")
    failures = ray.get(d.stats.remote()).transfer_failures
    deltas = run(_stall_past_the_lease(d, RequestId("stalled"), prompts[8]))
    assert deltas[-1].finish_reason is not FinishReason.ERROR
    reference = run(collect(Dispatcher(), prompts[8], GREEDY, c)).tokens
    assert [t for x in deltas for t in x.token_ids] == reference
    assert ray.get(d.stats.remote()).transfer_failures == failures + 1


def test_with_policy_fail_a_missed_lease_fails_the_request_with_a_clear_status(
    workers: Any, prompts: list[list[int]]
) -> None:
    d = workers.decode("decode-short-lease-fail", on_timeout="fail", **SHORT_LEASE)
    deltas = run(_stall_past_the_lease(d, RequestId("stalled-fail"), prompts[6]))
    assert deltas[-1].finish_reason is FinishReason.ERROR
    assert deltas[-1].error is not None and "lease_s=2" in deltas[-1].error
    assert [t for x in deltas for t in x.token_ids] == []


def test_an_abort_during_a_claimed_transfer_ends_the_stream_and_keeps_the_pages_till_cancel(
    workers: Any, prompts: list[list[int]]
) -> None:
    """The client gets its ABORT at once; the request stays in flight here (its id
    refused, its pages held) until its sender says no WRITE can land, then it is gone."""
    d = workers.decode("decode", local_prefill_tokens=0)
    rid = RequestId("aborted-in-transfer")
    sender = StalledSender("aborted-sender", COMPAT)

    async def go() -> None:
        target = await d.submit.remote(submission(rid, prompts[7], remote_prefill=True))
        sender.claim(target, rid)
        await until(lambda: sender.hears(NoticeKind.ACK), "the claim acknowledged")
        assert await d.abort.remote(rid) is RequestStatus.TRANSFERRING
        assert [x.finish_reason for x in await _outputs(d, rid)] == [FinishReason.ABORT]
        await until(lambda: sender.hears(NoticeKind.REVOKE), "the abort revoked the claim")
        stats = await d.stats.remote()
        assert stats.transferring == 1 and stats.in_flight == 1  # a WRITE could still land
        assert await d.abort.remote(rid) is None  # its stream is over: nothing to abort
        assert not await d.transfer_failed.remote(rid, "too late")
        with pytest.raises(InvalidRequestError, match="already in flight"):
            await d.submit.remote(submission(rid, prompts[7], remote_prefill=True))
        sender.cancel()
        await until(lambda: _stat(d, "transferring", 0), "the pages let go")
        assert (await d.stats.remote()).in_flight == 0
        assert (
            await d.submit.remote(submission(rid, prompts[7], remote_prefill=False)) is None
        )  # anew
        assert await d.abort.remote(rid) is not None

    run(go())


def test_a_reservation_nobody_fills_is_released_when_its_lease_ends(
    workers: Any, prompts: list[list[int]]
) -> None:
    """The prefill worker chosen for it never claims it (it died before it could), or
    claims it too late: its STARTED gets REVOKE (the receiving machine's RELEASED rule)."""
    d = workers.decode("decode-short-lease", **SHORT_LEASE)
    c = workers.decode("colocated")
    rid = RequestId("unclaimed")
    failures = ray.get(d.stats.remote()).transfer_failures
    late = StalledSender("late-sender", COMPAT)

    async def go() -> list[int]:
        target = await d.submit.remote(submission(rid, prompts[8], remote_prefill=True))
        assert target is not None and len(target.pages) == -(-len(prompts[8]) // 16)
        assert target.lease_s == SHORT_LEASE["lease_s"]
        deltas = await _outputs(d, rid)
        late.claim(target, rid)  # the request is over there: released
        await until(lambda: late.hears(NoticeKind.REVOKE), "a late claim revoked")
        return [t for x in deltas for t in x.token_ids]

    assert run(go()) == run(collect(Dispatcher(), prompts[8], GREEDY, c)).tokens
    assert ray.get(d.stats.remote()).transfer_failures == failures + 1  # the lease ended
    assert late.heard == [NoticeKind.REVOKE]  # never an ACK: no WRITE may follow


async def _is(ref: Any, status: RequestStatus) -> bool:
    return bool(await ref == status)


async def _worker_id(disp: Dispatcher, request_id: str) -> RequestId:
    """The id the workers know the caller's request by, once its stream has started."""
    found: list[RequestId] = []

    async def started() -> bool:
        rid = disp.worker_id(RequestId(request_id))
        found.extend([rid] if rid else [])
        return rid is not None

    await until(started, request_id)
    return found[0]


def test_abort_while_queued_or_prefilling_on_the_prefill_worker(
    workers: Any, prompts: list[list[int]]
) -> None:
    serial = workers.prefill("prefill-serial", engine=SERIAL)
    d = workers.decode("decode", local_prefill_tokens=0)

    async def go() -> None:
        disp = Dispatcher()
        a = asyncio.create_task(
            collect(disp, long_prompt(prompts[7], 1000), GREEDY, d, serial, "pf")  # 16 steps
        )
        pf = await _worker_id(disp, "pf")
        await until(lambda: _is(serial.status.remote(pf), RequestStatus.PREFILLING), "pf")
        b = asyncio.create_task(collect(disp, prompts[4], GREEDY, d, serial, "q"))
        q = await _worker_id(disp, "q")
        await until(lambda: _is(serial.status.remote(q), RequestStatus.WAITING), "q")
        assert await serial.status.remote(pf) is RequestStatus.PREFILLING
        await disp.abort(RequestId("q"))  # first: with "pf" gone, "q" would start at once
        await disp.abort(RequestId("pf"))
        for rid, task in ((q, b), (pf, a)):
            result = await task
            assert result.finish is FinishReason.ABORT and result.tokens == []
            assert await serial.status.remote(rid) is None

    run(go())


@pytest.mark.parametrize("how", ["dies", "drained"])
def test_a_prefill_worker_that_stops_before_pushing_costs_a_recompute_not_the_request(
    workers: Any, prompts: list[list[int]], how: str
) -> None:
    """Its requests, one prefilling and one queued, stop there: it dies, or it is drained
    (`abort_all`, which counts both). The decode worker prefills each itself (its
    on_timeout: recompute), so both end with the tokens they would have had."""
    serial = workers.prefill("prefill-serial", engine=SERIAL)
    d = workers.decode("decode", local_prefill_tokens=0)
    c = workers.decode("colocated")
    # Not prompts an earlier test left in this worker's prefix cache: all of them compute.
    busy, queued = {
        "dies": (long_prompt(prompts[5] + prompts[1], 500), prompts[4]),
        "drained": (long_prompt(prompts[6] + prompts[2], 500), prompts[3]),
    }[how]
    failures = ray.get(d.stats.remote()).transfer_failures

    async def go() -> None:
        disp = Dispatcher()
        a = asyncio.create_task(collect(disp, busy, GREEDY, d, serial, f"{how}-busy"))
        busy_id = await _worker_id(disp, f"{how}-busy")
        await until(lambda: _is(serial.status.remote(busy_id), RequestStatus.PREFILLING), "busy")
        b = asyncio.create_task(collect(disp, queued, SEEDED, d, serial, f"{how}-queued"))
        queued_id = await _worker_id(disp, f"{how}-queued")
        await until(lambda: _is(serial.status.remote(queued_id), RequestStatus.WAITING), "queued")
        if how == "dies":
            ray.kill(serial)
            del workers.handles["prefill-serial"]
        else:
            assert await serial.abort_all.remote() == 2
        split = await asyncio.gather(a, b)
        assert split[0].tokens == (await collect(disp, busy, GREEDY, c)).tokens
        assert split[1].tokens == (await collect(disp, queued, SEEDED, c)).tokens
        if how == "drained":
            for rid in (busy_id, queued_id):
                assert await serial.status.remote(rid) is None

    run(go())
    assert ray.get(d.stats.remote()).transfer_failures == failures + 2


@pytest.mark.parametrize("where", ["decode", "prefill"])
def test_abort_while_waiting_for_decode_pages(
    workers: Any, prompts: list[list[int]], where: str
) -> None:
    """The abort reaches the decode worker, where the submit waits for pages, or only the
    prefill worker, whose submit waits there: then, once the pages are reserved, the
    prefill worker aborts it on the decode worker."""
    p = workers.prefill("prefill")
    d = workers.decode("decode-small", engine={"kv_cache_gb": 0.01}, local_prefill_tokens=0)
    pages = ray.get(d.stats.remote()).num_pages
    # Each run's prompts uncached on these workers.
    big, small = {
        "decode": (prompts[7], prompts[7]),
        "prefill": (prompts[6] + prompts[3], prompts[9]),
    }[where]
    first = long_prompt(big, (pages - 2) * 16)
    # The big one's pages are held by a claim whose KV never comes, until the test cancels
    # it (the decode worker then computes it itself): the starved request waits as long as
    # the test needs, however fast this machine prefills.
    holder, held = StalledSender(f"holder-{where}", COMPAT), RequestId(f"held-{where}")

    async def go() -> None:
        disp = Dispatcher()
        target = await d.submit.remote(
            submission(held, first, remote_prefill=True, sampling=SamplingParams(max_tokens=8))
        )
        holder.claim(target, held)
        await until(lambda: holder.hears(NoticeKind.ACK), "the claim acknowledged")
        b = asyncio.create_task(collect(disp, small, GREEDY, d, p, "starved"))
        await until(lambda: _stat(d, "admitting", 1), "starved waiting")
        starved = disp.worker_id(RequestId("starved"))
        if where == "decode":
            assert await d.abort.remote(starved) is RequestStatus.WAITING
        else:
            await p.abort.remote(starved)
        holder.cancel()
        assert (await b).finish is FinishReason.ABORT
        assert (await _outputs(d, held))[-1].finish_reason is FinishReason.LENGTH
        assert await d.abort.remote(starved) is None  # not there any more

    run(go())


def test_a_prefill_worker_dead_before_the_request_reaches_the_decode_worker(
    workers: Any, prompts: list[list[int]]
) -> None:
    """The request never got to the decode worker: the router submits it there to prefill
    itself, and it ends with the tokens it would have had."""
    dead = workers.prefill("prefill-doomed")
    d = workers.decode("decode", local_prefill_tokens=0)
    c = workers.decode("colocated")
    ray.get(dead.stats.remote())
    ray.kill(dead)
    del workers.handles["prefill-doomed"]

    async def go() -> None:
        disp = Dispatcher()
        split = await collect(disp, prompts[2], GREEDY, d, dead)
        assert split.tokens == (await collect(disp, prompts[2], GREEDY, c)).tokens

    run(go())


def test_a_request_the_decode_worker_refuses_fails_through_the_prefill_worker(
    workers: Any, prompts: list[list[int]]
) -> None:
    p = workers.prefill("prefill")
    d = workers.decode("decode", local_prefill_tokens=0)

    async def go() -> None:
        too_long = SamplingParams(max_tokens=10**6)
        with pytest.raises(InvalidRequestError, match="max_tokens"):
            await collect(Dispatcher(), prompts[2], too_long, d, p)

    run(go())
    assert ray.get(p.stats.remote()).queued_requests == 0


async def _stat(worker: Any, name: str, value: int) -> bool:
    return bool(getattr(await worker.stats.remote(), name) == value)


def test_abort_while_transferring_and_while_running(workers: Any, prompts: list[list[int]]) -> None:
    """A long local prefill keeps the decode worker in one step after another; the small
    request's KV lands meanwhile, and the abort is read before its notices (TRANSFERRING)
    or, if a step ended in between, after them (RUNNING): a race between two processes
    that the test cannot order. Either way the stream ends aborted and its pages are free.
    The abort that surely comes first is the test above, with a sender the test drives."""
    p = workers.prefill("prefill")
    d = workers.decode("decode", local_prefill_tokens=0)

    async def go() -> None:
        disp = Dispatcher()
        hog_ids = long_prompt(prompts[4] + prompts[5], 900)  # uncached: several long steps
        hog = disp.generate(hog_ids, GREEDY, d, None, RequestId("hog"))
        hog_first = asyncio.create_task(anext(hog))
        await until(lambda: _stat(d, "running", 1), "hog running")
        small = disp.generate(prompts[3], GREEDY, d, p, RequestId("small"))
        first = await anext(small)  # from the prefill worker, before the decode reads notices
        assert first.index == 0 and len(first.token_ids) == 1
        status = await d.abort.remote(disp.worker_id(RequestId("small")))
        assert status in (RequestStatus.TRANSFERRING, RequestStatus.RUNNING)
        rest = [x async for x in small]
        assert rest[-1].finish_reason is FinishReason.ABORT
        await hog_first
        await anext(hog)  # two tokens out: decoding
        assert await d.abort.remote(disp.worker_id(RequestId("hog"))) is RequestStatus.RUNNING
        rest = [x async for x in hog]
        assert rest[-1].finish_reason is FinishReason.ABORT

    run(go())


@pytest.mark.parametrize("peer", ["page_size_32", "another_model", "int4_weights"])
def test_mismatched_peers_are_refused_at_the_handshake(
    workers: Any, prompts: list[list[int]], tiny_llama_dir: Any, peer: str
) -> None:
    engine = {
        "page_size_32": {"page_size": 32},
        "another_model": {"model": str(tiny_llama_dir), "quantization": "none"},
        "int4_weights": {"quantization": "int4"},  # the same file, other weights: other KV
    }[peer]
    bad = workers.prefill(f"prefill-{peer}", engine=engine)
    d = workers.decode("decode", local_prefill_tokens=0)
    strict = workers.decode("decode-short-lease-fail", on_timeout="fail", **SHORT_LEASE)
    c = workers.decode("colocated")
    ray.get(bad.stats.remote())  # started
    rid = RequestId(f"mismatch-{peer}")

    async def go() -> None:
        # Refused by the handshake's hash check, not by a lease or a timeout: the decode
        # worker hears it at once, and with policy fail ends the request saying so.
        assert (
            await bad.prefill.remote(submission(rid, prompts[0], remote_prefill=True), strict)
            is None
        )
        deltas = await _outputs(strict, rid)
        assert deltas[-1].finish_reason is FinishReason.ERROR
        assert deltas[-1].error is not None and "compatibility hash" in deltas[-1].error
        # Through the dispatcher the decode worker's policy (recompute) serves it anyway.
        disp = Dispatcher()
        split = await collect(disp, prompts[0], GREEDY, d, bad)
        assert split.tokens == (await collect(disp, prompts[0], GREEDY, c)).tokens

    run(go())


def test_a_duplicate_request_id_is_refused_and_the_first_request_is_untouched(
    workers: Any, prompts: list[list[int]]
) -> None:
    _, d, c = workers.trio()
    # Chunks of 32 tokens: the first prefill takes 13 engine steps, and a call to the worker
    # is taken between two steps, so the duplicate arrives while the first is in flight.
    p = workers.prefill("prefill-chunks-32", engine={"max_num_batched_tokens": 32})
    rid = RequestId("twice")
    ids = long_prompt(prompts[8] + prompts[1], 400)  # uncached

    async def go() -> None:
        first = asyncio.ensure_future(
            p.prefill.remote(submission(rid, ids, remote_prefill=True), d)
        )
        # An async actor may start calls out of order: wait until the first one is in.
        await until(lambda: _in(p, rid), "the first prefill to be admitted")
        with pytest.raises(InvalidRequestError, match="already in flight"):
            await d.submit.remote(submission(rid, prompts[0], remote_prefill=False))
        with pytest.raises(InvalidRequestError, match="already in flight"):
            await p.prefill.remote(submission(rid, prompts[0], remote_prefill=True), d)
        token = await first
        # The decode worker's deltas start after the first token, which it never repeats.
        deltas = await _outputs(d, rid)
        assert deltas[0].index == 1
        tokens = [token.token.token_id] + [t for x in deltas for t in x.token_ids]
        assert tokens == (await collect(Dispatcher(), ids, GREEDY, c)).tokens

    run(go())


def test_two_dispatchers_may_use_the_same_id_and_each_runs_its_own_request(
    workers: Any, prompts: list[list[int]]
) -> None:
    """Two routers share a decode worker and a caller's id: each id is its own router's,
    so each runs its own request, and neither's end touches the other's."""
    c = workers.decode("colocated")
    rid = RequestId("shared-id")
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)

    async def go() -> None:
        first, second = Dispatcher(), Dispatcher()
        live = asyncio.ensure_future(collect(first, prompts[2], sampling, c, request_id=rid))
        await until(lambda: _stat_at_least(c, "running", 1), "the first request to decode")
        other = await collect(second, prompts[0], SamplingParams(max_tokens=4), c, request_id=rid)
        assert other.finish is not None and other.tokens
        assert [d.request_id for d in other.deltas] == [rid] * len(other.deltas)
        done = await live
        assert done.finish is FinishReason.LENGTH and len(done.tokens) == 40

    run(go())


def test_an_id_reused_right_after_its_cancel_runs_the_second_request_untouched(
    workers: Any, prompts: list[list[int]]
) -> None:
    """The first use's abort is issued after the second use is submitted: it must end only
    the first, and the second streams every token of its own."""
    c = workers.decode("colocated")
    rid = RequestId("again")
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)

    async def go() -> None:
        disp = Dispatcher()
        reference = await collect(disp, prompts[3], sampling, c)
        first = disp.generate(prompts[2], SamplingParams(max_tokens=200, ignore_eos=True), c,
                              request_id=rid)  # fmt: skip
        assert (await first.__anext__()).token_ids
        await first.aclose()  # the abort of the first use is spawned, not yet sent
        second = disp.generate(prompts[3], sampling, c, request_id=rid)
        deltas = [await second.__anext__()]  # submitted before that abort goes out
        deltas += [d async for d in second]
        assert deltas[-1].finish_reason is FinishReason.LENGTH, deltas[-1]
        assert [t for d in deltas for t in d.token_ids] == reference.tokens

    run(go())


async def _in(worker: Any, rid: RequestId) -> bool:
    return await worker.status.remote(rid) is not None


async def _stat_at_least(worker: Any, name: str, value: int) -> bool:
    return bool(getattr(await worker.stats.remote(), name) >= value)
