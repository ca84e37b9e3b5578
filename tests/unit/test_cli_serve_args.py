"""`splitserve serve [MODEL] --dtype --quantization`: both pools get the same engine."""

from __future__ import annotations

from cluster.config import ServeConfig
from splitserve.cli import build_parser, serve_config


def test_serve_with_no_arguments_runs_the_defaults() -> None:
    assert serve_config(build_parser().parse_args(["serve"])) == ServeConfig()


def test_the_model_and_engine_flags_reach_both_pools() -> None:
    argv = ["serve", "m.gguf", "--quantization", "gguf", "--dtype", "bfloat16", "--port", "7"]
    config = serve_config(build_parser().parse_args(argv))
    for pool in (config.prefill, config.decode):
        engine = pool.engine
        assert (engine.model, engine.quantization, engine.dtype) == ("m.gguf", "gguf", "bfloat16")
        assert engine.kv_cache_gb == ServeConfig().decode.engine.kv_cache_gb  # the rest kept
    assert config.router.port == 7
