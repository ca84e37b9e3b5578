"""Model checkpoints: the Llama-family shape (`ModelSpec`) and its weights, from GGUF or HF.

Weights come back under Hugging Face names (`model.layers.0.self_attn.q_proj.weight`).
A HF directory streams: each tensor is read from its shard when the model takes it, in the
target dtype on the target device, with no host copy kept. A GGUF is dequantized to
float32 whatever the file held; or, asked to keep its blocks, its quantized matrices come
back as `GroupQuant`s holding the file's own blocks.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from cluster.engine.model.checkpoint_quant import (
    KEPT,
    Prequantized,
    checkpoint_quant,
    read_quant_config,
)
from cluster.engine.model.model_files import ModelLoadError
from cluster.engine.model.quantization import (
    GGUF_BLOCKS,
    GroupQuant,
    QuantizationError,
    Stored,
    from_gguf_blocks,
)

if TYPE_CHECKING:  # gguf is imported where a GGUF is read: an HF checkpoint needs no gguf
    from cluster.engine.model.gguf_file import GGUFFile

HF_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "GemmaForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)
QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
GEMMA = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Gemma 1's GGUF is not among them: transformers does not read its tokenizer.
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3")
GGUF_GEMMA = ("gemma2", "gemma3")
ROPE_TYPES = ("default", "linear", "llama3")
CPU = torch.device("cpu")
Progress = Callable[[int, int], None]  # (tensors read, tensors in all), after each one


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a Llama-family decoder: RMSNorm, RoPE, GQA, SwiGLU."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_embeddings: bool
    qkv_bias: bool
    eos_token_ids: tuple[int, ...]
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head of q and of k before RoPE
    # Mixture-of-Experts (experts.py): experts per layer (0: a dense MLP), how many each
    # token takes, each one's intermediate size, whether the chosen weights sum to 1
    experts: int = 0
    experts_per_token: int = 0
    expert_size: int = 0
    renormalize_experts: bool = True
    # Gemma: RMSNorm weights as 1 + w, GELU (tanh) gating, embeddings times
    # sqrt(hidden_size); from Gemma 2 on, the attention's and the MLP's outputs each normed
    # before their add (`sandwich_norms`)
    gemma: bool = False
    sandwich_norms: bool = False
    query_scale: float | None = None  # query_pre_attn_scalar ** -0.5; None: head_dim's
    windows: tuple[int | None, ...] = ()  # each layer's sliding window (None: full); (): none
    attn_softcap: float | None = None  # attention scores soft-capped (Gemma 2)
    final_softcap: float | None = None  # logits soft-capped (Gemma 2)
    local_rope_theta: float | None = None  # Gemma 3's sliding layers' RoPE base (unscaled)

    def rope_inv_freq(self, local: bool = False) -> torch.Tensor:
        """Inverse frequencies of the rotary embedding, computed as transformers does
        (`local`: Gemma 3's sliding layers', default RoPE at local_rope_theta)."""
        dim = self.head_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        if local:
            assert self.local_rope_theta is not None
            return 1.0 / (self.local_rope_theta**exponents)
        inv_freq = 1.0 / (self.rope_theta**exponents)
        kind = self.rope_scaling.get("rope_type", "default")
        if kind == "linear":
            return inv_freq / float(self.rope_scaling["factor"])
        if kind == "llama3":
            s = self.rope_scaling
            factor, low, high = float(s["factor"]), s["low_freq_factor"], s["high_freq_factor"]
            old_len = s["original_max_position_embeddings"]
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
            smooth = (old_len / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
            return torch.where(medium, smoothed, scaled)
        return inv_freq


class Weights(Protocol):
    """A checkpoint's tensors under HF names, each taken once by the model it builds."""

    def __contains__(self, name: object) -> bool: ...

    def pop(self, name: str) -> Stored: ...


