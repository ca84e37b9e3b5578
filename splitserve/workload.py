"""The benchmark's request set: fixed-seed prompts and output lengths, ShareGPT-like.

Lengths are lognormal (a long right tail, as chat prompts and replies have), rounded and
clipped; prompts are random vocabulary ids. Every request is meant to run with
ignore_eos, so it produces exactly `output_len` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    output_len: int

    @property
    def total_len(self) -> int:
        return len(self.prompt) + self.output_len


@dataclass(frozen=True)
class LengthDist:
    """Lognormal with this median and sigma, rounded, clipped to [low, high]."""

    median: float
    sigma: float
    low: int
    high: int

    def draw(self, rng: np.random.Generator, n: int) -> list[int]:
        x = rng.lognormal(np.log(self.median), self.sigma, n)
        return [int(v) for v in np.clip(np.round(x), self.low, self.high)]


PROMPTS = LengthDist(median=110, sigma=0.8, low=16, high=512)
OUTPUTS = LengthDist(median=100, sigma=0.7, low=16, high=256)
QUICK_PROMPTS = LengthDist(median=48, sigma=0.6, low=16, high=128)
QUICK_OUTPUTS = LengthDist(median=24, sigma=0.3, low=16, high=32)
FIRST_ID = 100  # skip the special and byte tokens at the start of the vocabulary


def make_requests(
    n: int, vocab_size: int, seed: int, prompts: LengthDist, outputs: LengthDist
) -> list[Request]:
    rng = np.random.default_rng(seed)
    prompt_lens = prompts.draw(rng, n)
    output_lens = outputs.draw(rng, n)
    return [
        Request(random_prompt(rng, p, vocab_size), o)
        for p, o in zip(prompt_lens, output_lens, strict=True)
    ]


def random_prompt(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return [int(t) for t in rng.integers(FIRST_ID, vocab_size, n)]
