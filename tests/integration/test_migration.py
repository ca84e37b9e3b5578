"""Mid-stream migration at the Dispatcher, on real Ray and NIXL: a stream whose decode
worker dies raises WorkerLost holding what it delivered; continued on another decode
worker from there (prefilled remotely or locally), it yields the tokens and text of a
run that never moved, with no gap and no duplicate, greedy or seeded. Every page on
every surviving worker comes back (the `workers` fixture checks), including those of a
prefill worker that was pushing KV to the dead one."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import openai
import pytest
import ray

from cluster.types import SamplingParams, Structured
from router.dispatch import Dispatcher, Progress, WorkerLost
from tests.helpers import until, wait_until
from tests.integration.disagg import Result, collect, run
from tests.integration.router_harness import RouterHarness, ask
from tests.integration.test_disagg import long_prompt

GREEDY = SamplingParams(max_tokens=48, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=48, temperature=0.9, top_p=0.95, seed=99, ignore_eos=True)
# A stop string that never comes: the workers hold back its length of text at each step.
STOPS = SamplingParams(max_tokens=48, ignore_eos=True, stop=("zzqx",))
# Penalties count the tokens delivered before the move; the continuation's first token is
# sampled by a prefill worker (remote) or the new decode worker (local) with those counts.
PENALISED = SamplingParams(
    max_tokens=48, ignore_eos=True, frequency_penalty=1.0, presence_penalty=0.5,
    repetition_penalty=1.2, logit_bias=((13, -100.0),),
)  # fmt: skip


async def kill_then_continue(
    workers: Any,
    ids: list[int],
    sp: SamplingParams,
    doomed: str,
    prefill: Any,
    then: Any,
    after_tokens: int,
) -> Result:
    """Stream on worker `doomed`, kill it once `after_tokens` tokens came, go on on `then`."""
    disp, delivered, out = Dispatcher(), Progress(), Result()
    victim = workers.handles[doomed]

    def take(delta: Any) -> None:
        assert delta.index == len(out.tokens), "no gap, no duplicate"
        out.tokens += delta.token_ids
        out.text += delta.text
        out.finish = delta.finish_reason

    with pytest.raises(WorkerLost) as lost:
        async for delta in disp.generate(ids, sp, victim, prefill, None, delivered):
            take(delta)
            if len(out.tokens) >= after_tokens and doomed in workers.handles:
                ray.kill(workers.handles.pop(doomed))
    assert lost.value.dead
    assert delivered.token_ids == out.tokens and delivered.chars == len(out.text)
    async for delta in disp.generate(ids, sp, then, prefill, None, delivered):
        take(delta)
    await disp.close()
    return out


# A grammar: the continuation's matcher resumes from the delivered tokens (an array long
# enough to pass 48 tokens).
STRUCTURED = SamplingParams(
    max_tokens=48, temperature=0.9, seed=5,
    structured=Structured("json_schema", '{"type": "array", "items": {"type": "integer"}, '
                                         '"minItems": 40}'),
)  # fmt: skip


@pytest.mark.parametrize(
    "sp",
    [
        GREEDY,
        SEEDED,
        STOPS,
        # Through the Dispatcher alone; CI runs the same kinds moved through the OpenAI
        # API (test_through_the_openai_api_a_moved_stream_keeps_its_penalties_and_grammar).
        pytest.param(PENALISED, marks=pytest.mark.nightly),
        pytest.param(STRUCTURED, marks=pytest.mark.nightly),
    ],
    ids=["greedy", "seeded", "stops", "penalised", "structured"],
)
def test_a_stream_moved_off_a_dead_decode_worker_goes_on_as_if_never_moved(
    workers: Any, prompts: list[list[int]], sp: SamplingParams
) -> None:
    p, d, c = workers.trio()
    doomed = f"doomed-{sp.temperature}-{len(sp.stop)}-{sp.frequency_penalty}-{sp.seed}"
    workers.decode(doomed, local_prefill_tokens=0)

    async def go() -> None:
        alone = await collect(Dispatcher(), prompts[5], sp, c)
        # The continuation prefills remotely (d never prefills locally), then locally (c).
        for then in (d, c):
            if doomed not in workers.handles:
                workers.decode(doomed, local_prefill_tokens=0)
            moved = await kill_then_continue(workers, prompts[5], sp, doomed, p, then, 6)
            assert len(moved.tokens) == 48
            assert (moved.tokens, moved.text, moved.finish) == (
                alone.tokens,
                alone.text,
                alone.finish,
            )

    run(go())


def test_a_decode_worker_killed_while_its_kv_is_pushed_frees_the_senders_pages(
    workers: Any, prompts: list[list[int]]
) -> None:
    serial = workers.prefill("prefill-serial", engine={"max_num_batched_tokens": 64})
    doomed = workers.decode("doomed-transferring", local_prefill_tokens=0)
    c = workers.decode("colocated")
    ids = long_prompt(prompts[6] + prompts[8], 700)  # many chunks of 64: seconds of pushing

    async def go() -> None:
        disp, delivered = Dispatcher(), Progress()
        stream = disp.generate(ids, GREEDY, doomed, serial, None, delivered)
        first = asyncio.ensure_future(anext(stream))  # submit, prefill, wait
        await until(
            lambda: _pushing(serial), "the prefill worker to push KV to the doomed worker", 60
        )
        ray.kill(workers.handles.pop("doomed-transferring"))
        with pytest.raises(WorkerLost):
            await first
        assert delivered.token_ids == []
        tokens = [
            t
            async for d in disp.generate(ids, GREEDY, c, None, None, delivered)
            for t in d.token_ids
        ]
        assert tokens == (await collect(Dispatcher(), ids, GREEDY, c)).tokens
        await disp.close()

    run(go())


async def _pushing(worker: Any) -> bool:
    stats = await worker.stats.remote()
    return bool(stats.transferring == 1 and stats.sent.writes > 0)


def kill_mid_stream(workers: Any, decode: dict[str, Any], stream: Callable[[], None]) -> str:
    """Run `stream` on a thread, kill the decode worker it runs on, wait for it to end;
    the killed worker's name."""
    streaming = threading.Thread(target=stream)
    streaming.start()
    busy = lambda n: ray.get(decode[n].stats.remote()).running >= 1
    wait_until(lambda: any(busy(n) for n in decode), "the stream to be decoding", 30)
    doomed = next(n for n in decode if busy(n))
    ray.kill(workers.handles.pop(doomed))
    streaming.join(60)
    assert not streaming.is_alive(), "the moved stream must end"
    return doomed


