"""vLLM's offline engine on a request set, run inside .venv-vllm (scripts/setup-vllm).

`python splitserve/bench/vllm_worker.py IN.json OUT.json`. It imports nothing of splitserve (that
venv has vLLM's own pins, not ours): IN names an HF model directory, the dtype, the
requests (prompt token ids, output lengths) and the prompts for the prefill and batch-1
decode timings; OUT gets seconds and token counts. Greedy, EOS ignored, as our engine.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def main(inp: str, out: str) -> int:
    from vllm import LLM, SamplingParams, TokensPrompt

    spec: dict[str, Any] = json.loads(Path(inp).read_text())
    llm = LLM(
        model=spec["model_dir"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        max_num_seqs=spec["max_num_seqs"],
        enable_prefix_caching=False,  # every prompt computes all its tokens, as ours in bench
        seed=0,
    )

    def run(prompts: list[list[int]], lens: list[int]) -> tuple[float, int]:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lens]
        start = time.perf_counter()
        done = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        seconds = time.perf_counter() - start
        return seconds, sum(len(o.outputs[0].token_ids) for o in done)

    run(spec["warmup"]["prompts"], spec["warmup"]["output_lens"])
    seconds, tokens = run(spec["prompts"], spec["output_lens"])
    prefills = [run([p], [1])[0] for p in spec["prefill_prompts"]]
    # Batch-1 decode: a whole generation less its one-token prefill, per decoded token.
    decode_prompt, steps = spec["decode_prompt"], spec["decode_steps"]
    alone = [run([decode_prompt], [1])[0] for _ in range(2)]
    whole = [run([decode_prompt], [steps + 1])[0] for _ in range(2)]
    result = {
        "seconds": seconds,
        "output_tokens": tokens,
        "prefill_s": min(prefills[1:]),  # the first warms up
        "decode_step_s": (min(whole) - statistics.median(alone)) / steps,
    }
    Path(out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
