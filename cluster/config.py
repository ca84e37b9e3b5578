"""One config tree, validated at the edge with errors that name the field."""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field."""


T = TypeVar("T")

DTYPES = ("auto", "float32", "bfloat16", "float16")  # float16: CUDA only (engine.pick_dtype)
# auto: the model's dtype; fp8 is fp8_e4m3 (cluster/engine/kernels/kv_cache.py)
KV_CACHE_DTYPES = (
    "auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"
)  # fmt: skip
DEVICES = ("auto", "cpu", "cuda")
# cluster/engine/model/quantization.py; fp8 / awq / gptq: a checkpoint's own
QUANTIZATIONS = ("auto", "none", "int8", "int4", "gguf", "fp8", "awq", "gptq")
ATTENTION_BACKENDS = ("auto", "cpu", "triton", "flashinfer")  # cluster/engine/kernels/attention.py
ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s]+")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine needs. `model` None means the bundled SmolLM2-135M-Instruct."""

    model: str | None = None
    # auto: bfloat16 on CUDA and on a CPU with native bf16, else float32 (engine.pick_dtype)
    dtype: str = "auto"
    # weights: none | int8 | int4 | gguf (the file's own blocks) | auto: gguf for a GGUF on
    # the CPU, else none (engine.pick_quantization)
    quantization: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"  # cpu on CPU; CUDA: flashinfer if installed, else triton
    # The KV cache: kv_cache_gb GiB, or (kv_cache_gb null) what a share of the GPU leaves:
    # gpu_memory_utilization of its total memory for weights, workspace and KV together, as
    # vLLM's flag (cluster/engine/memory.py: kv_share). CUDA only.
    kv_cache_gb: float | None = 1.0
    gpu_memory_utilization: float | None = None
    # A second tier behind the KV cache, GiB of host memory (pinned on a GPU): full pages
    # the prefix cache holds are copied there, and a prefix evicted from the cache comes
    # back from it instead of being recomputed (cluster/engine/kv_tier.py). 0: none. Off
    # by default: on a CPU the cache is host memory too, and the same GiB serve more as
    # kv_cache_gb (no copy back); on a GPU host memory is the larger, cheaper store.
    kv_offload_gb: float = 0.0
    # What the KV cache stores: auto (the model's dtype), bfloat16, float32, or 8 bits
    # (fp8 = fp8_e4m3, fp8_e5m2, int8) with a scale per page and KV head: twice
    # bfloat16's tokens in the same kv_cache_gb (kv_cache.py), as vLLM's --kv-cache-dtype.
    kv_cache_dtype: str = "auto"
    page_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    chunked_prefill: bool = True
    prefix_caching: bool = True
    max_model_len: int | None = None  # None: the model's own context length
    threads: int | None = None  # CPU threads for torch; None: torch's default
    # Ranks the model is split across (cluster/engine/model/tensor_parallel.py): Ray actors on one
    # node, a CPU (or a GPU) each; 1: the whole model in this engine.
    tensor_parallel_size: int = 1
    # A step's collective that waits longer for another rank fails (GroupLost: the worker
    # ends and its pool replaces it), on NCCL as on the CPU's shared memory.
    collective_timeout_s: float = 120.0
    cpu_cores: tuple[int, ...] | None = None  # pin the engine's threads to these cores (Linux)
    # The worker that runs this engine serves its own Prometheus /metrics on host:port
    # (cluster/worker_metrics.py; its URL is in the worker's stats and log); 0: any free
    # port, null: off. One worker per node (a pod) can take a fixed port. Beyond loopback
    # it asks for the key in metrics_api_key_file (Authorization: Bearer), as anything
    # bound wider does.
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = 0
    metrics_api_key_file: str | None = None  # a scrape-only key (plain HTTP: not the API's)
    # What a request leaves out of its sampling (vLLM's --generation-config): auto the
    # model's own generation_config.json or GGUF metadata, vllm none of it (OpenAI's
    # defaults), or a folder holding a generation_config.json.
    generation_config: str = "auto"
    # A Hugging Face id's snapshot (vLLM's --revision: a branch, tag or commit; null: main)
    # and the hub cache it is in (vLLM's --download-dir; null: huggingface_hub's own).
    revision: str | None = None
    download_dir: str | None = None
    # An id not in that cache is fetched from the hub (vLLM downloads by default; here
    # only when asked: --download); false: refused, naming the cache and the flag.
    download: bool = False

    def __post_init__(self) -> None:
        _check(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _check(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "kv_cache_dtype",
            f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}",
        )
        given = self.generation_config
        _check(
            isinstance(given, str) and bool(given),
            "generation_config",
            f"must be auto, vllm or a folder, got {given!r}",
        )
        _check(self.device in DEVICES, "device", f"must be one of {DEVICES}, got {self.device!r}")
        _check(
            self.quantization in QUANTIZATIONS,
            "quantization",
            f"must be one of {QUANTIZATIONS}, got {self.quantization!r}",
        )
        _check(
            self.attention_backend in ATTENTION_BACKENDS,
            "attention_backend",
            f"must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}",
        )
        share = self.gpu_memory_utilization
        _check(
            share is None or (_is_number(share) and 0 < share <= 1),
            "gpu_memory_utilization",
            f"must be a number in (0, 1] or null, got {share!r}",
        )
        kv = self.kv_cache_gb
        _check(
            share is not None if kv is None else _is_number(kv) and kv > 0,
            "kv_cache_gb",
            f"must be a number > 0 (null: gpu_memory_utilization sizes the cache), got {kv!r}",
        )
        _check(
            kv is None or share is None,
            "gpu_memory_utilization",
            f"sizes the KV cache in place of kv_cache_gb ({kv!r}): give one, with kv_cache_gb null",
        )
        for name in ("chunked_prefill", "prefix_caching"):
            value = getattr(self, name)
            _check(isinstance(value, bool), name, f"must be true or false, got {value!r}")
        offload = self.kv_offload_gb
        _check(
            _is_number(offload) and offload >= 0,
            "kv_offload_gb",
            f"must be a number >= 0 (0: no tier), got {offload!r}",
        )
        _check(
            not offload or self.prefix_caching,
            "kv_offload_gb",
            "holds prefix-cached pages: it needs prefix_caching true",
        )
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
        _check(
            _is_int(self.tensor_parallel_size) and self.tensor_parallel_size >= 1,
            "tensor_parallel_size",
            f"must be an integer >= 1, got {self.tensor_parallel_size!r}",
        )
        _check(
            _is_number(self.collective_timeout_s) and self.collective_timeout_s > 0,
            "collective_timeout_s",
            f"must be a number of seconds > 0, got {self.collective_timeout_s!r}",
        )
        _check(
            not self.kv_offload_gb or self.tensor_parallel_size == 1,
            "kv_offload_gb",
            "is served on one rank only so far: it needs tensor_parallel_size 1",
        )
        cores = self.cpu_cores
        _check(
            cores is None
            or (
                isinstance(cores, list | tuple)
                and bool(cores)
                and all(_is_int(c) and c >= 0 for c in cores)
            ),
            "cpu_cores",
            f"must be a non-empty list of core numbers >= 0 or null, got {cores!r}",
        )
        if cores is not None:
            object.__setattr__(self, "cpu_cores", tuple(cores))  # YAML gives a list
        key_file = self.metrics_api_key_file
        _check(
            key_file is None or (isinstance(key_file, str) and bool(key_file)),
            "metrics_api_key_file",
            f"must be a file's path or null, got {key_file!r}",
        )
        _check(
            isinstance(self.metrics_host, str)
            and (loopback(self.metrics_host) or key_file is not None),
            "metrics_host",
            f"beyond loopback it needs engine.metrics_api_key_file (the worker's /metrics "
            f"then asks for that key), got {self.metrics_host!r}",
        )
        port = self.metrics_port
        _check(
            port is None or (_is_int(port) and 0 <= port < 65536),
            "metrics_port",
            f"must be a port in [0, 65536) or null, got {port!r}",
        )


