"""One config tree, validated at the edge with errors that name the field."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field."""


T = TypeVar("T")

DTYPES = ("float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs. `model` None means the bundled SmolLM2-135M-Instruct."""

    model: str | None = None
    dtype: str = "float32"
    device: str = "auto"
    kv_cache_gb: float = 1.0
    page_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    chunked_prefill: bool = True
    prefix_caching: bool = True
    max_model_len: int | None = None  # None: the model's own context length
    threads: int | None = None  # CPU threads for torch; None: torch's default

    def __post_init__(self) -> None:
        _check(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _check(self.device in DEVICES, "device", f"must be one of {DEVICES}, got {self.device!r}")
        _check(
            isinstance(self.kv_cache_gb, int | float)
            and not isinstance(self.kv_cache_gb, bool)
            and self.kv_cache_gb > 0,
            "kv_cache_gb",
            f"must be a number > 0, got {self.kv_cache_gb!r}",
        )
        for name in ("chunked_prefill", "prefix_caching"):
            value = getattr(self, name)
            _check(isinstance(value, bool), name, f"must be true or false, got {value!r}")
        _check(
            _is_int(self.page_size) and self.page_size >= 1,
            "page_size",
            f"must be an integer >= 1, got {self.page_size!r}",
        )
        _check(
            _is_int(self.max_num_seqs) and self.max_num_seqs >= 1,
            "max_num_seqs",
            f"must be an integer >= 1, got {self.max_num_seqs!r}",
        )
        _check(
            _is_int(self.max_num_batched_tokens) and self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            f"must be an integer >= 1, got {self.max_num_batched_tokens!r}",
        )
        _check(
            self.max_model_len is None or (_is_int(self.max_model_len) and self.max_model_len >= 2),
            "max_model_len",
            f"must be an integer >= 2 or null, got {self.max_model_len!r}",
        )
        _check(
            self.threads is None or (_is_int(self.threads) and self.threads >= 1),
            "threads",
            f"must be an integer >= 1 or null, got {self.threads!r}",
        )


TIMEOUT_POLICIES = ("recompute", "fail")


@dataclass(frozen=True)
class TransferConfig:
    """How prefill and decode workers move KV and what happens when a transfer fails."""

    ucx_devices: str = "lo"  # UCX network devices: "lo" keeps KV on this host; "" uses all
    stream_layers: bool = True  # write each layer's KV as soon as it is computed
    progress_thread: bool = False  # a UCX progress thread per worker (off: workers poll)
    lease_s: float = 30.0  # how long a decode worker holds reserved pages waiting for KV
    write_margin_s: float = 1.0  # a sender posts no WRITE this close to the lease end
    on_timeout: str = "recompute"  # KV not landed in time: recompute it here, or fail
    local_prefill_tokens: int = 32  # uncached prompt tokens a decode worker prefills itself

    def __post_init__(self) -> None:
        _check(isinstance(self.ucx_devices, str), "ucx_devices", "must be a string")
        for name in ("stream_layers", "progress_thread"):
            value = getattr(self, name)
            _check(isinstance(value, bool), name, f"must be true or false, got {value!r}")
        for name in ("lease_s", "write_margin_s"):
            value = getattr(self, name)
            _check(
                isinstance(value, int | float) and not isinstance(value, bool) and value > 0,
                name,
                f"must be a number > 0, got {value!r}",
            )
        _check(
            self.write_margin_s < self.lease_s,
            "write_margin_s",
            f"must be below lease_s ({self.lease_s}), got {self.write_margin_s}",
        )
        _check(
            self.on_timeout in TIMEOUT_POLICIES,
            "on_timeout",
            f"must be one of {TIMEOUT_POLICIES}, got {self.on_timeout!r}",
        )
        _check(
            _is_int(self.local_prefill_tokens) and self.local_prefill_tokens >= 0,
            "local_prefill_tokens",
            f"must be an integer >= 0, got {self.local_prefill_tokens!r}",
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, field: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"{field}: {why}")


def _from_dict(cls: type[T], data: dict[str, Any], where: str) -> T:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must be a mapping, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown field (known: {sorted(known)})")
    try:
        return cls(**data)
    except ConfigError as e:
        raise ConfigError(f"{where}.{e}") from None


def engine_config_from_dict(data: dict[str, Any], where: str = "engine") -> EngineConfig:
    """Build an EngineConfig from plain data, refusing unknown fields by name."""
    return _from_dict(EngineConfig, data, where)


def transfer_config_from_dict(data: dict[str, Any], where: str = "transfer") -> TransferConfig:
    """Build a TransferConfig from plain data, refusing unknown fields by name."""
    return _from_dict(TransferConfig, data, where)


def load_engine_config(path: str | Path) -> EngineConfig:
    """Read the `engine:` section of a YAML config file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p}: not found")
    try:
        doc = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p}: not valid YAML: {e}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"config file {p}: top level must be a mapping")
    try:
        return engine_config_from_dict(doc.get("engine") or {})
    except ConfigError as e:
        raise ConfigError(f"config file {p}: {e}") from None