def load_checkpoint(
    path: str | Path,
    keep_blocks: bool = False,
    dtype: torch.dtype = torch.float32,
    device: torch.device = CPU,
    progress: Progress | None = None,
) -> tuple[ModelSpec, Weights]:
    """Read a GGUF file or a HF checkpoint directory; weights under HF names; `progress`
    hears of each tensor read (a GGUF's as it is read here, a directory's as it is taken).

    A directory's tensors come as `dtype` on `device`, read one by one as they are taken;
    a GGUF's as float32 on the CPU. `keep_blocks`: a GGUF's Q4_0 / Q4_1 / Q8_0 matrices
    come back as their own blocks; QuantizationError for a directory or a file with other
    quantized types."""
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"model path {p}: does not exist")
    if p.is_dir():
        spec = spec_from_hf_config(p / "config.json")
        weights: Weights = StreamedWeights(p, dtype, device, progress)
        quant = checkpoint_quant(p)
        if keep_blocks and (quant is None or quant.method not in KEPT):
            raise QuantizationError(f"{p}: float weights in a directory, not a .gguf file")
        if quant is not None:
            weights = Prequantized(weights, quant, keep_blocks)
        return spec, Unfused(weights, spec)
    if p.suffix == ".gguf":
        return _load_gguf(p, keep_blocks, progress)
    raise ModelLoadError(f"model path {p}: expected a .gguf file or a checkpoint directory")


# --- Hugging Face directory ---------------------------------------------------------------


class Unfused:
    """A checkpoint's fused projections (Phi-3's qkv_proj and gate_up_proj) as the separate
    ones the model takes, each part cut from the fused rows when it is asked for (the
    fused tensor read once, its other parts held until taken); every other name as the
    checkpoint has it. Below tensor_parallel.ShardedWeights, which cuts the parts as any."""

    def __init__(self, weights: Weights, spec: ModelSpec) -> None:
        self.weights, self.held = weights, dict[str, Stored]()
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        inner = spec.intermediate_size
        self.parts: dict[str, tuple[str, list[str], list[int]]] = {}  # part -> fused, all
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            for fused, names, sizes in (
                (p + "self_attn.qkv_proj", [p + f"self_attn.{n}_proj" for n in "qkv"], [q, kv, kv]),
                (p + "mlp.gate_up_proj", [p + "mlp.gate_proj", p + "mlp.up_proj"], [inner, inner]),
            ):
                for name in names:
                    self.parts[name + ".weight"] = (
                        fused + ".weight",
                        [n + ".weight" for n in names],
                        sizes,
                    )

    def __contains__(self, name: object) -> bool:
        if name in self.held or name in self.weights or _mixtral(name) in self.weights:
            return True
        return isinstance(name, str) and name in self.parts and self.parts[name][0] in self.weights

    def pop(self, name: str) -> Stored:
        if name in self.held:
            return self.held.pop(name)
        if name not in self.weights and _mixtral(name) in self.weights:
            return self.weights.pop(_mixtral(name))
        if name in self.weights or name not in self.parts:
            return self.weights.pop(name)
        fused, names, sizes = self.parts[name]
        whole = self.weights.pop(fused)
        if not isinstance(whole, torch.Tensor):
            raise ModelLoadError(f"{fused}: a fused matrix must be float to be split")
        if whole.shape[0] != sum(sizes):
            raise ModelLoadError(f"{fused}: {whole.shape[0]} rows, the config says {sum(sizes)}")
        self.held.update(zip(names, whole.split(sizes), strict=True))
        return self.held.pop(name)


_MIXTRAL = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def _mixtral(name: object) -> str:
    """Mixtral's name of an MoE tensor the model takes by Qwen3-MoE's (`mlp.gate`,
    `mlp.experts.E.gate_proj`: Mixtral's `block_sparse_moe.gate`, `...experts.E.w1`)."""
    if not isinstance(name, str) or (".mlp.gate." not in name and ".mlp.experts." not in name):
        return ""
    name = name.replace(".mlp.", ".block_sparse_moe.")
    for ours, theirs in _MIXTRAL.items():
        name = name.replace(f".{ours}.", f".{theirs}.")
    return name


