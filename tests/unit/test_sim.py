"""The cluster simulator (splitserve/sim.py) against closed forms and its own invariants."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from cluster.config import EngineConfig, ScalingConfig
from router.policy import PolicyConfig, PolicyName
from splitserve.arrivals import send_offsets
from splitserve.capacity import ARCHITECTURES, kv_bytes_per_token
from splitserve.hardware import GPUS
from splitserve.plan import counts, recommend, simulate
from splitserve.serve_workload import (
    Conversation,
    Turn,
    UniformDist,
    WorkloadSpec,
    ideal_cached_tokens,
    make_conversations,
)
from splitserve.sim import Cluster, Pool, Simulation, weighted_percentile
from splitserve.step_cost import Linear, Roofline, fit

SERVICE_S = 0.1


def one_at_a_time(decode_pages: int = 1000, prefill: int = 0) -> Cluster:
    """Each request is one fixed-cost step on a worker that runs one request at a time."""
    cost = Linear(SERVICE_S, 0, 0, 0, 0)
    engine = EngineConfig(max_num_seqs=1, chunked_prefill=False)
    return Cluster(
        Pool(prefill, engine, decode_pages, cost),
        Pool(1, engine, decode_pages, cost),
        PolicyConfig(),
        kv_bytes_per_token(ARCHITECTURES["smollm2-135m"], "bfloat16"),
        link_gb_s=10.0,
        router_s=0.0,
    )


def single_turns(lengths: list[tuple[int, int]]) -> list[Conversation]:
    rng = np.random.default_rng(1)
    return [
        Conversation("", (Turn([int(t) for t in rng.integers(0, 49152, p)], out),))
        for p, out in lengths
    ]


def test_one_worker_serving_one_at_a_time_is_an_m_d_1_queue() -> None:
    """Poisson arrivals, deterministic service S, one server: the mean wait is
    rho S / (2 (1 - rho)) (Pollaczek-Khinchine), the mean time in system that plus S."""
    n, rho = 20_000, 0.7
    arrivals = send_offsets(n, rho / SERVICE_S, seed=3)
    result = Simulation(one_at_a_time(), single_turns([(64, 1)] * n), arrivals).run()
    ttft = result.latencies()["ttft"]
    assert len(ttft) == n
    wait = rho * SERVICE_S / (2 * (1 - rho))
    assert ttft.mean() == pytest.approx(wait + SERVICE_S, rel=0.05)
    assert ttft.min() == pytest.approx(SERVICE_S)


def test_a_lone_request_takes_its_steps_and_nothing_else() -> None:
    """Local prefill: 1 step for the prompt (first token), then output - 1 decode steps."""
    result = Simulation(one_at_a_time(), single_turns([(40, 5)]), [2.0]).run()
    (r,) = result.requests
    assert r.first_token == pytest.approx(2.0 + SERVICE_S)
    assert r.end == pytest.approx(2.0 + 5 * SERVICE_S)
    assert r.tokens == 5
    np.testing.assert_allclose(np.repeat(result.itl, result.itl_weight), [SERVICE_S] * 4)


def test_remote_prefill_moves_the_prompts_kv_and_frees_every_page() -> None:
    cluster = one_at_a_time(prefill=1)
    sim = Simulation(cluster, single_turns([(100, 20)] * 30), send_offsets(30, 2.0, seed=0))
    result = sim.run()
    assert all(r.tokens == r.output_len == 20 for r in result.requests)
    assert all(r.prefill is not None for r in result.requests)
    assert result.transfer_bytes == 30 * 100 * cluster.kv_bytes_per_token
    for w in [*sim.prefill.values(), *sim.decode.values()]:
        assert w.pages.num_free == w.pages.num_pages
        assert w.idle


def test_a_multi_step_run_gives_the_same_times_as_stepping_one_by_one() -> None:
    """Decode runs are cut when a request arrives mid-run: with arrivals dense enough to cut
    every run, and sparse enough to cut few, TTFT and end times agree exactly with a cost
    model that makes every step the same (so the order of steps cannot matter)."""
    lengths = [(32, 50 + 7 * i) for i in range(12)]
    arrivals = [0.3537 * i + 0.0011 for i in range(12)]  # never on a step boundary
    cost = Linear(0.01, 0.002, 0.0, 0.001, 0.0)
    engine = EngineConfig(max_num_seqs=64)

    def run(runs: bool) -> list[tuple[float, float]]:
        cluster = Cluster(Pool(0, engine, 500, cost), Pool(1, engine, 500, cost),
                          PolicyConfig(), 1, 1.0, router_s=0.0)  # fmt: skip
        sim = Simulation(cluster, single_turns(lengths), arrivals)
        if not runs:
            sim._run_length = lambda w, rows: 1  # type: ignore[method-assign]
        return [(r.first_token, r.end) for r in sim.run().requests]

    np.testing.assert_allclose(run(True), run(False), rtol=1e-9)


def test_too_few_pages_queue_requests_instead_of_losing_them() -> None:
    """A decode worker with room for one request at a time still serves them all."""
    result = Simulation(one_at_a_time(decode_pages=8, prefill=1),
                        single_turns([(100, 20)] * 5), [0.0] * 5).run()  # fmt: skip
    assert [r.tokens for r in result.requests] == [20] * 5
    ends = sorted(r.end for r in result.requests)
    assert all(b > a for a, b in itertools.pairwise(ends))


def test_a_second_turn_finds_the_first_turns_kv_on_its_decode_worker() -> None:
    spec = WorkloadSpec("two-turn", UniformDist(200, 200), UniformDist(30, 30), UniformDist(2, 2))
    cluster = Cluster(
        Pool(2, EngineConfig(), 2000, Linear(0.01, 0.0, 0.0, 0.0001, 0.0)),
        Pool(3, EngineConfig(), 2000, Linear(0.01, 0.0, 0.0, 0.0001, 0.0)),
        PolicyConfig(), 100, 10.0,
    )  # fmt: skip
    result = simulate(cluster, spec, rate=1.0, requests=10, seed=0)
    second = [r for r in result.requests if r.turn == 1]
    assert len(second) == 10
    # the whole first turn (200 + 30 tokens) is cached but its last, partial page
    assert all(r.cached_tokens == 224 for r in second)
    assert all(r.decode == first.decode for r in second
               for first in result.requests if first.turn == 0
               and first.conversation == r.conversation)  # fmt: skip


@pytest.mark.parametrize("policy", list(PolicyName))
def test_shared_system_prompts_are_served_from_the_worker_holding_them(
    policy: PolicyName,
) -> None:
    """Two decode workers, two 512-token system prompts, requests overlapping: under
    cache_aware each goes where its system prompt is cached and the prefix caches serve
    the workload's ideal; by load alone or in turn each prompt is computed on both."""
    spec = WorkloadSpec(
        "sp", UniformDist(16, 16), UniformDist(8, 8), prefixes=2, prefix=UniformDist(512, 512)
    )
    conversations = make_conversations(spec, 20, seed=0)
    cost = Linear(0.01, 0.0, 0.0, 0.0001, 0.0)
    cluster = Cluster(
        Pool(0, EngineConfig(), 2000, cost), Pool(2, EngineConfig(), 2000, cost),
        PolicyConfig(name=policy), 100, 10.0,
    )  # fmt: skip
    result = Simulation(cluster, conversations, [0.1 * i for i in range(20)]).run()
    cached = sum(r.cached_tokens for r in result.requests)
    ideal = ideal_cached_tokens(conversations, 16)
    assert (cached == ideal) == (policy is PolicyName.CACHE_AWARE), (cached, ideal)
    assert cached >= ideal - 2 * 512


