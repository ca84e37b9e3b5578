"""`splitserve plan capacity`: the tables it prints (splitserve/capacity.py has the math)."""

from __future__ import annotations

from cluster.engine.checkpoint import ModelSpec
from splitserve.capacity import (
    decode_bound,
    kv_bytes_per_token,
    kv_capacity,
    num_params,
    weight_bytes,
)
from splitserve.hardware import Hardware

WEIGHTS = (("bf16", 16.0), ("int8", 8.0), ("int4", 4.0))
KV_GB = (1, 10, 20, 40, 80)


def report(
    name: str,
    spec: ModelSpec,
    hw: Hardware,
    kv_dtype: str,
    page_size: int,
    kv_cache_gb: float,
    contexts: list[int],
    batches: list[int],
) -> str:
    per_token = kv_bytes_per_token(spec, kv_dtype)
    cap = kv_capacity(spec, kv_dtype, page_size, kv_cache_gb)
    lines = [
        f"{name}: {num_params(spec) / 1e9:.3g}B parameters; {spec.num_layers} layers, "
        f"{spec.num_kv_heads} KV heads of {spec.head_dim}",
        f"hardware {hw.name}: {hw.memory_gb:.0f} GB, {hw.bandwidth_gb_s:.0f} GB/s, "
        f"{hw.bf16_tflops:.3g} bf16 TFLOP/s (ridge {hw.ridge_flop_per_byte:.0f} FLOP/byte)",
        "",
        "weights: "
        + ", ".join(f"{w} {weight_bytes(spec, bits) / 1e9:.3g} GB" for w, bits in WEIGHTS),
        f"KV cache ({kv_dtype}): {per_token / 1024:.1f} KiB per token, "
        f"{cap.bytes_per_page / 2**20:.2f} MiB per page of {page_size}; {kv_cache_gb:g} GiB "
        f"holds {cap.pages} pages = {cap.tokens} tokens",
        "",
        "sequences that fit at once, by KV cache size (GiB) and context (tokens):",
        f"{'KV GiB':>8} " + " ".join(f"{c:>9}" for c in contexts),
    ]
    for gb in sorted({*KV_GB, kv_cache_gb}):
        row = kv_capacity(spec, kv_dtype, page_size, gb)
        lines.append(f"{gb:>8g} " + " ".join(f"{row.sequences(c):>9}" for c in contexts))
    context = contexts[len(contexts) // 2]
    lines += [
        "",
        f"decode floor (the memory wall) at context {context}: step time, tokens/s per user "
        "and in total, and what bounds it",
        f"{'weights':>8} {'batch':>6} {'step ms':>9} {'tok/s/user':>11} {'tok/s':>10} {'bound':>8}",
    ]
    for w, bits in WEIGHTS:
        for b in batches:
            d = decode_bound(spec, hw, bits, kv_dtype, b, context)
            lines.append(
                f"{w:>8} {b:>6} {d.step_s * 1e3:>9.2f} {d.tokens_per_s_per_user:>11.1f} "
                f"{d.tokens_per_s:>10.0f} {d.bound:>8}"
            )
    return "\n".join(lines)
