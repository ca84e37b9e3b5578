"""Both pools on quantized weights (the GGUF's own blocks, bfloat16 activations and KV):
disaggregated serving gives the same tokens as one colocated worker of the same mode."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.types import FinishReason, SamplingParams
from router.dispatch import Dispatcher
from tests.integration.disagg import collect, run
from tests.integration.test_disagg import GREEDY, SEEDED, long_prompt

GGUF = {"quantization": "gguf", "dtype": "bfloat16"}


@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_gguf_pools_match_a_colocated_gguf_worker(
    workers: Any, prompts: list[list[int]], sp: SamplingParams
) -> None:
    p = workers.prefill("prefill-gguf", engine=GGUF)
    d = workers.decode("decode-gguf", engine=GGUF, local_prefill_tokens=0)
    c = workers.decode("colocated-gguf", engine=GGUF)

    async def go() -> None:
        disp = Dispatcher()
        for ids in (prompts[2], long_prompt(prompts[7], 300), prompts[9]):
            split = await collect(disp, ids, sp, d, p)
            alone = await collect(disp, ids, sp, c)
            assert split.finish is not None and split.finish is not FinishReason.ERROR
            assert (split.tokens, split.finish) == (alone.tokens, alone.finish)

    run(go())
