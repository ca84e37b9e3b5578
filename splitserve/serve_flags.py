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
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
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
    aliases: tuple[str, ...] = ()  # vLLM's other spellings: -tp, --model
    many: bool = False  # given more than once or with several values: all of them, a list

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
        if self.type is bool:  # --x sets it, --no-x clears it
            parser.add_argument(self.name, *self.aliases, action=argparse.BooleanOptionalAction,
                                default=None, help=help)  # fmt: skip
            return
        if self.many:
            parser.add_argument(self.name, *self.aliases, action="extend", nargs="+",
                                type=self.type, default=None, help=help)  # fmt: skip
            return
        if self.name == self.dest:  # the positional may be left out, or given as an option
            parser.add_argument(self.name, nargs="?", type=self.type, default=None, help=help)
            for alias in self.aliases:
                parser.add_argument(alias, dest=f"{self.dest}_option", type=self.type,
                                    default=None, help=f"the same as {self.dest}")  # fmt: skip
            return
        parser.add_argument(self.name, *self.aliases, type=self.type, choices=self.choices,
                            default=None, help=help)  # fmt: skip


def _engines(field: str) -> tuple[str, ...]:
    return tuple(f"{engine}.{field}" for engine in ENGINES)


def _boolean(text: str) -> bool:
    """A variable's true or false (SPLITSERVE_ENABLE_PREFIX_CACHING=false)."""
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def _origins(text: str) -> tuple[str, ...]:
    """`https://a.example,https://b.example` as the YAML's list."""
    return tuple(origin.strip() for origin in text.split(",") if origin.strip())


API_KEY = Flag(
    "--api-key",
    ("router.api_key",),
    "clients must send it as a bearer token (router/auth.py); several (--api-key a b, or "
    "the flag again): any of them",
    clears=("router.api_key_file",),
    many=True,
)
FLAGS = (
    Flag(
        "model",
        _engines("model"),
        "a .gguf file, an HF checkpoint directory, or an HF id (owner/name) in the local "
        "Hugging Face cache, offline (default: the bundled SmolLM2-135M)",
        aliases=("--model",),
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
        "else float32; float16 on a GPU only)",
        choices=DTYPES,
    ),
    Flag(
        "--kv-cache-dtype",
        _engines("kv_cache_dtype"),
        "what the KV cache stores (default auto: the dtype's); fp8 (= fp8_e4m3), fp8_e5m2 "
        "and int8 hold twice bfloat16's tokens, with a scale per page and KV head",
        choices=KV_CACHE_DTYPES,
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
        "ranks each worker's model is split across, a CPU (or GPU) each, on one node (default 1)",
        int,
        aliases=("-tp",),
    ),
    Flag(
        "--max-num-seqs",
        _engines("max_num_seqs"),
        "sequences an engine steps together at most (default 64)",
        int,
    ),
    Flag(
        "--max-num-batched-tokens",
        _engines("max_num_batched_tokens"),
        "tokens an engine step computes at most, prompt chunks included (default 1024)",
        int,
    ),
    Flag(
        "--enable-prefix-caching",
        _engines("prefix_caching"),
        "reuse the KV of prompts' common prefixes (default on; --no-enable-prefix-caching: off)",
        bool,
    ),
    Flag(
        "--generation-config",
        _engines("generation_config"),
        "sampling defaults for what a request leaves out: auto the model's own "
        "generation_config.json (or GGUF metadata), vllm none (OpenAI's), or a folder with a "
        "generation_config.json (default auto)",
    ),
    Flag(
        "--revision",
        _engines("revision"),
        "a Hugging Face id's branch, tag or commit in the cache (default main)",
    ),
    Flag(
        "--download-dir",
        _engines("download_dir"),
        "the Hugging Face hub cache the id is in (default: huggingface_hub's, $HF_HUB_CACHE)",
    ),
    Flag(
        "--download",
        _engines("download"),
        "fetch a Hugging Face id that is not in the cache from the hub (huggingface_hub, "
        "$HF_ENDPOINT) into it (default off: refused, naming the cache)",
        bool,
    ),
    Flag(
        "--seed",
        ("router.seed",),
        "sampled requests without a seed draw theirs from this one: the same requests in "
        "order get the same replies on every start (default: random)",
        int,
    ),
    Flag(
        "--tool-call-parser",
        ("router.tool_call_parser",),
        "how tool_choice auto reads calls from a reply (default: the one the chat template "
        "teaches)",
        choices=TOOL_CALL_PARSERS,
    ),
    Flag(
        "--reasoning-parser",
        ("router.reasoning_parser",),
        "a chat reply's <think> thoughts as reasoning_content (default: none, all content)",
        choices=REASONING_PARSERS,
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
TYPES: dict[Callable[[str], Any], str] = {int: "an integer", float: "a number",
                                          bool: "true or false"}  # fmt: skip


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
            parse = _boolean if flag.type is bool else flag.type
            value = parse(text)
            layer.append((flag, value, flag.env))
        except ValueError:
            raise ConfigError(f"{flag.env}: must be {TYPES[flag.type]}, got {text!r}") from None
    return layer


def _flags(args: argparse.Namespace) -> list[tuple[Flag, Any, str]]:
    given = []
    for flag in FLAGS:
        value = getattr(args, flag.dest)
        option = getattr(args, f"{flag.dest}_option", None)  # --model for the positional
        if value is not None and option is not None and value != option:
            raise ConfigError(f"{flag.aliases[0]}: {option!r} and the model {value!r}: give one")
        if flag.many and value is not None and len(value) == 1:
            value = value[0]  # one is the field's plain value, as the YAML spells it
        if (value := option if value is None else value) is not None:
            given.append((flag, value, flag.name))
    return given


def _set(doc: dict[str, Any], field: str, value: Any) -> dict[str, Any]:
    """`doc` with the dotted `field` set to `value`; the mappings on its way are copied."""
    key, _, rest = field.partition(".")
    if not rest:
        return {**doc, key: value}
    inner = doc.get(key) or {}
    if not isinstance(inner, dict):
        raise ConfigError(f"{key}: must be a mapping, got {type(inner).__name__}")
    return {**doc, key: _set(inner, rest, value)}
