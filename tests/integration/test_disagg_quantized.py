"""Both pools on quantized weights (the GGUF's own blocks; float32 activations and KV, the
mode that is fast on every CPU, and bfloat16 where this CPU computes it natively), and on
8-bit KV pages (moved over NIXL as stored, codes and scales): disaggregated serving gives
the same tokens as one colocated worker of the same mode."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.types import FinishReason, SamplingParams
from router.dispatch import Dispatcher
from tests.helpers import needs_native_bf16
from tests.integration.disagg import collect, run
from tests.integration.test_disagg import GREEDY, SEEDED, long_prompt
from tests.integration.test_migration import GREEDY as GREEDY_48
from tests.integration.test_migration import kill_then_continue

CASES = [
    pytest.param("float32", "auto", GREEDY, id="float32-greedy"),
    pytest.param("float32", "auto", SEEDED, id="float32-seeded"),
    pytest.param("bfloat16", "auto", GREEDY, id="bfloat16-greedy", marks=needs_native_bf16),
    pytest.param("float32", "int8", GREEDY, id="float32-int8kv-greedy"),
]


@pytest.mark.parametrize(("dtype", "kv", "sp"), CASES)
def test_gguf_pools_match_a_colocated_gguf_worker(
    workers: Any, prompts: list[list[int]], dtype: str, kv: str, sp: SamplingParams
) -> None:
    gguf = {"quantization": "gguf", "dtype": dtype, "kv_cache_dtype": kv}
    p = workers.prefill(f"prefill-gguf-{dtype}-{kv}", engine=gguf)
    d = workers.decode(f"decode-gguf-{dtype}-{kv}", engine=gguf, local_prefill_tokens=0)
    c = workers.decode(f"colocated-gguf-{dtype}-{kv}", engine=gguf)

    async def go() -> None:
        disp = Dispatcher()
        for ids in (prompts[2], long_prompt(prompts[7], 300), prompts[9]):
            split = await collect(disp, ids, sp, d, p)
            alone = await collect(disp, ids, sp, c)
            assert split.finish is not None and split.finish is not FinishReason.ERROR
            assert (split.tokens, split.finish) == (alone.tokens, alone.finish)

    run(go())


def test_a_stream_on_int8_pages_moved_off_a_dead_worker_goes_on_as_if_never_moved(
    workers: Any, prompts: list[list[int]]
) -> None:
    # The continuation's prompt (the prompt and the 6 tokens delivered) is prefilled at once
    # on the prefill worker and its pages moved; the unmoved run wrote those 6 a token a
    # step. A page's codes do not depend on that (kv_cache.py), so neither do the tokens.
    int8 = {"quantization": "gguf", "dtype": "float32", "kv_cache_dtype": "int8"}
    p = workers.prefill("prefill-gguf-float32-int8", engine=int8)
    d = workers.decode("decode-gguf-float32-int8", engine=int8, local_prefill_tokens=0)
    c = workers.decode("colocated-gguf-float32-int8", engine=int8)
    workers.decode("doomed-int8", engine=int8, local_prefill_tokens=0)

    async def go() -> None:
        alone = await collect(Dispatcher(), prompts[5], GREEDY_48, c)
        moved = await kill_then_continue(workers, prompts[5], GREEDY_48, "doomed-int8", p, d, 6)
        assert len(moved.tokens) == 48
        assert (moved.tokens, moved.text) == (alone.tokens, alone.text)

    run(go())
