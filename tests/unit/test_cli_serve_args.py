"""`splitserve serve [MODEL]` flags as vLLM users type them: each sets its config field
(the engine's in both pools), and one precedence holds for all of them: flag >
SPLITSERVE_<FLAG> > YAML > default; a value refused names where it came from."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from cluster.config import ConfigError, ServeConfig
from splitserve.cli import build_parser, main
from splitserve.serve_flags import FLAGS, serve_config


def _config(argv: list[str], environ: dict[str, str] | None = None) -> ServeConfig:
    return serve_config(build_parser().parse_args(["serve", *argv]), environ or {})


def _get(config: Any, field: str) -> Any:
    for name in field.split("."):
        config = getattr(config, name)
    return config


def test_serve_with_no_arguments_runs_the_defaults() -> None:
    assert _config([]) == ServeConfig()


@pytest.mark.parametrize(
    ("argv", "fields"),
    [
        (["--host", "0.0.0.0"], {"router.host": "0.0.0.0"}),
        (["--port", "8001"], {"router.http_port": 8001, "router.port": 50051}),
        (["--grpc-port", "50052"], {"router.port": 50052, "router.http_port": 8000}),
        (["--served-model-name", "smol"], {"router.served_model_name": "smol"}),
        (["--max-model-len", "512"], {"engine.max_model_len": 512}),
        (["m.gguf", "--dtype", "bfloat16"], {"engine.model": "m.gguf", "engine.dtype": "bfloat16"}),
        (["--quantization", "int4"], {"engine.quantization": "int4"}),
        (["--kv-cache-gb", "0.5"], {"engine.kv_cache_gb": 0.5, "engine.page_size": 16}),
        (["--kv-offload-gb", "8"], {"engine.kv_offload_gb": 8.0, "engine.kv_cache_gb": 1.0}),
        (
            ["--gpu-memory-utilization", "0.9"],  # in place of kv_cache_gb, which it clears
            {"engine.gpu_memory_utilization": 0.9, "engine.kv_cache_gb": None},
        ),
        (["--prefill-replicas", "0"], {"prefill.replicas": 0, "decode.replicas": 1}),
        (["--decode-replicas", "3"], {"decode.replicas": 3, "prefill.replicas": 1}),
        (["--redis-url", "redis://r:6379"], {"redis_url": "redis://r:6379"}),
        (["--address", "auto"], {"ray_address": "auto"}),
        (["--api-key-file", "k.txt"], {"router.api_key_file": "k.txt"}),
        (
            ["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"],
            {"router.ssl_keyfile": "k.pem", "router.ssl_certfile": "c.pem"},
        ),
        (
            ["--allowed-origins", "https://a.example, https://b.example:8443,"],
            {"router.allowed_origins": ("https://a.example", "https://b.example:8443")},
        ),
        (["--allowed-origins", "*"], {"router.allowed_origins": ("*",)}),
        # vLLM's spellings: -tp, --model for the positional, the scheduler's and router's
        (["-tp", "2"], {"engine.tensor_parallel_size": 2}),
        (["--tensor-parallel-size", "2"], {"engine.tensor_parallel_size": 2}),
        (["--model", "m.gguf"], {"engine.model": "m.gguf"}),
        (["m.gguf", "--model", "m.gguf"], {"engine.model": "m.gguf"}),
        (["--max-num-seqs", "8"], {"engine.max_num_seqs": 8}),
        (["--max-num-batched-tokens", "512"], {"engine.max_num_batched_tokens": 512}),
        (["--no-enable-prefix-caching"], {"engine.prefix_caching": False}),
        (["--enable-prefix-caching"], {"engine.prefix_caching": True}),
        (["--generation-config", "vllm"], {"engine.generation_config": "vllm"}),
        (["--seed", "7"], {"router.seed": 7}),
        (["--revision", "v2"], {"engine.revision": "v2"}),
        (["--download-dir", "/hub"], {"engine.download_dir": "/hub"}),
        (["--download"], {"engine.download": True}),
        (["--tool-call-parser", "hermes"], {"router.tool_call_parser": "hermes"}),
        (["--reasoning-parser", "qwen3"], {"router.reasoning_parser": "qwen3"}),
        (["--api-key", "a", "b", "--api-key", "c"], {"router.api_key": ("a", "b", "c")}),
    ],
)
def test_each_flag_sets_its_field(argv: list[str], fields: dict[str, Any]) -> None:
    config = _config(argv)
    for field, value in fields.items():
        pools = ("prefill.", "decode.") if field.startswith("engine.") else ("",)
        for pool in pools:  # an engine field: both pools, as KV moves between them
            assert _get(config, pool + field) == value, pool + field


def test_every_flag_names_real_fields_and_its_variable() -> None:
    for flag in FLAGS:
        assert flag.env == "SPLITSERVE_" + flag.name.lstrip("-").upper().replace("-", "_")
        for field in flag.fields:
            _get(ServeConfig(), field)  # AttributeError if the table names no such field


YAML = """
engine: {dtype: float32}
decode: {replicas: 2}
router: {http_port: 8100, port: 50100, served_model_name: yaml-name,
         allowed_origins: [https://yaml.example], ssl_keyfile: y.key, ssl_certfile: y.pem}
"""


@pytest.mark.parametrize(
    ("argv", "environ", "field", "value"),
    [
        ([], {}, "router.http_port", 8100),  # YAML over the default
        ([], {"SPLITSERVE_PORT": "8200"}, "router.http_port", 8200),  # environment over YAML
        (["--port", "8300"], {"SPLITSERVE_PORT": "8200"}, "router.http_port", 8300),  # flag
        ([], {"SPLITSERVE_PORT": ""}, "router.http_port", 8100),  # empty: unset
        ([], {"SPLITSERVE_GRPC_PORT": "50200"}, "router.port", 50200),
        ([], {"SPLITSERVE_DECODE_REPLICAS": "1"}, "decode.replicas", 1),
        ([], {"SPLITSERVE_DTYPE": "bfloat16"}, "prefill.engine.dtype", "bfloat16"),
        (["--dtype", "auto"], {"SPLITSERVE_DTYPE": "bfloat16"}, "decode.engine.dtype", "auto"),
        ([], {"SPLITSERVE_SERVED_MODEL_NAME": "env"}, "router.served_model_name", "env"),
        ([], {"SPLITSERVE_MAX_MODEL_LEN": "256"}, "decode.engine.max_model_len", 256),
        ([], {}, "router.allowed_origins", ("https://yaml.example",)),  # a YAML list
        (
            [],
            {"SPLITSERVE_ALLOWED_ORIGINS": "https://a.example,https://b.example"},
            "router.allowed_origins",
            ("https://a.example", "https://b.example"),
        ),
        (
            ["--allowed-origins", "*"],
            {"SPLITSERVE_ALLOWED_ORIGINS": "https://a.example"},
            "router.allowed_origins",
            ("*",),
        ),
        ([], {"SPLITSERVE_SSL_CERTFILE": "env.pem"}, "router.ssl_certfile", "env.pem"),
        (["--ssl-keyfile", "f.key"], {}, "router.ssl_keyfile", "f.key"),
        ([], {}, "prefill.engine.max_model_len", None),  # the default, none of them set
        ([], {"SPLITSERVE_ENABLE_PREFIX_CACHING": "false"}, "decode.engine.prefix_caching", False),
        (
            ["--enable-prefix-caching"],
            {"SPLITSERVE_ENABLE_PREFIX_CACHING": "0"},
            "decode.engine.prefix_caching",
            True,
        ),
        ([], {"SPLITSERVE_SEED": "3"}, "router.seed", 3),
        # The KV cache in GiB or as a share of the GPU: one choice, the higher level's.
        ([], {"SPLITSERVE_GPU_MEMORY_UTILIZATION": "0.8"}, "decode.engine.kv_cache_gb", None),
        (
            [],
            {"SPLITSERVE_GPU_MEMORY_UTILIZATION": "0.8"},
            "decode.engine.gpu_memory_utilization",
            0.8,
        ),
        (
            ["--kv-cache-gb", "2"],
            {"SPLITSERVE_GPU_MEMORY_UTILIZATION": "0.8"},
            "decode.engine.kv_cache_gb",
            2,
        ),
        (
            ["--kv-cache-gb", "2"],
            {"SPLITSERVE_GPU_MEMORY_UTILIZATION": "0.8"},
            "decode.engine.gpu_memory_utilization",
            None,
        ),
    ],
)
def test_the_flag_wins_over_the_environment_over_the_yaml_over_the_default(
    argv: list[str], environ: dict[str, str], field: str, value: Any, tmp_path: Path
) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(YAML)
    assert _get(_config(["--config", str(config), *argv], environ), field) == value


def test_serve_reads_its_own_environment(
    monkeypatch: pytest.MonkeyPatch, started: list[Any], tmp_path: Path
) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("router: {metrics_port: null}\n")
    monkeypatch.setenv("SPLITSERVE_GRPC_PORT", "0")
    monkeypatch.setenv("SPLITSERVE_PORT", "0")
    monkeypatch.setenv("SPLITSERVE_DECODE_REPLICAS", "2")
    argv = ["--config", str(config), "--decode-replicas", "1"]
    assert main(["serve", *argv]) == 0
    [served] = started
    assert served == _config(argv, dict(os.environ))
    assert (served.router.port, served.router.http_port, served.decode.replicas) == (0, 0, 1)


@pytest.mark.parametrize(
    ("environ", "argv", "error"),
    [
        ({"SPLITSERVE_PORT": "http"}, [], "SPLITSERVE_PORT: must be an integer, got 'http'"),
        ({"SPLITSERVE_KV_CACHE_GB": "1GB"}, [], "SPLITSERVE_KV_CACHE_GB: must be a number"),
        (
            {"SPLITSERVE_PORT": "70000"},
            [],
            "SPLITSERVE_PORT: router.http_port: must be an integer in [0, 65535]",
        ),
        (
            {"SPLITSERVE_DTYPE": "float8"},
            [],
            "SPLITSERVE_DTYPE: prefill.engine.dtype: must be one of",
        ),
        (
            {"SPLITSERVE_DECODE_REPLICAS": "0"},
            [],
            "SPLITSERVE_DECODE_REPLICAS: config.decode.replicas: must be at least 1",
        ),
        ({}, ["--max-model-len", "1"], "--max-model-len: prefill.engine.max_model_len: must be"),
        ({}, ["--served-model-name", " "], "--served-model-name: router.served_model_name:"),
        (
            {},
            ["--ssl-keyfile", "k.pem"],
            "--ssl-keyfile: router.ssl_keyfile: TLS needs ssl_certfile too: give both or neither",
        ),
        (
            {"SPLITSERVE_ALLOWED_ORIGINS": "https://app.example.com/"},
            [],
            "SPLITSERVE_ALLOWED_ORIGINS: router.allowed_origins: must be a list of origins, "
            "scheme://host[:port] (no path)",
        ),
        (
            {},
            ["--kv-cache-gb", "2", "--gpu-memory-utilization", "0.9"],
            "--gpu-memory-utilization: prefill.engine.gpu_memory_utilization: sizes the KV "
            "cache in place of kv_cache_gb",
        ),
    ],
)
def test_a_refused_value_names_the_flag_or_variable_and_the_field(
    environ: dict[str, str], argv: list[str], error: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        _config(argv, environ)
    assert str(refused.value).startswith(error), refused.value


def test_a_bad_yaml_value_still_names_the_file(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("router: {http_port: -1}\n")
    with pytest.raises(ConfigError) as refused:
        _config(["--config", str(config), "--grpc-port", "50300"])
    assert str(refused.value).startswith(f"config file {config}: router.http_port: must be")


def test_a_bad_variable_stops_serve_with_one_line(
    monkeypatch: pytest.MonkeyPatch, started: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SPLITSERVE_GRPC_PORT", "grpc")
    assert main(["serve"]) == 2
    assert started == []
    assert capsys.readouterr().err.splitlines() == [
        "splitserve: error: SPLITSERVE_GRPC_PORT: must be an integer, got 'grpc'"
    ]


def test_the_engine_flags_keep_the_rest_of_each_pools_engine(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("engine: {page_size: 32}\nprefill: {engine: {max_num_seqs: 8}}\n")
    served = _config(["--config", str(config), "--dtype", "float32"])
    assert served.prefill.engine == dataclasses.replace(
        served.decode.engine, max_num_seqs=8
    )  # the pool's own field kept
    assert (served.decode.engine.page_size, served.decode.engine.dtype) == (32, "float32")


def test_the_model_as_argument_and_as_option_must_agree() -> None:
    with pytest.raises(ConfigError, match=r"^--model: 'b\.gguf' and the model 'a\.gguf': give one"):
        _config(["a.gguf", "--model", "b.gguf"])


def test_a_parser_the_router_lacks_is_refused_by_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        _config(["--reasoning-parser", "granite"])
    assert "invalid choice: 'granite'" in capsys.readouterr().err