class StreamedWeights:
    """A HF checkpoint directory's tensors, each read from its shard's memory map when it
    is popped, converted to `dtype` on `device`, and its mapping dropped: loading holds
    at most one tensor of the file in host memory beyond what the model keeps; `progress`
    hears of each."""

    def __init__(
        self, d: Path, dtype: torch.dtype, device: torch.device, progress: Progress | None
    ) -> None:
        from safetensors import SafetensorError, safe_open

        files = sorted(d.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{d}: no *.safetensors files")
        self._where: dict[str, Path] = {}
        for f in files:
            try:
                with safe_open(str(f), "pt") as shard:  # reads the header only
                    self._where.update(dict.fromkeys(shard.keys(), f))
            except (SafetensorError, OSError, ValueError) as e:
                raise ModelLoadError(f"{f}: corrupt or truncated safetensors file: {e}") from None
        self._dtype, self._device = dtype, device
        self._progress, self._total = progress, len(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def pop(self, name: str) -> torch.Tensor:
        from safetensors import SafetensorError, safe_open

        f = self._where.pop(name)
        try:
            with safe_open(str(f), "pt") as shard:
                mapped = shard.get_tensor(name)  # a view of the file: no bytes read yet
            # integer tensors (a quantized checkpoint's packed codes) stay integers
            dtype = self._dtype if mapped.is_floating_point() else mapped.dtype
            tensor = mapped.to(device=self._device, dtype=dtype, copy=True)
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{f}: tensor {name} cannot be read: {e}") from None
        if self._progress is not None:
            self._progress(self._total - len(self._where), self._total)
        return tensor


def spec_from_hf_config(path: Path) -> ModelSpec:
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing (a checkpoint directory needs config.json)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON: {e}") from None
    archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
    if archs[0] not in HF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: architecture {archs[0]!r} is not supported (supported: {HF_ARCHITECTURES})"
        )
    read_quant_config(cfg, path)  # a quantization it cannot read is refused here
    gemma = _gemma(cfg, archs[0], path)
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "full_attention" in rope:  # Gemma 3 in transformers 5: one set a layer type
        rope = dict(rope["full_attention"])
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ModelLoadError(f"{path}: rope_type {kind!r} is not supported ({ROPE_TYPES})")
    rope["rope_type"] = kind
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ModelLoadError(f"{path}: partial_rotary_factor {partial} is not supported (1.0)")
    # A sliding window (Phi-3-mini's 2047, Mistral 7B v0.1's 4096; Qwen2's off unless
    # use_sliding_window) is not computed here: the context is capped to it, where every
    # token attends to all before it anyway.
    # Gemma's windowed layers are computed (`windows`).
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    max_position = cfg.get("max_position_embeddings", 2048)
    if not gemma and isinstance(window, int) and 0 < window < max_position:
        max_position = window
    eos = cfg.get("eos_token_id")
    heads = cfg["num_attention_heads"]
    experts = _experts(cfg, archs[0], path)
    return ModelSpec(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        max_position=max_position,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=archs[0] == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        rope_scaling=rope,
        name=cfg.get("_name_or_path") or path.parent.name,
        qk_norm=archs[0] in QK_NORM,
        **experts,
        **gemma,
    )


def _gemma(cfg: dict[str, Any], arch: str, path: Path) -> dict[str, Any]:
    """ModelSpec's Gemma fields from a Gemma, Gemma 2 or 3 config ({} for another family):
    which layers slide (`layer_types`, else every other layer from the first (Gemma 2) or
    five of each six (Gemma 3, `sliding_window_pattern`); none in Gemma 1); what the engine
    does not compute refused naming its key."""
    if arch not in GEMMA:
        return {}
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ModelLoadError(
            f"{path}: hidden_activation {act!r} is not supported (gelu_pytorch_tanh)"
        )
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(
            f"{path}: use_bidirectional_attention true (an encoder's) is not supported: "
            "attention here is causal"
        )
    layers = cfg["num_hidden_layers"]
    if arch == "GemmaForCausalLM":
        return {"gemma": True}
    pattern = 2 if arch == "Gemma2ForCausalLM" else cfg.get("sliding_window_pattern", 6)
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
    ]
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown or len(types) != layers:
        raise ModelLoadError(
            f"{path}: layer_types {sorted(unknown) or types} is not supported (one of "
            "sliding_attention or full_attention for each layer)"
        )
    window = cfg.get("sliding_window")
    local: float | None = None
    if arch == "Gemma3ForCausalLM":
        sliding = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
        if sliding.get("rope_type", "default") != "default":
            raise ModelLoadError(
                f"{path}: the sliding layers' rope_type {sliding['rope_type']!r} is not "
                "supported (default)"
            )
        local = sliding.get("rope_theta") or cfg.get("rope_local_base_freq", 10000.0)
    return {
        "gemma": True,
        "sandwich_norms": True,
        "query_scale": float(cfg.get("query_pre_attn_scalar") or cfg["head_dim"]) ** -0.5,
        "windows": tuple(window if t == "sliding_attention" else None for t in types),
        "attn_softcap": cfg.get("attn_logit_softcapping"),
        "final_softcap": cfg.get("final_logit_softcapping"),
        "local_rope_theta": None if local is None else float(local),
    }


