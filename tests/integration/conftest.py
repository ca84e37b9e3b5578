"""Fixtures on the real bundled model: one engine per configuration, HF as the reference."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from cluster.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.kernels import qmatmul
from cluster.engine.model.model_files import bundled_model_path
from cluster.engine.model.tokenizer import Tokenizer
from tests.helpers import assert_no_leak

# Eight varied prompts: chat turns, code, prose, a list, numbers, non-English, a long one.
RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 5, 8, 13,",
    "Translate to French: I love reading books in the garden.",
    "Hi",
    "Here is a list of fruits:\n- apple\n- banana\n-",
    "In 1969, the Apollo 11 mission " + "carried astronauts to the Moon and back. " * 12 + "Then",
]
CHAT_PROMPTS = [
    "What is the capital of Japan?",
    "Write a haiku about the ocean.",
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, LLMEngine]]:
    """Engines built on demand by name, shared within a test module (each module its own:
    held for the whole session they passed 10 GB in one process)."""
    built: dict[str, LLMEngine] = {}
    yield built
    built.clear()


# Exact by default: tests compare tokens with transformers and between paths, in float32
# on float weights; a test of another mode names it. On the CPU, GPU host or not: a GPU
# test compares its engine against these (`auto` would make them GPU engines too).
EXACT = {"dtype": "float32", "quantization": "none", "device": "cpu"}
# What tests of our own paths against each other run (the workers, and the engine they are
# checked against): float32 activations over the GGUF's own blocks on our kernel
# (cluster/engine/kernels/qmatmul.c), whose every row's result depends on that row alone, so a
# request's tokens are the same whatever its batch or worker; its steps run ~4x faster
# than float weights' on one thread. Prefill and decode attention round differently and
# its input rounding can widen that (logprobs of tokens prefilled rather than decoded
# moved by up to 6e-4): a test comparing logprobs across that seam keeps EXACT. Torch's
# int4 kernel (no C compiler) promises no such thing: float weights then.
INVARIANT = {
    "dtype": "float32",
    "quantization": "gguf" if qmatmul.available() else "none",
    "device": "cpu",
}


def _build(engines: dict[str, LLMEngine], name: str, **overrides: Any) -> LLMEngine:
    if name not in engines:
        engines[name] = LLMEngine(EngineConfig(**{**EXACT, **overrides}))
    engine = engines[name]
    assert_no_leak(engine)
    return engine


@pytest.fixture
def engine(engines: dict[str, LLMEngine]) -> Iterator[LLMEngine]:
    """The default engine (float32, chunked prefill, prefix caching); leak-checked after."""
    e = _build(engines, "default")
    yield e
    assert_no_leak(e)


@pytest.fixture
def twin(engines: dict[str, LLMEngine]) -> Iterator[LLMEngine]:
    """An engine in the workers' mode (INVARIANT), to check what they serve against."""
    e = _build(engines, "twin", **INVARIANT)
    yield e
    assert_no_leak(e)


@pytest.fixture
def make_engine(engines: dict[str, LLMEngine]) -> Iterator[Any]:
    used: list[LLMEngine] = []

    def make(name: str, **overrides: Any) -> LLMEngine:
        e = _build(engines, name, **overrides)
        used.append(e)
        return e

    yield make
    for e in used:
        assert_no_leak(e)


@pytest.fixture(scope="session")
def tok() -> Tokenizer:
    """The bundled model's tokenizer."""
    return Tokenizer.load(bundled_model_path())


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    """Token ids of the eight raw prompts plus two chat-templated ones."""
    tok = Tokenizer.load(bundled_model_path())
    chats = [tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT_PROMPTS]
    return [tok.encode(p) for p in RAW_PROMPTS + chats]


