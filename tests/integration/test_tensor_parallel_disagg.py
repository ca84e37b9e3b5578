"""KV moved between pools of different tensor-parallel sizes, served for real: a prefill
pool of two ranks into a decode pool of one, and one rank into two. Each prefill rank
WRITEs its own KV heads over NIXL straight into the decode rank that holds them (no
gather); the decode worker's tokens equal one unsplit engine's, greedy, float32, and
every page is free again on both sides."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray

from cluster.config import (
    EngineConfig,
    PoolConfig,
    RouterConfig,
    ServeConfig,
    TransferConfig,
)
from cluster.engine.engine import LLMEngine
from cluster.types import SamplingParams
from tests.integration.conftest import EXACT, RAW_PROMPTS
from tests.integration.router_harness import ClusterHarness, ask

SMALL = {"kv_cache_gb": 0.05, "threads": 1}
GREEDY = SamplingParams(max_tokens=24)
PROMPTS = [RAW_PROMPTS[7], RAW_PROMPTS[2]]  # ~100 tokens (7 pages) and one page


@pytest.fixture(scope="module")
def expected() -> tuple[list[list[int]], int]:
    """One unsplit engine's greedy tokens, and the pages the prompts fill."""
    engine = LLMEngine(EngineConfig(**EXACT, **SMALL))
    pages = sum(-(-len(engine.tokenizer.encode(p)) // engine.pool.page_size) for p in PROMPTS)
    return [c.token_ids for c in engine.generate(PROMPTS, GREEDY)], pages


def _pool(tensor_parallel_size: int) -> PoolConfig:
    # The test Ray has two CPUs: the split pool's ranks take one each, the other pool none.
    engine = EngineConfig(**EXACT, **SMALL, tensor_parallel_size=tensor_parallel_size)
    return PoolConfig(num_cpus=1 if tensor_parallel_size > 1 else 0, engine=engine)


@pytest.fixture(
    scope="module", params=[(2, 1), (1, 2)], ids=["prefill2-decode1", "prefill1-decode2"]
)
def cluster(request: Any, ray_workers: Any) -> Iterator[ClusterHarness]:
    prefill_tp, decode_tp = request.param
    config = ServeConfig(
        prefill=_pool(prefill_tp),
        decode=_pool(decode_tp),
        transfer=TransferConfig(local_prefill_tokens=0),  # every prompt's KV moves
        router=RouterConfig(port=0, metrics_port=None, http_port=None),
    )
    h = ClusterHarness(config, f"tpkv{prefill_tp}{decode_tp}-")
    yield h
    h.stop()


def _workers(h: ClusterHarness, pool: str) -> list[Any]:
    return h.read(lambda: list(h.cluster.pools[pool].workers.values()))


def test_kv_moves_between_different_split_sizes_and_decodes_one_ranks_tokens(
    cluster: ClusterHarness, expected: tuple[list[list[int]], int]
) -> None:
    tokens, pages = expected
    [decode] = _workers(cluster, "decode")
    [prefill] = _workers(cluster, "prefill")
    got = [ask(cluster.address, p, max_tokens=GREEDY.max_tokens).token_ids for p in PROMPTS]
    assert got == tokens
    moved = ray.get(decode.stats.remote())
    sent = ray.get(prefill.stats.remote()).sent
    assert moved.transfer_failures == 0
    assert pages > 2 and moved.pages_received == pages  # every prompt page, all layers, once
    assert sent.pages == moved.pages_received and sent.bytes == moved.bytes_received > 0
    cluster.assert_all_pages_free()