TIMEOUT_POLICIES = ("recompute", "fail")
UCX_LIST = re.compile(r"\^?[\w.:-]+(,[\w.:-]+)*")  # UCX's own list syntax; ^ excludes


@dataclass(frozen=True)
class TransferConfig:
    """How prefill and decode workers move KV and what happens when a transfer fails."""

    ucx_devices: str = "lo"  # UCX network devices: "lo" keeps KV on this host; "" uses all
    ucx_transports: str = ""  # UCX transports (UCX_TLS), e.g. "rc,cuda_copy,gdr_copy"; "" all
    stream_layers: bool = True  # write each layer's KV as soon as it is computed
    progress_thread: bool = False  # a UCX progress thread per worker (off: workers poll)
    # A transfer's lease, a duration each side counts on its own clock: the prefill worker
    # claims the reserved pages when it admits the request (STARTED) and renews the lease
    # with every WRITE, or a RENEW while the request waits or computes; the decode worker
    # revokes a claim that made no progress this long (and releases pages not claimed
    # this long after their reservation); a stalled prefill worker stops posting.
    lease_s: float = 30.0
    # A REVOKE no answer came to (no CANCEL, and nobody reported the prefill worker dead):
    # the pages are freed this long after it. Long, as a hung sender might still WRITE.
    revoke_cap_s: float = 300.0
    on_timeout: str = "recompute"  # KV not landed in time: recompute it here, or fail
    local_prefill_tokens: int = 32  # uncached prompt tokens a decode worker prefills itself

    def __post_init__(self) -> None:
        for name in ("ucx_devices", "ucx_transports"):
            value = getattr(self, name)
            _check(
                value == "" or (isinstance(value, str) and UCX_LIST.fullmatch(value) is not None),
                name,
                f'must be a comma-separated list of UCX names (no spaces) or "", got {value!r}',
            )
        for name in ("stream_layers", "progress_thread"):
            value = getattr(self, name)
            _check(isinstance(value, bool), name, f"must be true or false, got {value!r}")
        for name in ("lease_s", "revoke_cap_s"):
            value = getattr(self, name)
            _check(_is_number(value) and value > 0, name, f"must be a number > 0, got {value!r}")
        _check(
            self.revoke_cap_s >= self.lease_s,
            "revoke_cap_s",
            f"must be at least lease_s ({self.lease_s}), got {self.revoke_cap_s}",
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


POLICIES = ("round_robin", "least_loaded", "cache_aware")
# vLLM's names for the reply formats the router reads (router/reasoning.py, router/tools.py).
REASONING_PARSERS = ("qwen3", "deepseek_r1")
TOOL_CALL_PARSERS = ("hermes", "llama3_json")


@dataclass(frozen=True)
class ScalingConfig:
    """One phase's autoscaler (splitserve/autoscale.py has the decision it feeds)."""

    min_replicas: int = 1
    max_replicas: int = 1
    up_ticks: int = 3  # consecutive ticks over target before adding a replica
    down_ticks: int = 10  # consecutive ticks under `down_below` before removing one
    down_below: float = 0.3  # pressure under which a replica is spare
    cooldown_s: float = 30.0  # no change this soon after the last one
    interval_s: float = 1.0  # one tick: observe, decide, act
    drain_timeout_s: float = 60.0  # a removed worker's requests may run this long, then abort
    start_timeout_s: float = 600.0  # a new worker (maybe on a new node) must be ready by then
    ttft_slo_s: float = 2.0  # prefill: p90 time to first token
    target_queued_tokens: int = 4096  # prefill: queued prompt tokens per replica
    tpot_slo_s: float = 0.25  # decode: p90 time per output token
    target_kv_usage: float = 0.85  # decode: fraction of KV pages in use
    target_waiting: int = 8  # decode: admitted requests not yet running, per replica

    def __post_init__(self) -> None:
        for name in ("min_replicas", "max_replicas"):
            value = getattr(self, name)
            _check(_is_int(value) and value >= 0, name, f"must be an integer >= 0, got {value!r}")
        for name in ("up_ticks", "down_ticks", "target_queued_tokens", "target_waiting"):
            value = getattr(self, name)
            _check(_is_int(value) and value >= 1, name, f"must be an integer >= 1, got {value!r}")
        _check(
            self.max_replicas >= self.min_replicas,
            "max_replicas",
            f"must be >= min_replicas ({self.min_replicas}), got {self.max_replicas}",
        )
        for name in (
            "cooldown_s",
            "interval_s",
            "drain_timeout_s",
            "start_timeout_s",
            "ttft_slo_s",
            "tpot_slo_s",
            "target_kv_usage",
            "down_below",
        ):
            value = getattr(self, name)
            _check(_is_number(value) and value > 0, name, f"must be a number > 0, got {value!r}")
        _check(
            self.down_below < 1,
            "down_below",
            f"must be below 1 (the target), got {self.down_below}",
        )


@dataclass(frozen=True)
class PoolConfig:
    """One phase's workers: how many, what each asks of Ray, and the engine each runs.

    Without `autoscale` the pool keeps `replicas` workers, replacing any that die; with
    it, the pool starts at `replicas` and moves within [min_replicas, max_replicas]."""

    replicas: int = 1
    num_cpus: float = 1.0
    # None: one GPU per worker whose engine runs on CUDA (cluster/actor_options.py); 0 on a
    # cluster with GPUs hides them from the worker.
    num_gpus: float | None = None
    # Custom Ray resources each worker asks for, e.g. {prefill_node: 1} so a phase lands
    # on its own node type (deploy/ declares them on the nodes).
    resources: dict[str, float] = field(default_factory=dict)
    engine: EngineConfig = field(default_factory=EngineConfig)
    autoscale: ScalingConfig | None = None

    def __post_init__(self) -> None:
        _check(
            _is_int(self.replicas) and self.replicas >= 0,
            "replicas",
            f"must be an integer >= 0, got {self.replicas!r}",
        )
        low, high = self.scaling.min_replicas, self.scaling.max_replicas
        _check(
            low <= self.replicas <= high,
            "replicas",
            f"must be within autoscale's [min_replicas, max_replicas] = [{low}, {high}], "
            f"got {self.replicas}",
        )
        _check(
            _is_number(self.num_cpus) and self.num_cpus >= 0,
            "num_cpus",
            f"must be a number >= 0, got {self.num_cpus!r}",
        )
        _check(
            self.num_gpus is None or (_is_number(self.num_gpus) and self.num_gpus >= 0),
            "num_gpus",
            f"must be a number >= 0 or null, got {self.num_gpus!r}",
        )
        _check(
            self.num_gpus != 0 or self.engine.device != "cuda",
            "num_gpus",
            "0 gives each worker no GPU, but engine.device is cuda: leave num_gpus null "
            "(one each) or give a share (0.5: two workers on one GPU)",
        )
        _check(
            self.num_cpus > 0 or self.engine.tensor_parallel_size == 1,
            "num_cpus",
            f"must be > 0 for engine.tensor_parallel_size {self.engine.tensor_parallel_size}: "
            f"each rank's bundle of the worker's placement group holds that many CPUs",
        )
        _check(isinstance(self.resources, dict), "resources", "must be a mapping")
        for key, value in self.resources.items():
            _check(
                isinstance(key, str) and _is_number(value) and value >= 0,
                f"resources.{key}",
                f"must be a number >= 0, got {value!r}",
            )

    @property
    def scaling(self) -> ScalingConfig:
        """The autoscaler's config; a fixed pool only ever restores its `replicas`."""
        if self.autoscale is not None:
            return self.autoscale
        return ScalingConfig(min_replicas=self.replicas, max_replicas=self.replicas)


@dataclass(frozen=True)
class RouterConfig:
    """The front doors (gRPC, OpenAI HTTP): where they listen, how they route, what they
    refuse."""

    host: str = "127.0.0.1"
    port: int = 50051
    policy: str = "cache_aware"
    affinity_slack_tokens: int = 2048  # see router/policy.py
    seq_cost_tokens: int = 64  # ... what one more sequence on a decode worker is worth
    # Also prefill on the decode worker when the workers' measured costs say it is cheaper
    # (router/prefill_cost.py); false: transfer.local_prefill_tokens and the prefix rule
    # (router/policy.py) alone decide. Off: bench compare measured it worse on chat, better
    # on multi-turn (docs/benchmarks.md, bench compare).
    prefill_by_cost: bool = False
    max_pending: int = 256  # requests in flight; past it, RESOURCE_EXHAUSTED at once
    # ... and per client (its key, else its address); null: no limit per client.
    max_pending_per_client: int | None = None
    tokenize_threads: int = 1  # threads tokenizing long inputs (short ones: on the loop)
    max_tokenize_queue: int = 64  # long inputs waiting for them; past it, RESOURCE_EXHAUSTED
    max_tokens: int | None = None  # the most a request may ask for; null: the model's context
    max_message_bytes: int = 4 * 2**20
    session_ttl_s: float = 3600.0  # how long Redis keeps a session's placement
    redis_timeout_s: float = 0.05  # per Redis call on the request path
    stats_interval_s: float = 0.1  # how often worker loads are read
    grace_s: float = 10.0  # on shutdown, how long in-flight requests may run on
    metrics_port: int | None = 9464  # Prometheus /metrics on host:port; 0: any; null: off
    http_port: int | None = 8000  # the OpenAI-compatible HTTP API on host:port; null: off
    # A stream whose decode worker dies or is drained moves to another (router/router.py):
    # at most this many times per request (0: never; the stream then fails UNAVAILABLE),
    max_migrations: int = 3
    # ... waiting at most this long for a live decode worker (a pool replacing the dead one).
    migration_wait_s: float = 30.0
    # Clients must send `Authorization: Bearer <key>` (router/auth.py); null: no check.
    # The key itself (or a list of keys, any one of them will do), or a file holding it
    # (one of the two); kept out of the repr.
    api_key: str | tuple[str, ...] | None = field(default=None, repr=False)
    api_key_file: str | None = None
    # The model's name in /v1/models, ServerInfo and requests' `model`; null: the model
    # file's stem or checkpoint directory's name (ModelInfo.name).
    served_model_name: str | None = None
    # TLS on both front doors: a PEM certificate (chain) and its private key; both or
    # neither (router/tls.py). null: plain text.
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    # Browser origins allowed to call the HTTP API (CORS, router/cors.py), "*" any; empty:
    # no CORS headers at all.
    allowed_origins: tuple[str, ...] = ()
    # A Jinja chat template file in place of the model's own (vLLM's --chat-template): for
    # a model whose template renders no tools (else they get a default tool prompt,
    # router/tools.py), say.
    chat_template: str | None = None
    # Chat replies' `<think>` thoughts as `reasoning_content` (vLLM's --reasoning-parser:
    # qwen3, deepseek_r1); null: replies are content only.
    reasoning_parser: str | None = None
    # How `tool_choice: auto` reads calls out of a reply (vLLM's --tool-call-parser: hermes,
    # llama3_json); null: the one the chat template teaches, if any.
    tool_call_parser: str | None = None
    # Sampled requests that bring no seed draw theirs from this one (vLLM's --seed): the
    # same requests in the same order get the same replies on every start. null: random.
    seed: int | None = None

    def __post_init__(self) -> None:
        _check(isinstance(self.host, str) and bool(self.host), "host", "must be a host name")
        for name, known in (("reasoning_parser", REASONING_PARSERS),
                            ("tool_call_parser", TOOL_CALL_PARSERS)):  # fmt: skip
            value = getattr(self, name)
            _check(value is None or value in known, name,
                   f"must be one of {known} or null, got {value!r}")  # fmt: skip
        _check(
            self.seed is None or _is_int(self.seed),
            "seed",
            f"must be an integer or null, got {self.seed!r}",
        )
        keys = self.api_key
        if isinstance(keys, list | tuple):
            _check(
                bool(keys) and all(isinstance(k, str) and k.strip() for k in keys),
                "api_key",
                "must be a non-empty string, a list of them, or null",
            )
            object.__setattr__(self, "api_key", tuple(keys))  # YAML gives a list
        one_key = () if isinstance(keys, list | tuple) else ("api_key",)
        for name in ("api_key_file", "served_model_name", "ssl_keyfile", "ssl_certfile",
                     "chat_template", *one_key):  # fmt: skip
            value = getattr(self, name)
            _check(
                value is None or (isinstance(value, str) and value.strip() != ""),
                name,
                "must be a non-empty string or null",
            )
        _check(
            self.api_key is None or self.api_key_file is None,
            "api_key",
            "give api_key or api_key_file, not both",
        )
        for given, missing in (("ssl_keyfile", "ssl_certfile"), ("ssl_certfile", "ssl_keyfile")):
            _check(
                getattr(self, given) is None or getattr(self, missing) is not None,
                given,
                f"TLS needs {missing} too: give both or neither",
            )
        origins = self.allowed_origins
        _check(
            isinstance(origins, list | tuple) and all(_is_origin(o) for o in origins),
            "allowed_origins",
            f"must be a list of origins, scheme://host[:port] (no path) or * for any, "
            f"got {origins!r}",
        )
        object.__setattr__(self, "allowed_origins", tuple(origins))  # YAML gives a list
        _check(
            _is_int(self.port) and 0 <= self.port < 65536,
            "port",
            f"must be an integer in [0, 65535] (0: any free port), got {self.port!r}",
        )
        for name in ("metrics_port", "http_port"):
            value = getattr(self, name)
            _check(
                value is None or (_is_int(value) and 0 <= value < 65536),
                name,
                f"must be an integer in [0, 65535] or null, got {value!r}",
            )
        _check(self.policy in POLICIES, "policy", f"must be one of {POLICIES}, got {self.policy!r}")
        _check(
            isinstance(self.prefill_by_cost, bool),
            "prefill_by_cost",
            f"must be true or false, got {self.prefill_by_cost!r}",
        )
        for name in (
            "affinity_slack_tokens",
            "seq_cost_tokens",
            "max_migrations",
            "max_pending",
            "max_message_bytes",
            "tokenize_threads",
            "max_tokenize_queue",
        ):
            value = getattr(self, name)
            least = 0 if name in ("affinity_slack_tokens", "max_migrations") else 1
            _check(
                _is_int(value) and value >= least,
                name,
                f"must be an integer >= {least}, got {value!r}",
            )
        _check(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            f"must be an integer >= 1 or null, got {self.max_tokens!r}",
        )
        _check(
            self.max_pending_per_client is None
            or (_is_int(self.max_pending_per_client) and self.max_pending_per_client >= 1),
            "max_pending_per_client",
            f"must be an integer >= 1 or null, got {self.max_pending_per_client!r}",
        )
        for name in ("session_ttl_s", "redis_timeout_s", "stats_interval_s", "grace_s"):
            value = getattr(self, name)
            _check(_is_number(value) and value > 0, name, f"must be a number > 0, got {value!r}")
        _check(
            _is_number(self.migration_wait_s) and self.migration_wait_s >= 0,
            "migration_wait_s",
            f"must be a number >= 0, got {self.migration_wait_s!r}",
        )


@dataclass(frozen=True)
class ServeConfig:
    """Everything `splitserve serve` runs: both pools, the transfer, the router, Redis."""

    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    redis_url: str | None = None  # None: an embedded valkey-server, started and stopped here
    ray_address: str | None = None  # None: start a local Ray; "auto" or ray://...: join one

    def __post_init__(self) -> None:
        _check(
            self.decode.scaling.min_replicas >= 1,
            "decode.replicas",
            "must be at least 1, and so must decode.autoscale.min_replicas: every request "
            "decodes (prefill.replicas may be 0: the decode workers then prefill)",
        )
        _check(
            self.redis_url is None
            or (isinstance(self.redis_url, str) and self.redis_url.startswith("redis")),
            "redis_url",
            f"must be a redis:// or rediss:// URL or null, got {self.redis_url!r}",
        )
        for name in ("model", "dtype", "quantization", "kv_cache_dtype"):  # KV moves between
            ours, theirs = getattr(self.prefill.engine, name), getattr(self.decode.engine, name)
            _check(
                ours == theirs,
                f"prefill.engine.{name}",
                f"must equal decode.engine.{name} ({theirs!r}), got {ours!r}",
            )
        # auto resolves per device, so two pools on different devices would hold different KV.
        devices = self.prefill.engine.device, self.decode.engine.device
        for name, named in (
            ("dtype", "float32, bfloat16 or float16"),
            ("quantization", "none or gguf"),
        ):
            _check(
                getattr(self.decode.engine, name) != "auto" or devices[0] == devices[1],
                f"prefill.engine.{name}",
                f"auto resolves per device: with prefill.engine.device {devices[0]!r} and "
                f"decode.engine.device {devices[1]!r}, name the {name} ({named})",
            )


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_origin(value: object) -> bool:
    """A browser's Origin as it sends it (scheme://host[:port]), or * for any."""
    return value == "*" or (isinstance(value, str) and ORIGIN.fullmatch(value) is not None)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def loopback(host: str) -> bool:
    """Whether a listener on `host` is reachable only from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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


def serve_config_from_dict(doc: dict[str, Any]) -> ServeConfig:
    """Build a ServeConfig from a config file's plain data. The top-level `engine:` holds
    defaults for both pools; a pool's own `engine:` overrides them field by field."""
    doc = dict(doc)
    shared = doc.pop("engine", None) or {}
    if not isinstance(shared, dict):
        raise ConfigError(f"engine: must be a mapping, got {type(shared).__name__}")
    fields: dict[str, Any] = {}
    for phase in ("prefill", "decode"):
        pool = dict(doc.pop(phase, None) or {})
        engine = {**shared, **(pool.get("engine") or {})}
        pool["engine"] = engine_config_from_dict(engine, f"{phase}.engine")
        if pool.get("autoscale") is not None:
            pool["autoscale"] = _from_dict(ScalingConfig, pool["autoscale"], f"{phase}.autoscale")
        fields[phase] = _from_dict(PoolConfig, pool, phase)
    fields["transfer"] = transfer_config_from_dict(doc.pop("transfer", None) or {})
    fields["router"] = _from_dict(RouterConfig, doc.pop("router", None) or {}, "router")
    return _from_dict(ServeConfig, {**doc, **fields}, "config")


def read_yaml(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """A config file's path and its plain data, a mapping; ConfigError naming the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p}: not found")
    try:
        doc = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p}: not valid YAML: {e}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"config file {p}: top level must be a mapping")
    return p, doc


def load_engine_config(path: str | Path) -> EngineConfig:
    """Read the `engine:` section of a YAML config file."""
    p, doc = read_yaml(path)
    try:
        return engine_config_from_dict(doc.get("engine") or {})
    except ConfigError as e:
        raise ConfigError(f"config file {p}: {e}") from None


def load_serve_config(path: str | Path) -> ServeConfig:
    """Read a whole YAML config file for `splitserve serve`."""
    p, doc = read_yaml(path)
    try:
        return serve_config_from_dict(doc)
    except ConfigError as e:
        raise ConfigError(f"config file {p}: {e}") from None