def _experts(cfg: dict[str, Any], arch: str, path: Path) -> dict[str, Any]:
    """ModelSpec's Mixture-of-Experts fields from a Mixtral or Qwen3-MoE config ({} for a
    dense family); a layout the engine does not compute refused naming its key."""
    if arch == "MixtralForCausalLM":
        return {
            "experts": cfg["num_local_experts"],
            "experts_per_token": cfg["num_experts_per_tok"],
            "expert_size": cfg["intermediate_size"],
        }
    if arch != "Qwen3MoeForCausalLM":
        return {}
    if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
        raise ModelLoadError(
            f"{path}: dense layers among the experts' (decoder_sparse_step "
            f"{cfg.get('decoder_sparse_step', 1)}, mlp_only_layers "
            f"{cfg.get('mlp_only_layers')}) are not supported: every layer's MLP is experts"
        )
    return {
        "experts": cfg.get("num_experts") or cfg["num_local_experts"],  # published, transformers 5
        "experts_per_token": cfg["num_experts_per_tok"],
        "expert_size": cfg["moe_intermediate_size"],
        "renormalize_experts": bool(cfg.get("norm_topk_prob", False)),
    }


# --- GGUF ----------------------------------------------------------------------------------

_GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a Mixture-of-Experts' router; its experts stacked:
    "ffn_gate_exps": "mlp.experts.{}.gate_proj",
    "ffn_up_exps": "mlp.experts.{}.up_proj",
    "ffn_down_exps": "mlp.experts.{}.down_proj",
}


# Gemma 2's and 3's norms around each sublayer: llama.cpp's ffn_norm is their
# pre_feedforward_layernorm, its post_attention_norm their post_attention_layernorm.
_GGUF_SANDWICH = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def _gguf_name(name: str, arch: str) -> str:
    top = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if name in top:
        return top[name]
    blk, layer, part, kind = name.split(".")
    names = {**_GGUF_NAMES, **_GGUF_SANDWICH} if arch in GGUF_GEMMA else _GGUF_NAMES
    if blk != "blk" or part not in names:
        raise KeyError(name)
    return f"model.layers.{layer}.{names[part]}.{kind}"


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (it interleaves rotary halves for its kernels)."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def open_gguf(path: Path) -> GGUFFile:
    """The file's header and tensors (views of a read-only memory map). A start reads them
    several times (spec, block types, sampling defaults, weights): one parse per process
    for each version of a file."""
    try:
        stat = path.stat()
        return _parsed_gguf(path.resolve(), stat.st_size, stat.st_mtime_ns)
    except Exception as e:  # a bad file raises many kinds
        raise ModelLoadError(f"{path}: not a valid GGUF file (truncated or corrupt): {e}") from None


@functools.lru_cache(maxsize=2)
def _parsed_gguf(path: Path, size: int, mtime_ns: int) -> GGUFFile:
    from cluster.engine.model.gguf_file import GGUFFile

    return GGUFFile(path)


def gguf_field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


def gguf_blocks_servable(path: Path) -> bool:
    """Whether gguf mode can serve the file as stored: every quantized tensor in a block
    type with a kernel here (GGUF_BLOCKS; K-quants have none yet). Reads the header only."""
    kinds = {t.kind.name for t in open_gguf(path).tensors}
    return kinds - {"F32", "F16", "BF16"} <= GGUF_BLOCKS.keys()


# The sampling defaults a model ships (vLLM's `--generation-config auto`): the keys of an
# HF generation_config.json, and the GGUF metadata llama.cpp writes for them.
SAMPLING_DEFAULTS = {"temperature": "general.sampling.temp", "top_p": "general.sampling.top_p",
                     "top_k": "general.sampling.top_k", "min_p": "general.sampling.min_p",
                     "repetition_penalty": "general.sampling.penalty_repeat"}  # fmt: skip


