"""bench compare rebuilds its page section by section: a workload it reran replaces its
section, every other section stays as written, and a new workload is appended; its KV
reuse lines put cached prompt tokens against the workload's ideal and count recomputed
tokens only where a prefill pool ran."""

from __future__ import annotations

from splitserve.bench.compare import _kv_reuse, _sections, merge, report

PAGE = """# Serving benchmark

Intro.

## chat

old chat table

## loadgen agreement

hand-written

## multi-turn

old multi-turn table
"""


def test_a_rerun_workload_replaces_only_its_own_section() -> None:
    old = _sections(PAGE)
    assert [s.split("\n")[0] for s in old] == ["## chat", "## loadgen agreement", "## multi-turn"]
    merged = merge(old, ["## chat\n\nnew chat table", "## long-prompt\n\nnew"])
    assert merged == [
        "## chat\n\nnew chat table",
        "## loadgen agreement\n\nhand-written",
        "## multi-turn\n\nold multi-turn table",
        "## long-prompt\n\nnew",
    ]


def _run(rate: float, cached: int, ttft_p50: float) -> dict[str, object]:
    return {"rate": rate, "summary": {"cached_prompt_tokens": cached, "ttft_s": {"p50": ttft_p50}}}


def test_kv_reuse_reports_cache_against_the_ideal_and_ttft_against_round_robin() -> None:
    one_decode_pool = {"prefill": {"replicas": 0}}
    result = {
        "ideal_cached_prompt_tokens": [1000, 2000],
        "configs": {
            "cache-aware": {
                "serve_config": one_decode_pool,
                "recomputed_tokens": 0,
                "runs": [_run(1, 950, 0.5), _run(2, 1000, 1.0)],
            },
            "round-robin": {
                "serve_config": one_decode_pool,
                "recomputed_tokens": 0,
                "runs": [_run(1, 500, 2.0), _run(2, 400, 2.0)],
            },
        },
    }
    rows = [line for line in _kv_reuse(result) if line.startswith("| cache-aware")]
    assert rows == [
        "| cache-aware | 1 | 950 | 1,000 | 95% | 0.25x |",
        "| cache-aware | 2 | 1,000 | 2,000 | 50% | 0.50x |",
    ]
    assert not any("Recomputed" in line for line in _kv_reuse(result))  # no prefill pool


def test_kv_reuse_counts_recomputed_tokens_where_a_prefill_pool_ran() -> None:
    result = {
        "configs": {
            "disaggregated": {"serve_config": {"prefill": {}}, "recomputed_tokens": 1234},
            "colocated": {"serve_config": {"prefill": {"replicas": 0}}, "recomputed_tokens": 0},
            "vllm": {"serve_config": {}},
        }
    }
    (line,) = [line for line in _kv_reuse(result) if line.startswith("Recomputed")]
    assert line.endswith("splitserve_recomputed_tokens): disaggregated 1,234.")


def _rate(rate: float, tpot_p50: float, out_tok_s: float = 100.0) -> dict[str, object]:
    pct = {"mean": 0.1, "p50": 0.1, "p90": 0.2, "p99": 0.3}
    summary = {
        "requests": 16, "completed": 16, "ttft_s": pct, "tpot_s": {**pct, "p50": tpot_p50},
        "itl_s": pct, "e2e_s": pct, "output_throughput": out_tok_s, "slo_attainment": 1.0,
        "cached_prompt_tokens": 0, "server_ms": {},
    }  # fmt: skip
    return {"rate": rate, "summary": summary}


def test_the_report_names_the_isa_and_puts_each_figure_against_vllms() -> None:
    def config(goodput: float | None, tpots: list[float], out: float) -> dict[str, object]:
        runs = [_rate(r, t, out) for r, t in zip((2.0, 4.0), tpots, strict=True)]
        return {"goodput": {"goodput_rps": goodput, "highest_swept_rps": goodput},
                "runs": runs, "serve_config": {"prefill": {"replicas": 0}},
                "recomputed_tokens": 0}  # fmt: skip

    result = {
        "workload": "chat", "seed": 0,
        "plan": {"num_requests": 16, "slo_ttft_s": 2.0, "slo_tpot_s": 0.1, "rates": [2.0, 4.0]},
        "machine": {"cpus": 2, "cpu": "x86_64", "cpu_model": "AMD EPYC", "isa": "avx512f",
                    "python": "3.11", "torch": "2.13.0", "ray": "2.60.0", "date": "2026-12-01",
                    "splitserve_modes": "dtype auto: bfloat16 (native bf16: avx512_bf16), "
                    "quantization auto: gguf", "vllm_dtype": "bfloat16"},
        "configs": {"colocated": config(8.0, [0.06, 0.09], 150.0),
                    "vllm": config(16.0, [0.04, 0.045], 120.0)},
    }  # fmt: skip
    [section] = report([result])
    assert "Machine: 2 CPUs (AMD EPYC; ISA avx512f)" in section
    assert (
        "Modes: splitserve dtype auto: bfloat16 (native bf16: avx512_bf16), quantization auto: "
        "gguf; vLLM bfloat16 over the GGUF dequantized." in section
    )
    rows = [line for line in section.splitlines() if line.startswith("| colocated |")]
    assert rows[0].endswith("| 1.50x | 1.25x |")  # TPOT p50, output tokens/s
    assert rows[1].endswith("| 2.00x | 1.25x |")
    assert rows[2] == "| colocated | 8 | 8 | 0.50x |"  # goodput