def test_autoscaling_adds_decode_workers_under_load_with_the_real_decide() -> None:
    scaling = ScalingConfig(min_replicas=1, max_replicas=4, up_ticks=2, cooldown_s=5.0,
                            tpot_slo_s=0.05, target_waiting=2)  # fmt: skip
    cost = Linear(0.02, 0.002, 0.0, 0.0002, 0.0)
    engine = EngineConfig(max_num_seqs=8)
    cluster = Cluster(Pool(0, engine, 2000, cost), Pool(1, engine, 2000, cost, scaling),
                      PolicyConfig(), 100, 10.0, start_s=10.0)  # fmt: skip
    spec = WorkloadSpec("s", UniformDist(50, 50), UniformDist(100, 100))
    result = simulate(cluster, spec, rate=20.0, requests=2000, seed=0)
    assert max(t[2] for t in result.ticks) == 4
    assert all(r.tokens == 100 for r in result.requests)


def test_fit_recovers_a_linear_cost_it_was_sampled_from() -> None:
    truth = Linear(0.01, 0.0005, 2e-6, 3e-4, 1e-8)
    samples = [(c, p, truth.seconds(c, p)) for c, p in [
        ([], [(16, 0)]), ([], [(512, 0)]), ([], [(2048, 0)]), ([129], []), ([1025], []),
        ([257] * 16, []), ([129] * 64, []), ([513] * 64, []),
    ]]  # fmt: skip
    got = fit(samples, "test")
    for c, p, s in samples:
        assert got.seconds(c, p) == pytest.approx(s, rel=1e-6)


