"""How a model splits across ranks (pure): ranges, shards of the bundled model's shape, the
refusals naming tensor_parallel_size, matrices cut by rows and columns, the placement
group a split worker asks Ray for, and how long its ranks wait on one another."""

from __future__ import annotations

import pytest
import torch

from cluster.actor_options import rank_bundles
from cluster.config import ConfigError, EngineConfig
from cluster.engine.model.checkpoint import ModelSpec
from cluster.engine.model.quantization import GroupQuant, quantize
from cluster.engine.model.tensor_parallel import (
    IDLE_TIMEOUT,
    Shard,
    ShardedWeights,
    driver_bundles,
    group_settings,
    split,
    torch_index,
)

SMOL = ModelSpec(  # SmolLM2-135M's shape
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position=8192,
    tie_embeddings=True,
    qkv_bias=False,
    eos_token_ids=(2,),
)


def test_split_is_contiguous_even_and_in_whole_units() -> None:
    assert split(3, 2, 1) == [(0, 2), (2, 3)]
    assert split(1536, 2, 32) == [(0, 768), (768, 1536)]
    assert split(160, 3, 32) == [(0, 64), (64, 128), (128, 160)]


def test_the_bundled_models_shape_splits_two_ways_by_kv_head_groups() -> None:
    first, second = (Shard.of(SMOL, r, 2, quantized=True) for r in range(2))
    assert (first.kv_heads, first.heads) == ((0, 2), (0, 6))
    assert (second.kv_heads, second.heads) == ((2, 3), (6, 9))
    assert second.intermediate == (768, 1536) and second.vocab == (24576, 49152)
    local = second.local(SMOL)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (3, 1, 768)
    assert local.vocab_size == SMOL.vocab_size  # the logits are gathered whole


def test_a_split_the_model_cannot_take_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"tensor_parallel_size: 4 ranks: .* 3 KV heads"):
        Shard.of(SMOL, 0, 4, quantized=False)
    narrow = ModelSpec(**{**vars(SMOL), "num_heads": 6, "num_kv_heads": 6, "head_dim": 16})
    Shard.of(narrow, 0, 4, quantized=False)  # float: any column range
    with pytest.raises(ConfigError, match="o_proj's columns of 16-wide heads cut its groups"):
        Shard.of(narrow, 0, 4, quantized=True)


