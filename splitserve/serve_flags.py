"""`splitserve serve`'s settings as vLLM users type them: one table of flag and config
field, and one precedence for all of them: the flag, else the environment variable
SPLITSERVE_<FLAG> (`--grpc-port`: SPLITSERVE_GRPC_PORT; an empty one counts as unset),
else the YAML's field, else its default."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cluster.config import (
    DTYPES,
    QUANTIZATIONS,
    ConfigError,
    ServeConfig,
    read_yaml,
    serve_config_from_dict,
)

# Both pools' engines: KV moves between them, so they run one model, dtype and quantization.
ENGINES = ("prefill.engine", "decode.engine")


@dataclass(frozen=True)
class Flag:
    name: str  # "--grpc-port"; "model", the positional argument
    fields: tuple[str, ...]  # the config fields it sets, dotted as in the YAML
    help: str
    type: Callable[[str], Any] = str
    choices: tuple[str, ...] | None = None
    # Fields it unsets, as they are one choice with its own: the key or the key file, the
    # KV cache in GiB or as a share of the GPU.
    clears: tuple[str, ...] = ()

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")

    @property
    def env(self) -> str:
        return f"SPLITSERVE_{self.dest.upper()}"

    @property
    def field(self) -> str:
        """The field as the YAML names it: an engine field in the shared `engine:`."""
        leaf = self.fields[0].rsplit(".", 1)[-1]
        return f"engine.{leaf}" if self.fields == _engines(leaf) else self.fields[0]

    def add_to(self, parser: argparse.ArgumentParser, help: str) -> None:
        parser.add_argument(
            self.name,
            nargs="?" if self.name == self.dest else None,  # the positional may be left out
            type=self.type,
            choices=self.choices,
            default=None,
            help=help,
        )


def _engines(field: str) -> tuple[str, ...]:
    return tuple(f"{engine}.{field}" for engine in ENGINES)


def _origins(text: str) -> tuple[str, ...]:
    """`https://a.example,https://b.example` as the YAML's list."""
    return tuple(origin.strip() for origin in text.split(",") if origin.strip())


API_KEY = Flag(
    "--api-key",
    ("router.api_key",),
    "clients must send it as a bearer token (router/auth.py)",
    clears=("router.api_key_file",),
)
FLAGS = (
    Flag(
        "model",
        _engines("model"),
        "a .gguf file, an HF checkpoint directory, or an HF id (owner/name) in the local "
        "Hugging Face cache, offline (default: the bundled SmolLM2-135M)",
    ),
    Flag("--host", ("router.host",), "where both front doors listen (default 127.0.0.1)"),
    Flag("--port", ("router.http_port",), "the OpenAI HTTP API's port (default 8000)", int),
    Flag("--grpc-port", ("router.port",), "the gRPC API's port (default 50051)", int),
    Flag(
        "--served-model-name",
        ("router.served_model_name",),
        "the model's name in /v1/models and in requests (default: the model file's stem or "
        "checkpoint directory's name)",
    ),
    Flag(
        "--max-model-len",
        _engines("max_model_len"),
        "the served context in tokens, prompt and reply; longer requests are refused "
        "(default: the model's own)",
        int,
    ),
    Flag(
        "--dtype",
        _engines("dtype"),
        "activations and KV (default auto: bfloat16 on a GPU and on a CPU with native bf16, "
        "else float32)",
        choices=DTYPES,
    ),
    Flag(
        "--quantization",
        _engines("quantization"),
        "weights: int8/int4 quantized at load, gguf the file's own blocks, none float "
        "(default auto: gguf for a GGUF file on the CPU, else none)",
        choices=QUANTIZATIONS,
    ),
    Flag(
        "--kv-cache-gb",
        _engines("kv_cache_gb"),
        "KV cache per engine, GiB (default 1)",
        float,
        clears=_engines("gpu_memory_utilization"),
    ),
    Flag(
        "--gpu-memory-utilization",
        _engines("gpu_memory_utilization"),
        "or: the share of its GPU's memory each engine may hold, weights included; the KV "
        "cache gets the rest (CUDA only)",
        float,
        clears=_engines("kv_cache_gb"),
    ),
    Flag(
        "--kv-offload-gb",
        _engines("kv_offload_gb"),
        "a second KV tier per engine, GiB of host memory, that evicted prefixes come back "
        "from instead of being recomputed (default 0: none)",
        float,
    ),
    Flag(
        "--tensor-parallel-size",
        _engines("tensor_parallel_size"),
        "ranks each worker's model is split across, a CPU (or GPU) each, on one node "
        "(default 1; above 1 only colocated so far: --prefill-replicas 0)",
        int,
    ),
    Flag("--prefill-replicas", ("prefill.replicas",), "prefill workers (default 1)", int),
    Flag("--decode-replicas", ("decode.replicas",), "decode workers (default 1)", int),
    Flag("--redis-url", ("redis_url",), "an external Redis (default: embedded)"),
    Flag("--address", ("ray_address",), "join this Ray cluster (auto, ray://...) instead"),
    API_KEY,
    Flag(
        "--api-key-file",
        ("router.api_key_file",),
        "... or read the key from this file",
        clears=("router.api_key",),
    ),
    Flag(
        "--ssl-keyfile",
        ("router.ssl_keyfile",),
        "TLS on both front doors: the certificate's private key, PEM (with --ssl-certfile)",
    ),
    Flag("--ssl-certfile", ("router.ssl_certfile",), "... and the certificate (chain), PEM"),
    Flag(
        "--chat-template",
        ("router.chat_template",),
        "a Jinja chat template file in place of the model's own (e.g. one that renders tools)",
    ),
    Flag(
        "--allowed-origins",
        ("router.allowed_origins",),
        "CORS: browser origins that may call the HTTP API, comma-separated (* any; default "
        "none: no CORS headers)",
        _origins,
    ),
)
BY_NAME = {flag.name: flag for flag in FLAGS}
TYPES: dict[Callable[[str], Any], str] = {int: "an integer", float: "a number"}


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """Every flag of the table, its help naming its variable and its YAML field."""
    for flag in FLAGS:
        flag.add_to(parser, f"{flag.help} [${flag.env}, YAML {flag.field}]")