def test_through_the_router_a_killed_decode_workers_stream_ends_with_all_its_tokens(
    workers: Any,
) -> None:
    """gRPC end to end: the client's one stream survives its decode worker's death."""
    p = workers.prefill("prefill")
    names = ("router-decode-a", "router-decode-b")
    decode = {n: workers.decode(n, local_prefill_tokens=0) for n in names}
    router = RouterHarness({"prefill": p}, decode, redis_url=None)
    try:
        story = {"max_tokens": 96, "ignore_eos": True}
        replies: list[Any] = []
        doomed = kill_mid_stream(
            workers, decode,
            lambda: replies.append(ask(router.address, "Tell me a story.", **story)),
        )  # fmt: skip
        [moved] = replies
        assert moved.decode_worker != doomed
        alone = ask(router.address, "Tell me a story.", **story)
        assert moved.token_ids == alone.token_ids and len(moved.token_ids) == 96
        assert moved.text == alone.text
    finally:
        router.stop()


def test_through_the_openai_api_a_moved_stream_keeps_its_penalties_and_grammar(
    workers: Any,
) -> None:
    """HTTP end to end, with the openai package: the stream of a request that holds
    penalties, a logit bias, alternatives and a regex survives its decode worker's death,
    token for token as a run that never moved."""
    p = workers.prefill("prefill")
    names = ("openai-decode-a", "openai-decode-b")
    decode = {n: workers.decode(n, local_prefill_tokens=0) for n in names}
    router = RouterHarness({"prefill": p}, decode, redis_url=None, http_port=0)
    try:
        assert router.app.http is not None
        client = openai.OpenAI(base_url=router.app.http.address + "/v1", api_key="x", timeout=120)
        args: dict[str, Any] = {
            "model": "", "messages": [{"role": "user", "content": "Count to forty."}],
            "max_tokens": 60, "temperature": 0.8, "seed": 11, "frequency_penalty": 0.5,
            "presence_penalty": 0.3, "logit_bias": {"13": -100}, "logprobs": True,
            "top_logprobs": 2, "extra_body": {"guided_regex": "[0-9 ,]{60,}"},
        }  # fmt: skip
        chunks: list[Any] = []

        def stream() -> None:
            for chunk in client.chat.completions.create(stream=True, **args):
                chunks.append(chunk)

        kill_mid_stream(workers, decode, stream)
        registry = router.app.metrics.registry
        assert registry.get_sample_value("splitserve_request_migrations_total") == 1
        moved = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        alone = client.chat.completions.create(**args)
        assert moved == alone.choices[0].message.content
        assert len(moved) >= 60 and set(moved) <= set("0123456789 ,")
        tops = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content or []]  # fmt: skip
        assert len(tops) == 60 and all(len(t.top_logprobs) == 2 for t in tops)
    finally:
        router.stop()