@pytest.fixture(scope="session")
def hf_model() -> Any:
    from transformers import AutoModelForCausalLM

    path = bundled_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_greedy(hf_model: Any, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time, EOS included."""
    outs = []
    for ids in prompts:
        with torch.inference_mode():
            out = hf_model.generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                top_p=None,
                top_k=None,
                temperature=None,
            )
        outs.append(out[0, len(ids) :].tolist())
    return outs


def _save_tiny(root: Any, name: str, config: Any) -> Any:
    """A tiny random checkpoint saved by transformers, with the bundled tokenizer beside it;
    its norms' weights random too (transformers starts them at ones, which would hide a
    weight left out)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for key, t in model.named_parameters():
            if key.endswith("norm.weight"):
                t.uniform_(0.5, 1.5)
    path = root / name
    model.save_pretrained(path)
    Tokenizer.load(bundled_model_path()).hf.save_pretrained(path)
    return path


TINY = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
    eos_token_id=2,
)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Llama with grouped-query attention (4 heads, 2 KV heads) and untied embeddings."""
    from transformers import LlamaConfig

    config = LlamaConfig(**TINY, num_key_value_heads=2, tie_word_embeddings=False)
    return _save_tiny(tmp_path_factory.mktemp("ckpt"), "tiny-llama", config)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Qwen2: qkv bias, tied embeddings, one KV head."""
    from transformers import Qwen2Config

    config = Qwen2Config(**TINY, num_key_value_heads=1, tie_word_embeddings=True)
    return _save_tiny(tmp_path_factory.mktemp("ckpt"), "tiny-qwen2", config)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Qwen3: an RMSNorm over each q and k head, head_dim set apart from hidden / heads."""
    from transformers import Qwen3Config

    config = Qwen3Config(**TINY, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)
    return _save_tiny(tmp_path_factory.mktemp("ckpt"), "tiny-qwen3", config)


@pytest.fixture(scope="session")
def tiny_thinker_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny Qwen3 whose tokenizer has `<think>` and `</think>` as tokens of their own (ids
    49152 and 49153, ordinary added tokens, as Qwen3's and DeepSeek-R1's tokenizers have)."""
    from transformers import Qwen3Config

    config = Qwen3Config(**{**TINY, "vocab_size": 49154}, num_key_value_heads=2, head_dim=32)
    path = _save_tiny(tmp_path_factory.mktemp("ckpt"), "tiny-thinker", config)
    hf = Tokenizer.load(bundled_model_path()).hf
    assert hf.add_tokens(["<think>", "</think>"]) == 2
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_qwen3_gguf(tiny_qwen3_dir: Any) -> Any:
    """The tiny Qwen3's weights as a float32 GGUF, named and keyed as llama.cpp writes a
    qwen3 file (q/k norms as attn_q_norm / attn_k_norm, head_dim as attention.key_length),
    with the bundled GGUF's tokenizer."""
    return _write_gguf(tiny_qwen3_dir, "qwen3")


@pytest.fixture(scope="session")
def tiny_qwen3_moe_gguf(tiny_qwen3_moe_dir: Any) -> Any:
    """The tiny Qwen3-MoE as llama.cpp writes a qwen3moe GGUF: each layer's experts stacked
    in one [experts, out, in] tensor a projection, the router as ffn_gate_inp."""
    keys = {"expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 64}
    return _write_gguf(tiny_qwen3_moe_dir, "qwen3moe", keys)


@pytest.fixture(scope="session")
def tiny_mixtral_gguf(tiny_mixtral_dir: Any) -> Any:
    """The tiny Mixtral as llama.cpp writes one: a llama GGUF (q and k rows permuted) with
    expert_count, each layer's experts stacked."""
    return _write_gguf(tiny_mixtral_dir, "llama", {"expert_count": 8, "expert_used_count": 2})


# transformers' layer tensor names -> llama.cpp's (its gguf-py TENSOR_NAMES)
GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}  # fmt: skip
# Gemma 2 and 3: the norms around each sublayer
GGUF_SANDWICH = {"post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "ffn_norm",
                 "post_feedforward_layernorm": "post_ffw_norm"}  # fmt: skip


