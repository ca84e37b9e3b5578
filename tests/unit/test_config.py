"""EngineConfig validation and loading from YAML, with errors that name the field or file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cluster.config import (
    ConfigError,
    EngineConfig,
    ScalingConfig,
    ServeConfig,
    engine_config_from_dict,
    load_engine_config,
    load_serve_config,
    serve_config_from_dict,
)


def test_the_defaults_are_valid() -> None:
    config = EngineConfig()
    assert (config.dtype, config.device, config.page_size) == ("auto", "auto", 16)


@pytest.mark.parametrize(
    "field, value",
    [
        ("dtype", "float8"),
        ("quantization", "int3"),
        ("device", "tpu"),
        ("kv_cache_gb", 0),
        ("kv_cache_gb", -1.0),
        ("page_size", 0),
        ("page_size", 16.0),
        ("page_size", True),
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", 0),
        ("max_model_len", 1),
        ("threads", 0),
        ("collective_timeout_s", 0),
        ("gpu_memory_utilization", 0),
        ("gpu_memory_utilization", 1.5),
        ("gpu_memory_utilization", 0.9),  # beside kv_cache_gb's 1.0: one sizes the cache
        ("kv_offload_gb", -0.5),
    ],
)
def test_a_bad_value_is_refused_naming_its_field(field: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig(**{field: value})
    assert str(info.value).startswith(f"{field}:")


@pytest.mark.parametrize(
    "field, value",
    [
        ("kv_cache_gb", "2GB"),
        ("kv_cache_gb", None),
        ("chunked_prefill", "false"),
        ("prefix_caching", "no"),
        ("kv_offload_gb", "8G"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_naming_its_field(field: str, value: Any) -> None:
    # From YAML, `kv_cache_gb: 2GB` is a string and `chunked_prefill: "false"` is truthy.
    with pytest.raises(ConfigError) as info:
        EngineConfig(**{field: value})
    assert str(info.value).startswith(f"{field}:")


@pytest.mark.parametrize(
    "other, why",
    [
        ({"prefix_caching": False}, "it needs prefix_caching true"),
        ({"tensor_parallel_size": 2}, "it needs tensor_parallel_size 1"),
    ],
)
def test_a_kv_tier_is_refused_where_it_cannot_serve(other: dict[str, Any], why: str) -> None:
    with pytest.raises(ConfigError, match=f"^kv_offload_gb: .*{why}"):
        EngineConfig(kv_offload_gb=4, **other)
    assert EngineConfig(kv_offload_gb=0, **other).kv_offload_gb == 0


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_a_workers_metrics_listen_on_loopback(host: str) -> None:
    assert EngineConfig(metrics_host=host).metrics_host == host


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "worker.internal", ""])
def test_a_workers_metrics_beyond_loopback_need_a_key(host: str) -> None:
    with pytest.raises(ConfigError) as info:
        engine_config_from_dict({"metrics_host": host}, "decode.engine")
    assert str(info.value) == (
        "decode.engine.metrics_host: beyond loopback it needs engine.metrics_api_key_file "
        f"(the worker's /metrics then asks for that key), got {host!r}"
    )
    keyed = {"metrics_host": host, "metrics_api_key_file": "/etc/splitserve/api-key"}
    if host:  # "" is no host at all
        assert engine_config_from_dict(keyed, "decode.engine").metrics_host == host


def test_a_share_of_the_gpu_sizes_the_kv_cache_in_place_of_kv_cache_gb() -> None:
    config = EngineConfig(kv_cache_gb=None, gpu_memory_utilization=0.9)
    assert (config.kv_cache_gb, config.gpu_memory_utilization) == (None, 0.9)


def test_from_dict_builds_the_config() -> None:
    config = engine_config_from_dict({"page_size": 8, "chunked_prefill": False})
    assert config == EngineConfig(page_size=8, chunked_prefill=False)


def test_from_dict_refuses_an_unknown_field_by_name() -> None:
    with pytest.raises(ConfigError) as info:
        engine_config_from_dict({"page_size": 8, "page_sise": 8})
    assert str(info.value).startswith("engine.page_sise: unknown field")


def test_from_dict_prefixes_a_bad_value_with_where_it_came_from() -> None:
    with pytest.raises(ConfigError) as info:
        engine_config_from_dict({"page_size": 0}, where="prefill.engine")
    assert str(info.value).startswith("prefill.engine.page_size:")


def test_from_dict_refuses_a_non_mapping() -> None:
    with pytest.raises(ConfigError) as info:
        engine_config_from_dict([1, 2])  # type: ignore[arg-type]
    assert str(info.value).startswith("engine: must be a mapping")


def test_load_reads_the_engine_section(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("engine:\n  page_size: 32\n  kv_cache_gb: 0.5\n  prefix_caching: false\n")
    config = load_engine_config(path)
    assert config == EngineConfig(page_size=32, kv_cache_gb=0.5, prefix_caching=False)


def test_load_without_an_engine_section_gives_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("")
    assert load_engine_config(path) == EngineConfig()


def test_load_names_a_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_engine_config(path)
    assert str(path) in str(info.value) and "not found" in str(info.value)


def test_load_names_a_file_that_is_not_yaml(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("engine: [page_size: 16\n")
    with pytest.raises(ConfigError) as info:
        load_engine_config(path)
    assert str(path) in str(info.value) and "not valid YAML" in str(info.value)


def test_load_names_a_file_whose_top_level_is_not_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- engine\n")
    with pytest.raises(ConfigError) as info:
        load_engine_config(path)
    assert str(path) in str(info.value) and "mapping" in str(info.value)


def test_load_names_the_field_of_a_bad_value(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("engine:\n  page_size: 0\n")
    with pytest.raises(ConfigError) as info:
        load_engine_config(path)
    assert str(info.value).startswith(f"config file {path}: engine.page_size:")


def test_load_names_an_unknown_field(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("engine:\n  max_batch: 8\n")
    with pytest.raises(ConfigError, match=r"serve\.yaml: engine\.max_batch: unknown field"):
        load_engine_config(path)


# --- the whole serve config ----------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]


def test_the_example_serve_config_spells_out_the_defaults() -> None:
    assert load_serve_config(ROOT / "splitserve" / "serve.example.yaml") == ServeConfig()


def test_a_pool_without_autoscale_keeps_its_replicas_and_one_with_it_moves_in_bounds() -> None:
    config = serve_config_from_dict(
        {"prefill": {"replicas": 2}, "decode": {"autoscale": {"max_replicas": 3}}}
    )
    assert (config.prefill.scaling.min_replicas, config.prefill.scaling.max_replicas) == (2, 2)
    assert config.decode.scaling == ScalingConfig(max_replicas=3)


def test_pools_on_different_devices_may_share_a_named_dtype() -> None:
    engine = {"dtype": "float32", "quantization": "none"}
    config = serve_config_from_dict({"engine": engine, "prefill": {"engine": {"device": "cpu"}}})
    assert (config.prefill.engine.device, config.decode.engine.device) == ("cpu", "auto")


def test_a_prefill_pool_of_zero_is_colocated_serving() -> None:
    config = serve_config_from_dict({"prefill": {"replicas": 0}})
    assert (config.prefill.scaling.min_replicas, config.prefill.scaling.max_replicas) == (0, 0)


def test_cpu_cores_from_yaml_become_a_tuple_and_bad_ones_are_refused() -> None:
    assert EngineConfig(cpu_cores=[1]).cpu_cores == (1,)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cpu_cores: must be a non-empty list"):
        EngineConfig(cpu_cores=[])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cpu_cores: must be a non-empty list"):
        EngineConfig(cpu_cores=[-1])  # type: ignore[arg-type]


def test_pool_engines_override_the_shared_engine_field_by_field() -> None:
    config = serve_config_from_dict(
        {"engine": {"kv_cache_gb": 0.5, "threads": 2}, "decode": {"engine": {"threads": 1}}}
    )
    assert config.prefill.engine == EngineConfig(kv_cache_gb=0.5, threads=2)
    assert config.decode.engine == EngineConfig(kv_cache_gb=0.5, threads=1)


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"decode": {"replicas": -1}}, "decode.replicas: must be an integer >= 0"),
        ({"decode": {"replicas": 0}}, "config.decode.replicas: must be at least 1"),
        (
            {"decode": {"autoscale": {"min_replicas": 0}}},
            "config.decode.replicas: must be at least 1",
        ),
        ({"prefill": {"num_cpus": -1}}, "prefill.num_cpus: must be a number >= 0"),
        ({"prefill": {"num_gpus": -1}}, "prefill.num_gpus: must be a number >= 0 or null"),
        (
            {"decode": {"num_gpus": 0, "engine": {"device": "cuda"}}},
            "decode.num_gpus: 0 gives each worker no GPU, but engine.device is cuda",
        ),
        ({"prefill": {"engine": {"dtype": "int3"}}}, "prefill.engine.dtype: must be one of"),
        (
            {"decode": {"engine": {"quantization": "int4"}}},
            "config.prefill.engine.quantization: must equal decode.engine.quantization ('int4')",
        ),
        (
            {"prefill": {"engine": {"dtype": "bfloat16"}}},
            "config.prefill.engine.dtype: must equal decode.engine.dtype ('auto')",
        ),
        (
            {"decode": {"engine": {"kv_cache_dtype": "int8"}}},
            "config.prefill.engine.kv_cache_dtype: must equal decode.engine.kv_cache_dtype "
            "('int8')",
        ),
        ({"engine": {"kv_cache_dtype": "int4"}}, "prefill.engine.kv_cache_dtype: must be one of"),
        (
            {"prefill": {"engine": {"device": "cpu"}}},
            "config.prefill.engine.dtype: auto resolves per device: with prefill.engine.device "
            "'cpu' and decode.engine.device 'auto', name the dtype",
        ),
        (
            {"engine": {"dtype": "float32"}, "prefill": {"engine": {"device": "cpu"}}},
            "config.prefill.engine.quantization: auto resolves per device: with "
            "prefill.engine.device 'cpu' and decode.engine.device 'auto', name the quantization",
        ),
        ({"engine": {"page_size": 0}}, "prefill.engine.page_size: must be an integer >= 1"),
        ({"router": {"policy": "random"}}, "router.policy: must be one of"),
        ({"router": {"port": 70000}}, "router.port: must be an integer in [0, 65535]"),
        ({"router": {"max_pending": 0}}, "router.max_pending: must be an integer >= 1"),
        (
            {"router": {"max_pending_per_client": 0}},
            "router.max_pending_per_client: must be an integer >= 1 or null",
        ),
        ({"router": {"tokenize_threads": 0}}, "router.tokenize_threads: must be an integer >= 1"),
        ({"router": {"max_tokenize_queue": -1}}, "router.max_tokenize_queue: must be an integer"),
        ({"router": {"grace_s": 0}}, "router.grace_s: must be a number > 0"),
        ({"router": {"seq_cost_tokens": 0}}, "router.seq_cost_tokens: must be an integer >= 1"),
        ({"router": {"colour": "red"}}, "router.colour: unknown field"),
        ({"transfer": {"lease_s": -1}}, "transfer.lease_s: must be a number > 0"),
        (
            {"transfer": {"lease_s": 60, "revoke_cap_s": 30}},
            "transfer.revoke_cap_s: must be at least lease_s (60)",
        ),
        (
            {"transfer": {"ucx_devices": "lo, eth0"}},
            "transfer.ucx_devices: must be a comma-separated list of UCX names",
        ),
        (
            {"transfer": {"ucx_transports": ["tcp"]}},
            "transfer.ucx_transports: must be a comma-separated list of UCX names",
        ),
        ({"redis_url": "http://x"}, "config.redis_url: must be a redis:// or rediss:// URL"),
        ({"pools": 3}, "config.pools: unknown field"),
        ({"engine": [1]}, "engine: must be a mapping"),
        (
            {"prefill": {"autoscale": {"max_replicas": -1}}},
            "prefill.autoscale.max_replicas: must be an integer >= 0",
        ),
        (
            {"decode": {"autoscale": {"min_replicas": 2, "max_replicas": 1}}},
            "decode.autoscale.max_replicas: must be >= min_replicas (2)",
        ),
        ({"decode": {"autoscale": {"tpot_slo_s": 0}}}, "decode.autoscale.tpot_slo_s: must be"),
        ({"decode": {"autoscale": {"speed": 1}}}, "decode.autoscale.speed: unknown field"),
        (
            {"prefill": {"replicas": 3, "autoscale": {"max_replicas": 2}}},
            "prefill.replicas: must be within autoscale's [min_replicas, max_replicas] = [1, 2]",
        ),
    ],
)
def test_a_bad_serve_config_is_refused_naming_its_field(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        serve_config_from_dict(doc)
    assert str(err.value).startswith(message), str(err.value)