def read_sampling_defaults(path: Path, source: str = "auto") -> tuple[tuple[str, float], ...]:
    """(field, value) for each sampling default the model's files set; () when none.
    `source` (engine.generation_config): auto the model's files, vllm none, or a folder
    with a generation_config.json, which must be there."""
    if source == "vllm":
        return ()
    if source != "auto":
        path = Path(source)
        if not (path / "generation_config.json").is_file():
            raise ModelLoadError(f"generation_config: {path}/generation_config.json is missing")
    if path.is_dir():
        config = path / "generation_config.json"
        values = json.loads(config.read_text()) if config.is_file() else {}
        found = {name: values.get(name) for name in SAMPLING_DEFAULTS}
    else:
        reader = open_gguf(path)
        found = {name: gguf_field(reader, key) for name, key in SAMPLING_DEFAULTS.items()}
    return tuple(
        (name, int(v) if name == "top_k" else float(v))
        for name, v in found.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    )


def read_spec(path: str | Path) -> ModelSpec:
    """The model's shape alone, from its config or GGUF metadata: no weights are read."""
    p = Path(path)
    if p.is_dir():
        return spec_from_hf_config(p / "config.json")
    if p.suffix == ".gguf" and p.is_file():
        return _gguf_spec(open_gguf(p), p)
    raise ModelLoadError(f"model path {p}: expected a .gguf file or a checkpoint directory")


def _load_gguf(
    path: Path, keep_blocks: bool, progress: Progress | None
) -> tuple[ModelSpec, dict[str, torch.Tensor | GroupQuant]]:
    from gguf.quants import dequantize

    reader = open_gguf(path)
    spec = _gguf_spec(reader, path)
    arch = gguf_field(reader, "general.architecture")
    heads, kv_heads = spec.num_heads, spec.num_kv_heads
    weights: dict[str, torch.Tensor | GroupQuant] = {}
    for i, t in enumerate(reader.tensors, 1):
        if progress is not None and i > 1:
            progress(i - 1, len(reader.tensors))  # the one before is read
        try:
            hf_name = _gguf_name(t.name, arch)
        except (KeyError, ValueError):
            continue  # e.g. rope_freqs: recomputed from the metadata
        kind = t.kind.name
        if keep_blocks and kind not in ("F32", "F16", "BF16") and kind not in GGUF_BLOCKS:
            raise QuantizationError(
                f"{path}: tensor {t.name} is {kind}; gguf mode computes with "
                f"{', '.join(GGUF_BLOCKS)} blocks (use int8 or int4 for this file)"
            )
        # A Mixture-of-Experts' matrices come stacked, one [experts, out, in] tensor a layer
        stacked = "{}" in hf_name
        for e in range(t.shape[0] if stacked else 1):
            data, shape = (t.data[e], t.shape[1:]) if stacked else (t.data, t.shape)
            name = hf_name.format(e)
            if keep_blocks and kind not in ("F32", "F16", "BF16"):
                q = from_gguf_blocks(kind, data, *shape)
                weights[name] = _unpermuted(arch, t.name, q, heads, kv_heads)
                continue
            w = dequantize(data, t.kind).reshape(shape)
            w = _unpermuted(arch, t.name, w, heads, kv_heads)
            if arch in GGUF_GEMMA and t.name.endswith("norm.weight"):
                w = w - 1  # llama.cpp stores Gemma's 1 + w; the model adds it as transformers
            weights[name] = torch.from_numpy(np.require(w, np.float32, ["C", "W"]))
    if progress is not None:
        progress(len(reader.tensors), len(reader.tensors))
    return spec, weights