def _write_gguf(ckpt: Any, arch: str, keys: dict[str, Any] | None = None) -> Any:
    """A float32 GGUF of a tiny checkpoint's weights as llama.cpp's convert_hf_to_gguf
    writes one for `arch` (its names, its shape keys and `keys` beside them; Gemma's norms
    stored as 1 + w), with the bundled GGUF's tokenizer."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((ckpt / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    path = ckpt.parent / f"{ckpt.name}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (
        ("context_length", config["max_position_embeddings"]),
        ("embedding_length", config["hidden_size"]),
        ("feed_forward_length", config["intermediate_size"]),
        ("block_count", config["num_hidden_layers"]),
        ("attention.head_count", config["num_attention_heads"]),
        ("attention.head_count_kv", config["num_key_value_heads"]),
        ("attention.key_length", head_dim),
        ("attention.value_length", head_dim),
    ):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    rope = config["rope_parameters"]
    w.add_float32(f"{arch}.rope.freq_base", rope.get("full_attention", rope)["rope_theta"])
    for key, value in (keys or {}).items():
        if isinstance(value, float):
            w.add_float32(f"{arch}.{key}", value)
        elif isinstance(value, str):
            w.add_string(f"{arch}.{key}", value)
        elif isinstance(value, list):
            w.add_array(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", value)
    bundled = gguf.GGUFReader(str(bundled_model_path()))
    for key, field in bundled.fields.items():
        if key.startswith("tokenizer."):
            value = field.contents()
            sub = field.types[1] if len(field.types) > 1 else None
            w.add_key_value(key, value, field.types[0], sub)
    gemma = arch in ("gemma2", "gemma3")
    layer = {**GGUF_LAYER, **GGUF_SANDWICH} if gemma else GGUF_LAYER
    names = {"embed_tokens": "token_embd", "norm": "output_norm"}
    experts: dict[str, list[tuple[int, torch.Tensor]]] = {}  # stacked, as llama.cpp has them
    mixtral = {"w1": "gate", "w3": "up", "w2": "down"}  # block_sparse_moe.experts.E.wN
    for name, t in load_file(ckpt / "model.safetensors").items():
        parts = name.split(".")
        if ".experts." in name:  # model.layers.L.mlp.experts.E.gate_proj.weight
            proj = mixtral.get(parts[6]) or parts[6].split("_")[0]
            stacked = f"blk.{parts[2]}.ffn_{proj}_exps.weight"
            experts.setdefault(stacked, []).append((int(parts[5]), t.float()))
            continue
        if name == "lm_head.weight":
            gguf_name = "output.weight"
        elif parts[1] == "layers":
            part = "ffn_gate_inp" if parts[4] == "gate" else layer[".".join(parts[3:-1])]
            gguf_name = f"blk.{parts[2]}.{part}.{parts[-1]}"
        else:
            gguf_name = f"{names[parts[1]]}.weight"
        shift = 1.0 if gemma and name.endswith("norm.weight") else 0.0  # as convert adds it
        t = t.float() + shift
        if arch == "llama" and parts[-2] in ("q_proj", "k_proj"):  # convert's permute
            heads = config[
                "num_attention_heads" if parts[-2] == "q_proj" else "num_key_value_heads"
            ]
            t = t.reshape(heads, 2, t.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(t.shape)
        w.add_tensor(gguf_name, t.numpy())
    for gguf_name, each in experts.items():
        each.sort(key=lambda pair: pair[0])
        w.add_tensor(gguf_name, torch.stack([t for _, t in each]).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def tiny_gemma2_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """A tiny Gemma 2 as llama.cpp would run it (query_pre_attn_scalar its head size, every
    other layer sliding from the first), its checkpoint and its GGUF (soft-caps and the
    window as keys)."""
    from transformers import Gemma2Config

    caps = {"attn_logit_softcapping": 0.5, "final_logit_softcapping": 2.0}
    config = Gemma2Config(**{**TINY, "num_hidden_layers": 4}, num_key_value_heads=2,
                          head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
                          pad_token_id=0, **caps)  # fmt: skip
    ckpt = _save_tiny(tmp_path_factory.mktemp("ckpt"), "tiny-gemma2-as-llama-cpp", config)
    return ckpt, _write_gguf(ckpt, "gemma2", {"attention.sliding_window": 8, **caps})


@pytest.fixture(scope="session")
def tiny_gemma3_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """A tiny Gemma 3 as llama.cpp would run it (query_pre_attn_scalar its head size, the
    sliding layers at base 10,000), its checkpoint and its GGUF (the layers' pattern as
    attention.sliding_window_pattern, the full layer's linear RoPE scaling)."""
    config = _tiny_gemma3(query_pre_attn_scalar=32, local_theta=10000.0)
    ckpt = _save_tiny(tmp_path_factory.mktemp("ckpt"), "tiny-gemma3-as-llama-cpp", config)
    keys = {"attention.sliding_window": 8, "attention.sliding_window_pattern": [True] * 3 + [False],
            "rope.scaling.type": "linear", "rope.scaling.factor": 2.0}  # fmt: skip
    return ckpt, _write_gguf(ckpt, "gemma3", keys)


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Phi-3: q, k and v in one fused matrix, gate and up in another."""
    from transformers import Phi3Config

    config = Phi3Config(**TINY, num_key_value_heads=2, pad_token_id=0, tie_word_embeddings=False)
    return _save_tiny(tmp_path_factory.mktemp("ckpt"), "tiny-phi3", config)


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Mixtral: each layer's MLP eight experts, two a token (block_sparse_moe's names)."""
    from transformers import MixtralConfig

    config = MixtralConfig(
        **TINY, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2
    )
    return _save_tiny(tmp_path_factory.mktemp("ckpt"), "tiny-mixtral", config)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Qwen3-MoE: q/k norms, eight experts of their own size, two a token, their weights
    renormalized (norm_topk_prob)."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        **TINY,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
        tie_word_embeddings=True,
    )
    return _save_tiny(tmp_path_factory.mktemp("ckpt"), "tiny-qwen3-moe", config)