def test_sharded_weights_cut_rows_and_columns_of_floats_and_groups() -> None:
    shard = Shard.of(SMOL, 1, 2, quantized=True)
    o = torch.randn(576, 576)
    down = torch.randn(576, 1536)
    weights = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(576, 576),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(192, 576),
        "model.layers.0.self_attn.o_proj.weight": o,
        "model.layers.0.mlp.down_proj.weight": quantize(down, "int8"),
        "model.embed_tokens.weight": torch.randn(49152, 8),
        "model.norm.weight": torch.ones(576),
    }
    whole = dict(weights)
    sharded = ShardedWeights(weights, shard, SMOL.head_dim)  # type: ignore[arg-type]
    q = sharded.pop("model.layers.0.self_attn.q_proj.weight")
    assert torch.equal(q, whole["model.layers.0.self_attn.q_proj.weight"][384:])
    k = sharded.pop("model.layers.0.self_attn.k_proj.weight")
    assert torch.equal(k, whole["model.layers.0.self_attn.k_proj.weight"][128:])
    assert torch.equal(sharded.pop("model.layers.0.self_attn.o_proj.weight"), o[:, 384:])
    cut = sharded.pop("model.layers.0.mlp.down_proj.weight")
    assert isinstance(cut, GroupQuant) and cut.shape == (576, 768)
    full = whole["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(full, GroupQuant)
    assert torch.equal(cut.dequantize(), full.dequantize()[:, 768:])
    assert sharded.pop("model.embed_tokens.weight").shape == (24576, 8)
    assert torch.equal(sharded.pop("model.norm.weight"), torch.ones(576))
    assert "model.norm.weight" not in sharded


def test_a_mixture_of_experts_splits_by_whole_experts() -> None:
    # Expert parallelism: 8 experts of 3 ranks go 3 + 3 + 2, each whole (its rows and
    # columns uncut), the router on every rank; fewer experts than ranks is refused.
    moe = ModelSpec(**{**vars(SMOL), "num_kv_heads": 3, "experts": 8, "experts_per_token": 2})
    shards = [Shard.of(moe, r, 3, quantized=True) for r in range(3)]
    assert [s.experts for s in shards] == [(0, 3), (3, 6), (6, 8)]
    assert shards[2].describe().endswith("experts 6-7)")
    assert shards[2].local(moe).experts == 8  # the router scores every expert
    gate, router = torch.randn(64, 576), torch.randn(8, 576)
    weights = {
        "model.layers.0.mlp.experts.7.gate_proj.weight": gate,
        "model.layers.0.mlp.gate.weight": router,
    }
    sharded = ShardedWeights(weights, shards[2], SMOL.head_dim)  # type: ignore[arg-type]
    assert sharded.pop("model.layers.0.mlp.experts.7.gate_proj.weight") is gate
    assert sharded.pop("model.layers.0.mlp.gate.weight") is router
    few = ModelSpec(**{**vars(moe), "experts": 2})
    with pytest.raises(ConfigError, match=r"tensor_parallel_size: 3 ranks: .* 2 experts"):
        Shard.of(few, 0, 3, quantized=False)


def test_a_split_workers_placement_group_has_a_bundle_per_rank() -> None:
    options = {"num_cpus": 2.0, "num_gpus": 0.0, "resources": {"decode_node": 1.0}}
    assert rank_bundles(options, 3) == [
        {"CPU": 2.0, "decode_node": 1.0},
        {"CPU": 2.0},
        {"CPU": 2.0},
    ]
    gpu = {"num_cpus": 1.0, "num_gpus": 1.0, "resources": {}}
    assert rank_bundles(gpu, 2) == [{"CPU": 1.0, "GPU": 1.0}] * 2


def test_an_nccl_collective_waits_the_engines_timeout_not_a_followers_idle_days() -> None:
    """A rank lost mid-step fails its peers' collectives after collective_timeout_s (the
    group once waited 7 days on NCCL, hanging rank 0): a blocking wait raises in the caller
    (GroupLost) and the watchdog aborts a communicator a kernel still waits on."""
    timeout_s = EngineConfig().collective_timeout_s
    assert timeout_s == 120
    nccl = group_settings(torch.device("cuda"), timeout_s)
    assert nccl.backend == "nccl" and nccl.timeout.total_seconds() == 120
    assert dict(nccl.env) == {
        "TORCH_NCCL_BLOCKING_WAIT": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }
    assert nccl.control_timeout == IDLE_TIMEOUT  # the wait for the next step: gloo's
    gloo = group_settings(torch.device("cpu"), timeout_s)  # a dead peer's socket ends a wait
    assert (gloo.backend, gloo.timeout, gloo.control_timeout, gloo.env) == (
        "gloo",
        IDLE_TIMEOUT,
        None,
        (),
    )


def test_the_drivers_own_split_engine_reserves_a_gpu_for_every_rank_its_own_included() -> None:
    """`splitserve generate --tensor-parallel-size 3` on CUDA: rank 0 runs in the driver,
    and once reserved nothing, so Ray gave its GPU to a follower too."""
    bundles = driver_bundles(3, "10.0.0.5")
    assert [b["GPU"] for b in bundles] == [1, 1, 1]  # three distinct devices
    assert bundles[0]["node:10.0.0.5"] > 0  # on the driver's node (STRICT_PACK: all)


def test_rank_0_takes_the_index_torch_gives_its_reserved_gpu() -> None:
    assert torch_index("2", None) == 2
    assert torch_index("5", "4,5,6") == 1  # a node whose visible GPUs are 4-6
    assert torch_index("6", "4, 5, 6") == 2