def test_roofline_decode_is_the_memory_wall_and_prefill_the_compute_roof() -> None:
    spec, h100 = ARCHITECTURES["llama-3-8b"], GPUS["H100"]
    cost = Roofline(spec, h100)
    # batch 1: ~16 GB of weights at 3.35 TB/s
    assert cost.seconds([1], []) == pytest.approx(16.06e9 / 3.35e12, rel=0.01)
    # 8k tokens of prefill: 2 x 8B x 8192 FLOPs (+ attention) at 989 TFLOP/s
    assert cost.seconds([], [(8192, 0)]) > 2 * 8.03e9 * 8192 / 989e12
    run = cost.decode_run(4, 4 * 1000, 3)
    assert run == pytest.approx([cost.seconds([1000 + i] * 4, []) for i in range(3)])


def test_weighted_percentile_equals_numpy_on_the_repeated_values() -> None:
    rng = np.random.default_rng(0)
    values, weights = rng.random(50), rng.integers(1, 5, 50)
    for p in (0, 10, 50, 90, 99, 100):
        assert weighted_percentile(values, weights, p) == pytest.approx(
            np.percentile(np.repeat(values, weights), p)
        )


def test_recommend_and_counts() -> None:
    assert counts("1-3") == [1, 2, 3] and counts("1,4") == [1, 4] and counts("2") == [2]
    assert recommend([]) is None


@pytest.mark.parametrize("prefill", [0, 1])
def test_a_prompts_last_chunk_of_one_token_is_its_prefill_not_a_decode(prefill: int) -> None:
    """The scheduler runs a one-token chunk as a decode row; it still ends the prompt."""
    engine = EngineConfig(max_num_batched_tokens=64)
    cost = Linear(0.01, 0.001, 0.0, 0.0001, 0.0)
    cluster = Cluster(Pool(prefill, engine, 100, cost), Pool(1, engine, 100, cost),
                      PolicyConfig(local_prefill_tokens=0), 1, 1.0)  # fmt: skip
    result = Simulation(cluster, single_turns([(65, 4), (129, 3)]), [0.0, 0.005]).run()
    assert [r.tokens for r in result.requests] == [4, 3]
    assert all(r.first_token < r.end for r in result.requests)


def test_plan_cluster_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A sweep on a named GPU: one prefill worker cannot keep up with long prompts at this
    rate, two can, and the table says so and recommends the smallest cluster that does."""
    from splitserve.cli import main

    args = ["plan", "cluster", "--model", "llama-3-8b", "--hardware", "H100"]
    args += ["--workload", "long-prompt", "--rate", "30", "--requests", "300"]
    assert main([*args, "--prefill", "1-2", "--decode", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("  1   1", "  2   1"))]
    attainment = {row[0]: float(row[-5].rstrip("%")) for row in rows}
    assert attainment["1"] < 90 <= attainment["2"]
    assert "recommended: 2 prefill + 1 decode workers" in out


def test_plan_cluster_refuses_a_kv_cache_sized_as_a_share_of_the_gpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A worker's pages are the plan's input; a share of a GPU has none until it starts."""
    from splitserve.cli import main

    config = tmp_path / "serve.yaml"
    config.write_text("engine: {kv_cache_gb: null, gpu_memory_utilization: 0.9}\n")
    args = ["plan", "cluster", "--model", "llama-3-8b", "--hardware", "H100"]
    assert main([*args, "--config", str(config), "--requests", "10"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "splitserve: error: engine.kv_cache_gb: plan cluster sizes each worker's KV cache "
        "from it; gpu_memory_utilization depends on the device at start"
    ]


def test_plan_cluster_splits_a_model_too_big_for_one_device_over_tensor_parallel_workers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Llama-3-70B in bf16 (141 GB) does not fit an A100 (80 GB): refused, naming the
    pool; at tensor parallel 4 per worker (35 GB a device) the sweep runs, counts four
    devices a worker and recommends by devices; a TP-4 step is faster than the TP-1 roofline
    would be (a quarter of the bytes per device, plus its all-reduces)."""
    from splitserve.cli import main

    args = ["plan", "cluster", "--model", "llama-3-70b", "--hardware", "A100", "--kv-cache-gb",
            "30", "--workload", "chat", "--rate", "2", "--requests", "100"]  # fmt: skip
    assert main(args) == 2
    assert capsys.readouterr().err.startswith(
        "splitserve: error: prefill: weights 141 GB + KV 30 GiB per device exceed A100's 80 GB "
        "at tensor parallel 1"
    )
    assert main([*args, "--prefill-tp", "4", "--decode-tp", "4", "--decode", "1-2"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel 4 per prefill and 4 per decode worker" in out
    assert "recommended: 1 prefill + 1 decode workers (2 in all, P:D = 1:1; 8 devices)" in out
    spec, a100 = ARCHITECTURES["llama-3-70b"], GPUS["A100"]
    one, four = Roofline(spec, a100), Roofline(spec, a100, tp=4, link_gb_s=300)
    assert four.seconds([1], []) < one.seconds([1], []) / 3
    assert four.seconds([1], []) > one.seconds([1], []) / 4  # the all-reduces cost
