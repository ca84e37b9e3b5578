"""llama.cpp (llama-cpp-python, optional) on the same GGUF, its weights as stored (quantized).

One at a time goes through the high-level `Llama.generate`. Batched goes through the
C API (`llama_batch` with one sequence id per request), since the high-level class
decodes a single sequence: all requests are admitted at once, prompts are fed in
n_batch-token batches, then every unfinished request decodes one token per
`llama_decode` until it has its output length. Both pick tokens greedily, ignoring EOS.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from splitserve.bench.baselines import WARMUP, Run
from splitserve.workload import Request

N_BATCH = 512


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def one_at_a_time(gguf: Path, requests: list[Request], threads: int) -> Run:
    from llama_cpp import Llama

    n_ctx = max(r.total_len for r in [*requests, WARMUP])
    llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, verbose=False)

    def run(r: Request) -> None:
        n = 0
        # `generate` is a raw token stream that never stops at EOS: ignore_eos.
        for _ in llm.generate(r.prompt, temp=0.0, repeat_penalty=1.0, reset=True):
            n += 1
            if n == r.output_len:
                break
        assert n == r.output_len, "llama.cpp stopped early"

    run(WARMUP)
    start = time.perf_counter()
    for r in requests:
        run(r)
    seconds = time.perf_counter() - start
    tokens = sum(r.output_len for r in requests)
    note = f"{threads} threads, GGUF weights as stored (quantized)"
    return Run("llama.cpp, one at a time", len(requests), tokens, seconds, note)


def batched(gguf: Path, requests: list[Request], threads: int) -> Run:
    import llama_cpp as lc

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # its C log goes through this
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(str(gguf).encode(), lc.llama_model_default_params())
    assert model, f"llama.cpp could not load {gguf}"
    params = lc.llama_context_default_params()
    # Per-sequence KV streams of n_ctx / n_seq_max cells each: with one unified pool every
    # sequence's attention spans all cells (masked), measured 1.45x slower at 64 sequences.
    params.kv_unified = False
    params.n_seq_max = len(requests)
    params.n_ctx = len(requests) * max(r.total_len for r in [*requests, WARMUP])
    params.n_batch = params.n_ubatch = N_BATCH
    params.n_threads = params.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, params)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    batch = lc.llama_batch_init(N_BATCH, 0, 1)
    try:
        _generate(lc, ctx, batch, n_vocab, [WARMUP])
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        start = time.perf_counter()
        _generate(lc, ctx, batch, n_vocab, requests)
        seconds = time.perf_counter() - start
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(model)
    tokens = sum(r.output_len for r in requests)
    note = f"{threads} threads, C API llama_batch, per-sequence KV, all requests admitted at once"
    return Run("llama.cpp, batched", len(requests), tokens, seconds, note)


def _generate(lc: Any, ctx: Any, batch: Any, n_vocab: int, requests: list[Request]) -> None:
    """Greedy decoding of every request, sequence id = its index, to exactly output_len."""
    outputs: list[list[int]] = [[] for _ in requests]
    # (sequence, token, position, wants logits) waiting for the next llama_decode
    pending = [
        (s, t, pos, pos == len(r.prompt) - 1)
        for s, r in enumerate(requests)
        for pos, t in enumerate(r.prompt)
    ]
    while pending:
        chunk, pending = pending[:N_BATCH], pending[N_BATCH:]
        for i, (s, t, pos, logits) in enumerate(chunk):
            batch.token[i] = t
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = s
            batch.logits[i] = logits
        batch.n_tokens = len(chunk)
        assert lc.llama_decode(ctx, batch) == 0, "llama_decode failed"
        for i, (s, _, pos, logits) in enumerate(chunk):
            if not logits:
                continue
            row = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
            outputs[s].append(int(row.argmax()))
            r = requests[s]
            if len(outputs[s]) < r.output_len:
                pending.append((s, outputs[s][-1], pos + 1, True))
    assert all(len(o) == r.output_len for o, r in zip(outputs, requests, strict=True))


def decode_and_prefill(
    gguf: Path, prompt: list[int], steps: int, long_prompt: list[int], threads: int
) -> tuple[float, float]:
    """Batch-1 decode tok/s after `prompt` (the median of `steps` timed tokens, after 5
    untimed) and prefill tok/s of `long_prompt` (best of two), with `threads` threads."""
    from llama_cpp import Llama

    n = len(long_prompt)
    llm = Llama(
        model_path=str(gguf),
        n_ctx=max(n, len(prompt) + steps + 16),
        n_batch=n,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    tokens = llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True)
    for _ in range(6):  # the prompt, then warm-up tokens
        next(tokens)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        next(tokens)
        times.append(time.perf_counter() - start)
    tokens.close()
    prefills = []
    for _ in range(3):  # the first warms up
        llm.reset()
        start = time.perf_counter()
        llm.eval(long_prompt)
        prefills.append(time.perf_counter() - start)
    return 1 / float(np.median(times)), n / min(prefills[1:])


def greedy(gguf: Path, prompts: list[list[int]], max_tokens: int, threads: int) -> list[list[int]]:
    """llama.cpp's greedy continuation of each prompt, `max_tokens` tokens, EOS ignored."""
    from llama_cpp import Llama

    n_ctx = max(len(p) for p in prompts) + max_tokens + 1
    llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, verbose=False)
    outs = []
    for p in prompts:
        tokens = llm.generate(p, temp=0.0, repeat_penalty=1.0, reset=True)
        outs.append([next(tokens) for _ in range(max_tokens)])
        tokens.close()
    return outs
