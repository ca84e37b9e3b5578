"""`splitserve bench kv-tier`: the KV tier behind the pool (cluster/engine/kv_tier.py),
measured on the bundled model's engine.

1. Storage: the KV of a long prompt's full pages (K and V of every layer, as the cache
   stores them) copied out and back through each store a CPU tier could use: a host
   memory buffer, a memory-mapped file on local disk (through the page cache, and once
   msync'd), zlib level 1; and the checksums a tier entry could carry (crc32, blake2b),
   against prefilling the same tokens.
2. Multi-turn: conversations whose working set is at least 10 times the pool, one turn
   of each in turn (so each conversation's prefix has left the pool before its next
   turn), one request at a time, greedy, every reply `--reply-tokens` long. Run on an
   engine with the tier and on one without (the pool alone, so evicted prefixes are
   recomputed). Reused prompt tokens: a turn's prompt tokens that the conversation's
   previous turn held (its prompt and reply); the share served from the pool and from
   the tier (vLLM's prefix_cache_hits and external_prefix_cache_hits counted per turn).
   TTFT: from add_request to the first token, the restore's wait included.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import random
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from cluster.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.sched.page_pool import hash_pages
from cluster.types import SamplingParams
from splitserve.hardware import host_line


def _rate(nbytes: int, work: Callable[[], object], reps: int = 5) -> float:
    """GB/s of the fastest of `reps` runs of `work`, over `nbytes`."""
    work()
    best = min(_timed(work) for _ in range(reps))
    return nbytes / best / 1e9


def _timed(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def storage(engine: LLMEngine, rng: random.Random) -> list[str]:
    """The storage table's rows, for the KV of a 1,024-token prompt."""
    prompt = [rng.randrange(100, engine.spec.vocab_size) for _ in range(1024)]
    engine.generate([prompt[:64]], SamplingParams(max_tokens=1))  # warm
    started = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    prefill_s = time.perf_counter() - started
    cache, ps = engine.cache, engine.pool.page_size
    cached = [engine.pool.cached_page(h) for h in hash_pages(prompt[:-1], ps)]
    pages = [p for p in cached if p is not None]
    host = [torch.cat([cache.k[:, p].flatten(), cache.v[:, p].flatten()]) for p in pages]
    raw = [t.view(torch.uint8) for t in host]
    n, size = len(raw), raw[0].numel()
    total = n * size
    memory = torch.empty(n, size, dtype=torch.uint8)
    rows = [f"| host memory | {_rate(total, lambda: _out(memory, raw)):.2f} | "
            f"{_rate(total, lambda: _back(memory, raw)):.2f} | 1.00 |"]  # fmt: skip
    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:
        path = Path(tmp) / "tier.bin"
        with path.open("wb") as created:
            created.truncate(total)
        mapped = torch.from_file(str(path), shared=True, size=total, dtype=torch.uint8)
        mapped = mapped.view(n, size)
        rows.append(f"| mmap file, page cache | {_rate(total, lambda: _out(mapped, raw)):.2f} | "
                    f"{_rate(total, lambda: _back(mapped, raw)):.2f} | 1.00 |")  # fmt: skip
        with path.open("r+b") as f, mmap.mmap(f.fileno(), total) as synced:

            def out_and_sync() -> None:
                _out(mapped, raw)
                synced.flush()

            rate = _rate(total, out_and_sync)
            rows.append(f"| mmap file, msync'd | {rate:.2f} | | 1.00 |")
    blobs = [t.numpy().tobytes() for t in raw]
    packed = [zlib.compress(b, 1) for b in blobs]
    ratio = total / sum(map(len, packed))
    squeeze = _rate(total, lambda: [zlib.compress(b, 1) for b in blobs])
    unsqueeze = _rate(total, lambda: [zlib.decompress(b) for b in packed])
    rows.append(f"| zlib level 1 | {squeeze:.3f} | {unsqueeze:.3f} | {ratio:.2f} |")
    crc = _rate(total, lambda: [zlib.crc32(b) for b in blobs])
    blake = _rate(total, lambda: [hashlib.blake2b(b, digest_size=16).digest() for b in blobs])
    tokens = n * ps
    return [
        f"KV of {n} pages ({tokens} tokens, {size / 2**10:.0f} KiB a page, {engine.dtype}); "
        f"prefilling them took {prefill_s / tokens * 1e6:.0f} us a token",
        "| store | out GB/s | back GB/s | ratio |",
        "| --- | ---: | ---: | ---: |",
        *rows,
        f"checksums: crc32 {crc:.2f} GB/s ({size / crc / 1e3 / ps:.1f} us a token), "
        f"blake2b {blake:.2f} GB/s",
    ]


