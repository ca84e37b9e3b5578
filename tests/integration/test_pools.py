"""Elastic pools on a local Ray: the autoscaler grows and shrinks a pool under a real
burst, a drained worker finishes its streams (or, past its deadline, they move to another
worker), and a worker killed with SIGKILL mid-stream is replaced while the router stops
sending it work; its stream moves to the replacement."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import grpc
import pytest
import ray
from ray.exceptions import GetTimeoutError, RayActorError

from cluster.config import EngineConfig, PoolConfig, RouterConfig, ScalingConfig, ServeConfig
from splitserve.client import Reply
from tests.helpers import wait_until
from tests.integration.conftest import INVARIANT
from tests.integration.router_harness import ClusterHarness, ask

ENGINE = EngineConfig(**INVARIANT, kv_cache_gb=0.2, threads=1, max_num_batched_tokens=256)
NEVER = 1_000_000  # ticks: a scaler that never moves on its own


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


LONG = {"max_tokens": 400, "ignore_eos": True}


class _Requests:
    """Requests sent on threads; replies and errors collected."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.replies: list[Reply] = []
        self.errors: list[grpc.aio.AioRpcError] = []
        self._threads: list[threading.Thread] = []

    def send(self, prompt: Any, **fields: Any) -> None:
        def run() -> None:
            try:
                self.replies.append(ask(self.address, prompt, **fields))
            except grpc.aio.AioRpcError as e:
                self.errors.append(e)

        thread = threading.Thread(target=run)
        thread.start()
        self._threads.append(thread)

    def wait(self, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self._threads), "a request hung"


def _metrics(h: ClusterHarness) -> str:
    host, port = h.cluster.app.metrics_http.addresses[0][:2]
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
        text: str = response.read().decode()
    return text


def _dead(handle: Any) -> bool:
    """The actor is gone (ray.kill takes effect asynchronously)."""
    try:
        ray.get(handle.stats.remote(), timeout=5)
    except RayActorError:
        return True
    except GetTimeoutError:
        pass
    return False


def _kill_9(handle: Any) -> None:
    pid = ray.get(handle.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGKILL)


@pytest.mark.nightly  # the slowest scenarios: one of the run's minutes each
def test_a_burst_of_long_prompts_grows_the_prefill_pool_and_idleness_shrinks_it(
    ray_workers: Any,
) -> None:
    scaling = ScalingConfig(
        min_replicas=1,
        max_replicas=2,
        up_ticks=2,
        down_ticks=4,
        cooldown_s=2,
        interval_s=0.5,
        target_queued_tokens=1024,
        ttft_slo_s=600,  # scale on queued tokens alone: TTFT on 2 shared cores is noise
    )
    config = ServeConfig(
        prefill=PoolConfig(num_cpus=0, engine=ENGINE, autoscale=scaling),
        decode=PoolConfig(num_cpus=0, engine=EngineConfig(**INVARIANT, kv_cache_gb=0.5, threads=1)),
        router=RouterConfig(port=0, metrics_port=0, http_port=None),
    )
    h = ClusterHarness(config, "grow-")
    pool = h.cluster.pools["prefill"]
    try:
        requests = _Requests(h.address)
        for i in range(5):  # ~6,000 queued prompt tokens against a target of 1,024
            requests.send(_prompt(i, 1200), max_tokens=4, ignore_eos=True)
        wait_until(lambda: len(h.read(lambda: pool.serving)) == 2, "prefill to grow", 120)
        for i in range(5, 7):  # the router's own counts send one of these to the new worker
            requests.send(_prompt(i, 1200), max_tokens=4, ignore_eos=True)
        requests.wait()
        assert not requests.errors, requests.errors
        assert len(requests.replies) == 7
        assert all(len(r.token_ids) == 4 for r in requests.replies)
        assert {r.prefill_worker for r in requests.replies} == {"grow-prefill-0", "grow-prefill-1"}

        idle = lambda: h.read(lambda: pool.serving == ["grow-prefill-0"] and not pool.draining)
        wait_until(idle, "the idle prefill pool to shrink back to its minimum", 60)
        text = _metrics(h)
        for line in (
            'splitserve_autoscaler_decisions_total{decision="up",phase="prefill"} 1.0',
            'splitserve_autoscaler_decisions_total{decision="down",phase="prefill"} 1.0',
            'splitserve_pool_target_replicas{phase="prefill"} 1.0',
            'splitserve_workers{phase="prefill"} 1.0',
        ):
            assert line in text, line
        assert ask(h.address, _prompt(9, 400), max_tokens=2).prefill_worker == "grow-prefill-0"
        h.assert_all_pages_free()
    finally:
        h.stop()


