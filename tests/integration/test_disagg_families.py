"""The families beyond Llama through the disaggregated path: a Mixture-of-Experts model
(Mixtral), Qwen3 (q/k norms) and Gemma 3 (sliding windows) served by a prefill and a
decode worker, their KV moved over NIXL, give the tokens of one colocated worker; and a
stream moved off a dead decode worker goes on as if never moved. (Their float32 logits
against transformers: test_hf_checkpoint.py; the experts' own tests: test_experts.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cluster.types import FinishReason, SamplingParams
from router.dispatch import Dispatcher
from tests.integration.disagg import collect, run
from tests.integration.test_disagg import long_prompt
from tests.integration.test_migration import kill_then_continue

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("which", ["tiny_mixtral_dir", "tiny_qwen3_dir", "tiny_gemma3_dir"])
def test_a_family_served_disaggregated_and_moved_gives_one_workers_tokens(
    which: str, workers: Any, prompts: list[list[int]], request: pytest.FixtureRequest
) -> None:
    path: Path = request.getfixturevalue(which)
    engine = {"model": str(path), "dtype": "float32", "quantization": "none"}
    name = path.name
    p = workers.prefill(f"prefill-{name}", engine=engine)
    d = workers.decode(f"decode-{name}", engine=engine, local_prefill_tokens=0)
    c = workers.decode(f"colocated-{name}", engine=engine)
    workers.decode(f"doomed-{name}", engine=engine, local_prefill_tokens=0)

    async def go() -> None:
        disp = Dispatcher()
        for ids in (prompts[3], long_prompt(prompts[8], 200)):
            split = await collect(disp, ids, GREEDY, d, p)
            alone = await collect(disp, ids, GREEDY, c)
            assert split.finish is FinishReason.LENGTH
            assert split.progress.remote_prefill  # its prompt's KV came over NIXL
            assert split.tokens == alone.tokens
        alone = await collect(disp, prompts[6], GREEDY, c)
        moved = await kill_then_continue(workers, prompts[6], GREEDY, f"doomed-{name}", p, d, 6)
        assert moved.tokens == alone.tokens and len(moved.tokens) == 24

    run(go())