def _out(store: torch.Tensor, pages: list[torch.Tensor]) -> None:
    for i, page in enumerate(pages):
        store[i].copy_(page)


def _back(store: torch.Tensor, pages: list[torch.Tensor]) -> None:
    for i, page in enumerate(pages):
        page.copy_(store[i])


def multi_turn(config: EngineConfig, args: argparse.Namespace) -> dict[str, float]:
    """Run the conversations on an engine of `config`: shares of reused tokens and TTFTs."""
    engine = LLMEngine(config)
    rng = random.Random(0)
    vocab, pool = engine.spec.vocab_size, engine.pool

    def words(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    pool_tokens = pool.num_pages * pool.page_size
    turn_tokens = args.user_tokens + args.reply_tokens
    final = args.first_tokens + (args.turns - 1) * turn_tokens
    conversations = -(-10 * pool_tokens // final)  # working set >= 10x the pool
    contexts = [words(args.first_tokens) for _ in range(conversations)]
    greedy = SamplingParams(max_tokens=args.reply_tokens, temperature=0.0, ignore_eos=True)
    reused = from_pool = from_tier = 0
    ttfts: list[float] = []
    for turn in range(args.turns):
        for c in range(conversations):
            if turn:
                reused += len(contexts[c])
                contexts[c] = contexts[c] + words(args.user_tokens)
            hits = pool.prefix_hits
            tier_hits = pool.tier.hits if pool.tier else 0
            started = time.perf_counter()
            engine.add_request(contexts[c], greedy)
            reply: list[int] = []
            while engine.has_unfinished():
                for out in engine.step():
                    if not reply and turn:
                        ttfts.append(time.perf_counter() - started)
                    reply += out.new_token_ids
            contexts[c] = contexts[c] + reply
            if turn:
                from_pool += pool.prefix_hits - hits
                from_tier += (pool.tier.hits if pool.tier else 0) - tier_hits
    engine.close()
    return {
        "pool_tokens": pool_tokens,
        "working_set": conversations * (final + args.reply_tokens),
        "conversations": conversations,
        "reused": reused,
        "from_pool": from_pool / reused,
        "from_tier": from_tier / reused,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p90": statistics.quantiles(ttfts, n=10)[-1],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="splitserve bench kv-tier", description=__doc__)
    parser.add_argument("--pool-pages", type=int, default=16, help="the pool's size")
    parser.add_argument("--kv-offload-gb", type=float, default=0.25, help="the tier's")
    parser.add_argument("--first-tokens", type=int, default=96)
    parser.add_argument("--user-tokens", type=int, default=32)
    parser.add_argument("--reply-tokens", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--skip-storage", action="store_true")
    args = parser.parse_args(argv)
    print(host_line())
    engine = LLMEngine(EngineConfig())
    pool_gb = args.pool_pages * engine.layout.bytes_per_page / 2**30
    if not args.skip_storage:
        print("\n".join(storage(engine, random.Random(0))))
    del engine
    base = EngineConfig(kv_cache_gb=pool_gb)
    tiered = EngineConfig(kv_cache_gb=pool_gb, kv_offload_gb=args.kv_offload_gb)
    runs = {
        "pool only (recompute)": multi_turn(base, args),
        "pool + tier": multi_turn(tiered, args),
    }
    first = next(iter(runs.values()))
    print(f"multi-turn: {first['conversations']:.0f} conversations x {args.turns} turns, "
          f"working set {first['working_set']:.0f} tokens = "
          f"{first['working_set'] / first['pool_tokens']:.1f}x the pool's "
          f"{first['pool_tokens']:.0f}; {first['reused']:.0f} reused prompt tokens")  # fmt: skip
    print("| engine | reused from pool | from tier | from either | TTFT p50 (ms) | p90 | "
          "TTFT p50 / recompute |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in runs.items():
        ratio = r["ttft_p50"] / first["ttft_p50"]
        print(f"| {name} | {r['from_pool']:.0%} | {r['from_tier']:.0%} | "
              f"{r['from_pool'] + r['from_tier']:.0%} | {r['ttft_p50'] * 1e3:.0f} | "
              f"{r['ttft_p90'] * 1e3:.0f} | {ratio:.2f}x |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