@pytest.mark.nightly  # the slowest scenarios: one of the run's minutes each
def test_a_drained_decode_worker_finishes_its_streams_or_moves_them_past_the_deadline(
    ray_workers: Any,
) -> None:
    # A deadline no stream here comes near: the drained worker's streams finish there.
    scaling = ScalingConfig(
        min_replicas=1, max_replicas=3, up_ticks=NEVER, down_ticks=NEVER, drain_timeout_s=300
    )
    config = ServeConfig(
        prefill=PoolConfig(num_cpus=0, engine=ENGINE),
        decode=PoolConfig(replicas=2, num_cpus=0, engine=ENGINE, autoscale=scaling),
        router=RouterConfig(port=0, metrics_port=None, http_port=None, policy="least_loaded"),
    )
    h = ClusterHarness(config, "drain-")
    pool, registry = h.cluster.pools["decode"], h.cluster.app.workers
    try:
        drained = h.read(lambda: pool.workers["drain-decode-1"])
        requests = _Requests(h.address)
        for i in range(4):
            requests.send(f"Story number {i}:", max_tokens=32, ignore_eos=True)
        busy = lambda: h.read(lambda: registry.in_flight("drain-decode-1")) >= 1
        wait_until(busy, "a request on decode-1", 30)
        h.call(pool.drain(registry, "drain-decode-1"))
        requests.wait()
        assert not requests.errors, requests.errors
        assert [len(r.token_ids) for r in requests.replies] == [32] * 4
        assert {r.decode_worker for r in requests.replies} == {"drain-decode-0", "drain-decode-1"}
        assert h.read(lambda: registry.names("decode")) == ["drain-decode-0"]
        wait_until(lambda: _dead(drained), "the drained worker's actor to exit", 30)
        assert ask(h.address, "Hello", max_tokens=2).decode_worker == "drain-decode-0"

        # Past drain_timeout_s (now 10 ms: at once) the stream still running there moves to
        # drain-decode-0 and ends there with the tokens it would have had.
        pool.config = replace(pool.config, autoscale=replace(scaling, drain_timeout_s=0.01))
        assert h.call(pool.grow(registry), 300) == "drain-decode-2"
        requests = _Requests(h.address)
        for i in range(2):
            requests.send(f"Long story number {i}:", request_id=str(i), **LONG)
        busy = lambda: h.read(lambda: registry.in_flight("drain-decode-2")) >= 1
        wait_until(busy, "a request on decode-2", 30)
        h.call(pool.drain(registry, "drain-decode-2"))
        requests.wait()
        assert not requests.errors, requests.errors
        assert [r.decode_worker for r in requests.replies] == ["drain-decode-0"] * 2
        for reply in requests.replies:
            alone = ask(h.address, f"Long story number {reply.request_id}:", **LONG)
            assert reply.token_ids == alone.token_ids and len(reply.token_ids) == 400
        h.assert_all_pages_free()
    finally:
        h.stop()


@pytest.fixture(scope="module")
def fixed(ray_workers: Any) -> Iterator[ClusterHarness]:
    """One prefill and one decode worker, kept at one each (the dead are replaced)."""
    config = ServeConfig(
        prefill=PoolConfig(num_cpus=0, engine=ENGINE),
        decode=PoolConfig(num_cpus=0, engine=ENGINE),
        # A moving stream waits for the replacement worker: a model load on a busy machine.
        router=RouterConfig(port=0, metrics_port=None, http_port=None, migration_wait_s=180),
    )
    h = ClusterHarness(config, "kill-")
    yield h
    h.stop()


def test_a_decode_worker_killed_mid_stream_is_replaced_and_its_stream_moves_there(
    fixed: ClusterHarness,
) -> None:
    h = fixed
    pool, registry = h.cluster.pools["decode"], h.cluster.app.workers
    doomed = h.read(lambda: pool.serving[0])
    requests = _Requests(h.address)
    requests.send("Tell me a long story.", **LONG)
    handle = h.read(lambda: pool.workers[doomed])
    running = lambda: ray.get(handle.stats.remote()).running >= 1
    wait_until(running, "the request to be decoding on its worker", 30)
    _kill_9(handle)
    gone = lambda: doomed not in h.read(lambda: registry.names("decode"))
    wait_until(gone, "the router to drop the dead worker", 2)  # its next load poll
    # The stream waits (migration_wait_s) for the pool to replace its worker, then goes on.
    requests.wait(240)
    assert not requests.errors, requests.errors
    new = h.read(lambda: pool.serving[0])
    assert new != doomed
    [moved] = requests.replies
    assert moved.decode_worker == new
    assert moved.token_ids == ask(h.address, "Tell me a long story.", **LONG).token_ids
    h.assert_all_pages_free()


def test_a_prefill_worker_killed_mid_prefill_is_replaced_and_its_request_completes(
    fixed: ClusterHarness,
) -> None:
    h = fixed
    pool, registry = h.cluster.pools["prefill"], h.cluster.app.workers
    full = lambda: h.read(lambda: len(registry.snapshot().decode) == 1 and len(pool.serving) == 1)
    wait_until(full, "the pools to be back to one worker each", 120)
    doomed = h.read(lambda: pool.serving[0])
    prompt = _prompt(42, 1500)  # several chunks of 256: it is still prefilling when killed
    requests = _Requests(h.address)
    requests.send(prompt, max_tokens=8)
    handle = h.read(lambda: pool.workers[doomed])
    # Killed between its first computed chunk and its last.
    midway = lambda: 0 < ray.get(handle.stats.remote()).queued_tokens < len(prompt)
    wait_until(midway, "the prompt to be partly prefilled", 30)
    _kill_9(handle)
    requests.wait(120)
    assert not requests.errors, requests.errors  # the decode worker recomputed it
    [reply] = requests.replies
    replaced = lambda: h.read(lambda: len(pool.serving) == 1 and doomed not in pool.serving)
    wait_until(replaced, "the dead prefill worker's replacement", 120)
    new = h.read(lambda: pool.serving[0])
    again = ask(h.address, _prompt(43, 1500), max_tokens=2)
    assert again.prefill_worker == new
    assert ask(h.address, prompt, max_tokens=8).token_ids == reply.token_ids
    h.assert_all_pages_free()
