"""`splitserve bench parallel`: KV pages that n choices of one prompt hold, against n
independent requests, on the bundled model's engine.

The engine runs the choices as the OpenAI front door does (router/openai.py `_choices`):
choice 0 alone until its first token, then the other n - 1, which find the prompt's full
pages in the prefix cache and share them (each computes and owns its last, partial
page and its reply). Independent: n different prompts of the same length, all at once.
The figure is the most pages referenced at once while they run (the pool's pages minus
its free ones), and its ratio; the prompt tokens computed are shown beside it.
"""

from __future__ import annotations

import argparse
import random

from cluster.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.types import SamplingParams
from splitserve.hardware import host_line


def peak_pages(engine: LLMEngine, prompts: list[list[int]], staged: bool, out: int) -> int:
    """The most pages held at once while `prompts` run to `out` tokens each (`staged`:
    the first alone until its first token)."""
    pool = engine.pool
    used = 0

    def add(prompt: list[int], seed: int) -> None:
        engine.add_request(prompt, SamplingParams(max_tokens=out, temperature=1.0, seed=seed,
                                                  ignore_eos=True))  # fmt: skip

    first, rest = (prompts[:1], prompts[1:]) if staged else (prompts, [])
    for i, prompt in enumerate(first):
        add(prompt, i)
    while engine.has_unfinished():
        produced = engine.step()
        used = max(used, pool.num_pages - pool.num_free)
        if rest and any(o.new_token_ids for o in produced):
            for i, prompt in enumerate(rest, start=1):
                add(prompt, i)
            rest = []
    return used


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="splitserve bench parallel", description=__doc__)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    engine = LLMEngine(EngineConfig(dtype="float32", quantization="none"))
    rng = random.Random(0)
    vocab = engine.spec.vocab_size

    def prompt() -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(args.prompt_tokens)]

    shared = [prompt()] * args.n
    choices = peak_pages(engine, shared, staged=True, out=args.output_tokens)
    independent = peak_pages(
        engine, [prompt() for _ in range(args.n)], staged=False, out=args.output_tokens
    )
    print(host_line())
    print(f"n = {args.n}, {args.prompt_tokens}-token prompt, {args.output_tokens}-token replies, "
          f"page size {engine.pool.page_size}")  # fmt: skip
    print("| requests | peak KV pages | ratio |")
    print("| --- | ---: | ---: |")
    print(f"| n = {args.n} choices of one prompt | {choices} | {choices / independent:.2f} |")
    print(f"| {args.n} independent requests | {independent} | 1.00 |")
    return 0