@pytest.fixture(scope="session")
def tiny_gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Gemma (1): norms as 1 + w, GELU gating, scaled embeddings, one KV head."""
    from transformers import GemmaConfig

    config = GemmaConfig(**TINY, num_key_value_heads=1, head_dim=32, pad_token_id=0)
    return _save_tiny(tmp_path_factory.mktemp("ckpt"), "tiny-gemma", config)


@pytest.fixture(scope="session")
def tiny_gemma2_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Gemma 2: every other layer an 8-token sliding window, attention and final logits
    soft-capped (tight caps, so the tiny model's scores reach them), query_pre_attn_scalar
    apart from head_dim, norms around each sublayer, GELU gating, scaled embeddings."""
    from transformers import Gemma2Config

    config = Gemma2Config(
        **{**TINY, "num_hidden_layers": 4},
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=8,
        attn_logit_softcapping=0.5,
        final_logit_softcapping=2.0,
        pad_token_id=0,
    )
    return _save_tiny(tmp_path_factory.mktemp("ckpt"), "tiny-gemma2", config)


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Gemma 3 (text): q/k norms, three sliding layers of four (8-token window) rotated at
    their own base, the full one's RoPE linearly scaled, no soft-capping."""
    config = _tiny_gemma3(query_pre_attn_scalar=24, local_theta=1000.0)
    return _save_tiny(tmp_path_factory.mktemp("ckpt"), "tiny-gemma3", config)


# --- real Ray workers ----------------------------------------------------------------------

# A small token budget makes prompts of a few hundred tokens prefill in several chunks.
WORKER_ENGINE = {**INVARIANT, "kv_cache_gb": 0.2, "threads": 1, "max_num_batched_tokens": 256}