def serve_config(args: argparse.Namespace, environ: Mapping[str, str]) -> ServeConfig:
    """The YAML file --config (or the defaults), the environment's settings over it and the
    flags' over those. A value refused names where it came from: the flag or variable, then
    the field (`SPLITSERVE_PORT: router.http_port: must be ...`)."""
    path, doc = read_yaml(args.config) if args.config else (None, {})
    origin: dict[str, str] = {}  # field: the flag or variable that set it
    for layer in (_environment(environ), _flags(args)):
        for flag, _, _ in layer:  # first, so that one layer setting both of a choice is refused
            for field in flag.clears:
                doc = _set(doc, field, None)
        for flag, value, source in layer:
            for field in flag.fields:
                doc = _set(doc, field, value)
                origin[field] = source
    try:
        return serve_config_from_dict(doc)
    except ConfigError as e:
        named = str(e).split(":", 1)[0].removeprefix("config.")
        where = origin.get(named) or (f"config file {path}" if path else None)
        if where is None:
            raise
        raise ConfigError(f"{where}: {e}") from None


def _environment(environ: Mapping[str, str]) -> list[tuple[Flag, Any, str]]:
    layer = []
    for flag in FLAGS:
        text = environ.get(flag.env)
        if not text:
            continue
        try:
            layer.append((flag, flag.type(text), flag.env))
        except ValueError:
            raise ConfigError(f"{flag.env}: must be {TYPES[flag.type]}, got {text!r}") from None
    return layer


def _flags(args: argparse.Namespace) -> list[tuple[Flag, Any, str]]:
    return [
        (flag, value, flag.name)
        for flag in FLAGS
        if (value := getattr(args, flag.dest)) is not None
    ]


def _set(doc: dict[str, Any], field: str, value: Any) -> dict[str, Any]:
    """`doc` with the dotted `field` set to `value`; the mappings on its way are copied."""
    key, _, rest = field.partition(".")
    if not rest:
        return {**doc, key: value}
    inner = doc.get(key) or {}
    if not isinstance(inner, dict):
        raise ConfigError(f"{key}: must be a mapping, got {type(inner).__name__}")
    return {**doc, key: _set(inner, rest, value)}