def _gguf_spec(reader: GGUFFile, path: Path) -> ModelSpec:
    arch = gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported ({GGUF_ARCHITECTURES})"
        )

    def get(key: str, default: Any = None) -> Any:
        value = gguf_field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata {arch}.{key} is missing")
        return value

    heads, hidden = int(get("attention.head_count")), int(get("embedding_length"))
    kv_heads = int(get("attention.head_count_kv", heads))
    names = {t.name for t in reader.tensors}
    scaling = gguf_field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ModelLoadError(f"{path}: rope scaling {scaling!r} is not supported")
    rope: dict[str, Any] = {"rope_type": "default"}
    if scaling == "linear":
        rope = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    vocab = gguf_field(reader, f"{arch}.vocab_size") or len(
        gguf_field(reader, "tokenizer.ggml.tokens", ())
    )
    if not vocab:
        raise ModelLoadError(f"{path}: GGUF metadata has neither {arch}.vocab_size nor tokens")
    return ModelSpec(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(
            gguf_field(reader, f"{arch}.attention.key_length")  # Qwen3's, apart from hidden's
            or gguf_field(reader, f"{arch}.rope.dimension_count", hidden // heads)
        ),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position=int(get("context_length")),
        tie_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        eos_token_ids=(int(gguf_field(reader, "tokenizer.ggml.eos_token_id")),),
        rope_scaling=rope,
        name=str(gguf_field(reader, "general.name", path.stem)),
        qk_norm="blk.0.attn_q_norm.weight" in names,
        **_gguf_gemma(reader, arch, get, hidden, heads),
        **_gguf_experts(reader, arch, get),
    )


def _gguf_experts(reader: GGUFFile, arch: str, need: Callable[[str], Any]) -> dict[str, Any]:
    """ModelSpec's Mixture-of-Experts fields from a GGUF's metadata (Qwen3-MoE's qwen3moe,
    Mixtral's llama with experts; {} for a dense model): llama.cpp renormalizes the chosen
    weights of both unless `expert_weights_norm` says not. `need`: a key it cannot go
    without (ModelLoadError naming it when missing)."""
    experts = gguf_field(reader, f"{arch}.expert_count", 0)
    if not experts:
        return {}
    size = gguf_field(reader, f"{arch}.expert_feed_forward_length")
    return {
        "experts": int(experts),
        "experts_per_token": int(need("expert_used_count")),
        "expert_size": int(size or need("feed_forward_length")),
        "renormalize_experts": bool(gguf_field(reader, f"{arch}.expert_weights_norm", True)),
    }


def _gguf_gemma(
    reader: GGUFFile, arch: str, need: Callable[[str], Any], hidden: int, heads: int
) -> dict[str, Any]:
    """ModelSpec's Gemma fields from a Gemma GGUF's metadata, read as llama.cpp reads them
    ({} for another family): its sliding layers from `attention.sliding_window_pattern`,
    else every other layer (Gemma 2) or five of each six (Gemma 3); the query scale from
    `attention.scale`, else hidden / heads for the 27B models (46 and 62 layers) and the head
    size for the rest; Gemma 3's sliding layers rotated at `rope.freq_base_swa`, else
    10,000; Gemma 2's soft-capping. `need`: as _gguf_experts'."""
    if arch not in GGUF_GEMMA:
        return {}

    def get(key: str, default: Any = None) -> Any:
        return gguf_field(reader, f"{arch}.{key}", default)

    layers = int(need("block_count"))
    head_dim = int(get("attention.key_length") or hidden // heads)
    pattern = get("attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    if isinstance(pattern, int | float):  # llama.cpp's: layer i slides when i % n < n - 1
        sliding = [i % int(pattern) < int(pattern) - 1 for i in range(layers)]
    else:
        sliding = [bool(b) for b in pattern]
    big = (arch, layers) in (("gemma2", 46), ("gemma3", 62))
    scale = get("attention.scale") or (hidden / heads if big else head_dim) ** -0.5
    window = int(need("attention.sliding_window"))
    return {
        "gemma": True,
        "sandwich_norms": True,
        "query_scale": float(scale),
        "windows": tuple(window if s else None for s in sliding),
        "attn_softcap": get("attn_logit_softcapping") if arch == "gemma2" else None,
        "final_softcap": get("final_logit_softcapping") if arch == "gemma2" else None,
        "local_rope_theta": float(get("rope.freq_base_swa", 10000.0)) if arch == "gemma3" else None,
    }


_ROPE_TENSORS = ("attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias")


def _unpermuted(arch: str, name: str, w: Any, heads: int, kv_heads: int) -> Any:
    """A tensor in transformers' q/k row order (a numpy array, or a GroupQuant's rows)."""
    if arch != "llama" or not name.endswith(_ROPE_TENSORS):
        return w
    n_head = heads if ".attn_q." in name else kv_heads
    if isinstance(w, GroupQuant):
        order = _unpermute_rope(np.arange(w.shape[0]), n_head)
        rows = torch.from_numpy(np.ascontiguousarray(order))
        return GroupQuant(w.q[rows], w.scale[rows], w.offset[rows], w.bits)
    return _unpermute_rope(w, n_head)