class Workers:
    """Prefill and decode actors on a local Ray, spawned on first use by name and config.
    Modules share them: a name asked for again with the same config gets the same actor
    (tests read its counters as differences, and use prompts no other test caches), one
    asked for with another config replaces it. A test that kills one pops it first."""

    KEEP = 4  # actors kept between modules, the last used (each holds its own model)

    def __init__(self) -> None:
        self.handles: dict[str, Any] = {}
        self._configs: dict[str, tuple[Any, ...]] = {}
        self._used: dict[str, int] = {}  # name -> the module count when last asked for
        self.modules = 0

    def prefill(self, name: str, engine: dict[str, Any] | None = None, **transfer: Any) -> Any:
        from prefill_worker.worker import spawn

        return self._get(spawn, name, engine, transfer)

    def decode(self, name: str, engine: dict[str, Any] | None = None, **transfer: Any) -> Any:
        from decode_worker.worker import spawn

        return self._get(spawn, name, engine, transfer)

    def trio(self) -> tuple[Any, Any, Any]:
        """The usual three: a prefill worker, a decode worker that always takes remote KV,
        and a colocated decode worker (prefills itself) as the reference."""
        return (
            self.prefill("prefill"),
            self.decode("decode", local_prefill_tokens=0),
            self.decode("colocated"),
        )

    def _get(self, spawn: Any, name: str, engine: Any, transfer: dict[str, Any]) -> Any:
        import ray

        from cluster.config import TransferConfig

        config = (spawn, EngineConfig(**{**WORKER_ENGINE, **(engine or {})}), transfer)
        if name in self.handles and self._configs[name] != config:
            ray.kill(self.handles.pop(name))
        if name not in self.handles:
            self.handles[name] = spawn(name, config[1], TransferConfig(**transfer), num_cpus=0)
            self._configs[name] = config
        self._used[name] = self.modules
        return self.handles[name]

    def end_module(self) -> None:
        """Keep the KEEP actors asked for last that are alive with every page free (a
        module may leave a request behind); kill the others."""
        import ray

        self.modules += 1
        last = sorted(self.handles, key=lambda n: self._used[n], reverse=True)
        for i, name in enumerate(last):
            if i >= self.KEEP or not self._idle(name):
                ray.kill(self.handles.pop(name))

    def _idle(self, name: str) -> bool:
        import ray

        try:
            stats = ray.get(self.handles[name].stats.remote(), timeout=30)
        except Exception:  # killed by its module, or broken: spawned anew on demand
            return False
        return bool(stats.free_pages == stats.num_pages)

    def assert_all_pages_free(self, timeout_s: float = 10.0) -> None:
        """Every worker's pages return to its free pool (leases may still have to end)."""
        import time

        import ray

        deadline = time.monotonic() + timeout_s
        while True:
            stats = dict(
                zip(
                    self.handles,
                    ray.get([h.stats.remote() for h in self.handles.values()]),
                    strict=True,
                )
            )
            busy = {n: s for n, s in stats.items() if s.free_pages != s.num_pages}
            if not busy or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert not busy, f"pages still held: {busy}"


# Each module's workers are checked (pages all free) when it ends and then shared with the
# next ones, up to Workers.KEEP of them: every actor holds its own copy of the model, so
# keeping them all would not fit a whole run in this machine's 24 GB.
_session_workers: list[Workers] = []


@pytest.fixture(scope="session")
def ray_workers() -> Iterator[Workers]:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    workers = Workers()
    _session_workers.append(workers)
    yield workers
    _session_workers.clear()
    ray.shutdown()


@pytest.fixture(scope="module", autouse=True)
def release_module_workers() -> Iterator[None]:
    yield
    for workers in _session_workers:
        workers.end_module()


@pytest.fixture
def workers(ray_workers: Workers) -> Iterator[Workers]:
    """The session's workers; every page on every worker is free again after the test."""
    yield ray_workers
    ray_workers.assert_all_pages_free()


def _tiny_gemma3(query_pre_attn_scalar: int, local_theta: float) -> Any:
    """Four layers, three sliding (8 tokens) at `local_theta`, the full one's RoPE linearly
    scaled."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **{**TINY, "num_hidden_layers": 4},
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=query_pre_attn_scalar,
        sliding_window=8,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        },
        pad_token_id=0,
    )
