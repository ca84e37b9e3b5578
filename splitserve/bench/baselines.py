"""transformers `generate` over the request set, and the record every timed run returns.

Each run is timed from the first request to the last token, after a warm-up call, and
checks that every request produced exactly its output length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from splitserve.workload import Request

WARMUP = Request(list(range(1000, 1032)), 8)


@dataclass(frozen=True)
class Run:
    """One method's timed pass over a request set; output_tokens counts requested tokens."""

    method: str
    requests: int
    output_tokens: int
    seconds: float
    note: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def load_transformers(gguf: Path, dtype: torch.dtype) -> Any:
    """The same GGUF through transformers' own loader (dequantized to `dtype`)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    return model.eval()


@torch.inference_mode()
def _hf_generate(model: Any, batch: list[Request], pad_id: int) -> list[list[int]]:
    """Greedy `generate` over one left-padded batch, run to the batch's longest output."""
    width = max(len(r.prompt) for r in batch)
    ids = torch.tensor([[pad_id] * (width - len(r.prompt)) + r.prompt for r in batch])
    mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch])
    new = max(r.output_len for r in batch)
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new,
        min_new_tokens=new,  # the transformers spelling of ignore_eos
        do_sample=False,
        pad_token_id=pad_id,
    )
    rows: list[list[int]] = out[:, width:].tolist()
    assert all(len(row) == new for row in rows), "transformers stopped early"
    return [row[: r.output_len] for row, r in zip(rows, batch, strict=True)]


def transformers_one_at_a_time(
    model: Any, requests: list[Request], pad_id: int
) -> tuple[Run, list[list[int]]]:
    """Each request alone, in order; also returns the generated ids."""
    _hf_generate(model, [WARMUP], pad_id)
    start = time.perf_counter()
    outputs = [_hf_generate(model, [r], pad_id)[0] for r in requests]
    seconds = time.perf_counter() - start
    tokens = sum(r.output_len for r in requests)
    return Run("transformers, one at a time", len(requests), tokens, seconds), outputs


def transformers_static_batches(
    model: Any, requests: list[Request], batch_size: int, pad_id: int
) -> Run:
    """Consecutive batches of `batch_size` in arrival order; each runs to its longest output."""
    _hf_generate(model, [WARMUP, WARMUP], pad_id)
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        _hf_generate(model, requests[i : i + batch_size], pad_id)
    seconds = time.perf_counter() - start
    tokens = sum(r.output_len for r in requests)
    note = f"batch {batch_size}, left-padded; rows run to their batch's longest output"
    return Run("transformers, static batches", len(requests), tokens, seconds, note)
